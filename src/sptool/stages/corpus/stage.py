"""``corpus fetch`` as a stage: path records in, ``document`` records out (WIST §3.3).

For each input record the query is its ``query`` field, else its ``leaf`` (or, with
``query_from="path"``, its ``labels`` joined by spaces). Then, per result URL, in order:

1. duplicate URL within the query's results → dropped (``duplicate-url``);
2. URL policy F_url (scheme, deny/allow lists) → ``scheme``, ``denied-domain``, ``denied-pattern``…;
3. title similarity cos(φ(leaf), φ(title)) ≥ τ_emb on the search result's title
   (``title-similarity``); results without a title are checked after extraction instead;
4. fetch (results that carry their content — ``local:``, ``wikipedia`` — are not fetched):
   ``private-address``, ``timeout``, ``http-error``, ``too-large``, ``content-type``…;
5. F_clean: trafilatura extraction (``no-text``), ``language``, ``too-short``,
   ``near-duplicate`` (against documents already kept for the leaf).

Every rejected URL becomes one dropped record (``path_id``, ``leaf``, ``url``, ``title``,
``reject_detail``) with its category as the reason, so ``--rejects`` says why each URL went.
With a pool directory, a leaf already covered is served from its pool unless ``refresh``.
"""

from __future__ import annotations

import datetime as _dt
from collections import Counter
from typing import Callable, Iterator

from sptool.stages.corpus.clean import NearDuplicateIndex, extract_text, language_ok
from sptool.stages.corpus.fetch import Fetcher, FetchResult
from sptool.stages.corpus.policy import UrlPolicy
from sptool.stages.corpus.pool import LeafPool
from sptool.stages.corpus.search import SearchBackend, SearchError, SearchResult
from sptool.stages.corpus.similarity import DEFAULT_TAU_EMB, TextEncoder, title_similarities
from sptool.core.records import InputError, RecordKind, content_id
from sptool.core.stage import Stage


class _LeafOrQuery(RecordKind):
    def validate(self, record):
        record = super().validate(record)
        for name in ("query", "leaf"):
            value = record.get(name)
            if isinstance(value, str) and value.strip():
                return record
            if name in record and value is not None and not isinstance(value, str):
                raise InputError(f"expected a string, got {type(value).__name__}", field=name)
        raise InputError("missing, expected a non-empty string (a path record from `tree expand`, "
                         "or any record with 'leaf' or 'query')", field="leaf")


PATH_OR_QUERY = _LeafOrQuery("path")


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


