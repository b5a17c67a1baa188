"""Streaming JSONL: read with ``source:line`` in every error, write atomically, ``.gz`` both ways.

>>> from sptool.core.jsonl import read_records, AtomicJsonlWriter
>>> with AtomicJsonlWriter("out.jsonl") as out:          # doctest: +SKIP
...     for record in read_records("in.jsonl"):
...         out.write(record)

A path of ``-`` or ``None`` means stdin / stdout. Output files are written to a temporary file
in the same directory and renamed into place on success, so a failed run leaves no half file
(and an existing file is left as it was).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import re
import sys
from typing import IO, Any, Callable, Iterator

from sptool.core.records import ANY, InputError, RecordKind, describe, remember_location

STDIN_NAME = "<stdin>"


def source_name(path: str | os.PathLike | None) -> str:
    return STDIN_NAME if path in (None, "-") else str(path)


def open_binary_input(path: str | os.PathLike | None) -> IO[bytes]:
    """Open a path, ``-``/None (stdin) or a ``.gz`` file for reading bytes.

    Lines are decoded one at a time by :func:`read_records`, so a byte sequence that is not
    UTF-8 is reported at its ``source:line`` like any other bad line.
    """
    if path in (None, "-"):
        if sys.stdin is None or getattr(sys.stdin, "closed", False):
            raise InputError("standard input is closed; give an input file or pipe JSONL in",
                             source=STDIN_NAME)
        return getattr(sys.stdin, "buffer", None) or io.BytesIO(sys.stdin.read().encode("utf-8"))
    path = os.fspath(path)
    if not os.path.exists(path):
        raise InputError("no such file", source=path)
    if os.path.isdir(path):
        raise InputError("is a directory, expected a JSONL file", source=path)
    try:
        if path.endswith(".gz"):
            return gzip.open(path, "rb")
        return open(path, "rb")
    except OSError as exc:  # unreadable: permissions, a broken mount
        raise InputError(f"cannot open ({exc.strerror or exc})", source=path) from None


#: One JSONL line may hold at most this many bytes: an endless line (``/dev/zero``, a binary
#: file) is cut there with one clear error instead of growing until the memory runs out.
MAX_LINE_BYTES = int(os.environ.get("SPTOOL_MAX_LINE_BYTES", 64 << 20))
#: Lists/objects may nest at most this deep (a deeper value is refused before any stage recurses).
MAX_DEPTH = 100
#: Integers may have at most this many digits (like a float's range: 1e308); Python refuses to
#: convert more than 4,300 anyway, with a traceback.
MAX_INT_DIGITS = 308


class NonFiniteNumber(ValueError):
    """A NaN/Infinity literal or a number too large for a float: not JSON for sptool."""


class BadJsonValue(ValueError):
    """Valid JSON syntax sptool refuses: nesting deeper than :data:`MAX_DEPTH`, a lone surrogate."""


def _refuse_constant(name: str) -> Any:
    raise NonFiniteNumber(f"{name} is not a JSON number; numbers must be finite")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise NonFiniteNumber(f"the number {text[:30]} is too large; numbers must be finite")
    return value


def _bounded_int(text: str) -> int:
    if len(text) - text.startswith("-") > MAX_INT_DIGITS:
        raise NonFiniteNumber(f"the integer {text[:20]}... has {len(text.lstrip('-'))} digits "
                              f"(at most {MAX_INT_DIGITS})")
    return int(text)


_SURROGATE_ESCAPE = re.compile(r"\\[uU][dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_value(value: Any, text: str | None = None) -> None:
    """Raise :class:`BadJsonValue` for a value nested deeper than :data:`MAX_DEPTH` or holding a
    lone surrogate (``"\\ud800"``: valid JSON, but no UTF-8 writer can write it back).

    With the ``text`` it was parsed from, the walk is skipped when the text cannot hold either."""
    deep = text is None or text.count("[") + text.count("{") > MAX_DEPTH
    surrogates = text is None or _SURROGATE_ESCAPE.search(text) is not None
    if not (deep or surrogates):
        return
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if surrogates and _SURROGATE.search(item):
                raise BadJsonValue(f"the string {_shown(item)} holds a lone surrogate "
                                   "(\\ud800-\\udfff), which is not text")
        elif isinstance(item, (list, dict)):
            if depth > MAX_DEPTH:
                raise BadJsonValue(f"nested too deeply: more than {MAX_DEPTH} levels of lists/objects")
            if isinstance(item, dict):
                for key, child in item.items():
                    stack.append((key, depth))
                    stack.append((child, depth + 1))
            else:
                stack.extend((child, depth + 1) for child in item)


def _shown(text: str) -> str:
    shown = text if len(text) <= 30 else text[:27] + "..."
    return json.dumps(shown)


def loads_strict(text: str) -> Any:
    """``json.loads`` that refuses what sptool could not carry through a stage and write back:
    ``NaN``/``Infinity``, numbers that overflow to infinity, integers of more than
    :data:`MAX_INT_DIGITS` digits, nesting deeper than :data:`MAX_DEPTH`, lone surrogates.
    Every refusal is a :class:`ValueError` (``json.JSONDecodeError`` for syntax)."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float,
                           parse_int=_bounded_int)
    except RecursionError:
        raise BadJsonValue(f"nested too deeply: more than {MAX_DEPTH} levels of lists/objects") from None
    check_value(value, text)
    return value


