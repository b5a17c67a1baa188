"""The stage contract: a stage turns an iterator of records into an iterator of records.

Every sptool stage (``solve``, ``verify``, ``filter``, …) is a :class:`Stage`. The CLI and the
``run`` driver use the same objects: the CLI feeds them records read from JSONL, the driver
feeds them the previous stage's output in-process.

A stage counts what it read, wrote and dropped (by reason) in :attr:`Stage.stats`, and hands
every dropped record with its reason to :attr:`Stage.on_drop` (the CLI points that at the
``--rejects`` file), so no record is ever lost silently.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

from sptool.core.records import ANY, RecordKind


@dataclass
class StageStats:
    """Counts for the one-line summary every stage prints at the end."""

    read: int = 0
    written: int = 0
    invalid: int = 0
    dropped: Counter = field(default_factory=Counter)
    notes: Counter = field(default_factory=Counter)

    def summary(self, name: str) -> str:
        parts = [f"{name}: {self.read} in", f"{self.written} out"]
        if self.invalid:
            parts.append(f"{self.invalid} invalid input skipped")
        for reason, count in sorted(self.dropped.items()):
            parts.append(f"{count} dropped ({reason})")
        for note, count in sorted(self.notes.items()):
            parts.append(f"{count} {note}")
        return ", ".join(parts)

    def as_dict(self) -> dict:
        return {"read": self.read, "written": self.written, "invalid": self.invalid,
                "dropped": dict(self.dropped), "notes": dict(self.notes)}


class Stage:
    """Base class: subclasses implement :meth:`process`, a generator over records.

    ``input_kind`` declares the fields the stage needs; the CLI validates input lines against it
    before they reach :meth:`process`.
    """

    name: str = "stage"
    input_kind: RecordKind = ANY

    def __init__(self) -> None:
        self.stats = StageStats()
        self.on_drop: Callable[[dict, str], None] | None = None

    def drop(self, record: dict, reason: str) -> None:
        """Drop a record: count it by reason and hand it to ``on_drop`` (the rejects file)."""
        self.stats.dropped[reason] += 1
        if self.on_drop is not None:
            self.on_drop(record, reason)

    def _count_in(self, records: Iterable[dict]) -> Iterator[dict]:
        for record in records:
            self.stats.read += 1
            yield record

    def run(self, records: Iterable[dict]) -> Iterator[dict]:
        """Run the stage over ``records``; yields output records and keeps :attr:`stats`."""
        for record in self.process(self._count_in(records)):
            self.stats.written += 1
            yield record

    def process(self, records: Iterator[dict]) -> Iterator[dict]:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self) -> None:
        """Release resources (worker pools, models). Safe to call twice."""
