"""The executor of ``sptool run``: plan -> skip what the manifest has -> run step -> persist.

It knows no recipe. It is handed a recipe object (``sptool.recipes.build_run`` makes one from a
configuration): its ``session`` (the run's models, :class:`~sptool.run.session.Session`) and
``plan(iteration)``, a list of :class:`~sptool.run.steps.Step`; the driver runs the steps in order, each with its own seed
derived from ``(run seed, iteration, step name)``, writes each output atomically and records it
in the manifest. With ``eval.benchmarks`` it adds a held-out evaluation before the first
iteration and after every ``eval.every``-th and the last one.

Resume: a step listed in the manifest is not run again; its output is read back (sha256
checked). Seeds are derived and ids are content hashes, so a resumed run writes the same records
as an uninterrupted one.
"""

from __future__ import annotations

import gc
import time
from typing import Any, Callable

from sptool.core import faults
from sptool.core.records import RuntimeFailure
from sptool.run import watch
from sptool.run.metrics import step_metrics
from sptool.run.run_dir import MANIFEST, StepKey  # noqa: F401 - MANIFEST is part of the API
from sptool.run.steps import Step, StepContext, WrittenOutput, run_step, stage_seed

Event = Callable[[dict], None]


class CollectorClock:
    """The seconds Python's cyclic garbage collector has held the process up (``gc.callbacks``):
    a stage's ``gc_s``. A full collection scans every tracked object (models, compiled graphs, the
    records, and in a compiled run tens of thousands of dynamo and inductor objects): on an H100's
    loop step of 64 x 8 samples with the captured step decoder, one full collection of 0.52-0.58 s
    in nine steps, and 0.135-0.143 s a step on average in a curve run (``run.gc_freeze`` exempts
    what the first iteration made)."""

    def __init__(self):
        self.seconds = 0.0
        self._began: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.seconds += time.perf_counter() - self._began
            self._began = None

    def __enter__(self) -> "CollectorClock":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


