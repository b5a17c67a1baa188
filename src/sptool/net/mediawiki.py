"""The one MediaWiki client: the ``api.php`` URL, the ``list=search``, ``opensearch`` and
``prop=extracts`` requests, their JSON and their failures.

Both MediaWiki users go through it: the ``wikipedia`` search backend of ``corpus fetch``
(:class:`sptool.stages.corpus.search.WikipediaSearch`) and WIST's title validation
(:class:`sptool.stages.tree.title_sources.WikipediaTitles`). Every request goes through
:class:`sptool.net.http.HttpClient` under the URL policy the caller passes in: the configured
endpoint is trusted at its own origin (a mirror or a local test server may stand in for
Wikipedia), a redirect anywhere else is checked by the policy before any connection, and each
request has a total time budget.

A failure raises :class:`MediaWikiError` with a ``category`` (``http``, ``not-json``,
``api-error``, ``shape``); each caller words it for its own command.
"""

from __future__ import annotations

import urllib.parse

from sptool.core.records import RuntimeFailure, UsageError
from sptool.net.http import DEFAULT_USER_AGENT, HttpClient, HttpError

DEFAULT_API_URL = "https://en.wikipedia.org/w/api.php"
SEARCH_SHAPE = "{'query': {'search': [{'title': ...}]}}"
OPENSEARCH_SHAPE = "an opensearch array [query, [titles], …]"


class MediaWikiError(RuntimeFailure):
    """A MediaWiki request that failed. ``category``: ``http`` (``http`` holds the
    :class:`~sptool.net.http.HttpError`), ``not-json``, ``api-error`` (the API's own error) or
    ``shape`` (JSON of another form); ``detail`` says what happened, without the URL."""

    def __init__(self, category: str, url: str, detail: str, *, http: HttpError | None = None):
        super().__init__(f"MediaWiki API at {url}: {detail}")
        self.category, self.url, self.detail, self.http = category, url, detail, http


def api_url(url: str | None = None, *, setting: str = "--wiki-url") -> str:
    """The ``api.php`` URL for ``url``: English Wikipedia's when empty; a site given without a
    ``.php`` path (``https://host``, ``https://host/``) gets ``/w/api.php``. Anything but an
    http(s) URL is one :class:`UsageError` naming ``setting``."""
    url = url or DEFAULT_API_URL
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # e.g. an unclosed IPv6 bracket
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
        raise UsageError(f"{setting} must be an http(s) URL of a MediaWiki api.php, got '{url}'")
    if parts.path.endswith(".php"):
        return url
    return urllib.parse.urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/w/api.php"))


class MediaWiki:
    """One MediaWiki endpoint (``api.php``). ``policy`` is the URL policy for redirects away from
    it (:func:`sptool.stages.corpus.policy.network_policy`); ``timeout`` is the total budget of one
    request, retries included. ``attempts`` counts the HTTP attempts made so far."""

    def __init__(self, url: str | None, *, policy, timeout: float = 10.0, retries: int = 1,
                 backoff: float = 0.5, max_bytes: int = 2_000_000,
                 user_agent: str = DEFAULT_USER_AGENT, setting: str = "--wiki-url"):
        self.url = api_url(url, setting=setting)
        parts = urllib.parse.urlsplit(self.url)
        self.page_base = f"{parts.scheme}://{parts.netloc}/wiki/"
        self.attempts = 0
        self.client = HttpClient(policy, timeout=timeout, retries=max(0, retries), backoff=backoff,
                                 max_bytes=max_bytes, user_agent=user_agent, trusted=[self.url],
                                 total_s=timeout)

    def request_url(self, **params: str) -> str:
        """``api.php?format=json&…`` (``&…`` when the configured URL already has a query)."""
        separator = "&" if urllib.parse.urlsplit(self.url).query else "?"
        return self.url + separator + urllib.parse.urlencode({"format": "json", **params})

    def get(self, **params: str) -> object:
        """One GET of ``api.php`` with ``params``: the decoded JSON. An HTTP failure, an answer
        that is not JSON and MediaWiki's own ``{"error": …}`` raise :class:`MediaWikiError`."""
        from sptool.core.jsonl import loads_strict

        try:
            response = self.client.request(self.request_url(**params), accept="application/json")
        except HttpError as error:
            self.attempts += error.response.attempts if error.response is not None else 1
            raise MediaWikiError("http", self.url, f"{error.category}: {error.detail}", http=error) from None
        self.attempts += response.attempts
        try:
            data = loads_strict(response.body.decode("utf-8"))
        except ValueError:  # not UTF-8, not JSON, or a value sptool refuses (digits, nesting)
            raise MediaWikiError("not-json", self.url, "did not return JSON") from None
        if isinstance(data, dict) and "error" in data:
            error = data["error"]
            info = error.get("info") if isinstance(error, dict) else error
            raise MediaWikiError("api-error", self.url, f"returned an error: {info}")
        return data

    def search(self, query: str, limit: int, **params: str) -> list[dict]:
        """``action=query&list=search``: the hits (dicts with a string ``title``), best first, at
        most ``limit``; ``params`` adds request parameters (``srprop``, ``srnamespace`` …)."""
        data = self.get(action="query", list="search", srsearch=query, srlimit=str(limit), **params)
        hits = _member(_member(data, "query"), "search")
        if not isinstance(hits, list):
            raise MediaWikiError("shape", self.url, f"expected {SEARCH_SHAPE}")
        return [hit for hit in hits if isinstance(hit, dict) and isinstance(hit.get("title"), str)
                and hit["title"]][:limit]

    def opensearch(self, query: str, limit: int) -> list[str]:
        """``action=opensearch`` (main namespace): the titles, best first, at most ``limit``."""
        data = self.get(action="opensearch", search=query, limit=str(limit), namespace="0")
        if isinstance(data, list) and len(data) >= 2 and isinstance(data[1], list):
            return [title for title in data[1] if isinstance(title, str)][:limit]
        raise MediaWikiError("shape", self.url, f"expected {OPENSEARCH_SHAPE}")

    def extracts(self, titles: list[str]) -> dict[str, str]:
        """``prop=extracts&explaintext`` (redirects followed): plain page text by title."""
        data = self.get(formatversion="2", action="query", prop="extracts", explaintext="1",
                        redirects="1", titles="|".join(titles))
        pages = _member(_member(data, "query"), "pages")
        return {str(page["title"]): str(page.get("extract") or "")
                for page in (pages if isinstance(pages, list) else [])
                if isinstance(page, dict) and page.get("title")}

    def page_url(self, title: str) -> str:
        """The article's URL on the endpoint's site (``https://host/wiki/Title_with_underscores``)."""
        return self.page_base + urllib.parse.quote(title.replace(" ", "_"), safe=":_()-,.'")


def _member(data: object, key: str) -> object:
    return data.get(key) if isinstance(data, dict) else None
