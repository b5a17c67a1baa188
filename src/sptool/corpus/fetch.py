"""Fetching web pages safely: every hop checked by the URL policy, bounded and polite.

The standard library's ``http.client`` does the HTTP; this module adds what a crawler needs:

- redirects are followed here, one hop at a time, and every hop goes through
  :class:`~sptool.corpus.policy.UrlPolicy` (URL rules, then DNS resolution and the address
  check) *before* any connection is made; the connection goes to the checked address;
- timeouts, retries with exponential backoff (connection errors, timeouts, 429 and 5xx),
  a response size cap (``Content-Length`` first, then while reading), a content-type check;
- bounded concurrency (a thread pool) and a per-host politeness delay between request starts;
- a descriptive User-Agent.

A failure never raises: :class:`FetchResult` carries ``error`` (a short category such as
``timeout``, ``too-large``, ``private-address``) and ``detail``.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable, Iterator
from urllib.parse import urljoin, urlsplit

from sptool import __version__
from sptool.corpus.policy import Refusal, UrlPolicy

DEFAULT_USER_AGENT = (f"sptool/{__version__} (corpus fetch for self-play RL research; "
                      "+https://github.com/sptool/sptool)")
DEFAULT_CONTENT_TYPES = ("text/html", "application/xhtml+xml", "text/plain")
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


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


class _Failure(Exception):
    def __init__(self, category: str, detail: str, *, retry: bool = False):
        super().__init__(detail)
        self.category, self.detail, self.retry = category, detail, retry


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """HTTPS to a pre-resolved address, with SNI and certificate checks for the host name."""

    def __init__(self, address: str, host: str, port: int, timeout: float, context: ssl.SSLContext):
        super().__init__(host, port, timeout=timeout, context=context)
        self._address = address

    def connect(self) -> None:  # pragma: no cover - exercised only against real HTTPS sites
        sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


class _PinnedHTTPConnection(http.client.HTTPConnection):
    def __init__(self, address: str, host: str, port: int, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self._address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self._address, self.port), self.timeout)


class Fetcher:
    """Fetch URLs under a :class:`UrlPolicy`; see the module docstring."""

    def __init__(self, policy: UrlPolicy, *, timeout: float = 10.0, retries: int = 2,
                 backoff: float = 0.5, max_bytes: int = 2_000_000, concurrency: int = 8,
                 per_host_delay: float = 1.0, max_redirects: int = 5,
                 user_agent: str = DEFAULT_USER_AGENT,
                 content_types: Iterable[str] = DEFAULT_CONTENT_TYPES):
        self.policy = policy
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.max_bytes, self.concurrency = max_bytes, max(1, concurrency)
        self.per_host_delay, self.max_redirects = per_host_delay, max_redirects
        self.user_agent = user_agent
        self.content_types = tuple(content_types)
        self._next_slot: dict[str, float] = {}
        self._slot_lock = threading.Lock()
        self._ssl = ssl.create_default_context()

    # ---- politeness --------------------------------------------------------------------------
    def _wait_for_host(self, host: str) -> None:
        """Space request starts to one host by ``per_host_delay`` seconds (threads reserve slots)."""
        if self.per_host_delay <= 0:
            return
        with self._slot_lock:
            now = time.monotonic()
            slot = max(now, self._next_slot.get(host, now))
            self._next_slot[host] = slot + self.per_host_delay
        if slot > now:
            time.sleep(slot - now)

    # ---- one URL -----------------------------------------------------------------------------
    def fetch(self, url: str) -> FetchResult:
        """Fetch one URL, following redirects hop by hop; never raises."""
        result = FetchResult(url=url, final_url=url)
        start = time.monotonic()
        current = url
        try:
            for hop in range(self.max_redirects + 1):
                refusal = self.policy.check_url(current)
                if refusal:
                    raise _Failure(refusal.category, _hop_detail(refusal, hop, current))
                parts = urlsplit(current)
                port = parts.port or (443 if parts.scheme == "https" else 80)
                addresses, refusal = self.policy.check_addresses(parts.hostname or "", port)
                if refusal:  # refused before any connection is made
                    raise _Failure(refusal.category, _hop_detail(refusal, hop, current))
                status, headers, body = self._request_with_retries(current, addresses[0], result)
                result.final_url, result.status = current, status
                if status in (301, 302, 303, 307, 308):
                    location = headers.get("location")
                    if not location:
                        raise _Failure("http-error", f"HTTP {status} without a Location header")
                    current = urljoin(current, location)
                    result.redirects.append(current)
                    continue
                if status >= 400:
                    raise _Failure("http-error", f"HTTP {status}")
                media, charset = _content_type(headers.get("content-type", ""))
                result.content_type, result.charset = media, charset
                if self.content_types and media not in self.content_types:
                    raise _Failure("content-type", f"content type {media or '(none)'!r} is not "
                                   f"one of {list(self.content_types)}")
                result.body = body
                break
            else:
                raise _Failure("too-many-redirects", f"more than {self.max_redirects} redirects")
        except _Failure as failure:
            result.error, result.detail = failure.category, failure.detail
            result.body = None
        result.seconds = time.monotonic() - start
        return result

    def _request_with_retries(self, url: str, address: str, result: FetchResult):
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        last: _Failure | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * (2 ** (attempt - 1)))
            result.attempts += 1
            self._wait_for_host(host)
            try:
                return self._request_once(url, parts, address, host, port)
            except _Failure as failure:
                if not failure.retry:
                    raise
                last = failure
        assert last is not None
        if self.retries:
            last.detail += f" (after {self.retries + 1} attempts)"
        raise last

    def _request_once(self, url, parts, address: str, host: str, port: int):
        if parts.scheme == "https":
            conn = _PinnedHTTPSConnection(address, host, port, self.timeout, self._ssl)
        else:
            conn = _PinnedHTTPConnection(address, host, port, self.timeout)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        deadline = time.monotonic() + self.timeout
        try:
            conn.request("GET", path, headers={
                "User-Agent": self.user_agent,
                "Accept": "text/html,application/xhtml+xml,text/plain;q=0.9,*/*;q=0.1",
                "Accept-Encoding": "identity", "Connection": "close"})
            response = conn.getresponse()
            headers = {k.lower(): v for k, v in response.getheaders()}
            status = response.status
            if status in RETRY_STATUSES:
                raise _Failure("http-error", f"HTTP {status}", retry=True)
            if 300 <= status < 400 or status >= 400:
                return status, headers, b""
            length = headers.get("content-length", "")
            if length.isdigit() and int(length) > self.max_bytes:
                raise _Failure("too-large", f"Content-Length {int(length)} > {self.max_bytes} bytes")
            chunks, size = [], 0
            while True:
                if time.monotonic() > deadline:
                    raise _Failure("timeout", f"body not complete within {self.timeout:g}s", retry=True)
                chunk = response.read(65536)
                if not chunk:
                    break
                size += len(chunk)
                if size > self.max_bytes:
                    raise _Failure("too-large", f"body exceeds {self.max_bytes} bytes")
                chunks.append(chunk)
            return status, headers, b"".join(chunks)
        except (socket.timeout, TimeoutError):
            raise _Failure("timeout", f"no answer within {self.timeout:g}s", retry=True) from None
        except ssl.SSLError as exc:
            raise _Failure("tls-error", str(exc)) from None
        except (http.client.HTTPException, OSError) as exc:
            raise _Failure("connection-error", f"{type(exc).__name__}: {exc}", retry=True) from None
        finally:
            conn.close()

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


def _hop_detail(refusal: Refusal, hop: int, url: str) -> str:
    return refusal.detail if hop == 0 else f"redirect to {url}: {refusal.detail}"


def _content_type(value: str) -> tuple[str, str | None]:
    media, _, params = value.partition(";")
    charset = None
    for param in params.split(";"):
        key, _, val = param.partition("=")
        if key.strip().lower() == "charset" and val.strip():
            charset = val.strip().strip("\"'")
    return media.strip().lower(), charset
