"""A run's training, checkpoints and replay: the part of :class:`~sptool.run.session.Session`
that updates the policies.

- ``train`` step functions: optimizer steps per role over its training groups, in ``updates``
  updates or as many as ``completions_per_update`` completions fill (:func:`pack_completions`);
- checkpoints every ``run.checkpoint_every``-th iteration and the last (:func:`checkpoint_due`),
  written in the background from a CPU copy when the generator shares the weights;
- replay on ``--resume``: the train steps recorded after the newest complete checkpoint are
  trained again (``replaying``), rewriting only a checkpoint the run recorded but lost.

:class:`Training` is a base of :class:`~sptool.run.session.Session`: it uses the session's
``policies``, ``settings``, ``run_dir``, ``writer``, ``replaying``, ``role_for_group`` and ``restart``.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable

from sptool.core import faults
from sptool.run.checkpoints import RELOADING_BACKENDS, checkpoint_due, is_complete, snapshot
from sptool.run.steps import StepContext, StepFunction


def pack_completions(groups: list[dict], batch: int) -> list[list[dict]]:
    """Consecutive groups packed into updates of at most ``batch`` completions (a group is never
    split; one larger than ``batch`` is an update of its own): WIST's training batch."""
    chunks: list[list[dict]] = []
    size = 0
    for group in groups:
        n = len(group.get("completions") or [])
        if chunks and size + n <= batch:
            chunks[-1].append(group)
            size += n
        else:
            chunks.append([group])
            size = n
    return chunks



#: the numbers of every update recorded when a train step makes several (``per_update``)
PER_UPDATE_METRICS = ("ratio_mean", "ratio_max", "clip_fraction", "logprob_gap", "tis_weight_mean", "loss")


