"""The one HTTP client every outbound request goes through (corpus pages, search APIs, titles).

What it guarantees, for each request:

- **address policy at the socket layer**: every hop (the first URL and each redirect) is checked
  by a :class:`~sptool.stages.corpus.policy.UrlPolicy` — scheme allow-list (http, https), URL rules,
  DNS resolution and the address check (loopback, private, link-local/metadata, decimal or octal
  spellings of them: they resolve to the same addresses) — *before* any connection, and the
  connection goes to the very address that was checked (no second DNS answer in between);
- **trusted origins**: a user-configured endpoint (``--search-url``, ``--wiki-url``, often on
  localhost) may be contacted at its own scheme, host and port; anything it redirects to elsewhere
  goes through the full policy;
- **a total time budget** per attempt (connect, TLS, headers and body together): a server that
  sends one byte a second is cut when the budget is spent, not after each read's timeout;
- **a size cap** (``Content-Length`` first, then while reading), retries with exponential backoff
  on timeouts, connection errors, 429 and 5xx, and a descriptive User-Agent.

Failures raise :class:`HttpError` with a short category (``timeout``, ``too-large``,
``private-address``, ``scheme``, ``http-error`` …) and a detail line.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping
from urllib.parse import urljoin, urlsplit

from sptool import __version__

DEFAULT_USER_AGENT = (f"sptool/{__version__} (self-play RL research toolkit; "
                      "+https://github.com/sptool/sptool)")
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})


class HttpError(Exception):
    """A request that did not succeed: ``category`` (short, counted) and ``detail``."""

    def __init__(self, category: str, detail: str, *, retry: bool = False, status: int | None = None):
        super().__init__(f"{category}: {detail}")
        self.category, self.detail, self.retry, self.status = category, detail, retry, status
        self.response: "Response | None" = None


@dataclass
class Response:
    url: str
    final_url: str
    status: int
    headers: dict[str, str]
    body: bytes
    redirects: list[str] = field(default_factory=list)
    attempts: int = 0

    @property
    def content_type(self) -> tuple[str, str | None]:
        return parse_content_type(self.headers.get("content-type", ""))


def parse_content_type(value: str) -> tuple[str, str | None]:
    media, _, params = value.partition(";")
    charset = None
    for param in params.split(";"):
        key, _, val = param.partition("=")
        if key.strip().lower() == "charset" and val.strip():
            charset = val.strip().strip("\"'")
    return media.strip().lower(), charset


def origin(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of a URL, the unit a user-configured endpoint is trusted at."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    port = parts.port or (443 if scheme == "https" else 80)
    return scheme, (parts.hostname or "").lower().rstrip("."), port


class _Budget:
    """A total deadline for one attempt: shuts the socket down when it is spent, so that a read
    that keeps receiving a byte at a time cannot outlive it."""

    def __init__(self, seconds: float, shown: float | None = None):
        self.seconds = seconds
        self.shown = seconds if shown is None else shown  # the budget the user set, for messages
        self.deadline = time.monotonic() + seconds
        self.expired = False
        self._sock: socket.socket | None = None
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.expired = True
            raise HttpError("timeout", f"no complete answer within {self.shown:g}s", retry=True)
        return left

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sock = sock
            self._timer = threading.Timer(max(0.0, self.deadline - time.monotonic()), self._expire)
            self._timer.daemon = True
            self._timer.start()

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            if self._sock is not None:
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cancel(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._sock = None


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """HTTP to a pre-resolved (checked) address, with the host name in the Host header."""

    def __init__(self, address: str, host: str, port: int, budget: _Budget):
        super().__init__(host, port, timeout=budget.seconds)
        self._address, self._budget = address, budget

    def connect(self) -> None:
        self.sock = socket.create_connection((self._address, self.port), self._budget.left())
        self._budget.watch(self.sock)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """HTTPS to a pre-resolved address, with SNI and certificate checks for the host name."""

    def __init__(self, address: str, host: str, port: int, budget: _Budget, context: ssl.SSLContext):
        super().__init__(host, port, timeout=budget.seconds, context=context)
        self._address, self._budget = address, budget

    def connect(self) -> None:  # pragma: no cover - exercised only against real HTTPS sites
        sock = socket.create_connection((self._address, self.port), self._budget.left())
        self._budget.watch(sock)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


class HttpClient:
    """GET (or POST) under a URL policy, a total time budget and a size cap; see the module
    docstring. ``timeout`` is the budget of one attempt, ``total_s`` (optional) the budget of a
    whole request (every hop and retry); ``trusted`` lists URLs whose origin (scheme, host, port)
    may be contacted without the address check."""

    def __init__(self, policy, *, timeout: float = 10.0, retries: int = 2, backoff: float = 0.5,
                 max_bytes: int = 2_000_000, max_redirects: int = 5,
                 user_agent: str = DEFAULT_USER_AGENT, trusted: Iterable[str] = (),
                 per_host_delay: float = 0.0, total_s: float | None = None):
        self.policy = policy
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        self.max_bytes, self.max_redirects = int(max_bytes), int(max_redirects)
        self.user_agent = user_agent
        self.trusted = {origin(url) for url in trusted}
        self.per_host_delay = float(per_host_delay)
        self.total_s = None if total_s is None else float(total_s)  # all hops and retries together
        self._next_slot: dict[str, float] = {}
        self._slot_lock = threading.Lock()
        self._ssl = ssl.create_default_context()
        self._local = threading.local()

    # ---- politeness ---------------------------------------------------------------------------
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

    # ---- the policy, per hop ------------------------------------------------------------------
    def check(self, url: str, hop: int) -> str:
        """The checked address to connect to for ``url``; raises :class:`HttpError` if refused."""
        scheme, host, port = origin(url)
        if (scheme, host, port) in self.trusted:
            if scheme not in ("http", "https"):
                raise HttpError("scheme", _hop(hop, url, f"scheme {scheme!r} not in ['http', 'https']"))
            try:
                addresses = self.policy.resolver(host, port)
            except (socket.gaierror, UnicodeError, OSError) as exc:
                raise HttpError("dns-error", _hop(hop, url, f"cannot resolve {host}: {exc}")) from None
            if not addresses:
                raise HttpError("dns-error", _hop(hop, url, f"{host} resolves to no address"))
            for address in addresses:  # trusted, but never the metadata service implicitly
                if self.policy.address_allowed(address) == "link-local/metadata":
                    raise HttpError("private-address", _hop(hop, url, f"{host} resolves to {address} "
                                                            "(link-local/metadata)"))
            return addresses[0]
        refusal = self.policy.check_url(url)
        if refusal:
            raise HttpError(refusal.category, _hop(hop, url, refusal.detail))
        addresses, refusal = self.policy.check_addresses(host, port)
        if refusal:  # refused before any connection is made
            raise HttpError(refusal.category, _hop(hop, url, refusal.detail))
        return addresses[0]

    # ---- requests -----------------------------------------------------------------------------
    def request(self, url: str, *, method: str = "GET", headers: Mapping[str, str] | None = None,
                body: bytes | None = None, accept: str = "*/*") -> Response:
        """Follow redirects hop by hop (each one checked); return the final response (2xx).
        A 4xx/5xx answer raises :class:`HttpError` (``http-error``, with ``status``)."""
        response = Response(url=url, final_url=url, status=0, headers={}, body=b"")
        self._local.deadline = None if self.total_s is None else time.monotonic() + self.total_s
        try:
            return self._follow(url, response, method, headers, body, accept)
        except HttpError as error:
            error.response = response  # how far it got: redirects, attempts
            raise

    def _follow(self, url, response: Response, method, headers, body, accept) -> Response:
        current = url
        for hop in range(self.max_redirects + 1):
            address = self.check(current, hop)
            status, answer_headers, data = self._with_retries(current, address, method, headers, body,
                                                              accept, response)
            response.final_url, response.status, response.headers = current, status, answer_headers
            if status in REDIRECT_STATUSES:
                location = answer_headers.get("location")
                if not location:
                    raise HttpError("http-error", f"HTTP {status} without a Location header", status=status)
                current = urljoin(current, location)
                response.redirects.append(current)
                if status == 303:
                    method, body = "GET", None
                continue
            if status >= 400:
                raise HttpError("http-error", f"HTTP {status}", status=status)
            response.body = data
            return response
        raise HttpError("too-many-redirects", f"more than {self.max_redirects} redirects")

    def get_json(self, url: str, *, headers: Mapping[str, str] | None = None) -> object:
        from sptool.core.jsonl import loads_strict

        response = self.request(url, headers=headers, accept="application/json")
        try:
            text = response.body.decode("utf-8") if isinstance(response.body, bytes) else response.body
            return loads_strict(text)
        except ValueError:  # not UTF-8, not JSON, or a value sptool refuses (digits, nesting)
            raise HttpError("bad-answer", "the answer is not JSON") from None

    def _with_retries(self, url, address, method, headers, body, accept, response: Response):
        host = urlsplit(url).hostname or ""
        last: HttpError | None = None
        deadline = getattr(self._local, "deadline", None)
        for attempt in range(self.retries + 1):
            if attempt:
                pause = self.backoff * (2 ** (attempt - 1))
                if deadline is not None and time.monotonic() + pause >= deadline:
                    break  # no time left for another attempt
                time.sleep(pause)
            response.attempts += 1
            self._wait_for_host(host)
            try:
                return self._once(url, address, method, headers, body, accept)
            except HttpError as failure:
                if not failure.retry:
                    raise
                last = failure
        assert last is not None
        if self.retries:
            last.detail += f" (after {self.retries + 1} attempts)"
        raise last

    def _once(self, url: str, address: str, method: str, headers, body, accept: str):
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        seconds = self.timeout
        deadline = getattr(self._local, "deadline", None)
        if deadline is not None:
            seconds = min(seconds, deadline - time.monotonic())
            if seconds <= 0:
                raise HttpError("timeout", f"no complete answer within {self.total_s:g}s")
        budget = _Budget(seconds, shown=self.total_s if deadline is not None else self.timeout)
        if parts.scheme == "https":
            conn = _PinnedHTTPSConnection(address, host, port, budget, self._ssl)
        else:
            conn = _PinnedHTTPConnection(address, host, port, budget)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        try:
            conn.request(method, path, body=body, headers={
                "User-Agent": self.user_agent, "Accept": accept, "Accept-Encoding": "identity",
                "Connection": "close", **dict(headers or {})})
            answer = conn.getresponse()
            answer_headers = {k.lower(): v for k, v in answer.getheaders()}
            status = answer.status
            if status in RETRY_STATUSES:
                raise HttpError("http-error", f"HTTP {status}", retry=True, status=status)
            if status in REDIRECT_STATUSES or status >= 400:
                return status, answer_headers, b""
            length = answer_headers.get("content-length", "")
            if length.isdigit() and int(length) > self.max_bytes:
                raise HttpError("too-large", f"Content-Length {int(length)} > {self.max_bytes} bytes")
            chunks, size = [], 0
            while True:
                budget.left()
                chunk = answer.read1(65536) if hasattr(answer, "read1") else answer.read(65536)
                if budget.expired:
                    budget.left()
                if not chunk:
                    break
                size += len(chunk)
                if size > self.max_bytes:
                    raise HttpError("too-large", f"body exceeds {self.max_bytes} bytes")
                chunks.append(chunk)
            if budget.expired:  # the shutdown looked like the end of the body
                budget.left()
            return status, answer_headers, b"".join(chunks)
        except HttpError:
            raise
        except (socket.timeout, TimeoutError):
            raise HttpError("timeout", f"no complete answer within {budget.shown:g}s", retry=True) from None
        except ssl.SSLError as exc:
            if budget.expired:
                raise HttpError("timeout", f"no complete answer within {budget.shown:g}s", retry=True) from None
            raise HttpError("tls-error", str(exc)) from None
        except (http.client.HTTPException, OSError) as exc:
            if budget.expired:
                raise HttpError("timeout", f"no complete answer within {budget.shown:g}s", retry=True) from None
            raise HttpError("connection-error", f"{type(exc).__name__}: {exc}", retry=True) from None
        finally:
            budget.cancel()
            conn.close()


def _hop(hop: int, url: str, detail: str) -> str:
    return detail if hop == 0 else f"redirect to {url}: {detail}"
