"""Checkpoint cadence of ``sptool run``: which train steps write one, and writing it off the loop.

- A train step writes a checkpoint after every ``run.checkpoint_every``-th iteration and after the
  last one (:func:`checkpoint_due`); the others record ``"checkpoint": null, "deferred": true``.
  A backend that reloads weights from disk (vllm, openai) needs every one.
- Writing happens on a background thread (:class:`CheckpointWriter`) from a CPU copy of the
  weights and the optimizer state taken when the step ends (full precision: a resumed run must
  continue from exactly the weights the uninterrupted one had), so generation goes on while the
  files are written. A checkpoint is complete once its directory exists (the writer renames a
  finished staging directory into place); older ones are pruned only after that.
- Resume (:func:`replay_plan`): each role starts from its newest complete checkpoint and the
  train steps recorded after it are trained again, in order, from their recorded inputs, which
  gives the same weights (generation is not repeated: its outputs are on disk).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterable

from sptool.train.checkpoint import STATE_DIR, STATE_FILE

RELOADING_BACKENDS = ("vllm", "openai")


def checkpoint_due(settings, iteration: int) -> bool:
    """Does a train step of ``iteration`` write its checkpoint? (``settings``: the run's typed
    :class:`~sptool.run.config.Sections`.)"""
    if settings.model.backend in RELOADING_BACKENDS:
        return True  # the generator reads the new weights from the checkpoint
    every = settings.run.checkpoint_every
    return every <= 1 or iteration % every == 0 or iteration >= settings.run.iterations


def is_complete(directory: Path) -> bool:
    return (directory / STATE_DIR / STATE_FILE).is_file()


def replay_plan(train_entries: Iterable[tuple[str, list[dict]]], run_dir: Path,
                start: str) -> tuple[dict[str, str], list[tuple[str, set[str]]]]:
    """From the finished train steps (``(key, records)`` in manifest order): each role's starting
    weights (its newest complete checkpoint, else ``start``) and the train steps to train again
    after it (``(key, roles)`` in order)."""
    starts: dict[str, str] = {}
    pending: dict[str, list[str]] = {}  # role -> keys after its newest complete checkpoint
    order: list[str] = []
    for key, records in train_entries:
        order.append(key)
        for record in records:
            role, step = record.get("role"), record.get("step")
            if role is None or step is None:
                continue  # nothing trained in this step for this role
            checkpoint = record.get("checkpoint")
            if checkpoint and is_complete(run_dir / checkpoint):
                starts[role] = str(run_dir / checkpoint)
                pending[role] = []
            else:  # deferred, or its writer did not finish before the run died
                pending.setdefault(role, []).append(key)
    replay = [(key, {role for role, keys in pending.items() if key in keys}) for key in order]
    return starts, [(key, roles) for key, roles in replay if roles]


def _cpu_copy(value: Any, seen: dict | None = None, pinned: bool = False) -> Any:
    """A CPU copy of tensors in nested dicts/lists; tensors that share memory (tied embeddings)
    stay shared, so ``save_pretrained`` still recognises and drops the tied copy. ``pinned``: CUDA
    tensors go into page-locked memory without waiting, one after another (the caller then
    synchronizes): one pageable ``.to("cpu")`` per tensor waits for each copy, and stages it
    through the driver's buffer."""
    import torch

    seen = {} if seen is None else seen
    if isinstance(value, torch.Tensor):
        key = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
               tuple(value.stride()), value.dtype)
        if key not in seen:
            tensor = value.detach()
            if pinned and tensor.is_cuda:
                copy = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
                copy.copy_(tensor, non_blocking=True)
                seen[key] = copy
            else:
                seen[key] = tensor.to("cpu", copy=True)
        return seen[key]
    if isinstance(value, dict):
        return {k: _cpu_copy(v, seen, pinned) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu_copy(v, seen, pinned) for v in value)
    return value


def _tensors(value: Any) -> Iterable:
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


#: the most page-locked memory a snapshot takes, as a share of the memory available now (the
#: caching host allocator keeps freed page-locked blocks for the next snapshot)
PINNED_SHARE = 0.25


def _pin_snapshots(*values: Any) -> set:
    """The CUDA devices to synchronize after copying ``values`` to page-locked memory, or an empty
    set to copy them as before: no tensor on CUDA (a CPU trainer never touches CUDA here), or more
    bytes than a quarter of the available memory (``PINNED_SHARE``)."""
    tensors = [tensor for value in values for tensor in _tensors(value)]
    devices = {tensor.device for tensor in tensors if tensor.is_cuda}
    if not devices:
        return set()
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return set()
    return devices if sum(t.numel() * t.element_size() for t in tensors) <= PINNED_SHARE * available else set()


def snapshot(trainer) -> Callable[[Path], None] | None:
    """A function that writes ``trainer``'s current checkpoint from a CPU copy taken now, or None
    where only the trainer's own ``save`` is right (LoRA adapters, several processes)."""
    if trainer.is_lora or trainer.accelerator.num_processes > 1:
        return None
    from sptool.train import checkpoint as ckpt

    import torch

    policy = trainer.accelerator.unwrap_model(trainer.model)
    weights, optimizer = policy.state_dict(), trainer.optimizer.state_dict()
    devices = _pin_snapshots(weights, optimizer)
    weights = _cpu_copy(weights, pinned=bool(devices))
    optimizer = _cpu_copy(optimizer, pinned=bool(devices))
    for device in devices:  # the copies are in place before the writer thread reads them (cuda:N too)
        torch.cuda.synchronize(device)
    state = trainer.checkpoint_state()
    tokenizer = trainer.tokenizer

    def write(directory: Path) -> None:
        def save_model(target: str) -> None:
            policy.save_pretrained(target, state_dict=weights, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(target)

        ckpt.save_checkpoint(directory, save_model=save_model, optimizer_state=optimizer, state=state)

    return write


class CheckpointWriter:
    """One checkpoint written at a time on a background thread; ``wait`` re-raises its error."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, write: Callable[[], None]) -> None:
        self.wait()

        def target() -> None:
            try:
                write()
            except BaseException as exc:  # noqa: BLE001 - handed to the loop at wait()
                self._error = exc

        self._thread = threading.Thread(target=target, name="sptool-checkpoint", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
