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
common layout (:data:`PRESETS`): ``gsm8k`` (the ``#### N`` line of ``answer``), ``math`` (the
last ``\\boxed{}`` of ``solution``), ``aime`` (an integer ``answer``), ``numina`` (``answer``, else
the last ``\\boxed{}`` of ``solution``). A row that cannot be read is an :class:`InputError` at
``source:row`` (1-based; in JSONL and CSV files the line) naming the field and what was expected,
exit 2, as a bad JSONL line is.

``datasets``/pyarrow are imported only for the formats that need them.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from sptool.core.records import QUESTION, InputError, RecordKind, RuntimeFailure, UsageError, answer_text, describe

DATASETS_HINT = "pip install datasets pyarrow (sptool's own dependencies: reinstall it)"


# ---------------------------------------------------------------- presets: column layouts

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


def _columns_hint(row: dict) -> str:
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
                         hint=_columns_hint(row) if question_field not in row else None)
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
                             hint=_columns_hint(row) if field not in row else None)
        record.pop("answer", None)  # not a readable answer: no gold rather than a wrong one
        return record
    if preset and preset.name == "gsm8k" and answer_field == "answer" and "solution" not in row:
        record["solution"] = value  # the worked solution; `answer` becomes the final number
    record["answer"] = answer
    return record


# ---------------------------------------------------------------- sources

@dataclass(frozen=True)
class Source:
    """A parsed source: ``kind`` in jsonl, parquet, json, csv, disk, parquet-dir, hf."""

    spec: str
    kind: str
    path: str = ""
    name: str = ""  # hf: the dataset id
    config: str | None = None
    split: str | None = None

    @property
    def display(self) -> str:
        return self.spec


def parse_source(spec: str) -> Source:
    """What ``spec`` names (no reading yet); a missing local path is an :class:`InputError`."""
    spec = str(spec)
    if spec.startswith("hf:"):
        body = spec[3:]
        split = None
        if "@" in body:
            body, split = body.rsplit("@", 1)
        name, _, config = body.partition(":")
        if not name or (split is not None and not split) or (_ and not config):
            raise UsageError(f"{spec}: expected hf:NAME[:CONFIG][@SPLIT], e.g. hf:openai/gsm8k:main@test")
        return Source(spec, "hf", name=name, config=config or None, split=split)
    if spec in ("-", ""):
        return Source(spec, "jsonl", path="-")
    path, split = spec, None
    if not os.path.exists(path) and "@" in spec:
        head, tail = spec.rsplit("@", 1)
        if os.path.isdir(head):
            path, split = head, tail
    if os.path.isdir(path):
        if _is_saved_dataset(Path(path)):
            return Source(spec, "disk", path=path, split=split)
        if sorted(Path(path).rglob("*.parquet")):
            return Source(spec, "parquet-dir", path=path)
        raise InputError("is a directory, but neither a `datasets` save_to_disk directory nor one of "
                         "parquet files", source=spec)
    lower = path.lower()
    if lower.endswith((".parquet", ".pq")):
        kind = "parquet"
    elif lower.endswith(".csv"):
        kind = "csv"
    elif lower.endswith(".json"):
        kind = "json"
    else:
        kind = "jsonl"
    if not os.path.exists(path):
        raise InputError("no such file", source=spec)
    return Source(spec, kind, path=path)


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _import_datasets():
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise RuntimeFailure(f"reading this source needs the `datasets` library: {DATASETS_HINT}") from None
    return datasets