class CorpusFetchStage(Stage):
    """Search, filter, fetch and clean web documents for each leaf; see the module docstring."""

    name = "corpus fetch"
    input_kind = PATH_OR_QUERY

    def __init__(self, search: SearchBackend, fetcher: Fetcher, *, encoder: TextEncoder | None,
                 tau_emb: float = DEFAULT_TAU_EMB, results_per_query: int = 10,
                 query_from: str = "leaf", min_chars: int = 500, lang: str = "en",
                 dedup_threshold: float = 0.9, pool: LeafPool | None = None, refresh: bool = False,
                 log: Callable[[str], None] | None = None, now: Callable[[], str] = utc_now):
        super().__init__()
        if query_from not in ("leaf", "path"):
            from sptool.core.records import UsageError
            raise UsageError(f"--query-from must be 'leaf' or 'path', got {query_from!r}")
        language_ok("", lang)  # validates the language name up front
        self.search, self.fetcher, self.encoder = search, fetcher, encoder
        self.policy: UrlPolicy = fetcher.policy
        self.tau_emb, self.results_per_query, self.query_from = tau_emb, results_per_query, query_from
        self.min_chars, self.lang, self.dedup_threshold = min_chars, lang, dedup_threshold
        self.pool, self.refresh, self.log, self.now = pool, refresh, log, now
        self._done: dict[str, list[dict]] = {}   # leaf → documents, within this run
        self._searched_ok = False

    # ---- helpers ---------------------------------------------------------------------------
    def _query(self, record: dict) -> tuple[str, str]:
        leaf = str(record.get("leaf") or record.get("query")).strip()
        query = record.get("query")
        if isinstance(query, str) and query.strip():
            return leaf, query.strip()
        labels = record.get("labels")
        if self.query_from == "path" and isinstance(labels, list) and labels:
            return leaf, " ".join(str(label) for label in labels)
        return leaf, leaf

    def _reject(self, record: dict, leaf: str, hit: SearchResult, category: str, detail: str,
                tally: Counter, **extra) -> None:
        tally[category] += 1
        rejected = {"path_id": self._path_id(record, leaf), "leaf": leaf, "url": hit.url,
                    "title": hit.title, "rank": hit.rank, "search": hit.engine,
                    "reject_detail": detail, **extra}
        self.drop(rejected, category)

    @staticmethod
    def _path_id(record: dict, leaf: str) -> str:
        return str(record.get("path_id") or record.get("id") or content_id("query", leaf))

    def _document(self, record: dict, leaf: str, query: str, doc: dict) -> dict:
        path_id = self._path_id(record, leaf)
        out = {"id": content_id("document", path_id, doc["url"]), "path_id": path_id, "leaf": leaf,
               **{k: v for k, v in doc.items() if k not in ("id", "path_id", "leaf")}}
        for key in ("labels", "nodes"):
            if key in record:
                out[key] = record[key]
        return out

    # ---- the stage -------------------------------------------------------------------------
    def process(self, records: Iterator[dict]) -> Iterator[dict]:
        for record in records:
            leaf, query = self._query(record)
            key = f"{leaf}\x1f{query}"
            if key in self._done:
                documents = self._done[key]
                self.stats.notes["leaves reused"] += 1
            elif self.pool is not None and not self.refresh and self.pool.has(leaf):
                documents = self.pool.load(leaf)
                self.stats.notes["leaves from pool"] += 1
                self._say(f"{leaf!r}: {len(documents)} documents from the pool")
            else:
                fresh = self._fetch_leaf(record, leaf, query)
                documents = self.pool.save(leaf, fresh) if self.pool is not None else fresh
                if self.pool is not None and self.refresh:
                    self.stats.notes["leaves refreshed"] += 1
            self._done[key] = documents
            if not documents:
                self.stats.notes["leaves without documents"] += 1
            for document in documents:
                yield self._document(record, leaf, query, document)

    def _say(self, message: str) -> None:
        if self.log is not None:
            self.log(f"corpus fetch: {message}")

    def _fetch_leaf(self, record: dict, leaf: str, query: str) -> list[dict]:
        tally: Counter = Counter()
        self.stats.notes["queries"] += 1
        try:
            hits = self.search.search(query, self.results_per_query)
            self._searched_ok = True
        except SearchError as error:
            if not self._searched_ok:
                raise  # the first search failing means the endpoint is wrong or down: exit 1
            self.drop({**record, "query": query, "reject_detail": str(error)}, "search-failed")
            return []
        self.stats.notes["search results"] += len(hits)

        # 1–2: duplicate URLs and the URL policy, before anything is fetched.
        candidates: list[SearchResult] = []
        seen: set[str] = set()
        for hit in hits:
            if hit.url in seen:
                self._reject(record, leaf, hit, "duplicate-url", "URL listed twice", tally)
                continue
            seen.add(hit.url)
            if hit.url.startswith(("http://", "https://")) or hit.content is None:
                refusal = self.policy.check_url(hit.url)
                if refusal:
                    self._reject(record, leaf, hit, refusal.category, refusal.detail, tally)
                    continue
            candidates.append(hit)

        # 3: title similarity on the search results' titles (one encoder call).
        similarity: dict[int, float] = {}
        titled = [i for i, hit in enumerate(candidates) if hit.title.strip()]
        if self.encoder is not None and titled:
            scores = title_similarities(leaf, [candidates[i].title for i in titled], self.encoder)
            similarity = dict(zip(titled, scores))
        passing: list[tuple[SearchResult, float | None]] = []
        for i, hit in enumerate(candidates):
            score = similarity.get(i)
            if score is not None and score < self.tau_emb:
                self._reject(record, leaf, hit, "title-similarity",
                             f"cos(leaf, title) = {score:.3f} < {self.tau_emb}", tally, title_sim=score)
                continue
            passing.append((hit, score))

        # 4: fetch what is not already in hand (bounded concurrency inside the fetcher).
        to_fetch = [hit.url for hit, _ in passing if hit.content is None]
        fetched: dict[str, FetchResult] = {r.url: r for r in self.fetcher.fetch_many(to_fetch)}
        self.stats.notes["urls fetched"] += len(to_fetch)

        # 5: clean, check, deduplicate — in search rank order, so the best-ranked copy is kept.
        index = NearDuplicateIndex(self.dedup_threshold)
        previous = self.pool.load(leaf) if self.pool is not None else []
        for document in previous:
            index.add(document["url"], document.get("text", ""))
        kept: list[dict] = []
        for hit, score in passing:
            provenance = {"search": hit.engine, "query": query, "rank": hit.rank}
            if hit.content is not None:
                content, content_type, url = hit.content, hit.content_type, hit.url
            else:
                result = fetched[hit.url]
                if not result.ok:
                    self._reject(record, leaf, hit, result.error or "fetch-error", result.detail, tally,
                                 redirects=result.redirects)
                    continue
                content, content_type, url = result.text(), result.content_type, result.url
                provenance.update({"final_url": result.final_url, "http_status": result.status,
                                   "content_type": result.content_type, "redirects": result.redirects,
                                   "bytes": len(result.body or b"")})
            extracted = extract_text(content, content_type=content_type, url=url)
            if extracted is None:
                self._reject(record, leaf, hit, "no-text", "no main text found", tally)
                continue
            title = hit.title.strip() or extracted.title
            if score is None and self.encoder is not None:
                score = title_similarities(leaf, [title or leaf], self.encoder)[0] if title else None
                if score is None or score < self.tau_emb:
                    detail = (f"cos(leaf, title) = {score:.3f} < {self.tau_emb}" if score is not None
                              else "page has no title")
                    self._reject(record, leaf, hit, "title-similarity", detail, tally, title_sim=score)
                    continue
            if not language_ok(extracted.text, self.lang):
                self._reject(record, leaf, hit, "language", f"text does not look like {self.lang}", tally)
                continue
            if len(extracted.text) < self.min_chars:
                self._reject(record, leaf, hit, "too-short",
                             f"{len(extracted.text)} characters < {self.min_chars}", tally)
                continue
            duplicate = index.find(extracted.text)
            if duplicate and duplicate[0] != hit.url:
                self._reject(record, leaf, hit, "near-duplicate",
                             f"{duplicate[1]:.2f} similar to {duplicate[0]}", tally)
                continue
            index.add(hit.url, extracted.text)
            provenance["extractor"] = "trafilatura" if content_type == "text/html" else "plain-text"
            if self.encoder is not None:
                provenance["encoder"] = getattr(self.encoder, "name", "encoder")
            kept.append({"url": hit.url, "title": title, "text": extracted.text,
                         "title_sim": score, "fetched_at": self.now(), "provenance": provenance})
        self.stats.notes["urls kept"] += len(kept)
        dropped = ", ".join(f"{n} {reason}" for reason, n in sorted(tally.items())) or "none"
        self._say(f"query {query!r}: {len(hits)} results, {len(to_fetch)} fetched, "
                  f"{len(kept)} kept, dropped: {dropped}")
        return kept