class RunDriver:
    """Runs ``run.iterations`` iterations of ``recipe`` in its session's run directory.

    ``recipe`` is any object with ``config`` (the effective configuration), ``session``,
    ``plan(iteration)``, ``prelude()``, ``prelude_name``, ``restore(run_dir)``, ``schema()`` (every
    key's default) and ``config_text()`` (the configuration as TOML):
    :class:`sptool.recipes.base.Recipe`."""

    def __init__(self, recipe: Any, *, resume: bool = False, on_event: Event | None = None):
        self.recipe = recipe
        self.config = recipe.config
        self.session = recipe.session
        self.settings = self.session.settings
        self.run_dir = self.session.run_dir
        self.resume = resume
        self.on_event = on_event
        self.collector = CollectorClock()

    def emit(self, event: dict) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def _prepare_dir(self) -> None:
        self.resume = self.run_dir.prepare(self.config, resume=self.resume, defaults=self.recipe.schema(),
                                           config_text=lambda: self.recipe.config_text() + precision_comment(self.config))

    def first_iteration(self) -> int:
        """0 when the recipe has a phase before its iterations (R-Quest's validity
        initialisation: ``iter-0000``), else 1."""
        return 0 if self.recipe.prelude() else 1

    def plan(self, iteration: int) -> list[Step]:
        """The recipe's steps (iteration 0: its first phase), with the held-out evaluations
        around them: before anything trains, after every ``eval.every``-th and the last iteration."""
        steps = self.recipe.prelude() if iteration == 0 else self.recipe.plan(iteration)
        if self.session.eval_sets():
            every = self.session.settings.eval.every
            if iteration == self.first_iteration():
                steps.insert(0, Step("eval-before", self.session.evaluate(0), kind="eval"))
            if iteration and (iteration == self.session.settings.run.iterations
                              or (every and iteration % every == 0)):
                steps.append(Step("eval", self.session.evaluate(iteration), kind="eval"))
        if iteration == 0:  # a phase before self-play generates no questions: no curriculum health
            return steps
        if watch.probe_problems(self.settings):
            steps += watch.probe_steps(self.session, self.settings.health.probe_samples)
        steps.append(watch.health_step(self.session, steps))
        return steps

    def run(self) -> dict:
        if not self.session.is_main:  # ranks > 0 of several processes: train and generate for rank 0
            self.session.serve_rank()
            return {"run_dir": str(self.run_dir.path), "rank": self.session.dist.rank}
        self.session.eval_sets()  # a bad benchmark file fails here, before the run directory or a model
        watch.probe_problems(self.settings)
        watch.decontamination_index(self.settings)
        if getattr(self.recipe, "needs_data", False):
            self.recipe.data()  # and a bad --data row (svs, rlvr)
        self._prepare_dir()
        self.session.restore()
        self.recipe.restore(self.run_dir)
        self._replay()
        iterations = self.session.settings.run.iterations
        started = time.monotonic()
        ran = resumed = 0
        frozen = False
        try:
            for iteration in range(self.first_iteration(), iterations + 1):
                if ran and not frozen and self.settings.run.gc_freeze:
                    gc.collect()
                    gc.freeze()  # what the first iteration loaded and compiled stays: scan it no more
                    frozen = True
                steps = self.plan(iteration)
                outputs: dict[str, Callable[[], list[dict]]] = {}
                event = {"event": "iteration", "iteration": iteration, "iterations": iterations,
                         "elapsed_s": time.monotonic() - started}
                if iteration == 0:
                    event["phase"] = self.recipe.prelude_name
                self.emit(event)
                for index, step in enumerate(steps, 1):
                    key = StepKey(iteration, index, step.name)
                    entry = self.run_dir.finished(key)
                    if entry is not None:
                        outputs[step.name] = self.run_dir.reader(key)
                        resumed += 1
                        self.emit({"event": "stage-skipped", "stage": key, "iteration": iteration,
                                   "records": entry["records"]})
                        if step.metrics_kind == "health":
                            self._check_health(iteration, outputs[step.name]())
                        continue
                    outputs[step.name] = written = self._run_step(step, key, iteration, index, len(steps), outputs)
                    ran += 1
                    if step.metrics_kind == "health":
                        self._check_health(iteration, written())
        finally:
            if frozen:
                gc.unfreeze()
            self.session.close()
        return {"run_dir": str(self.run_dir.path), "stages_run": ran, "stages_resumed": resumed,
                "iterations": iterations, "wall_s": time.monotonic() - started}

    def _replay(self) -> None:
        """Resume: train again, in order and from their recorded inputs, the train steps that
        finished after each role's newest complete checkpoint (``run.checkpoint_every``), so the
        weights are those of the uninterrupted run. Their outputs are on disk already."""
        for recorded_key, roles in self.session.replay:
            key = StepKey.parse(recorded_key)
            iteration, index = key.iteration, key.index
            steps = self.plan(iteration)
            step = steps[index - 1]
            outputs = {s.name: self.run_dir.reader(str(StepKey(iteration, i, s.name)))
                       for i, s in enumerate(steps[:index - 1], 1)}
            self.emit({"event": "stage-replayed", "stage": key, "iteration": iteration, "roles": sorted(roles)})
            seed = stage_seed(self.session.settings.run.seed, iteration, step.name)
            ctx = StepContext(self.emit, iteration, key, step, seed, outputs)
            recorded = {r["role"]: r for r in self.run_dir.reader(key)()}
            self.session.replaying = {role: recorded[role].get("checkpoint") for role in roles}
            try:
                records = run_step(ctx, ctx.inputs())
            finally:
                self.session.replaying = None
            for record in records:
                if recorded[record["role"]].get("step") != record.get("step"):
                    raise RuntimeFailure(f"--resume: replaying {key} gave {record['role']} step "
                                         f"{record.get('step')}, the run recorded "
                                         f"{recorded[record['role']].get('step')}")

    def _check_health(self, iteration: int, records: list[dict]) -> None:
        """Warn for each health threshold the iteration crosses; stop with ``run.stop_on_collapse``."""
        reasons = watch.health_warnings(self.settings, records[0]) if records else []
        for reason in reasons:
            self.emit({"event": "warning", "iteration": iteration,
                       "message": f"iteration {iteration}: curriculum health: {reason}"})
        if reasons and self.settings.run.stop_on_collapse:
            raise watch.RunStopped(f"run stopped after iteration {iteration} (run.stop_on_collapse): "
                                   f"{'; '.join(reasons)}. The run is resumable: change the health "
                                   f"thresholds or run.stop_on_collapse and --resume")

    def _run_step(self, step: Step, key: str, iteration: int, index: int, total: int,
                  outputs: dict) -> WrittenOutput:
        self.emit({"event": "stage", "stage": key, "iteration": iteration, "index": index, "total": total})
        faults.kill_point(key, "start")
        seed = stage_seed(self.session.settings.run.seed, iteration, step.name)
        ctx = StepContext(self.emit, iteration, key, step, seed, outputs)
        begin, collecting = time.monotonic(), self.collector.seconds
        with self.collector:
            records = run_step(ctx, ctx.inputs())
            kind = step.metrics_kind
            records, contaminated = watch.screen(self.settings, ctx, kind, records)
        wall = time.monotonic() - begin
        lines: list[str] = []
        entry = self.run_dir.write_step(key, kind, records, seed=seed, rejects=ctx.rejects,
                                        documents={name: doc for name, (doc, _) in ctx.documents.items()},
                                        before_rename=lambda: faults.kill_point(key, "save"), lines=lines)
        metrics: dict[str, Any] = step_metrics(kind, records)
        for name, (_, summary) in ctx.documents.items():
            if summary is not None:
                metrics[name] = summary
        metrics["rejected"] = len(ctx.rejects)
        metrics["gc_s"] = round(self.collector.seconds - collecting, 3)
        metrics.update({name: round(seconds, 3) for name, seconds in ctx.timings.items()})
        if kind in watch.SCREENED_KINDS and watch.benchmark_paths(self.settings):
            metrics["contaminated"] = contaminated
        entry["metrics_line"] = {"iteration": iteration, "stage": step.name, "kind": kind,
                                 "records": len(records), "wall_s": round(wall, 3), **metrics}
        self.run_dir.finish(key, entry)
        faults.kill_point(key, "done")
        self.emit({"event": "stage-done", "stage": key, "iteration": iteration, "records": len(records),
                   "wall_s": wall, "metrics": metrics})
        return WrittenOutput(records, lines)


