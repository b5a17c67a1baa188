"""Search backends behind one protocol: a query in, ranked :class:`SearchResult` s out.

Chosen by name with :func:`load_search` (``--search``):

- ``searxng``: a SearXNG instance's JSON API (``--search-url``, e.g. ``http://localhost:8888``;
  the instance must enable the ``json`` format).
- ``wikipedia``: MediaWiki search (``list=search``) and page text (``prop=extracts``) through
  :mod:`sptool.net.mediawiki`; the API URL is configurable (default
  ``https://en.wikipedia.org/w/api.php``). Results carry the page text, so nothing is fetched.
- ``brave``: the Brave Search API, key from ``SPTOOL_BRAVE_API_KEY``.
- ``local:PATH``: a folder of ``.html``/``.htm``/``.txt``/``.md`` files or a JSONL corpus
  (``text`` or ``html``, optional ``title`` and ``url``), ranked for the query with BM25 — the
  offline backend. Results carry their content, so nothing is fetched.

The search endpoints themselves are configured by the user and are trusted at their own origin
(a SearXNG instance usually runs on localhost); every request goes through
:class:`sptool.net.http.HttpClient`, so a redirect away from the endpoint is checked by the address
policy before any connection (loopback, private, link-local/metadata refused unless
``--allow-private``), with a total time budget per attempt. The URL policy applies to the result
URLs that sptool fetches.
"""

from __future__ import annotations

import html as html_lib
import json
import math
import os
import re
import urllib.parse
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Protocol

from sptool.core.records import InputError, RuntimeFailure, UsageError
from sptool.core.registry import Registry

if TYPE_CHECKING:
    from sptool.net.http import HttpClient, HttpError


@dataclass
class SearchResult:
    """One hit: where it is, its title, and (for offline/API backends) its content already."""

    url: str
    title: str = ""
    snippet: str = ""
    rank: int = 0
    engine: str = ""
    content: str | None = None          # page content when the backend already has it
    content_type: str = "text/html"      # of ``content``: text/html or text/plain


class SearchBackend(Protocol):
    name: str

    def search(self, query: str, limit: int) -> list[SearchResult]: ...


class SearchError(RuntimeFailure):
    """The search endpoint failed (down, bad answer)."""


def search_client(endpoint: str, *, timeout: float = 15.0, allow_private: bool = False,
                  allow_networks: Iterable[str] = ()) -> "HttpClient":
    """The HTTP client of one search endpoint: the endpoint's own origin (scheme, host, port) is
    trusted, as the user configured it (often localhost); every redirect elsewhere goes through
    the address policy (loopback, private, metadata refused unless ``allow_private``), with a
    total time budget of ``timeout`` per attempt and a 20 MB size cap."""
    from sptool.stages.corpus.policy import network_policy
    from sptool.net.http import HttpClient

    return HttpClient(network_policy(allow_private=allow_private, allow_networks=allow_networks),
                      timeout=timeout, retries=1, backoff=0.5, max_bytes=20_000_000,
                      trusted=[endpoint], total_s=timeout)


def http_get_json(url: str, *, client: "HttpClient", headers: dict | None = None) -> dict:
    """GET a JSON document from a search endpoint through its :func:`search_client`."""
    from sptool.net.http import HttpError

    where = url.split("?")[0]
    try:
        data = client.get_json(url, headers=headers)
    except HttpError as error:
        raise endpoint_error(where, error) from None
    if not isinstance(data, dict):
        raise SearchError(f"search endpoint {where} did not answer a JSON object")
    return data


def endpoint_error(where: str, error: "HttpError") -> SearchError:
    """The one line for a search endpoint's HTTP failure."""
    if error.category == "http-error" and error.status:
        return SearchError(f"search endpoint {where} answered HTTP {error.status}")
    if error.category == "bad-answer":
        return SearchError(f"search endpoint {where} did not answer JSON")
    return SearchError(f"search endpoint {where} failed ({error.category}: {error.detail})")


_TAG = re.compile(r"<[^>]+>")


def strip_tags(text: str) -> str:
    return html_lib.unescape(_TAG.sub("", text or "")).strip()


