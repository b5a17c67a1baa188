"""Fetching web pages safely: every hop checked by the URL policy, bounded and polite.

The HTTP itself is :class:`sptool.net.http.HttpClient`, the one client every outbound request of
sptool goes through; this module adds what a crawler needs on top:

- redirects are followed one hop at a time, and every hop goes through
  :class:`~sptool.stages.corpus.policy.UrlPolicy` (URL rules, then DNS resolution and the address
  check) *before* any connection is made; the connection goes to the checked address;
- a total time budget per attempt (``timeout``: connect, answer and body together), retries with
  exponential backoff (connection errors, timeouts, 429 and 5xx), a response size cap
  (``Content-Length`` first, then while reading), a content-type check;
- bounded concurrency (a thread pool) and a per-host politeness delay between request starts;
- a descriptive User-Agent.

A failure never raises: :class:`FetchResult` carries ``error`` (a short category such as
``timeout``, ``too-large``, ``private-address``) and ``detail``.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from sptool import __version__
from sptool.stages.corpus.policy import UrlPolicy
from sptool.net.http import HttpClient, HttpError, parse_content_type

DEFAULT_USER_AGENT = (f"sptool/{__version__} (corpus fetch for self-play RL research; "
                      "+https://github.com/sptool/sptool)")
DEFAULT_CONTENT_TYPES = ("text/html", "application/xhtml+xml", "text/plain")


@dataclass
class FetchResult:
    """The outcome of fetching one URL: a body, or an error category with details."""

    url: str
    final_url: str = ""
    status: int | None = None
    content_type: str = ""
    charset: str | None = None
    body: bytes | None = None
    error: str | None = None
    detail: str = ""
    redirects: list[str] = field(default_factory=list)
    attempts: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None

    def text(self) -> str:
        """The body decoded (header charset, then a ``<meta charset>`` sniff, then UTF-8)."""
        body = self.body or b""
        charset = self.charset or _sniff_charset(body) or "utf-8"
        try:
            return body.decode(charset, errors="replace")
        except LookupError:
            return body.decode("utf-8", errors="replace")


def _sniff_charset(body: bytes) -> str | None:
    head = body[:2048].lower()
    marker = head.find(b"charset=")
    if marker < 0:
        return None
    value = head[marker + 8:marker + 40].strip(b"\"' ")
    end = 0
    while end < len(value) and (chr(value[end]).isalnum() or value[end] in b"-_"):
        end += 1
    return value[:end].decode("ascii", "ignore") or None


class Fetcher:
    """Fetch URLs under a :class:`UrlPolicy`; see the module docstring."""

    def __init__(self, policy: UrlPolicy, *, timeout: float = 10.0, retries: int = 2,
                 backoff: float = 0.5, max_bytes: int = 2_000_000, concurrency: int = 8,
                 per_host_delay: float = 1.0, max_redirects: int = 5,
                 user_agent: str = DEFAULT_USER_AGENT,
                 content_types: Iterable[str] = DEFAULT_CONTENT_TYPES):
        self.policy = policy
        self.client = HttpClient(policy, timeout=timeout, retries=retries, backoff=backoff,
                                 max_bytes=max_bytes, max_redirects=max_redirects,
                                 user_agent=user_agent, per_host_delay=per_host_delay)
        self.timeout, self.retries, self.max_bytes = timeout, retries, max_bytes
        self.concurrency = max(1, concurrency)
        self.content_types = tuple(content_types)

    def fetch(self, url: str) -> FetchResult:
        """Fetch one URL, following redirects hop by hop; never raises."""
        result = FetchResult(url=url, final_url=url)
        start = time.monotonic()
        try:
            response = self.client.request(
                url, accept="text/html,application/xhtml+xml,text/plain;q=0.9,*/*;q=0.1")
        except HttpError as failure:
            result.error, result.detail = failure.category, failure.detail
            if failure.response is not None:
                result.final_url = failure.response.final_url
                result.redirects, result.attempts = failure.response.redirects, failure.response.attempts
        else:
            result.final_url, result.status = response.final_url, response.status
            result.redirects, result.attempts = response.redirects, response.attempts
            media, charset = response.content_type
            result.content_type, result.charset = media, charset
            if self.content_types and media not in self.content_types:
                result.error = "content-type"
                result.detail = (f"content type {media or '(none)'!r} is not one of "
                                 f"{list(self.content_types)}")
            else:
                result.body = response.body
        result.seconds = time.monotonic() - start
        return result

    # ---- many URLs ---------------------------------------------------------------------------
    def fetch_many(self, urls: Iterable[str]) -> Iterator[FetchResult]:
        """Fetch with at most ``concurrency`` requests in flight; results in input order."""
        urls = list(urls)
        if self.concurrency == 1 or len(urls) <= 1:
            for url in urls:
                yield self.fetch(url)
            return
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(urls)),
                                thread_name_prefix="sptool-fetch") as pool:
            yield from pool.map(self.fetch, urls)