def stage_precisions(config: dict) -> dict[str, str]:
    """The precision each stage of a run computes in on this machine, resolved from
    ``train.mixed_precision`` and ``model.dtype``: the sampler, the trainer and the KL reference."""
    import torch

    from sptool.models.hf import DEFAULT_SHARED_SAMPLER_DTYPE
    from sptool.train.step import TrainConfig, resolve_precision

    model, train = config["model"], config["train"]
    device = model.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    resolved = resolve_precision(TrainConfig(
        mixed_precision=None if train.get("mixed_precision") in (None, "auto") else train["mixed_precision"],
        old_logprobs=train.get("old_logprobs") or "auto", weight_rounding=train.get("weight_rounding") or "auto",
        tis_cap=float(train.get("tis_cap") or 0)), cuda=cuda)
    mixed, rounding = resolved.mixed_precision, resolved.weight_rounding
    body = "float32" if mixed == "no" else f"{mixed} autocast (float32 master weights, optimizer and reductions)"
    rounded = f", weights rounded by {rounding} (train.weight_rounding)" if mixed != "no" and rounding != "nearest" \
        else ""
    trainer = body + rounded + f", log π_old from the {resolved.old_logprobs} (train.old_logprobs)"
    names = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "fp32": "float32",
             "float32": "float32"}
    dtype = model.get("dtype") or ""
    if model.get("backend") == "scripted":
        sampler = "none (the scripted backend replays its script)"
    elif model.get("backend", "hf") == "hf":
        chosen = names.get(dtype, names[DEFAULT_SHARED_SAMPLER_DTYPE])
        sampler = "float32 (the trainer's policy)" if chosen == "float32" else \
            f"{chosen} autocast over the trainer's float32 policy{rounded}"
    else:
        sampler = names.get(dtype, "bf16" if cuda else "float32") + f" ({model.get('backend')} backend's own copy)"
    # the frozen reference is never routed through the weight rounding
    reference = body if float(train.get("beta", 0) or 0) > 0 else "none (beta = 0)"
    return {"sampler": sampler, "trainer": trainer, "reference": reference, "device": device}


def precision_comment(config: dict) -> str:
    """``config.toml``'s closing comment: :func:`stage_precisions` (a comment, so the file still
    reads back as ``--config``)."""
    try:
        found = stage_precisions(config)
    except (KeyError, ImportError):
        return ""
    return "\n# precision on this machine (resolved from train.mixed_precision and model.dtype)\n" + \
        "".join(f"# {stage} = {value}\n" for stage, value in found.items())
