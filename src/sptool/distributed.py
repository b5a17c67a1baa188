"""One run over several processes (``accelerate launch`` / ``torchrun``): rank 0 drives, the
other ranks train and generate with it.

Rank 0 runs the recipe exactly as a single process does: it alone reads and writes the run
directory (manifest, stage outputs, checkpoints), grades, filters and decides. The other ranks
run :func:`serve_rank`, doing what rank 0 broadcasts (a ``gloo`` group of its own carries the
commands, so they work beside NCCL on GPUs):

- ``trainer(role, start)``: load the role's trainer (wrapping it in DDP/FSDP is collective);
- ``update(role, groups)``: one optimizer update over the groups; every rank takes its share of
  the sequences (``PolicyTrainer.update_sequences``) and the gradients are all-reduced;
- ``save(role, directory)``: the checkpoint (collective: FSDP gathers full weights; rank 0 writes);
- ``generate(role, calls)``: generation calls ``k`` with ``k % world == rank``, the results
  gathered at rank 0;
- ``stop``.

Generation split across ranks (hf backend): :func:`run_sharded` runs a stage twice on rank 0.
First against a recording :class:`ShardedBackend` that generates nothing (placeholder samples)
and lists the stage's ``generate`` calls; the ranks execute those calls, call ``k`` on rank
``k % world``, each with exactly the prompts, ``n`` and seed a single process would use, so the
samples do not depend on the number of processes (the hf backend seeds per call and batch; the
weights are equal on every rank). Then the stage runs for real and the backend hands back the
gathered results in order; a call the first pass did not foresee (a stage whose later calls
depend on earlier outputs) is generated on rank 0, so the outcome is right either way.

Killing any rank ends the launch (the launcher stops the others); ``sptool run --resume`` then
continues from the last finished step, as for one process.
"""

from __future__ import annotations

import copy
import datetime
import os
from typing import Any, Callable

from sptool.models.base import Sample

COMMAND_TIMEOUT = datetime.timedelta(days=1)  # rank 0 may grade for a long time between commands


def launched() -> bool:
    """Whether this process is one of several (``WORLD_SIZE`` > 1, set by the launchers)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


class Distributed:
    """The process group of a multi-process run and its command channel (create on every rank)."""

    def __init__(self, cpu: bool | None = None):
        import torch
        import torch.distributed as dist
        from accelerate import PartialState

        if cpu is None:
            cpu = not torch.cuda.is_available()
        self.state = PartialState(cpu=cpu)
        self.world = self.state.num_processes
        self.rank = self.state.process_index
        self._dist = dist
        self.group = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT) if self.world > 1 else None
        self.stopped = self.closed = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def command(self, op: str, *args: Any) -> None:
        """Rank 0: tell every other rank to do ``op(*args)``."""
        assert self.is_main
        if self.world > 1:
            self._dist.broadcast_object_list([(op, args)], src=0, group=self.group)

    def receive(self) -> tuple[str, tuple]:
        """Ranks > 0: the next command from rank 0."""
        box: list[Any] = [None]
        self._dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` at rank 0 (in rank order); None elsewhere."""
        if self.world == 1:
            return [value]
        out: list[Any] | None = [None] * self.world if self.is_main else None
        self._dist.gather_object(value, out, dst=0, group=self.group)
        return out

    def stop(self) -> None:
        if self.is_main and not self.stopped:
            self.stopped = True
            self.command("stop")

    def close(self) -> None:
        """End the process group on this rank, every rank once rank 0 has sent ``stop``: a barrier,
        so that no rank leaves while another still reads the stop command, then
        ``destroy_process_group``. Left to the interpreter's exit, gloo's threads were torn down
        during it, and rank 0 of a two-process CI run once aborted there, after its run had
        finished ("terminate called without an active exception", exit -6)."""
        if self.world > 1 and not self.closed and self._dist.is_initialized():
            self.closed = True
            self._dist.barrier(group=self.group)
            self._dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Generation split across ranks


Call = tuple[list, int, Any]  # (prompts, n, SamplingParams)


def execute_share(backend, calls: list[Call], rank: int, world: int) -> list[tuple[int, list]]:
    """This rank's calls (``k % world == rank``), as ``(k, samples)``."""
    return [(k, backend.generate(prompts, n, params))
            for k, (prompts, n, params) in enumerate(calls) if k % world == rank]