def _jsonable(value: Any) -> Any:
    """A column value as JSON: NaN (a missing value in pandas-written files) becomes null,
    dates become ISO text, other objects their text; bytes (images, audio) are dropped."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return None
    if hasattr(value, "isoformat"):
        return value.isoformat()
    if hasattr(value, "item"):  # numpy scalars
        return _jsonable(value.item())
    return str(value)


def _rows_jsonl(source: Source) -> Iterator[tuple[int, dict]]:
    import sys

    from sptool.core.jsonl import _parse_line, iter_lines, open_binary_input, source_name
    from sptool.core.records import ANY

    name = source_name(source.path)
    handle = open_binary_input(source.path)
    try:
        for number, raw in iter_lines(handle, name):
            if raw.strip():
                yield number, _parse_line(raw, ANY, name, number)
    except (OSError, EOFError) as exc:
        raise InputError(f"cannot read ({exc})", source=name) from None
    finally:
        if handle is not getattr(sys.stdin, "buffer", None):
            handle.close()


def _rows_table(table, source: str) -> Iterator[tuple[int, dict]]:
    for number, row in enumerate(table.to_pylist(), start=1):
        yield number, {str(k): _jsonable(v) for k, v in row.items()}


def _read_parquet(path: str, source: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise RuntimeFailure(f"reading parquet needs pyarrow: {DATASETS_HINT}") from None
    try:
        return pq.read_table(path)
    except Exception as exc:  # pyarrow's ArrowInvalid and friends: not a parquet file
        raise InputError(f"not a readable parquet file ({str(exc).splitlines()[0][:160]})", source=source) from None


def _rows_csv(source: Source) -> Iterator[tuple[int, dict]]:
    try:
        handle = open(source.path, newline="", encoding="utf-8-sig")
    except OSError as exc:
        raise InputError(f"cannot open ({exc.strerror or exc})", source=source.spec) from None
    with handle:
        reader = csv.DictReader(handle)
        line = 1
        try:
            for row in reader:
                start, line = line + 1, reader.line_num
                if None in row:
                    raise InputError(f"{len(row[None]) + len(row) - 1} values, expected {len(reader.fieldnames)} "
                                     "(one per header column)", source=source.spec, line=start)
                yield start, {k: (None if v in ("", None) else v) for k, v in row.items()}
        except UnicodeDecodeError as exc:
            raise InputError(f"not valid UTF-8 ({exc.reason})", source=source.spec) from None
        except csv.Error as exc:
            raise InputError(f"not valid CSV ({exc})", source=source.spec, line=reader.line_num) from None


def _rows_json(source: Source) -> Iterator[tuple[int, dict]]:
    from sptool.core.jsonl import loads_strict

    try:
        text = Path(source.path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read ({exc})", source=source.spec) from None
    try:
        value = loads_strict(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":  # JSON Lines in a .json file, as the hub often has them
            yield from _rows_jsonl(Source(source.spec, "jsonl", path=source.path))
            return
        raise InputError(f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})",
                         source=source.spec) from None
    except ValueError as exc:
        raise InputError(f"not valid JSON ({exc})", source=source.spec) from None
    if isinstance(value, dict):  # {"data": [...]} or a single split under its name
        lists = [v for v in value.values() if isinstance(v, list)]
        if len(lists) != 1:  # one object: JSON Lines of one line
            yield from _rows_jsonl(Source(source.spec, "jsonl", path=source.path))
            return
        value = lists[0]
    if not isinstance(value, list):
        raise InputError(f"expected a JSON array of objects (or JSON Lines), got {describe(value)}",
                         source=source.spec)
    for number, row in enumerate(value, start=1):
        if not isinstance(row, dict):
            raise InputError(f"expected an object (one problem), got {describe(row)}", source=source.spec,
                             line=number)
        yield number, row


def _pick_split(dataset_dict, source: Source):
    splits = list(dataset_dict.keys())
    if source.split is not None:
        if source.split not in splits:
            raise UsageError(f"{source.spec}: no split {source.split!r} (its splits: {', '.join(splits)})")
        return dataset_dict[source.split]
    if "train" in splits:
        return dataset_dict["train"]
    if len(splits) == 1:
        return dataset_dict[splits[0]]
    raise UsageError(f"{source.spec}: several splits, name one as {source.spec}@SPLIT "
                     f"(its splits: {', '.join(splits)})")


def _rows_disk(source: Source) -> Iterator[tuple[int, dict]]:
    datasets = _import_datasets()
    try:
        loaded = datasets.load_from_disk(source.path)
    except Exception as exc:
        raise InputError(f"not a readable `datasets` directory ({str(exc).splitlines()[0][:160]})",
                         source=source.spec) from None
    if isinstance(loaded, datasets.DatasetDict):
        loaded = _pick_split(loaded, source)
    elif source.split is not None:
        raise UsageError(f"{source.spec}: the directory holds one split, not a DatasetDict: drop @{source.split}")
    yield from _rows_table(loaded.data.table, source.spec)


def _rows_hf(source: Source) -> Iterator[tuple[int, dict]]:
    datasets = _import_datasets()
    try:
        loaded = datasets.load_dataset(source.name, source.config, split=source.split)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0") or os.environ.get("HF_DATASETS_OFFLINE", "") not in ("", "0")
        if offline:
            raise RuntimeFailure(f"{source.spec}: not in the Hugging Face cache and HF_HUB_OFFLINE is set "
                                 f"({first}); download it once with network access") from None
        raise RuntimeFailure(f"{source.spec}: cannot load the dataset ({first})") from None
    if isinstance(loaded, datasets.DatasetDict):
        loaded = _pick_split(loaded, source)
    yield from _rows_table(loaded.data.table, source.spec)


def iter_rows(source: Source) -> Iterator[tuple[int, dict]]:
    """``(row number, raw row)`` of a parsed source."""
    if source.kind == "jsonl":
        yield from _rows_jsonl(source)
    elif source.kind == "csv":
        yield from _rows_csv(source)
    elif source.kind == "json":
        yield from _rows_json(source)
    elif source.kind == "parquet":
        yield from _rows_table(_read_parquet(source.path, source.spec), source.spec)
    elif source.kind == "parquet-dir":
        number = 0
        for shard in sorted(Path(source.path).rglob("*.parquet")):
            for _, row in _rows_table(_read_parquet(str(shard), str(shard)), str(shard)):
                number += 1
                yield number, row
    elif source.kind == "disk":
        yield from _rows_disk(source)
    else:
        yield from _rows_hf(source)


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
                                 field="answer", hint=_columns_hint(row) if "answer" not in row else None)
        except InputError as error:
            if error.field in ("question", "answer") and error.field not in row and error.hint is None:
                error = InputError(error.reason, field=error.field, hint=_columns_hint(row))
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


def mapping_of(settings: Any) -> Mapping:
    """The ``[data]`` section of a run's settings as a :class:`Mapping`."""
    data = getattr(settings, "data", None)
    if data is None:
        return Mapping()
    return Mapping(data.preset, data.question_field, data.answer_field)


