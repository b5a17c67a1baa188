"""Per-leaf corpus pools C(D_leaf) on disk (WIST §3.3), reused across iterations.

``DIR/<slug>-<hash>.jsonl`` holds the kept documents of one leaf (one JSON object per line,
without path-specific fields), written atomically. A leaf whose pool exists is served from it;
``refresh`` searches and fetches again and merges the new documents in (same URL: replaced).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from sptool.jsonl import AtomicJsonlWriter, read_records
from sptool.records import content_id

#: Fields that belong to one path record, not to the leaf's pool.
PATH_FIELDS = ("id", "path_id", "labels", "nodes")


def leaf_slug(leaf: str) -> str:
    """A readable, unique file stem for a leaf: ``pythagorean-theorem-1a2b3c4d``."""
    slug = re.sub(r"[^a-z0-9]+", "-", leaf.lower()).strip("-")[:60] or "leaf"
    return f"{slug}-{content_id(leaf.strip().lower(), length=8)}"


class LeafPool:
    """A directory of per-leaf JSONL pools."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def path_for(self, leaf: str) -> Path:
        return self.directory / f"{leaf_slug(leaf)}.jsonl"

    def has(self, leaf: str) -> bool:
        return self.path_for(leaf).is_file()

    def load(self, leaf: str) -> list[dict]:
        path = self.path_for(leaf)
        if not path.is_file():
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
        with AtomicJsonlWriter(self.path_for(leaf)) as out:
            for document in pool:
                out.write(document)
        return pool