class Training:
    """The training half of a run's session (see the module's text)."""

    def train(self, roles: list[str] | Callable[[], list[str]], updates: int = 1,
              groups: Callable[[dict], bool] | None = None, *, completions_per_update: int = 0,
              checkpoints: str | None = None, restart: bool = False) -> StepFunction:
        """Optimizer steps per role over its training groups (those passing ``groups``):
        ``updates`` of them, or with ``completions_per_update`` as many as the completions fill
        (WIST: a 512-sample training batch); one checkpoint per role (under ``ckpt/ROLE``, or
        ``ckpt/{checkpoints}``), the older ones pruned to ``run.keep``. ``restart``: the role then
        begins anew from this checkpoint (:meth:`restart`)."""
        def train(ctx: StepContext, records: list[dict]) -> list[dict]:
            chosen = [g for g in records if groups is None or groups(g)]
            return self._train(ctx, chosen, roles() if callable(roles) else roles, updates,
                               completions_per_update=completions_per_update, checkpoints=checkpoints,
                               restart=restart)
        return train

    def _train(self, ctx: StepContext, groups: list[dict], roles: list[str], updates: int, *,
               completions_per_update: int = 0, checkpoints: str | None = None,
               restart: bool = False) -> list[dict]:
        """The updates, then the checkpoint when due (:func:`checkpoint_due`), written in the
        background. Replaying (resume), only the updates of the roles being replayed run."""
        from sptool.train.step import split_updates

        out = []
        for role in roles:
            if self.replaying is not None and role not in self.replaying:
                continue
            mine = [g for g in groups if self.role_for_group(g) == role]
            policy = self.policies[role]
            if not mine:
                record = {"role": role, "step": None, "checkpoint": None, "groups": 0,
                          "skipped": "no training groups"}
                out.append(record)
                if (self.replaying is None and policy.has_unsaved_updates()
                        and self._checkpoint_due(ctx.iteration)):
                    # the run's last iteration (or a due one) trained nothing: the updates since
                    # the last checkpoint are written now, not lost with the process
                    self._checkpoint(ctx, role, policy, policy.trainer, record)
                continue
            trainer = policy.trainer
            policy.before_update()
            if completions_per_update:
                chunks = pack_completions(mine, completions_per_update)
            else:
                chunks = split_updates(mine, max(1, math.ceil(len(mine) / updates)))
            filled = trainer.fill_old_logprobs(mine) if len(chunks) > 1 else 0
            metrics: dict[str, Any] = {}
            per_step = []
            for chunk in chunks:
                metrics = trainer.update(chunk)
                per_step.append({key: metrics.get(key) for key in PER_UPDATE_METRICS})
                ctx.advance()
            record = {"role": role, "step": trainer.step, "groups": len(mine),
                      "groups_with_signal": sum(1 for g in mine if any(a != 0 for a in g.get("advantages") or [])),
                      "updates": len(per_step), "checkpoint": None, "metrics": metrics}
            if len(per_step) > 1:
                record["per_update"] = per_step
            if filled:  # completions without sampling log-probs, scored before the first update
                record["old_logprobs_filled"] = filled
            out.append(record)
            if self.replaying is not None:  # resume: rewrite only a checkpoint the run recorded but lost
                recorded = self.replaying[role]
                if recorded:
                    record["checkpoint"] = recorded
                    self._save(ctx, Path(recorded).parent.name, trainer, self.run_dir.path / recorded)
                    policy.after_update(str(self.run_dir.path / recorded))
                    if restart:
                        record["restart"] = True
                        self.restart(role, str(self.run_dir.path / recorded))
                continue
            faults.kill_point(ctx.key, "train-done")
            if not (restart or self._checkpoint_due(ctx.iteration)):
                record["deferred"] = True
                continue
            self._checkpoint(ctx, role, policy, trainer, record, name=checkpoints or role, restart=restart)
        return out

    def _checkpoint(self, ctx: StepContext, role: str, policy, trainer, record: dict,
                    name: str | None = None, restart: bool = False) -> None:
        """Write ``role``'s checkpoint ``ckpt/NAME/step-N`` (recorded in ``record``) and point its
        generator at it (``restart``: the role starts over from it, as after R-Quest's init phase)."""
        name = name or role
        directory = self.run_dir.path / "ckpt" / name / f"step-{trainer.step:04d}"
        directory.parent.mkdir(parents=True, exist_ok=True)
        record["checkpoint"] = str(directory.relative_to(self.run_dir.path))
        began = time.monotonic()
        self._save(ctx, name, trainer, directory)
        # the train step's time on its checkpoint before going on: the CPU copy (the writing goes
        # on in the background), or the whole save where it cannot
        ctx.timings["checkpoint_s"] = ctx.timings.get("checkpoint_s", 0.0) + time.monotonic() - began
        policy.saved_step = trainer.step
        how = policy.after_update(str(directory))
        if how is not None:
            record["weights_update"] = how  # vllm/openai: "in-place" or "adapter" (or "restart")
        if restart:
            record["restart"] = True
            self.restart(role, str(directory))

    def _checkpoint_due(self, iteration: int) -> bool:
        """:func:`checkpoint_due`; in a phase before the iterations (iteration 0) only the step
        that ends it writes one (or every step, for a backend that reloads weights)."""
        if iteration == 0:
            return self.settings.model.backend in RELOADING_BACKENDS
        return checkpoint_due(self.settings, iteration)

    def _save(self, ctx: StepContext, name: str, trainer, directory) -> None:
        """Write the checkpoint (under ``ckpt/NAME``): in the background from a CPU copy when the
        generator shares the weights (hf, scripted), else (and under a test's kill point) before
        going on."""
        write = snapshot(trainer) if self.settings.model.backend not in RELOADING_BACKENDS else None
        if write is None or faults.kill_requested(ctx.key, "checkpoint"):
            self.writer.wait()
            with faults.checkpoint_kill_point(ctx.key):
                trainer.save(directory)
            self._prune(name)
            return

        def write_and_prune() -> None:
            write(directory)
            self._prune(name)

        self.writer.submit(write_and_prune)

    def _prune(self, name: str) -> None:
        """Older checkpoints of ``ckpt/NAME`` down to ``run.keep``, never one the manifest on disk
        still names (those go once the manifest names a newer one: :meth:`RunDir.finish`)."""
        self.run_dir.prune(name, self.settings.run.keep, complete=is_complete)

