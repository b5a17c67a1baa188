"""Per-leaf corpus pools C(D_leaf) on disk (WIST §3.3), reused across iterations.

``DIR/<slug>-<hash>.jsonl`` holds the kept documents of one leaf (one JSON object per line,
without path-specific fields), written atomically. A leaf whose pool exists is served from it;
``refresh`` searches and fetches again and merges the new documents in (same URL: replaced).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable

from sptool.core.jsonl import AtomicJsonlWriter, read_records
from sptool.core.records import content_id

#: Fields that belong to one path record, not to the leaf's pool.
PATH_FIELDS = ("id", "path_id", "labels", "nodes")


def leaf_slug(leaf: str) -> str:
    """A readable, unique file stem for a leaf: ``pythagorean-theorem-1a2b3c4d``."""
    slug = re.sub(r"[^a-z0-9]+", "-", leaf.lower()).strip("-")[:60] or "leaf"
    return f"{slug}-{content_id(leaf.strip().lower(), length=8)}"


class LeafPool:
    """A directory of per-leaf JSONL pools.

    In a ``sptool run``, ``step`` names the step that writes and ``committed(step)`` says whether
    a step finished (its manifest entry is on disk). Each pool file written by a step carries the
    step's name beside it (``<leaf>.jsonl.step``), and a pool written by a step that never
    finished (killed) does not count: the step, run again on ``--resume``, searches and fetches the
    leaf again and drops what it dropped the first time, so its rejects and metrics equal the
    uninterrupted run's."""

    def __init__(self, directory: str | os.PathLike, *, step: str | None = None,
                 committed: Callable[[str], bool] | None = None):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.step = step
        self.committed = committed
        self._written: set[Path] = set()  # pools this attempt wrote: they count within it

    def path_for(self, leaf: str) -> Path:
        return self.directory / f"{leaf_slug(leaf)}.jsonl"

    def _provisional(self, path: Path) -> bool:
        """Written by a step that has not finished (a killed attempt of this step or another)."""
        marker = path.with_name(path.name + ".step")
        if self.committed is None or path in self._written or not marker.is_file():
            return False
        return not self.committed(marker.read_text(encoding="utf-8").strip())

    def has(self, leaf: str) -> bool:
        path = self.path_for(leaf)
        return path.is_file() and not self._provisional(path)

    def load(self, leaf: str) -> list[dict]:
        path = self.path_for(leaf)
        if not path.is_file() or self._provisional(path):
            return []
        return list(read_records(path))  # a corrupt pool line: one error at path:line

    def save(self, leaf: str, documents: list[dict]) -> list[dict]:
        """Merge ``documents`` into the leaf's pool (by URL; newer wins); return the pool."""
        merged: dict[str, dict] = {d["url"]: d for d in self.load(leaf)}
        for document in documents:
            merged[document["url"]] = {k: v for k, v in document.items() if k not in PATH_FIELDS}
        pool = list(merged.values())
        if not pool:  # nothing found: the leaf stays uncovered and is tried again next time
            return pool
        if self.step is not None:  # first the marker: a kill between the two leaves it provisional
            from sptool.core.jsonl import write_text_atomic

            write_text_atomic(self.path_for(leaf).with_name(self.path_for(leaf).name + ".step"),
                              self.step + "\n")
        with AtomicJsonlWriter(self.path_for(leaf)) as out:
            for document in pool:
                out.write(document)
        self._written.add(self.path_for(leaf))
        return pool
