"""Column layouts of problem sets: the presets of common layouts (:data:`PRESETS`: ``gsm8k``,
``math``, ``aime``, ``numina``, each with how its answer is read) and :class:`Mapping`, how a row's
columns become ``question``/``answer`` (:func:`map_row`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from sptool.core.records import InputError, UsageError, answer_text, describe


def _gsm8k_answer(value: Any) -> str | None:
    if not isinstance(value, str):
        return None
    found = re.findall(r"^\s*####\s*(.+?)\s*$", value, flags=re.MULTILINE)
    if not found:
        return None
    return re.sub(r"(?<=\d),(?=\d{3}\b)", "", found[-1]).strip() or None


def _boxed_answer(value: Any) -> str | None:
    if not isinstance(value, str):
        return None
    from sptool.stages.verify import last_boxed

    return last_boxed(value)


def _integer_answer(value: Any) -> str | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        return str(int(value))
    return None


def _plain_answer(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return None
    return answer_text(value)


@dataclass(frozen=True)
class Preset:
    """A column layout: where the question and the answer are, and how to read the answer."""

    name: str
    question: tuple[str, ...]  # candidate columns, the first present is used
    answer: tuple[str, ...]
    extract: Callable[[Any], str | None]
    expected: str  # what a readable answer field holds, for the error line
    fallback: tuple[str, Callable[[Any], str | None]] | None = None  # numina: solution's \boxed{}


def _numina_answer(value: Any) -> str | None:
    text = _plain_answer(value)
    return None if text is None or text.lower() in ("proof", "notfound", "none") else text


PRESETS: dict[str, Preset] = {
    "gsm8k": Preset("gsm8k", ("question",), ("answer",), _gsm8k_answer,
                    "a GSM8K solution with a '#### N' answer line"),
    "math": Preset("math", ("problem",), ("solution",), _boxed_answer,
                   "a worked solution with a \\boxed{...} answer"),
    "aime": Preset("aime", ("problem", "Problem", "question"), ("answer", "Answer"), _integer_answer,
                   "an integer answer"),
    "numina": Preset("numina", ("problem",), ("answer",), _numina_answer,
                     "an answer, or a solution with a \\boxed{...} answer", ("solution", _boxed_answer)),
}
PRESET_NAMES = tuple(PRESETS)


@dataclass(frozen=True)
class Mapping:
    """How a row's columns become ``question``/``answer``: a preset and/or explicit column names."""

    preset: str = ""
    question_field: str = ""
    answer_field: str = ""

    def check(self) -> "Mapping":
        if self.preset and self.preset not in PRESETS:
            raise UsageError(f"unknown data preset {self.preset!r} (one of: {', '.join(PRESET_NAMES)})")
        return self

    @property
    def plain(self) -> bool:
        return not (self.preset or self.question_field or self.answer_field)

    def describe(self) -> str:
        parts = [self.preset] if self.preset else []
        if self.question_field:
            parts.append(f"question={self.question_field}")
        if self.answer_field:
            parts.append(f"answer={self.answer_field}")
        return ", ".join(parts) or "-"


def _pick(row: dict, names: tuple[str, ...]) -> str:
    return next((name for name in names if name in row), names[0])


def columns_hint(row: dict) -> str:
    columns = ", ".join(list(row)[:12]) + (", ..." if len(row) > 12 else "")
    return (f"its columns: {columns}; name them with --question-field/--answer-field (sptool run: "
            f"--set data.question_field=COLUMN) or a preset: {', '.join(PRESET_NAMES)}")


def map_row(row: dict, mapping: Mapping, *, need_answer: bool) -> dict:
    """One row as a problem record (located by the caller): ``question`` and ``answer`` set from
    the mapped columns, every other column kept. Raises :class:`InputError` (no location)."""
    if mapping.plain:
        return row
    preset = PRESETS.get(mapping.preset)
    question_field = mapping.question_field or (_pick(row, preset.question) if preset else "question")
    answer_field = mapping.answer_field or (_pick(row, preset.answer) if preset else "answer")
    record = dict(row)
    question = row.get(question_field)
    if not isinstance(question, str) or not question.strip():
        reason = ("missing, expected the problem text (a non-empty string)" if question_field not in row
                  else f"expected the problem text (a non-empty string), got {describe(question)}")
        raise InputError(reason, field=question_field,
                         hint=columns_hint(row) if question_field not in row else None)
    record["question"] = question
    extract = preset.extract if preset else _plain_answer
    value = row.get(answer_field)
    answer = extract(value)
    field = answer_field
    if answer is None and preset and preset.fallback and not mapping.answer_field:
        field, fallback = preset.fallback
        answer = fallback(row.get(field))
    if answer is None:
        if need_answer:
            expected = preset.expected if preset else "a reference answer (a string or a number)"
            reason = (f"missing, expected {expected}" if field not in row
                      else f"expected {expected}, got {describe(row.get(field))}")
            raise InputError(reason, field=field,
                             hint=columns_hint(row) if field not in row else None)
        record.pop("answer", None)  # not a readable answer: no gold rather than a wrong one
        return record
    if preset and preset.name == "gsm8k" and answer_field == "answer" and "solution" not in row:
        record["solution"] = value  # the worked solution; `answer` becomes the final number
    record["answer"] = answer
    return record


def mapping_of(settings: Any) -> Mapping:
    """The ``[data]`` section of a run's settings as a :class:`Mapping`."""
    data = getattr(settings, "data", None)
    if data is None:
        return Mapping()
    return Mapping(data.preset, data.question_field, data.answer_field)
