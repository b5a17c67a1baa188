"""Declarative steps: what a recipe's plan is made of.

A :class:`Step` names a function, the earlier steps whose outputs it reads and an optional
record predicate::

    Step("verify-variants", session.verify(), inputs=["solve-variants"], only=has_samples, kind="verify")

The executor (:mod:`sptool.run.driver`) hands the function a :class:`StepContext` and the
concatenated outputs of ``inputs``. With ``only``, the function sees just the records that pass
it; the others are passed through untouched, in their places.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from sptool.core import faults
from sptool.core.jsonl import dumps
from sptool.core.records import content_id
from sptool.core.stage import Stage, StageStats

StepFunction = Callable[["StepContext", list[dict]], list[dict]]
Predicate = Callable[[dict], bool]


@dataclass(frozen=True)
class Step:
    """One step of an iteration; its output is ``iter-NNNN/MM-{name}.jsonl``."""

    name: str                       # unique within the iteration, e.g. "q1-verify"
    fn: StepFunction                # (context, input records) -> output records
    inputs: Sequence[str] = ()      # earlier steps whose outputs are concatenated as input
    only: Predicate | None = None   # run fn on these records only; the rest pass through
    kind: str | None = None         # metrics kind (solve, verify, filter, train, …); default: name

    @property
    def metrics_kind(self) -> str:
        return self.kind or self.name


def stage_seed(run_seed: int, iteration: int, stage: str) -> int:
    """The seed of one step: a hash of (run seed, iteration, step name), below 2**20 (stages
    multiply seeds by batch numbers and backends again by large primes: keep within int64)."""
    return int(content_id("stage-seed", run_seed, iteration, stage)[:8], 16) % (2 ** 20)


def json_copy(records: list[dict]) -> list[dict]:
    """A deep copy through JSON: steps see exactly what a resumed run reads back from disk."""
    return [json.loads(dumps(record)) for record in records]


class WrittenOutput:
    """A step's output as the run directory wrote it: called, the records themselves (for a step
    that only reads them); :meth:`copy`, fresh records parsed from the JSONL lines written for
    them, which is what a resumed run reads back, without serialising the records once more (a
    solve step's 512 samples with their log-probabilities: 43 ms through :func:`json_copy`, 18 ms
    from the lines, on this repository's CPU)."""

    def __init__(self, records: list[dict], lines: list[str]):
        self.records, self.lines = records, lines

    def __call__(self) -> list[dict]:
        return self.records

    def copy(self) -> list[dict]:
        return [json.loads(line) for line in self.lines]


class StepContext:
    """What a step function sees: its seed, earlier outputs of the iteration, a record counter,
    the records it dropped, documents (a tree) to persist beside its output, and ``emit``, the
    executor's event callback (progress)."""

    def __init__(self, emit: Callable[[dict], None], iteration: int, key: str, step: Step, seed: int,
                 outputs: dict[str, Callable[[], list[dict]]]):
        self.emit, self.iteration, self.key, self.step = emit, iteration, key, step
        self.name = step.name
        self.seed = seed
        self.outputs = outputs
        self.rejects: list[dict] = []
        self.documents: dict[str, tuple[Any, Any]] = {}
        # seconds of named parts of the step (a train step's checkpoint_s): its metrics line only,
        # never its records, which a resumed run writes again byte for byte
        self.timings: dict[str, float] = {}
        self.count = 0

    def output(self, name: str) -> list[dict]:
        """A copy of an earlier step's output in this iteration."""
        source = self.outputs[name]
        return source.copy() if isinstance(source, WrittenOutput) else json_copy(source())

    def read_only(self, name: str) -> list[dict]:
        """An earlier step's output itself, not a copy, for a step that only reads it (a copy of a
        solve step's 512 samples with their log-probabilities takes about 0.1 s)."""
        return self.outputs[name]()

    def inputs(self) -> list[dict]:
        return [record for name in self.step.inputs for record in self.output(name)]

    def run_stage(self, stage: Stage, records: list[dict]) -> list[dict]:
        """Run a library stage over ``records``, counting items and collecting drops. In a
        multi-process run, the stage's generation calls are spread over the ranks."""
        backend = getattr(stage, "backend", None)
        if getattr(backend, "sharded", False):
            from sptool.distributed import run_sharded

            return run_sharded(backend, stage, records, lambda chosen: self._run_stage(stage, chosen))
        return self._run_stage(stage, records)

    def _run_stage(self, stage: Stage, records: list[dict]) -> list[dict]:
        stage.stats = StageStats()
        stage.on_drop = lambda record, reason: self.rejects.append({**record, "reject_reason": reason})
        out = []
        for record in stage.run(records):
            out.append(record)
            self.advance()
        return out

    def advance(self, n: int = 1) -> None:
        self.count += n
        if self.count == n:
            faults.kill_point(self.key, "mid")
        self.emit({"event": "progress", "stage": self.key, "items": self.count})

    def save_document(self, name: str, document: Any, summary: Any = None) -> None:
        """Persist ``document`` (JSON) as ``NN-step.{name}.json`` and ``{name}.json`` in the run
        directory; ``summary`` (if any) goes into the step's metrics under ``name``."""
        self.documents[name] = (document, summary)


def run_step(ctx: StepContext, records: list[dict]) -> list[dict]:
    """Apply ``ctx.step`` to ``records``, honouring its ``only`` predicate."""
    step = ctx.step
    if step.only is None:
        return step.fn(ctx, records)
    chosen = [i for i, record in enumerate(records) if step.only(record)]
    done = step.fn(ctx, [records[i] for i in chosen])
    out = list(records)
    for i, record in zip(chosen, done):
        out[i] = record
    return out