class SearxngSearch:
    """SearXNG's JSON API: ``GET {url}/search?q=…&format=json``."""

    name = "searxng"

    def __init__(self, url: str | None, *, timeout: float = 15.0, allow_private: bool = False,
                 allow_networks: Iterable[str] = (), **_: object):
        if not url:
            raise UsageError("--search searxng needs --search-url (e.g. http://localhost:8888) "
                             "or SPTOOL_SEARCH_URL")
        self.url = url.rstrip("/")
        if not self.url.endswith("/search"):
            self.url += "/search"
        self.timeout = timeout
        self.client = search_client(self.url, timeout=timeout, allow_private=allow_private,
                                    allow_networks=allow_networks)

    def search(self, query: str, limit: int) -> list[SearchResult]:
        params = urllib.parse.urlencode({"q": query, "format": "json"})
        data = http_get_json(f"{self.url}?{params}", client=self.client)
        results = []
        for item in data.get("results", []) or []:
            if isinstance(item, dict) and item.get("url"):
                results.append(SearchResult(url=str(item["url"]), title=str(item.get("title") or ""),
                                            snippet=str(item.get("content") or ""),
                                            rank=len(results) + 1, engine=self.name))
            if len(results) >= limit:
                break
        return results


class WikipediaSearch:
    """MediaWiki (:class:`sptool.net.mediawiki.MediaWiki`): ``list=search`` for titles,
    ``prop=extracts&explaintext`` for plain page text."""

    name = "wikipedia"

    def __init__(self, url: str | None = None, *, timeout: float = 15.0, allow_private: bool = False,
                 allow_networks: Iterable[str] = (), setting: str = "--search-url", **_: object):
        from sptool.net.mediawiki import MediaWiki
        from sptool.stages.corpus.policy import network_policy

        self.wiki = MediaWiki(url, policy=network_policy(allow_private=allow_private,
                                                         allow_networks=allow_networks),
                              timeout=timeout, retries=1, backoff=0.5, max_bytes=20_000_000,
                              setting=setting)
        self.api = self.wiki.url
        self.timeout = timeout

    def search(self, query: str, limit: int) -> list[SearchResult]:
        from sptool.net.mediawiki import MediaWikiError

        try:
            hits = self.wiki.search(query, limit, formatversion="2", srnamespace="*")
            texts = self.wiki.extracts([str(hit["title"]) for hit in hits]) if hits else {}
        except MediaWikiError as error:
            if error.http is not None:
                raise endpoint_error(self.api, error.http) from None
            if error.category == "not-json":
                raise SearchError(f"search endpoint {self.api} did not answer JSON") from None
            raise SearchError(f"search endpoint {self.api}: {error.detail}") from None
        return [SearchResult(url=self.wiki.page_url(hit["title"]), title=hit["title"],
                             snippet=strip_tags(hit.get("snippet", "")), rank=rank, engine=self.name,
                             content=texts.get(hit["title"], ""), content_type="text/plain")
                for rank, hit in enumerate(hits, start=1)]


class BraveSearch:
    """Brave Search API (``X-Subscription-Token`` from ``SPTOOL_BRAVE_API_KEY``)."""

    name = "brave"
    DEFAULT_URL = "https://api.search.brave.com/res/v1/web/search"
    KEY_ENV = "SPTOOL_BRAVE_API_KEY"

    def __init__(self, url: str | None = None, *, timeout: float = 15.0, allow_private: bool = False,
                 allow_networks: Iterable[str] = (), **_: object):
        self.key = os.environ.get(self.KEY_ENV, "").strip()
        if not self.key:
            raise UsageError(f"--search brave needs an API key in {self.KEY_ENV}")
        self.url = url or self.DEFAULT_URL
        self.timeout = timeout
        self.client = search_client(self.url, timeout=timeout, allow_private=allow_private,
                                    allow_networks=allow_networks)

    def search(self, query: str, limit: int) -> list[SearchResult]:
        params = urllib.parse.urlencode({"q": query, "count": str(min(limit, 20))})
        data = http_get_json(f"{self.url}?{params}", client=self.client,
                             headers={"X-Subscription-Token": self.key})
        results = []
        for item in ((data.get("web") or {}).get("results") or []):
            if isinstance(item, dict) and item.get("url"):
                results.append(SearchResult(url=str(item["url"]), title=strip_tags(item.get("title", "")),
                                            snippet=strip_tags(item.get("description", "")),
                                            rank=len(results) + 1, engine=self.name))
            if len(results) >= limit:
                break
        return results