def decode_json(raw: bytes | str, *, source: str, line: int = 0, what: str = "JSON") -> Any:
    """One JSON text (a JSONL line, a whole tree file) -> its value, or one :class:`InputError`
    at ``source:line`` saying what is wrong (not UTF-8, not JSON, a refused value)."""
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            hint = "is it a gzip file without .gz?" if raw.startswith(b"\x1f\x8b") else None
            raise InputError(f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})",
                             source=source, line=line, hint=hint) from None
    else:
        text = raw
    try:
        return loads_strict(text)
    except json.JSONDecodeError as exc:
        where = exc.lineno if not line else line
        raise InputError(f"not valid JSON ({exc.msg} at column {exc.colno})", source=source,
                         line=where, hint="each line must be one JSON object" if line else None) from None
    except NonFiniteNumber as exc:
        raise InputError(f"not valid JSON ({exc})", source=source,
                         line=line) from None
    except BadJsonValue as exc:
        raise InputError(f"refused JSON value ({exc})", source=source, line=line) from None


def read_bounded(path: str | os.PathLike, what: str) -> bytes:
    """A whole file's bytes, at most :data:`MAX_LINE_BYTES` (like a line); unreadable or larger
    is one :class:`InputError` naming the file."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_LINE_BYTES + 1)
    except OSError as exc:
        raise InputError(f"cannot read ({exc.strerror or exc})", source=path) from None
    if len(data) > MAX_LINE_BYTES:
        raise InputError(f"larger than {MAX_LINE_BYTES} bytes, refusing to read it as {what}",
                         source=path)
    return data


def load_json_file(path: str | os.PathLike, *, what: str = "JSON") -> Any:
    """A whole JSON file (tree, manifest, state) read through :func:`decode_json`: one
    :class:`InputError` naming the file for every problem, bounded in size like a line."""
    path = os.fspath(path)
    data = read_bounded(path, what)
    return decode_json(data, source=path, what=what)


def read_text_file(path: str | os.PathLike, *, what: str = "text") -> str:
    """A whole UTF-8 text file (a TOML config, a policy file), bounded like a line; not UTF-8,
    unreadable or too large is one :class:`InputError` naming ``path:line``."""
    path = os.fspath(path)
    data = read_bounded(path, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise InputError(f"not valid UTF-8 (byte 0x{data[exc.start]:02x} at column {column}), "
                         f"expected a {what} file", source=path, line=line) from None


def iter_lines(handle: IO[bytes], source: str) -> Iterator[tuple[int, bytes]]:
    """``(line number, raw line)`` of a binary stream, each line at most :data:`MAX_LINE_BYTES`
    (a longer one is one :class:`InputError`: it cannot be skipped, there may be no end)."""
    number = 0
    while True:
        raw = handle.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        number += 1
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            raise InputError(f"line longer than {MAX_LINE_BYTES} bytes (SPTOOL_MAX_LINE_BYTES); "
                             "is this a JSONL file?", source=source, line=number)
        yield number, raw


def _parse_line(raw: bytes, kind: RecordKind, source: str, number: int) -> dict:
    value = decode_json(raw, source=source, line=number)
    try:
        return kind.validate(value)
    except InputError as error:
        raise error.at(source, number) from None


def read_records(path: str | os.PathLike | None, kind: RecordKind = ANY, *,
                 skip_invalid: bool = False,
                 on_invalid: Callable[[InputError, str], None] | None = None) -> Iterator[dict]:
    """Stream validated records of ``kind`` from ``path`` (``-``/None: stdin).

    Strict by default: the first bad line (not UTF-8, not JSON, not a valid record) raises
    :class:`InputError` located at ``source:line``. With ``skip_invalid`` the error and the raw
    line go to ``on_invalid(error, raw_line)`` (to count it, write it to a rejects file) and
    reading goes on.
    """
    source = source_name(path)
    handle = open_binary_input(path)
    try:
        for number, raw in iter_lines(handle, source):
            if not raw.strip():
                continue
            try:
                record = _parse_line(raw, kind, source, number)
            except InputError as error:
                if not skip_invalid:
                    raise
                if on_invalid:
                    on_invalid(error, raw.decode("utf-8", "replace").rstrip("\r\n"))
                continue
            remember_location(record, source, number)
            yield record
    except (OSError, EOFError) as exc:  # a truncated or corrupt .gz file
        raise InputError(f"cannot read ({exc})", source=source) from None
    finally:
        if handle is not getattr(sys.stdin, "buffer", None):
            handle.close()


def dumps(record: Any) -> str:
    """One JSONL line (no trailing newline). NaN/Infinity are not JSON and are refused."""
    try:
        return json.dumps(record, ensure_ascii=False, allow_nan=False)
    except ValueError as exc:  # pragma: no cover - a bug in a stage, not user input
        raise ValueError(f"record is not valid JSON ({exc}): {describe(record)}") from None


class AtomicJsonlWriter:
    """Write JSONL to stdout (``-``/None) or atomically to a file (temp file + rename).

    Used as a context manager: on a clean exit the temporary file replaces the target, on an
    exception it is removed and the target is untouched.
    """

    def __init__(self, path: str | os.PathLike | None, *, flush_every: int = 1,
                 option: str = "--output"):
        self.path = None if path in (None, "-") else os.fspath(path)
        self.option = option
        self.count = 0
        self._tmp: str | None = None
        self._handle: IO[str] | None = None
        self._raw = None
        self._target = None
        self._flush_every = flush_every

    def __enter__(self) -> "AtomicJsonlWriter":
        from sptool.core import fsguard

        self._target = fsguard.output_target(self.path, option=self.option)
        if self._target.kind == "stdout":
            self.path = None
            self._handle = sys.stdout
            return self
        if self._target.kind == "devnull":
            self._handle = open(os.devnull, "w", encoding="utf-8")
            return self
        fd, self._tmp = fsguard.make_temp(os.path.dirname(self._target.path))
        raw = os.fdopen(fd, "wb")
        if self.path.endswith(".gz"):
            self._handle = io.TextIOWrapper(gzip.GzipFile(fileobj=raw, mode="wb"), encoding="utf-8")
            self._raw = raw
        else:
            self._handle = io.TextIOWrapper(raw, encoding="utf-8")
            self._raw = None
        return self

    def write(self, record: Any) -> str:
        """Write one record; returns its line (without the newline)."""
        assert self._handle is not None, "use AtomicJsonlWriter as a context manager"
        line = dumps(record)
        self._handle.write(line + "\n")
        self.count += 1
        if self.path is None and self.count % self._flush_every == 0:
            self._handle.flush()
        return line

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.path is None:
            if exc_type is None:
                sys.stdout.flush()
            return
        assert self._handle is not None
        if self._tmp is None:  # /dev/null
            self._handle.close()
            return
        committed = False
        try:
            self._handle.close()
            if self._raw is not None:
                self._raw.close()
            if exc_type is None:
                from sptool.core import fsguard

                fsguard.apply_default_mode(self._tmp, self._target.path)
                os.replace(self._tmp, self._target.path)
                committed = True
        finally:
            if not committed:
                try:
                    os.unlink(self._tmp)
                except FileNotFoundError:
                    pass


def write_json_atomic(path: str | os.PathLike, document: Any, *, option: str = "--output") -> None:
    """Write one JSON document (a tree, a manifest) atomically and durably (a symlink stays a
    link: the file it points to is replaced)."""
    text = json.dumps(document, ensure_ascii=False, indent=2, allow_nan=False) + "\n"
    write_text_atomic(path, text, option=option)


def write_text_atomic(path: str | os.PathLike, text: str, *, option: str = "--output") -> None:
    """Write ``text`` to ``path`` atomically and durably (temp file, fsync, rename, fsync dir)."""
    from sptool.core import fsguard

    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    target = fsguard.output_target(path, option=option)
    if target.kind != "file":
        with (open(os.devnull, "w") if target.kind == "devnull" else contextlib.nullcontext(sys.stdout)) as handle:
            handle.write(text)
            handle.flush()
        return
    fd, tmp = fsguard.make_temp(os.path.dirname(target.path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        fsguard.apply_default_mode(tmp, target.path)
        os.replace(tmp, target.path)
        fsguard.fsync_directory(os.path.dirname(target.path))
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
