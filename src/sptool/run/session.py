"""The models and graders a run keeps loaded between steps, and the step functions over them.

- :class:`Policy`: one trained role (``policy``, or ``questioner``/``solver``): its trainer and
  its generation backend. With the ``hf`` backend the generator *shares the trainer's weights*
  (:meth:`HFBackend.from_model`), so every generation after a ``train`` step uses the freshly
  trained weights without a reload. The ``vllm`` and ``openai`` backends are built once per run
  and switched to each new checkpoint (``update_weights``: in place, or a new LoRA adapter; for
  ``openai`` on every server); on GPU the in-process engine sleeps while the trainer updates.
  The servers of ``openai`` are brought to the run's current weights when the run (re)starts.
- Several processes (``accelerate launch … -m sptool run``): rank 0 runs the recipe and alone
  writes the run directory; the other ranks train with it (DDP/FSDP) and take their share of the
  hf generation calls (:mod:`sptool.distributed`).
- :class:`Session`: the policies per role, R-Quest's frozen judge, the verifier, the held-out
  sets, and factories of the step functions every recipe uses (solve, verify, evaluate; train,
  with checkpoints and replay, from its base :class:`~sptool.run.training.Training`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from sptool.stages.problemsets import read_labelled_problems  # noqa: F401 - its home was here
from sptool.core.records import UsageError, content_id
from sptool.run.checkpoints import CheckpointWriter, is_complete, replay_plan
from sptool.run.run_dir import RunDir, read_jsonl
from sptool.run.steps import StepContext, StepFunction
from sptool.run.training import Training, pack_completions  # noqa: F401 - pack_completions: API


class Policy:
    """One trained role: its trainer (loaded on first use) and its generation backend."""

    def __init__(self, session: "Session", role: str, start: str, reference: str | None = None):
        self.session, self.role, self.start = session, role, start
        self.reference = reference  # the KL reference; None: the checkpoint's own, else the start
        self._trainer = None
        self._backend = None
        self.saved_step: int | None = None  # the trainer step whose weights are on disk

    def has_unsaved_updates(self) -> bool:
        """Whether the trainer took steps since its weights were loaded or last written."""
        return self._trainer is not None and self._trainer.step != self.saved_step

    def restores_optimizer(self) -> bool:
        """Whether the trainer restores the optimizer state saved with its start: always for this
        run's own checkpoints (resume, R-Quest's restart), else as ``train.start_optimizer`` says."""
        if self.session.settings.train.start_optimizer == "restore":
            return True
        return Path(self.start).resolve().is_relative_to(self.session.run_dir.path.resolve())

    @property
    def trainer(self):
        if self._trainer is None:
            from sptool.train.step import PolicyTrainer, TrainConfig

            s = self.session.settings
            config = TrainConfig(model=self.start, **s.train_options(), restore_optimizer=self.restores_optimizer(),
                                 max_completion_tokens=s.generation.max_tokens,  # Dr. GRPO's L
                                 chat_template=s.model.chat_template, device=s.model.device or None,
                                 ref_model=self.reference, seed=s.run.seed)
            self.session.say(f"loading {self.role} policy from {self.start}")
            dist = self.session.dist
            if dist is not None and dist.is_main:
                from sptool.distributed import RankZeroTrainer

                # every rank loads it (DDP wrap is collective), with the same KL reference
                dist.command("trainer", self.role, self.start, self.reference)
                self._trainer = RankZeroTrainer(PolicyTrainer(config, log=self.session.say), dist, self.role)
            else:
                self._trainer = PolicyTrainer(config, log=self.session.say)
            self.saved_step = self._trainer.step  # the weights it loaded
        return self._trainer

    @property
    def backend(self):
        if self._backend is None:
            c = self.session.settings.model
            if c.backend == "hf":
                from sptool.models.hf import HFBackend, shared_sampler_autocast

                trainer = self.trainer
                self._backend = HFBackend.from_model(
                    trainer.accelerator.unwrap_model(trainer.model), trainer.tokenizer,
                    model_id=str(trainer.config.model), batch_size=c.gen_batch_size,
                    chat_template=c.chat_template, compile=c.compile_generation, decoder=c.decoder,
                    decode_attention=c.decode_attention, step_graph=c.step_graph, log=self.session.say,
                    autocast=shared_sampler_autocast(c.dtype or None, str(trainer.device)))
                dist = self.session.dist
                if dist is not None and dist.is_main and dist.world > 1:
                    from sptool.distributed import ShardedBackend

                    self._backend = ShardedBackend(self._backend, dist, self.role, log=self.session.say)
            elif c.backend == "openai":
                # the servers serve the base model by its name; then they get this run's weights
                # (a restarted server, or one left at another run's checkpoint, is brought back)
                self._backend = self.session.load_generator(c.policy)
                self._update_generator(self.start)
            else:
                self._backend = self.session.load_generator(self.start)
        return self._backend

    def before_update(self) -> None:
        """The trainer is about to update: an in-process engine frees the GPU (colocated)."""
        if self._backend is not None and hasattr(self._backend, "sleep"):
            self._backend.sleep()

    def after_update(self, checkpoint: str) -> str | None:
        """New weights: the shared ``hf`` backend sees them already; ``vllm`` and ``openai``
        switch the running engine or the servers to the checkpoint. Returns how (or None)."""
        self.start = checkpoint
        if self._backend is None:
            return None
        return self._update_generator(checkpoint)

    def _update_generator(self, checkpoint: str) -> str | None:
        update = getattr(self._backend, "update_weights", None)
        if update is None:
            return None
        from sptool.core.records import RuntimeFailure

        try:
            how = update(checkpoint)
        except RuntimeFailure as exc:
            raise RuntimeFailure(f"{exc}; restart the server(s), then continue with `sptool run --resume "
                                 f"--run-dir {self.session.run_dir.path}`") from None
        self.session.say(f"{self.role}: generating from {checkpoint} ({how})")
        return how

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
        self._backend = None
        self._trainer = None


class Session(Training):
    """Models, graders and held-out sets of one run (loaded lazily, closed at the end)."""

    def __init__(self, config: dict, run_dir: RunDir, log: Callable[[str], None] | None = None):
        from sptool.run.config import Sections

        self.config = config
        self.settings = Sections.of(config)  # the shared sections, typed
        self.run_dir = run_dir
        self.log = log
        self.policies: dict[str, Policy] = {}
        self._judge = None
        self._verifier = None
        self._eval_sets: list[tuple[str, list[dict]]] | None = None
        self.writer = CheckpointWriter()
        self.replay: list[tuple[str, set[str]]] = []  # train steps to train again on resume
        self.replaying: dict[str, str | None] | None = None  # role -> its recorded checkpoint, on replay
        self.dist = None
        from sptool.distributed import launched

        if launched():
            import os

            from sptool.distributed import Distributed

            model = self.settings.model
            if model.backend == "vllm":
                raise UsageError("model.backend=vllm runs in one process; with several processes use hf "
                                 "(generation split across the ranks) or openai (servers)")
            if model.backend == "hf" and os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
                raise UsageError("under FSDP each rank holds a shard of the policy, so the hf backend cannot "
                                 "generate from it: use --backend openai with `sptool serve` servers (or DDP)")
            self.dist = Distributed(cpu=model.device.startswith("cpu") or None)

    @property
    def is_main(self) -> bool:
        """Whether this process writes the run (the only one, or rank 0 of several)."""
        return self.dist is None or self.dist.is_main

    def serve_rank(self) -> None:
        """Ranks > 0 of a multi-process run: train and generate as rank 0 commands."""
        from sptool.distributed import serve_rank

        policies: dict[str, Policy] = {}

        def trainer_for(role: str, start: str, reference: str | None = None):
            if role in policies:  # a restart (R-Quest's initialised solver)
                policies[role].close()
            policies[role] = Policy(self, role, start, reference)
            return policies[role].trainer

        try:
            serve_rank(self.dist, trainer_for, lambda role: policies[role].backend)
        finally:
            for policy in policies.values():
                policy.close()
        self.dist.close()  # after rank 0's stop, as rank 0 does

    def say(self, message: str) -> None:
        if self.log is not None:
            self.log(message)

    # -- roles and models ------------------------------------------------------------------------

    @property
    def shared_policy(self) -> bool:
        return self.settings.train.shared_policy

    def roles(self) -> list[str]:
        return ["policy"] if self.shared_policy else ["questioner", "solver"]

    def role_for_group(self, group: dict) -> str:
        if self.shared_policy:
            return "policy"
        return "questioner" if group.get("role") == "questioner" else "solver"

    def policy(self, role: str) -> Policy:
        return self.policies["policy" if self.shared_policy else role]

    def start_of(self, role: str) -> str:
        """A role's configured start: ``model.questioner`` / ``model.solver``, else ``model.policy``."""
        model = self.settings.model
        return {"questioner": model.questioner, "solver": model.solver}.get(role) or model.policy

    def restore(self) -> None:
        """Each role starts from its configured start (:meth:`start_of`) or its newest complete
        checkpoint in the run directory; ``self.replay`` lists the train steps recorded after it
        (to train again). A role restarted from a checkpoint (R-Quest's initialised solver) keeps
        that checkpoint as its KL reference once it is complete (else replaying restarts it)."""
        entries = [(key, read_jsonl(self.run_dir.path / entry["output"]))
                   for key, entry in zip(self.run_dir.manifest.get("order", []), self.run_dir.entries())
                   if entry["kind"] == "train"]
        found, self.replay = replay_plan(entries, self.run_dir.path, self.settings.model.policy)
        references: dict[str, str] = {}
        for _, records in entries:
            for record in records:
                checkpoint = record.get("checkpoint")
                if record.get("restart") and checkpoint and is_complete(self.run_dir.path / checkpoint):
                    references[record["role"]] = str(self.run_dir.path / checkpoint)
        starts = {role: found.get(role, self.start_of(role)) for role in self.roles()}
        self.policies = {role: Policy(self, role, start, references.get(role))
                         for role, start in starts.items()}

    def restart(self, role: str, checkpoint: str) -> None:
        """``role`` begins anew from ``checkpoint``: a fresh trainer whose KL reference is that
        checkpoint (R-Quest: the self-play solver starts from the initialised solver)."""
        self.writer.wait()  # the checkpoint is on disk before anything loads it
        old = self.policies[role]
        new = Policy(self, role, checkpoint, reference=checkpoint)
        if self.settings.model.backend != "hf" and old._backend is not None:
            new._backend, old._backend = old._backend, None  # already at the checkpoint (after_update)
        old.close()
        self.policies[role] = new

    def prompts_per_call(self, samples: int) -> int:
        """Prompts per generate call so that one call fills the backend's batch
        (``model.gen_batch_size`` sequences, ``samples`` per prompt)."""
        return max(1, self.settings.model.gen_batch_size // max(1, samples))

    def load_generator(self, model: str):
        from sptool.models.base import load_backend

        c = self.settings.model
        if c.backend == "scripted":
            return load_backend("scripted", c.script or "scripted")
        options: dict[str, Any] = {}
        if c.backend == "openai":
            options["base_url"] = c.base_url or None
        if c.backend == "hf":
            options["compile"] = c.compile_generation  # honoured on CUDA only
            options["decoder"] = c.decoder
            options["decode_attention"] = c.decode_attention
            options["step_graph"] = c.step_graph
        lora_r = self.settings.train.lora_r
        if c.backend == "vllm" and lora_r:  # adapters swapped into the running engine
            options.update(enable_lora=True, max_lora_rank=next(r for r in (8, 16, 32, 64, 128, 256, 512)
                                                                  if r >= lora_r or r == 512))
        return load_backend(c.backend, model, device=c.device or None, dtype=c.dtype or None,
                            batch_size=c.gen_batch_size, chat_template=c.chat_template, log=self.say,
                            **options)

    @property
    def judge(self):
        """R-Quest's frozen novelty judge: the base model (or ``model.judge``), never trained."""
        if self._judge is None:
            c = self.settings.model
            self._judge = self.load_generator(c.judge or c.policy)
        return self._judge

    def verifier(self, pseudo_label: bool):
        from sptool.stages.verify import VerifyStage

        if self._verifier is None:
            v = self.settings.verify
            self._verifier = VerifyStage(workers=v.workers, deadline_s=v.deadline_s,
                                         require_boxed=v.require_boxed, vote=v.vote)
        self._verifier.pseudo_label = pseudo_label
        return self._verifier

    def prompt(self, role: str):
        """The prompt of ``role`` from the run's ``[prompts]`` (a :class:`sptool.prompts.PromptSpec`)."""
        from sptool.prompts import prompt_spec

        return prompt_spec(self.config, role)

    def params(self, seed: int, max_tokens: int | None = None, *, logprobs: bool = False,
               top_p: float | None = None):
        """Sampling parameters of ``generation``; ``logprobs`` for generations that are trained
        on (the behaviour policy's per-token log-probabilities, the update's importance ratio)."""
        from sptool.models.base import SamplingParams

        g = self.settings.generation
        return SamplingParams(temperature=g.temperature, top_p=top_p or g.top_p,
                              max_new_tokens=max_tokens or g.max_tokens, seed=seed, logprobs=logprobs)

    def eval_sets(self) -> list[tuple[str, list[dict]]]:
        """The held-out benchmarks of ``eval.benchmarks`` (read and checked once, at the start)."""
        if self._eval_sets is None:
            self._eval_sets = []
            for path in [p.strip() for p in self.settings.eval.benchmarks.split(",") if p.strip()]:
                from sptool.stages.problemsets.columns import Mapping
                from sptool.stages.problemsets.sources import source_name

                problems = read_labelled_problems(path, "a held-out benchmark", Mapping(self.settings.eval.preset))
                name = source_name(path)
                if any(name == known for known, _ in self._eval_sets):
                    name = path  # two files with one stem: tell them apart by path
                self._eval_sets.append((name, problems))
        return self._eval_sets

    def close(self) -> None:
        self.writer.wait()
        for policy in self.policies.values():
            policy.close()
        if self._judge is not None:
            self._judge.close()
        if self._verifier is not None:
            self._verifier.close()
        if self.dist is not None:
            self.dist.stop()
            self.dist.close()

    # -- step functions every recipe uses --------------------------------------------------------

    def solve(self, samples: int, mode: str = "math", role: str = "solver", *, trained: bool = False,
              top_p: float | None = None) -> StepFunction:
        """Sample ``samples`` solutions per record with ``role``'s current weights (``trained``:
        the samples are a training group, so they keep their sampling log-probabilities)."""
        def solve(ctx: StepContext, records: list[dict]) -> list[dict]:
            return self.solve_records(ctx, records, samples, mode, role, trained=trained, top_p=top_p)
        return solve

    def solve_records(self, ctx: StepContext, records: list[dict], samples: int, mode: str = "math",
                      role: str = "solver", *, trained: bool = False, top_p: float | None = None,
                      seed: int | None = None) -> list[dict]:
        """:meth:`solve` over ``records`` now (``seed``: instead of the step's)."""
        from sptool.stages.solve import SolveStage

        params = self.params(ctx.seed if seed is None else seed, logprobs=trained, top_p=top_p)
        stage = SolveStage(self.policy(role).backend, samples=samples, mode=mode, params=params,
                           batch_size=self.prompts_per_call(samples),
                           prompt=self.prompt("validity" if mode == "validity" else "solve"))
        return ctx.run_stage(stage, records)

    def verify(self, pseudo_label: bool) -> StepFunction:
        """Grade the samples: against the reference answer, or the majority (``pseudo_label``)."""
        def verify(ctx: StepContext, records: list[dict]) -> list[dict]:
            return ctx.run_stage(self.verifier(pseudo_label), records)
        return verify

    def evaluate(self, after_iteration: int) -> StepFunction:
        """Greedy accuracy, mean@k and pass@k of the current solver weights on each benchmark."""
        def evaluate(ctx: StepContext, records: list[dict]) -> list[dict]:
            from sptool.stages.evaluate import evaluate_benchmark

            e = self.settings.eval
            backend = self.policy("solver").backend
            out = []
            for name, problems in self.eval_sets():
                result, _ = evaluate_benchmark(
                    name, problems, backend, samples=e.samples,
                    ks=tuple(sorted({1, e.samples})) if e.samples else (),
                    params=self.params(ctx.seed, e.max_tokens or None), verifier=self.verifier(False),
                    batch_size=self.prompts_per_call(e.samples),
                    greedy_batch_size=self.prompts_per_call(1), prompt=self.prompt("solve"))
                out.append({"id": content_id("eval", name, after_iteration), "benchmark": name,
                            "after_iteration": after_iteration, **result.as_dict()})
                ctx.advance()
            return out
        return evaluate