# ---- local: an offline corpus ranked by BM25 -------------------------------------------------
_WORD = re.compile(r"\w+", re.UNICODE)
_TITLE = re.compile(r"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)
LOCAL_SUFFIXES = (".html", ".htm", ".txt", ".md")


def tokenize(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


def bm25_scores(query: list[str], documents: list[list[str]], *, k1: float = 1.5,
                b: float = 0.75) -> list[float]:
    """Okapi BM25: Σ_t idf(t) · f(t,d)(k1+1) / (f(t,d) + k1(1 − b + b|d|/avgdl)),
    idf(t) = ln(1 + (N − n_t + 0.5)/(n_t + 0.5))."""
    n_docs = len(documents)
    if not n_docs:
        return []
    avgdl = sum(len(d) for d in documents) / n_docs or 1.0
    df = Counter(t for d in documents for t in set(d))
    scores = []
    for doc in documents:
        tf = Counter(doc)
        score = 0.0
        for term in set(query):
            f = tf.get(term, 0)
            if not f:
                continue
            idf = math.log(1 + (n_docs - df[term] + 0.5) / (df[term] + 0.5))
            score += idf * f * (k1 + 1) / (f + k1 * (1 - b + b * len(doc) / avgdl))
        scores.append(score)
    return scores


class LocalSearch:
    """``local:PATH``: a folder of HTML/text files or a JSONL corpus, ranked by BM25 on title+text
    (``local:package:web``: the sample pages shipped with sptool)."""

    name = "local"

    def __init__(self, path: str, **_: object):
        if not path:
            raise UsageError("--search local needs a path: local:DIR or local:FILE.jsonl")
        from sptool.core.packaged import local_path

        self.path = Path(local_path(path))
        if not self.path.exists():
            raise InputError("no such local corpus (folder of .html/.txt files or a JSONL file)",
                             source=f"local:{path}",
                             hint="choose --search local:PATH, searxng, wikipedia or brave")
        self.entries = self._load()
        self._tokens = [tokenize(e.title + " " + e.title + " " + _visible_text(e)) for e in self.entries]

    def _load(self) -> list[SearchResult]:
        entries = []
        if self.path.is_dir():
            for file in sorted(p for p in self.path.rglob("*") if p.is_file()
                               and p.suffix.lower() in LOCAL_SUFFIXES):
                text = file.read_text(encoding="utf-8", errors="replace")
                is_html = file.suffix.lower() in (".html", ".htm")
                if is_html:
                    match = _TITLE.search(text)
                    title = strip_tags(match.group(1)) if match else file.stem
                else:
                    title = next((line.strip("# ").strip() for line in text.splitlines() if line.strip()),
                                 file.stem)
                entries.append(SearchResult(url=file.resolve().as_uri(), title=title, engine=self.name,
                                            content=text,
                                            content_type="text/html" if is_html else "text/plain"))
            return entries
        from sptool.core.jsonl import read_records
        from sptool.core.records import LOCAL_DOCUMENT

        for record in read_records(str(self.path), LOCAL_DOCUMENT):  # "text": 5 is an error
            html = record.get("html")
            text = record.get("text")
            number = len(entries) + 1
            url = str(record.get("url") or f"{self.path.resolve().as_uri()}#{number}")
            entries.append(SearchResult(url=url, title=str(record.get("title") or ""), engine=self.name,
                                        content=html if isinstance(html, str) else text,
                                        content_type="text/html" if isinstance(html, str) else "text/plain"))
        return entries

    def search(self, query: str, limit: int) -> list[SearchResult]:
        scores = bm25_scores(tokenize(query), self._tokens)
        order = sorted((i for i, s in enumerate(scores) if s > 0), key=lambda i: (-scores[i], i))
        results = []
        for rank, index in enumerate(order[:limit], start=1):
            entry = self.entries[index]
            results.append(SearchResult(url=entry.url, title=entry.title, rank=rank, engine=self.name,
                                        content=entry.content, content_type=entry.content_type))
        return results


def _visible_text(entry: SearchResult) -> str:
    text = entry.content or ""
    if entry.content_type == "text/html":
        text = re.sub(r"<(script|style)[^>]*>.*?</\1>", " ", text, flags=re.IGNORECASE | re.DOTALL)
        text = strip_tags(text)
    return text


SEARCH_BACKENDS: Registry[Callable[..., SearchBackend]] = Registry("search backend", {
    "searxng": SearxngSearch,
    "wikipedia": WikipediaSearch,
    "brave": BraveSearch,
    "local": LocalSearch,
})


def load_search(spec: str, *, url: str | None = None, timeout: float = 15.0, allow_private: bool = False,
                allow_networks: Iterable[str] = (), setting: str = "--search-url",
                allow_hint: str = "--allow-network CIDR") -> SearchBackend:
    """A search backend from ``--search`` (``searxng``, ``wikipedia``, ``brave``, ``local:PATH``).
    ``allow_private``/``allow_networks`` apply to redirects away from the configured endpoint."""
    name, _, argument = spec.partition(":")
    factory = SEARCH_BACKENDS.get(name.strip().lower())
    if factory is LocalSearch:
        return LocalSearch(argument or url or "")
    if argument:
        url = url or argument
    if url:
        from sptool.stages.corpus.policy import check_endpoint

        check_endpoint(url, setting=setting, allow_networks=allow_networks, allow_hint=allow_hint)
    return factory(url, timeout=timeout, allow_private=allow_private, allow_networks=list(allow_networks),
                   setting=setting)
