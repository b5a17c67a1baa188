"""Sources of problem sets: what a spec names (:func:`parse_source`: JSONL, parquet, JSON, CSV, a
``datasets`` directory, ``hf:NAME``, ``package:NAME`` for a set shipped with sptool), the raw rows
of each format (:func:`iter_rows`), and a source's short name and sha256. ``datasets``/pyarrow are
imported only for the formats that need them."""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from sptool.core.packaged import PACKAGE_SCHEME, local_path
from sptool.core.records import InputError, RuntimeFailure, UsageError, describe

DATASETS_HINT = "pip install datasets pyarrow (sptool's own dependencies: reinstall it)"


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
    path, split = local_path(spec), None
    if not os.path.exists(path) and "@" in path:
        head, tail = path.rsplit("@", 1)
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


def source_name(spec: str) -> str:
    """A short name for a source: a file's stem, a directory's name, a hub id with its split."""
    if str(spec).startswith("hf:"):
        return str(spec)[3:]
    spec = str(spec).removeprefix(PACKAGE_SCHEME)
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
        try:
            spec = local_path(spec)
        except InputError:  # package:NAME that sptool does not ship
            return None
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