def source_name(spec: str) -> str:
    """A short name for a source: a file's stem, a directory's name, a hub id with its split."""
    if str(spec).startswith("hf:"):
        return str(spec)[3:]
    path = Path(str(spec).split("@")[0] if not os.path.exists(spec) else spec)
    name = path.name
    for suffix in (".gz", ".jsonl", ".json", ".csv", ".parquet", ".pq"):
        name = name.removesuffix(suffix)
    return name or str(spec)


def source_sha256(spec: str) -> str | None:
    """sha256 of a local source's bytes (a directory: of its files' relative paths and bytes, in
    order); a hub id: of the cached files ``datasets`` read; None when it cannot be found."""
    spec = str(spec)
    digest = hashlib.sha256()
    if spec.startswith("hf:"):
        try:
            source = parse_source(spec)
            datasets = _import_datasets()
            loaded = datasets.load_dataset(source.name, source.config, split=source.split)
            files = sorted({f["filename"] for f in getattr(loaded, "cache_files", [])
                            if isinstance(f, dict)})
        except Exception:
            return None
        paths = [Path(f) for f in files]
        root = None
    else:
        path = Path(spec)
        if not path.exists() and "@" in spec:
            path = Path(spec.rsplit("@", 1)[0])
        if path.is_file():
            paths, root = [path], None
        elif path.is_dir():
            paths, root = sorted(p for p in path.rglob("*") if p.is_file()), path
        else:
            return None
    for path in paths:
        if root is not None:
            digest.update(str(path.relative_to(root)).encode() + b"\0")
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def read_labelled_problems(path: str, user: str, mapping: Mapping | None = None) -> list[dict]:
    """Problems with reference answers (``question``, ``answer``) from any source, its columns
    mapped by ``mapping``, for ``user`` (named in the error when a row has no answer)."""
    return read_problems(path, mapping=mapping, need_answer=True, user=user)