def placeholder(params) -> Sample:
    return Sample(text="", n_tokens=1, finish_reason="length", token_ids=[0],
                  logprobs=[0.0] if getattr(params, "logprobs", False) else None)


class ShardedBackend:
    """Rank 0's generation backend in a multi-process run: plain generation, plus the
    record and replay modes of :func:`run_sharded`. Every other attribute is the wrapped
    backend's (``model_id``, ``tokenizer``, ``render`` …)."""

    sharded = True

    def __init__(self, backend, dist: Distributed, role: str, log: Callable[[str], None] | None = None):
        self.backend, self.dist, self.role, self.log = backend, dist, role, log
        self._recorded: list[Call] | None = None
        self._replay: list[tuple[Call, list]] = []
        self.replayed = self.unforeseen = 0

    def __getattr__(self, name: str):
        return getattr(self.backend, name)

    def generate(self, prompts, n, params):
        if self._recorded is not None:
            self._recorded.append((copy.deepcopy(prompts), n, params))
            return [[placeholder(params) for _ in range(n)] for _ in prompts]
        if self._replay:
            call, result = self._replay[0]
            if call == (prompts, n, params):
                self._replay.pop(0)
                self.replayed += 1
                return result
            self._replay = []  # the stage went another way: generate the rest here
            self.unforeseen += 1
        return self.backend.generate(prompts, n, params)

    def close(self) -> None:
        self.backend.close()


def run_sharded(backend: ShardedBackend, stage, records: list[dict], run: Callable[[list[dict]], list[dict]]):
    """``run(records)`` (the stage's real run) with its generation calls spread over the ranks."""
    dist = backend.dist
    probe = copy.copy(stage)
    probe.on_drop = None
    from sptool.core.stage import StageStats

    probe.stats = StageStats()
    backend._recorded = []
    try:
        for _ in probe.run(copy.deepcopy(records)):
            pass
    finally:
        calls, backend._recorded = backend._recorded, None
    if len(calls) < 2 or dist.world == 1:
        return run(records)
    if backend.log is not None:
        backend.log(f"generation: {len(calls)} calls over {dist.world} processes")
    dist.command("generate", backend.role, calls)
    gathered = dist.gather(execute_share(backend.backend, calls, dist.rank, dist.world))
    results = dict(item for part in gathered for item in part)
    backend._replay = [(call, results[k]) for k, call in enumerate(calls)]
    try:
        return run(records)
    finally:
        backend._replay = []


# ---------------------------------------------------------------------------------------------
# Ranks > 0


def serve_rank(dist: Distributed, trainer_for: Callable[..., Any],
               backend_for: Callable[[str], Any]) -> None:
    """Ranks > 0: do rank 0's commands until ``stop``. ``trainer_for(role, start, reference)`` loads a
    role's trainer, ``backend_for(role)`` its generation backend (built like rank 0's)."""
    trainers: dict[str, Any] = {}
    while True:
        op, args = dist.receive()
        if op == "stop":
            return
        if op == "trainer":
            role, start, *reference = args  # reference: the KL reference (R-Quest's restart)
            trainers[role] = trainer_for(role, start, *reference)
        elif op == "update":
            role, groups = args
            trainers[role].update(groups)
        elif op == "save":
            role, directory = args
            trainers[role].save(directory)
        elif op == "generate":
            role, calls = args
            dist.gather(execute_share(backend_for(role), calls, dist.rank, dist.world))
        else:  # pragma: no cover - a newer rank 0 than this worker
            raise RuntimeError(f"unknown command from rank 0: {op}")


class RankZeroTrainer:
    """Rank 0's trainer in a multi-process run: each update and save is broadcast first, so
    every rank takes part. Other attributes are the wrapped trainer's."""

    def __init__(self, trainer, dist: Distributed, role: str):
        self.trainer, self.dist, self.role = trainer, dist, role

    def __getattr__(self, name: str):
        return getattr(self.trainer, name)

    def update(self, groups):
        self.dist.command("update", self.role, list(groups))
        return self.trainer.update(groups)

    def save(self, directory) -> None:
        self.dist.command("save", self.role, str(directory))
        self.trainer.save(directory)
