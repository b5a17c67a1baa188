"""One reader for labelled problem sets, in the formats the field keeps them.

A *source* is one of:

- a JSONL file (``.gz`` too, ``-`` for stdin): sptool's own format, read as every stage reads it;
- a parquet (``.parquet``), JSON (``.json``: an array of objects, or JSON Lines) or CSV file;
- a ``datasets`` ``save_to_disk`` directory (a ``DatasetDict``: ``DIR@SPLIT``, default ``train``
  or its only split), or a directory of parquet shards;
- ``hf:NAME[:CONFIG][@SPLIT]``: read through ``datasets.load_dataset`` with the hub's cache
  (offline, an id that is not cached is one line, exit 1).

Each row becomes a record with ``question`` and (when known) ``answer``; every other column passes
through. Columns are mapped by name (``question_field``, ``answer_field``) or by a preset of a
common layout (:data:`columns.PRESETS`): ``gsm8k`` (the ``#### N`` line of ``answer``), ``math`` (the
last ``\\boxed{}`` of ``solution``), ``aime`` (an integer ``answer``), ``numina`` (``answer``, else
the last ``\\boxed{}`` of ``solution``). A row that cannot be read is an :class:`InputError` at
``source:row`` (1-based; in JSONL and CSV files the line) naming the field and what was expected,
exit 2, as a bad JSONL line is.

``datasets``/pyarrow are imported only for the formats that need them.

The package: :mod:`.sources` (what a spec names, the rows of each format, a source's short name
and sha256), :mod:`.columns` (the presets and the column mapping), and here the readers of
problems that join them.
"""

from __future__ import annotations

from typing import Iterator

from sptool.core.records import QUESTION, InputError, RecordKind, answer_text
from sptool.stages.problemsets.columns import Mapping, columns_hint, map_row
from sptool.stages.problemsets.sources import iter_rows, parse_source


def iter_problems(spec: str, kind: RecordKind = QUESTION, mapping: Mapping | None = None, *,
                  need_answer: bool = False, user: str = "") -> Iterator[tuple[int, dict]]:
    """``(row number, record)`` of every problem of ``spec``, mapped and validated as ``kind``;
    ``need_answer``: a row without a reference answer is an error (naming ``user``).

    The first unreadable row raises :class:`InputError` at ``source:row``."""
    mapping = (mapping or Mapping()).check()
    source = parse_source(spec)
    location = source.spec if source.kind != "jsonl" else (source.path if source.path != "-" else "<stdin>")
    for number, row in iter_rows(source):
        try:
            record = kind.validate(map_row(row, mapping, need_answer=need_answer))
            if need_answer and answer_text(record.get("answer")) is None:
                raise InputError(f"missing, expected a reference answer{f' ({user} needs one)' if user else ''}",
                                 field="answer", hint=columns_hint(row) if "answer" not in row else None)
        except InputError as error:
            if error.field in ("question", "answer") and error.field not in row and error.hint is None:
                error = InputError(error.reason, field=error.field, hint=columns_hint(row))
            raise error.at(location, number) from None
        yield number, record


def read_problems(spec: str, kind: RecordKind = QUESTION, mapping: Mapping | None = None, *,
                  need_answer: bool = False, user: str = "", allow_empty: bool = False) -> list[dict]:
    """Every problem of ``spec`` (see :func:`iter_problems`); none at all is an error unless
    ``allow_empty``."""
    problems = [record for _, record in iter_problems(spec, kind, mapping, need_answer=need_answer, user=user)]
    if not problems and not allow_empty:
        raise InputError("no problems", source=spec)
    return problems


def read_labelled_problems(path: str, user: str, mapping: Mapping | None = None) -> list[dict]:
    """Problems with reference answers (``question``, ``answer``) from any source, its columns
    mapped by ``mapping``, for ``user`` (named in the error when a row has no answer)."""
    return read_problems(path, mapping=mapping, need_answer=True, user=user)
