"""The ``openai`` backend's HTTP side (standard library only, ``urllib``): the servers' base URLs
(:func:`parse_base_urls`), one JSON call with retries and exponential backoff on connection
failures, 429 and 5xx (:class:`HTTPClient`, round-robin over the servers), a server's error in
one line, and the numeric defaults read from the environment."""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request

from sptool.core.records import RuntimeFailure, UsageError

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}


def parse_base_urls(base_url: str | list[str] | None) -> list[str]:
    """Base URLs from the option, else ``$SPTOOL_BASE_URL``, else the local default.

    Comma-separated; a URL without a path gets ``/v1`` (``http://host:8000`` →
    ``http://host:8000/v1``); a trailing slash is dropped.
    """
    if base_url is None or base_url == "" or base_url == []:
        base_url = os.environ.get("SPTOOL_BASE_URL") or DEFAULT_BASE_URL
    parts = base_url if isinstance(base_url, list) else base_url.split(",")
    urls = []
    for part in parts:
        part = part.strip().rstrip("/")
        if not part:
            continue
        parsed = urllib.parse.urlparse(part)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise UsageError(f"--base-url '{part}' is not an http(s) URL (example: {DEFAULT_BASE_URL})")
        if parsed.path in ("", "/"):
            part += "/v1"
        urls.append(part)
    if not urls:
        raise UsageError("--base-url is empty")
    return urls


class HTTPClient:
    """Requests to OpenAI-compatible servers, mixed into the backend. It reads the backend's
    ``base_urls``, ``timeout``, ``backoff_s``, ``api_key``, ``model_id`` (named in a 404 about the
    model), ``_lock`` and ``_round_robin``."""

    def _next_base(self) -> str:
        with self._lock:
            base = self.base_urls[self._round_robin % len(self.base_urls)]
            self._round_robin += 1
        return base

    def _request(self, base: str, method: str, path: str, body: dict | None, *, retries: int,
                 text_ok: bool = False, deadline: float | None = None) -> dict:
        """One call with retries; the JSON answer (``text_ok``: a plain-text or empty answer is
        returned as ``{"text": ...}``, as vLLM's adapter endpoints answer)."""
        url = base + path
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        reason = "no attempt"
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            timeout = self.timeout
            if deadline is not None:
                timeout = min(timeout, deadline - time.monotonic())
                if timeout <= 0:
                    reason = "the deadline passed"
                    break
            request = urllib.request.Request(url, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(request, timeout=timeout) as response:
                    raw = response.read().decode("utf-8")
                if text_ok:
                    try:
                        answer = json.loads(raw) if raw.strip() else {}
                    except (ValueError, RecursionError):
                        answer = {"text": raw}
                    return answer if isinstance(answer, dict) else {"results": answer}
                return json.loads(raw)
            except urllib.error.HTTPError as exc:
                detail = error_detail(exc)
                reason = f"HTTP {exc.code}{': ' + detail if detail else ''}"
                if exc.code not in RETRYABLE_STATUS:
                    if exc.code == 404 and "model" in detail.lower():
                        raise RuntimeFailure(f"the server at {base} does not serve model "
                                             f"'{self.model_id}': {detail}") from None
                    raise RuntimeFailure(f"{method} {url} failed: {reason}") from None
            except urllib.error.URLError as exc:
                reason = str(getattr(exc, "reason", exc))
            except (socket.timeout, TimeoutError):
                reason = f"no answer within {timeout:g}s"
            except (ConnectionError, OSError) as exc:
                reason = str(exc) or type(exc).__name__
            except json.JSONDecodeError:
                raise RuntimeFailure(f"{method} {url}: the server's answer is not JSON "
                                     "(is this an OpenAI-compatible endpoint?)") from None
        if reason.startswith("HTTP "):
            raise RuntimeFailure(f"{method} {url} kept failing ({reason}; {retries + 1} attempts)")
        raise RuntimeFailure(f"cannot reach the OpenAI-compatible server at {base} "
                             f"({reason}; {retries + 1} attempts)")


def env_default(value, variable: str, default: float):
    if value is not None:
        return value
    raw = os.environ.get(variable)
    if raw in (None, ""):
        return default
    try:
        return float(raw)
    except ValueError:
        raise UsageError(f"{variable}={raw!r} is not a number") from None


def error_detail(exc: urllib.error.HTTPError) -> str:
    """The server's error message in one line (OpenAI shape ``{"error": {"message": …}}``)."""
    try:
        payload = json.loads(exc.read().decode("utf-8", "replace"))
    except Exception:  # noqa: BLE001
        return ""
    error = payload.get("error", payload) if isinstance(payload, dict) else payload
    message = error.get("message") if isinstance(error, dict) else error
    if message is None and isinstance(payload, dict):
        message = payload.get("detail") or payload.get("message")
    return " ".join(str(message).split())[:300] if message else ""
