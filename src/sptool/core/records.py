"""Every JSONL record kind sptool reads or writes, its validation, and the one error type for bad input.

Records are plain ``dict``s so that unknown fields pass through every stage untouched (the stage contract, docs/architecture.md:
stages *enrich* records, they never rename or drop fields they do not own). What this module
adds is a declarative description of the fields each stage needs (:class:`RecordKind`) and
deterministic ids.

A validation failure raises :class:`InputError`, whose message always has the shape
``source:line: field 'name': expected <what>, got <what>``; the CLI turns it into one line on
stderr and exit code 2.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable


class SptoolError(Exception):
    """Base class of every error sptool reports as one line (never a traceback)."""

    exit_code = 1


class InputError(SptoolError):
    """Bad input: a line that is not JSON, a missing field, a value of the wrong type.

    ``source`` is a path or ``<stdin>``; ``line`` is 1-based (0 when the error is not tied to a
    line). The message names both, the field and what was expected, so a user can fix the line.
    """

    exit_code = 2

    def __init__(self, reason: str, *, source: str = "<input>", line: int = 0,
                 field: str | None = None, hint: str | None = None):
        self.reason = reason
        self.source = source
        self.line = line
        self.field = field
        self.hint = hint
        super().__init__(self.message)

    @property
    def location(self) -> str:
        return f"{self.source}:{self.line}" if self.line else self.source

    @property
    def message(self) -> str:
        text = f"{self.location}: "
        if self.field:
            text += f"field '{self.field}': "
        text += self.reason
        if self.hint:
            text += f" ({self.hint})"
        return text

    def at(self, source: str, line: int) -> "InputError":
        """The same error, located at ``source:line``."""
        return InputError(self.reason, source=source, line=line, field=self.field, hint=self.hint)


class UsageError(SptoolError):
    """Conflicting or impossible options, unknown names: exit code 2."""

    exit_code = 2


class RuntimeFailure(SptoolError):
    """The environment failed us (model missing, server down): exit code 1."""

    exit_code = 1


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message, at most ``limit`` characters (a fallback's note)."""
    return (str(exc).strip().splitlines() or [""])[0][:limit]


def describe(value: Any) -> str:
    """Short description of a JSON value for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        shown = value if len(value) <= 30 else value[:27] + "..."
        return f"the string {json.dumps(shown)}"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
               list: "a list", dict: "an object"}


@dataclass(frozen=True)
class Field:
    """One field of a record kind: its name, JSON type(s), whether it must be present."""

    name: str
    types: tuple[type, ...]
    required: bool = True
    nullable: bool = False
    check: Callable[[Any], str | None] | None = None  # returns an error text or None
    help: str = ""

    def expected(self) -> str:
        names = [_TYPE_NAMES.get(t, t.__name__) for t in self.types]
        text = " or ".join(names)
        if self.nullable:
            text += " or null"
        return text

    def validate(self, record: dict) -> None:
        if self.name not in record:
            if self.required:
                raise InputError(f"missing, expected {self.expected()}", field=self.name)
            return
        value = record[self.name]
        if value is None:
            if self.nullable or not self.required:
                return
            raise InputError(f"expected {self.expected()}, got null", field=self.name)
        ok = isinstance(value, self.types) and not (
            isinstance(value, bool) and bool not in self.types)
        if not ok and float in self.types and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise InputError(f"expected {self.expected()}, got {describe(value)}", field=self.name)
        if self.check is not None:
            problem = self.check(value)
            if problem:
                raise InputError(problem, field=self.name)


@dataclass(frozen=True)
class RecordKind:
    """A record kind: the fields a stage needs to find in each input record."""

    name: str
    fields: tuple[Field, ...] = field(default_factory=tuple)

    def validate(self, record: Any) -> dict:
        if not isinstance(record, dict):
            raise InputError(f"expected a JSON object ({self.name} record), got {describe(record)}")
        check_known_fields(record)
        for f in self.fields:
            f.validate(record)
        return record


# Fields with one meaning in every sptool record, wherever they appear: a wrong type there would
# silently change a reward ("correct": "false" is truthy), so every record kind checks them.
_BOOLEAN_FIELDS = ("valid",)
_SAMPLE_BOOLEAN_FIELDS = ("correct",)
_FRACTION_FIELDS = ("p_hat", "var", "majority_frac", "invalid_frac")
# Ids and grouping keys: compared, hashed and written into names, so a string or an integer.
_ID_FIELDS = ("id", "group_id", "doc_id", "path_id", "parent_id", "topic_id")


def _check_id(value: Any, name: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InputError(f"expected a string or an integer id, got {describe(value)}", field=name)


def _check_samples(samples: Any) -> None:
    if samples is None:
        return
    if not isinstance(samples, list):
        raise InputError(f"expected a list, got {describe(samples)} (the samples of `sptool solve`)",
                         field="samples")
    for index, sample in enumerate(samples):
        if not isinstance(sample, dict):
            raise InputError(f"expected an object, got {describe(sample)}", field=f"samples[{index}]")
        if not isinstance(sample.get("text"), str):
            got = "missing" if "text" not in sample else describe(sample["text"])
            raise InputError(f"expected a string (the completion), got {got}",
                             field=f"samples[{index}].text")


def _check_boolean(value: Any, name: str) -> None:
    if value is not None and not isinstance(value, bool):
        raise InputError(f"expected true/false, got {describe(value)}", field=name)


def _check_fraction(value: Any, name: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"expected a number in [0, 1] or null, got {describe(value)}", field=name)
    if not (0.0 <= value <= 1.0):  # also refuses NaN
        raise InputError(f"expected a number in [0, 1], got {value!r}", field=name)


def check_known_fields(record: dict) -> None:
    """Type-check the fields every stage interprets the same way: ``valid`` and each sample's
    ``correct`` are JSON booleans (or null), ids and grouping keys (``id``, ``group_id``,
    ``doc_id``, ``path_id``, ``parent_id``, ``topic_id``) strings or integers, every sample an object
    with a string ``text``, ``p_hat``/``var``/``majority_frac``/``invalid_frac``
    (also under ``verdicts.<mode>``) are numbers in [0, 1] (or null), ``novelty.novel`` a boolean."""
    for name in _BOOLEAN_FIELDS:
        _check_boolean(record.get(name), name)
    for name in _FRACTION_FIELDS:
        _check_fraction(record.get(name), name)
    for name in _ID_FIELDS:
        _check_id(record.get(name), name)
    samples = record.get("samples")
    _check_samples(samples)
    if isinstance(samples, list):
        for index, sample in enumerate(samples):
            if isinstance(sample, dict):
                for name in _SAMPLE_BOOLEAN_FIELDS:
                    _check_boolean(sample.get(name), f"samples[{index}].{name}")
    verdicts = record.get("verdicts")
    if isinstance(verdicts, dict):
        for mode, summary in verdicts.items():
            if isinstance(summary, dict):
                for name in _FRACTION_FIELDS:
                    _check_fraction(summary.get(name), f"verdicts.{mode}.{name}")
    novelty = record.get("novelty")
    if isinstance(novelty, dict):
        _check_boolean(novelty.get("novel"), "novelty.novel")


def _non_empty(value: str) -> str | None:
    return None if value.strip() else "expected a non-empty string"


def _samples_check(value: list) -> str | None:
    for i, sample in enumerate(value):
        if not isinstance(sample, dict):
            return f"expected a list of objects, item {i} is {describe(sample)}"
        if not isinstance(sample.get("text"), str):
            return f"expected every sample to have a string 'text', item {i} has {describe(sample.get('text'))}"
    return None


class GeneratedQuestionKind(RecordKind):
    """A question kind that lets a generation marked ``"valid": false`` through without a question.

    ``challenge`` keeps every generation, including unparsable ones (``question`` null), so that
    ``filter`` can penalise them; ``solve`` and ``verify`` pass such records through unsolved.
    """

    def validate(self, record: Any) -> dict:
        if isinstance(record, dict) and record.get("valid") is False:
            return RecordKind(self.name, tuple(f for f in self.fields if f.name != "question")).validate(record)
        return super().validate(record)


ANSWER = Field("answer", (str, int, float), required=False, nullable=True,
               help="reference answer; null or absent means unknown (pseudo-label by majority)")

QUESTION = GeneratedQuestionKind("question", (
    Field("question", (str,), check=_non_empty, help="the problem text"),
    ANSWER,
))

SOLVED = GeneratedQuestionKind("solved question", (
    Field("question", (str,), check=_non_empty),
    ANSWER,
    Field("samples", (list,), check=_samples_check, help="solutions written by `sptool solve`"),
))

LABELLED = RecordKind("labelled problem", (
    Field("question", (str,), check=_non_empty, help="the problem text"),
    Field("answer", (str, int, float), help="the reference answer"),
))

OPTIONAL_TEXT = RecordKind("record with a question or a text", (
    Field("question", (str,), required=False, nullable=True),
    Field("text", (str,), required=False, nullable=True),
))


class _LocalDocumentKind(RecordKind):
    def validate(self, record: Any) -> dict:
        record = super().validate(record)
        if not isinstance(record.get("html"), str) and not isinstance(record.get("text"), str):
            raise InputError("missing, expected a string (the page), or an 'html' string", field="text")
        return record


LOCAL_DOCUMENT = _LocalDocumentKind("local corpus document", (
    Field("text", (str,), required=False, nullable=True),
    Field("html", (str,), required=False, nullable=True),
    Field("url", (str,), required=False, nullable=True),
    Field("title", (str,), required=False, nullable=True),
))

ANY = RecordKind("any", ())


# Where each record read by :func:`sptool.core.jsonl.read_records` came from, so that a stage that
# finds a problem later (a group out of order) names ``source:line`` (keyed by ``id()`` while the
# record is alive; bounded).
_LOCATIONS: dict[int, tuple[str, int, Any]] = {}
_MAX_LOCATIONS = 200_000


def remember_location(record: Any, source: str, line: int) -> None:
    if len(_LOCATIONS) >= _MAX_LOCATIONS:
        _LOCATIONS.pop(next(iter(_LOCATIONS)))
    if isinstance(record, dict):
        _LOCATIONS[id(record)] = (source, line, record.get("id"))


def location_of(record: dict) -> tuple[str, int]:
    """``(source, line)`` of a record read from JSONL, else ``("record ID", 0)``."""
    found = _LOCATIONS.get(id(record))
    if found is not None and found[2] == record.get("id"):
        return found[0], found[1]
    return f"record {record.get('id')}", 0


def record_error(reason: str, record: dict, *, field: str | None = None) -> InputError:
    """An :class:`InputError` about ``record``, located at its ``source:line`` when known."""
    source, line = location_of(record)
    return InputError(reason, source=source, line=line, field=field)


def content_id(*parts: Any, length: int = 16) -> str:
    """Deterministic id: a hash of the content and the parent id.

    Reruns and resumes produce the same ids, so records are never duplicated.
    """
    digest = hashlib.sha256()
    for part in parts:
        digest.update(json.dumps(part, sort_keys=True, ensure_ascii=False).encode())
        digest.update(b"\x1f")
    return digest.hexdigest()[:length]


def ensure_id(record: dict, *content: Any) -> str:
    """Give ``record`` an ``id`` (hash of ``content``) when it has none; return the id."""
    if not record.get("id"):
        record["id"] = content_id(*content)
    return str(record["id"])


def answer_text(value: Any) -> str | None:
    """A reference answer as text (numbers in datasets are common), or None when unknown."""
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    text = str(value).strip()
    return text or None


def iter_chunks(items: Iterable, size: int):
    """Yield lists of at most ``size`` items, streaming."""
    chunk: list = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
