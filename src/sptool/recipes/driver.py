"""``sptool run``: drive a recipe's stages in one process, resumably.

The driver chains the same stage objects the CLI commands use (``SolveStage``, ``VerifyStage``,
``FilterStage`` …) and keeps models loaded between them. With the ``hf`` backend the generation
backend *shares the weights* of the trainer's policy, so every generation after a ``train`` stage
uses the freshly trained weights without a reload.

Run directory::

    config.toml             the effective configuration
    manifest.json           finished stages: output file, record count, sha256, metrics (atomic)
    metrics.jsonl           one line per finished stage (rebuilt from the manifest, atomic)
    iter-0001/NN-STAGE.jsonl  each stage's output (atomic); .rejects.jsonl: dropped records
    ckpt/ROLE/step-N/       checkpoints (``--keep`` newest per role)
    tree.json, pools/       WIST: the domain tree (snapshots in iter-*/NN-*.tree.json) and leaf pools

Resume: a stage listed in the manifest is not run again; its output is read back. Stage seeds are
derived from ``(run seed, iteration, stage name)`` and ids are content hashes, so a resumed run
writes the same records as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import signal
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable

from sptool.jsonl import dumps, write_json_atomic
from sptool.records import RuntimeFailure, UsageError, content_id
from sptool.stage import Stage, StageStats

KILL_ENV = "SPTOOL_TEST_KILL_AT"   # tests: "[ITER/]STAGE:POINT", POINT in start, mid, save, checkpoint, done
MANIFEST = "manifest.json"
FORMAT = 1

Event = Callable[[dict], None]


def stage_seed(run_seed: int, iteration: int, stage: str) -> int:
    """The seed of one stage: a hash of (run seed, iteration, stage name), below 2**20 (stages
    multiply seeds by batch numbers and backends again by large primes: keep within int64)."""
    return int(content_id("stage-seed", run_seed, iteration, stage)[:8], 16) % (2 ** 20)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_jsonl_atomic(path: Path, records: Iterable[dict], before_rename: Callable[[], None] | None = None) -> None:
    """Write ``records`` to a temp file, fsync, (test hook), rename over ``path``."""
    tmp = path.with_name(f".{path.name}.part")
    with open(tmp, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    if before_rename is not None:
        before_rename()
    os.replace(tmp, path)


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def json_copy(records: list[dict]) -> list[dict]:
    """A deep copy through JSON: stages see exactly what a resumed run reads back from disk."""
    return [json.loads(dumps(record)) for record in records]


def read_labelled_problems(path: str, user: str) -> list[dict]:
    """Problems with reference answers (``question``, ``answer``) from JSONL, for ``user`` (named
    in the error when a line has no answer or the file has no problems)."""
    from sptool.jsonl import read_records
    from sptool.records import QUESTION

    problems = list(read_records(path, QUESTION))
    for number, record in enumerate(problems, 1):
        if record.get("answer") in (None, ""):
            raise UsageError(f"{path}:{number}: field 'answer': {user} needs a reference answer")
    if not problems:
        raise UsageError(f"{path}: no problems")
    return problems


# ---------------------------------------------------------------------------------- metrics

def _mean(values: Iterable[float | None]) -> float | None:
    values = [float(v) for v in values if v is not None]
    return sum(values) / len(values) if values else None


def question_diversity(questions: list[str]) -> dict:
    """Distinct-question ratio and mean pairwise 1 − BLEU (over at most 64 questions)."""
    questions = [q for q in questions if isinstance(q, str) and q.strip()]
    if not questions:
        return {"distinct_ratio": None, "mean_bleu_distance": None}
    normalised = {" ".join(q.lower().split()) for q in questions}
    out = {"distinct_ratio": len(normalised) / len(questions), "mean_bleu_distance": None}
    if len(questions) >= 2:
        from sptool.rewards import bleu_distance_matrix

        sample = questions[:64]
        matrix = bleu_distance_matrix(sample)
        pairs = [matrix[i][j] for i in range(len(sample)) for j in range(i + 1, len(sample))]
        out["mean_bleu_distance"] = _mean(pairs)
    return out


def stage_metrics(kind: str, records: list[dict]) -> dict:
    """Summary numbers of one stage's output, for ``metrics.jsonl`` and ``sptool report``."""
    metrics: dict[str, Any] = {}
    if kind == "challenge":
        valid = [r for r in records if r.get("valid") is not False]
        metrics["candidates"] = len(records)
        metrics["valid_rate"] = len(valid) / len(records) if records else None
        metrics.update(question_diversity([r.get("question") for r in valid]))
    elif kind == "verify":
        graded = [r for r in records if r.get("samples") and r.get("p_hat") is not None]
        metrics["graded"] = len(graded)
        metrics["accuracy"] = _mean(r["p_hat"] for r in graded)
        metrics["mean_var"] = _mean(r.get("var") for r in graded)
        metrics["majority_frac"] = _mean(r.get("majority_frac") for r in graded)
        metrics["invalid_frac"] = _mean(r.get("invalid_frac") for r in graded)
        metrics["verify_errors"] = sum(1 for r in records if r.get("verify_error"))
        if graded and any(r.get("mode") == "validity" for r in graded):
            metrics["validity_pass_rate"] = _mean(1.0 if (r.get("invalid_frac") or 0) <= 0.5 else 0.0
                                                  for r in graded)
    elif kind == "novelty":
        judged = [r["novelty"].get("novel") for r in records if isinstance(r.get("novelty"), dict)]
        judged = [v for v in judged if v is not None]
        metrics["novel_rate"] = _mean(1.0 if v else 0.0 for v in judged)
    elif kind == "filter":
        by_role: dict[str, list[float]] = defaultdict(list)
        groups: dict[str, int] = defaultdict(int)
        for group in records:
            role = str(group.get("role"))
            groups[role] += 1
            by_role[role].extend(float(r) for r in group.get("rewards") or [])
        metrics["groups"] = dict(groups)
        metrics["mean_reward"] = {role: _mean(values) for role, values in by_role.items()}
    elif kind == "solve":
        samples = [s for r in records for s in r.get("samples") or []]
        metrics["samples"] = len(samples)
        metrics["mean_tokens"] = _mean(s.get("n_tokens") for s in samples)
        metrics["truncated_rate"] = _mean(1.0 if s.get("finish_reason") == "length" else 0.0 for s in samples)
    elif kind == "train":
        metrics["roles"] = {r["role"]: {k: v for k, v in (r.get("metrics") or {}).items()
                                        if isinstance(v, (int, float)) and not isinstance(v, bool)}
                            for r in records}
    elif kind == "eval":
        metrics["after_iteration"] = records[0]["after_iteration"] if records else None
        metrics["benchmarks"] = {r["benchmark"]: {"greedy": r.get("greedy_accuracy"), "mean@k": r.get("mean_at_k"),
                                                  **(r.get("pass_at") or {})} for r in records}
    elif kind == "corpus-fetch":
        metrics["documents"] = len(records)
        metrics["leaves"] = len({r.get("leaf") for r in records})
    return metrics


def tree_summary(tree: dict) -> list[dict]:
    from sptool.tree import tree_rows

    return [{"id": row["id"], "label": row["label"], "depth": row["depth"], "mean": row["mean"],
             "visits": row["visits"]} for row in tree_rows(tree) if not row["is_unk"] and row["depth"] >= 1]


# ---------------------------------------------------------------------------------- models

def _shared_backend(trainer, chat_template: bool):
    """An ``hf`` generation backend over the trainer's own policy (no copy, always fresh)."""
    from sptool.models.hf import HFBackend, load_tokenizer

    class SharedPolicyBackend(HFBackend):
        def __init__(self) -> None:  # noqa: D401 - no loading: the model is the trainer's
            import torch

            self.model_id = str(trainer.config.model)
            self.path = str(trainer.config.model)
            self.device = str(trainer.device)
            self.model = trainer.accelerator.unwrap_model(trainer.model)
            self.dtype = next(self.model.parameters()).dtype
            self.batch_size = 64
            self.chat_template = chat_template
            self.tokenizer = trainer.tokenizer if trainer.tokenizer is not None else load_tokenizer(self.path)
            self.tokenizer.padding_side = "left"
            self._torch = torch
            self.generate_options = {}

        def generate(self, prompts, n, params):
            self.model.eval()
            return super().generate(prompts, n, params)

        def close(self) -> None:
            pass  # the trainer owns the model

    return SharedPolicyBackend()


class Policy:
    """One trained role (``policy``, or ``questioner``/``solver``): its trainer and generator."""

    def __init__(self, driver: "RunDriver", role: str, start: str):
        self.driver, self.role, self.start = driver, role, start
        self._trainer = None
        self._backend = None

    @property
    def trainer(self):
        if self._trainer is None:
            from sptool.train.step import PolicyTrainer, TrainConfig

            c = self.driver.config
            train = c["train"]
            config = TrainConfig(model=self.start, loss=train["loss"], beta=train["beta"],
                                 learning_rate=train["learning_rate"], max_grad_norm=train["max_grad_norm"],
                                 lora_r=train["lora_r"],
                                 max_tokens_per_micro_batch=train["max_tokens_per_micro_batch"],
                                 chat_template=c["model"]["chat_template"],
                                 device=c["model"]["device"] or None, seed=c["run"]["seed"])
            self.driver.say(f"loading {self.role} policy from {self.start}")
            self._trainer = PolicyTrainer(config, log=self.driver.say)
        return self._trainer

    @property
    def backend(self):
        if self._backend is None:
            c = self.driver.config["model"]
            if c["backend"] == "hf":
                self._backend = _shared_backend(self.trainer, c["chat_template"])
                self._backend.batch_size = c["gen_batch_size"]
            else:
                self._backend = self.driver.load_generator(self.start)
        return self._backend

    def after_update(self, checkpoint: str) -> None:
        """New weights: the shared ``hf`` backend sees them already; others reload."""
        self.start = checkpoint
        backend = self.driver.config["model"]["backend"]
        if backend not in ("hf", "scripted") and self._backend is not None:
            self._backend.close()
            self._backend = None

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
        self._backend = None
        self._trainer = None


# ---------------------------------------------------------------------------------- driver

@dataclass
class StageSpec:
    name: str                      # e.g. "q1-verify"; the file is NN-name.jsonl
    kind: str                      # metrics kind: challenge, solve, verify, filter, train, …
    run: Callable[["StageContext"], list[dict]]


class StageContext:
    """What a stage function sees: its seed, earlier outputs of the iteration, a record counter."""

    def __init__(self, driver: "RunDriver", iteration: int, key: str, name: str, outputs: dict):
        self.driver, self.iteration, self.key, self.name = driver, iteration, key, name
        self.seed = stage_seed(driver.config["run"]["seed"], iteration, name)
        self.outputs = outputs
        self.rejects: list[dict] = []
        self.count = 0

    def output(self, name: str) -> list[dict]:
        return json_copy(self.outputs[name]())

    def run_stage(self, stage: Stage, records: list[dict]) -> list[dict]:
        """Run a library stage over ``records``, counting items and collecting drops."""
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
            self.driver.kill_point(self.key, "mid")
        self.driver.emit({"event": "progress", "stage": self.key, "items": self.count})


class RunDriver:
    """Runs ``config['run']['iterations']`` iterations of a recipe in ``run_dir``."""

    def __init__(self, config: dict, run_dir: str | os.PathLike, *, resume: bool = False,
                 on_event: Event | None = None, log: Callable[[str], None] | None = None):
        self.config = config
        self.recipe = config["recipe"]
        self.own = config[self.recipe]
        self.run_dir = Path(run_dir)
        self.resume = resume
        self.on_event = on_event
        self.log = log
        self.policies: dict[str, Policy] = {}
        self._judge = None
        self._verifier = None
        self._encoder = None
        self._eval_sets: list[tuple[str, list[dict]]] | None = None
        self._svs_data: list[dict] | None = None
        self.tree: dict | None = None
        self.manifest: dict = {}

    # -- plumbing ---------------------------------------------------------------------------

    def say(self, message: str) -> None:
        if self.log is not None:
            self.log(message)

    def emit(self, event: dict) -> None:
        if self.on_event is not None:
            self.on_event(event)

    @staticmethod
    def kill_requested(key: str, point: str) -> bool:
        """Test hook: does ``SPTOOL_TEST_KILL_AT=[ITER/]STAGE:POINT`` name this stage and point?"""
        spec = os.environ.get(KILL_ENV)
        if not spec:
            return False
        where, _, wanted = spec.rpartition(":")
        iteration, stage = key.split("/")
        name = stage.split("-", 1)[1]
        targets = {stage, name, f"{iteration}/{stage}", f"{iteration}/{name}",
                   f"{int(iteration.split('-')[1])}/{name}"}
        return wanted == point and where in targets

    @classmethod
    def kill_point(cls, key: str, point: str) -> None:
        """Test hook: SIGKILL this process at the point ``SPTOOL_TEST_KILL_AT`` names."""
        if cls.kill_requested(key, point):
            os.kill(os.getpid(), signal.SIGKILL)

    def _prepare_dir(self) -> None:
        from sptool.recipes import to_toml

        manifest_path = self.run_dir / MANIFEST
        if self.resume:
            if not manifest_path.is_file():
                if self.run_dir.exists() and any(self.run_dir.iterdir()):
                    raise UsageError(f"--resume: {self.run_dir} has no {MANIFEST}; not a run directory")
                self.resume = False
            else:
                self.manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
                if self.manifest.get("recipe") != self.recipe:
                    raise UsageError(f"--resume: {self.run_dir} is a '{self.manifest.get('recipe')}' run, "
                                     f"not '{self.recipe}'")
                saved = self.manifest.get("config")
                if saved and saved != self.config:
                    from sptool.recipes import schema_for

                    # a key newer than the run (absent from its saved config) counts as its default
                    defaults = schema_for(self.recipe)
                    changed = sorted(f"{s}.{k}" for s in self.config if isinstance(self.config[s], dict)
                                     for k in self.config[s]
                                     if saved.get(s, {}).get(k, defaults.get(s, {}).get(k)) != self.config[s][k])
                    if any(key != "run.iterations" for key in changed):
                        raise UsageError(f"--resume: the configuration differs from the run's "
                                         f"({', '.join(changed[:5])}); resume with the same options")
                    self.manifest["config"] = self.config
                self._clean_partials()
                return
        elif self.run_dir.exists() and any(self.run_dir.iterdir()):
            raise UsageError(f"run directory {self.run_dir} is not empty; use --resume to continue "
                             f"it or choose another --run-dir")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(to_toml(self.config), encoding="utf-8")
        self.manifest = {"format": FORMAT, "recipe": self.recipe, "config": self.config,
                         "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "stages": {}, "order": []}
        self._save_manifest()

    def _clean_partials(self) -> None:
        """Remove temp files a killed run left (stage outputs, checkpoint staging dirs)."""
        for path in self.run_dir.rglob(".*"):
            if ".part" in path.name or ".sptool-tmp-" in path.name or ".sptool-old-" in path.name:
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)

    def _save_manifest(self) -> None:
        write_json_atomic(self.run_dir / MANIFEST, self.manifest)
        lines = [self.manifest["stages"][key]["metrics_line"] for key in self.manifest["order"]]
        write_jsonl_atomic(self.run_dir / "metrics.jsonl", lines)

    # -- models -----------------------------------------------------------------------------

    def roles(self) -> list[str]:
        return ["policy"] if self.config["train"]["shared_policy"] else ["questioner", "solver"]

    def role_for_group(self, group: dict) -> str:
        if self.config["train"]["shared_policy"]:
            return "policy"
        return "questioner" if group.get("role") == "questioner" else "solver"

    def policy(self, role: str) -> Policy:
        if self.config["train"]["shared_policy"]:
            role = "policy"
        return self.policies[role]

    def load_generator(self, model: str):
        from sptool.models.base import load_backend

        c = self.config["model"]
        if c["backend"] == "scripted":
            return load_backend("scripted", c["script"] or "scripted")
        return load_backend(c["backend"], model, device=c["device"] or None, dtype=c["dtype"] or None,
                            batch_size=c["gen_batch_size"], chat_template=c["chat_template"], log=self.say)

    @property
    def judge(self):
        """R-Quest's frozen novelty judge: the base model, never trained."""
        if self._judge is None:
            c = self.config["model"]
            self._judge = self.load_generator(c["judge"] or c["policy"])
        return self._judge

    def verifier(self, pseudo_label: bool):
        from sptool.verify import VerifyStage

        if self._verifier is None:
            v = self.config["verify"]
            self._verifier = VerifyStage(workers=v["workers"], deadline_s=v["deadline_s"])
        self._verifier.pseudo_label = pseudo_label
        return self._verifier

    def params(self, seed: int, max_tokens: int | None = None):
        from sptool.models.base import SamplingParams

        g = self.config["generation"]
        return SamplingParams(temperature=g["temperature"], top_p=g["top_p"],
                              max_new_tokens=max_tokens or g["max_tokens"], seed=seed)

    def close(self) -> None:
        for policy in self.policies.values():
            policy.close()
        if self._judge is not None:
            self._judge.close()
        if self._verifier is not None:
            self._verifier.close()

    # -- the loop ---------------------------------------------------------------------------

    def plan(self, iteration: int) -> list[StageSpec]:
        """The iteration's stages; with ``eval.benchmarks``, a held-out evaluation before the first
        iteration and after every ``eval.every``-th and the last one."""
        specs = {"wist": self.plan_wist, "svs": self.plan_svs, "rzero": self.plan_rzero,
                 "rquest": self.plan_rzero}[self.recipe](iteration)
        if self.eval_sets():
            every = self.config["eval"]["every"]
            if iteration == 1:
                specs.insert(0, StageSpec("eval-before", "eval", lambda c: self.evaluate(c, 0)))
            if iteration == self.config["run"]["iterations"] or (every and iteration % every == 0):
                specs.append(StageSpec("eval", "eval", lambda c: self.evaluate(c, iteration)))
        return specs

    def eval_sets(self) -> list[tuple[str, list[dict]]]:
        """The held-out benchmarks of ``eval.benchmarks`` (read and checked once, at the start)."""
        if self._eval_sets is None:
            self._eval_sets = []
            for path in [p.strip() for p in self.config["eval"]["benchmarks"].split(",") if p.strip()]:
                problems = read_labelled_problems(path, "a held-out benchmark")
                name = Path(path).name.split(".")[0]
                if any(name == known for known, _ in self._eval_sets):
                    name = path  # two files with one stem: tell them apart by path
                self._eval_sets.append((name, problems))
        return self._eval_sets

    def evaluate(self, ctx: StageContext, after_iteration: int) -> list[dict]:
        """Greedy accuracy, mean@k and pass@k of the current solver weights on each benchmark."""
        from sptool.evaluate import evaluate_benchmark

        e = self.config["eval"]
        backend = self.policy("solver").backend
        out = []
        for name, problems in self.eval_sets():
            result, _ = evaluate_benchmark(
                name, problems, backend, samples=e["samples"], ks=tuple(sorted({1, e["samples"]})),
                params=self.params(ctx.seed, e["max_tokens"] or None), verifier=self.verifier(False),
                batch_size=16)
            out.append({"id": content_id("eval", name, after_iteration), "benchmark": name,
                        "after_iteration": after_iteration, **result.as_dict()})
            ctx.advance()
        return out

    def _restore_state(self) -> None:
        """Latest checkpoint per role and latest tree, from the finished stages."""
        starts = {role: self.config["model"]["policy"] for role in self.roles()}
        tree_file = None
        for key in self.manifest["order"]:
            entry = self.manifest["stages"][key]
            if entry.get("tree"):
                tree_file = entry["tree"]
            if entry["kind"] == "train":
                for record in read_jsonl(self.run_dir / entry["output"]):
                    if record.get("checkpoint"):
                        starts[record["role"]] = str(self.run_dir / record["checkpoint"])
        self.policies = {role: Policy(self, role, start) for role, start in starts.items()}
        if self.recipe == "wist":
            from sptool.tree import load_tree, new_tree

            if tree_file:
                self.tree = load_tree(self.run_dir / tree_file)
            elif self.own["tree"]:
                self.tree = load_tree(self.own["tree"])
            else:
                self.tree = new_tree(self.own["domain"], max_depth=self.own["max_depth"],
                                     window_size=self.own["window"], max_children=self.own["max_children"])

    def run(self) -> dict:
        self.eval_sets()  # a bad benchmark file fails here, before the run directory or a model
        self._prepare_dir()
        self._restore_state()
        iterations = self.config["run"]["iterations"]
        started = time.monotonic()
        ran = resumed = 0
        try:
            for iteration in range(1, iterations + 1):
                specs = self.plan(iteration)
                outputs: dict[str, Callable[[], list[dict]]] = {}
                self.emit({"event": "iteration", "iteration": iteration, "iterations": iterations,
                           "elapsed_s": time.monotonic() - started})
                for index, spec in enumerate(specs, 1):
                    key = f"iter-{iteration:04d}/{index:02d}-{spec.name}"
                    if key in self.manifest["stages"]:
                        outputs[spec.name] = self._reader(key)
                        resumed += 1
                        self.emit({"event": "stage-skipped", "stage": key, "iteration": iteration,
                                   "records": self.manifest["stages"][key]["records"]})
                        continue
                    records = self._run_stage(spec, key, iteration, index, len(specs), outputs)
                    outputs[spec.name] = (lambda r=records: r)
                    ran += 1
        finally:
            self.close()
        return {"run_dir": str(self.run_dir), "stages_run": ran, "stages_resumed": resumed,
                "iterations": iterations, "wall_s": time.monotonic() - started}

    def _reader(self, key: str) -> Callable[[], list[dict]]:
        entry = self.manifest["stages"][key]
        path = self.run_dir / entry["output"]
        cache: list = []

        def read() -> list[dict]:
            if not cache:
                if not path.is_file() or file_sha256(path) != entry["sha256"]:
                    raise RuntimeFailure(f"--resume: {path} is missing or changed since it was written "
                                         f"(sha256 differs from {MANIFEST})")
                cache.append(read_jsonl(path))
            return cache[0]

        return read

    def _run_stage(self, spec: StageSpec, key: str, iteration: int, index: int, total: int,
                   outputs: dict) -> list[dict]:
        self.emit({"event": "stage", "stage": key, "iteration": iteration, "index": index,
                   "total": total})
        self.kill_point(key, "start")
        ctx = StageContext(self, iteration, key, spec.name, outputs)
        begin = time.monotonic()
        records = spec.run(ctx)
        wall = time.monotonic() - begin
        iter_dir = self.run_dir / f"iter-{iteration:04d}"
        iter_dir.mkdir(exist_ok=True)
        stem = key.split("/")[1]
        path = iter_dir / f"{stem}.jsonl"
        entry: dict[str, Any] = {"kind": spec.kind, "output": str(path.relative_to(self.run_dir)),
                                 "records": len(records), "seed": ctx.seed}
        if spec.kind in ("tree-expand", "posterior-update"):
            tree_path = iter_dir / f"{stem}.tree.json"
            write_json_atomic(tree_path, self.tree)
            write_json_atomic(self.run_dir / "tree.json", self.tree)
            entry["tree"] = str(tree_path.relative_to(self.run_dir))
        if ctx.rejects:
            write_jsonl_atomic(iter_dir / f"{stem}.rejects.jsonl", ctx.rejects)
        write_jsonl_atomic(path, records, before_rename=lambda: self.kill_point(key, "save"))
        entry["sha256"] = file_sha256(path)
        metrics = stage_metrics(spec.kind, records)
        if spec.kind in ("tree-expand", "posterior-update") and self.tree is not None:
            metrics["tree"] = tree_summary(self.tree)
        metrics["rejected"] = len(ctx.rejects)
        entry["metrics_line"] = {"iteration": iteration, "stage": spec.name, "kind": spec.kind,
                                 "records": len(records), "wall_s": round(wall, 3), **metrics}
        self.manifest["stages"][key] = entry
        self.manifest["order"].append(key)
        self._save_manifest()
        self.kill_point(key, "done")
        self.emit({"event": "stage-done", "stage": key, "iteration": iteration, "records": len(records),
                   "wall_s": wall, "metrics": metrics})
        return records

    # -- shared stage bodies ----------------------------------------------------------------

    def _solve(self, ctx: StageContext, records: list[dict], role: str, samples: int, mode: str = "math",
               only: Callable[[dict], bool] | None = None) -> list[dict]:
        """Solve ``records`` (those passing ``only``; the rest pass through untouched, in order)."""
        from sptool.solve import SolveStage

        stage = SolveStage(self.policy(role).backend, samples=samples, mode=mode,
                           params=self.params(ctx.seed), batch_size=16)
        return self._subset(ctx, stage, records, only)

    def _verify(self, ctx: StageContext, records: list[dict], pseudo_label: bool,
                only: Callable[[dict], bool] | None = None) -> list[dict]:
        return self._subset(ctx, self.verifier(pseudo_label), records, only)

    @staticmethod
    def _subset(ctx: StageContext, stage: Stage, records: list[dict],
                only: Callable[[dict], bool] | None) -> list[dict]:
        if only is None:
            return ctx.run_stage(stage, records)
        chosen = [i for i, record in enumerate(records) if only(record)]
        done = ctx.run_stage(stage, [records[i] for i in chosen])
        out = list(records)
        for i, record in zip(chosen, done):
            out[i] = record
        return out

    def _filter(self, ctx: StageContext, records: list[dict], **extra) -> list[dict]:
        from sptool.filter import FilterOptions, FilterStage

        advantage = "dr_grpo" if self.config["train"]["loss"] == "dr_grpo" else "grpo"
        options = FilterOptions(advantage=advantage, seed=ctx.seed, **extra)
        return ctx.run_stage(FilterStage(self.recipe, options), records)

    def _train(self, ctx: StageContext, groups: list[dict], roles: list[str], updates: int = 1) -> list[dict]:
        """``updates`` optimizer steps per role over its groups; one checkpoint per role."""
        from sptool.train.step import split_updates

        out = []
        for role in roles:
            mine = [g for g in groups if self.role_for_group(g) == role]
            policy = self.policies[role]
            if not mine:
                out.append({"role": role, "step": None, "checkpoint": None, "groups": 0,
                            "skipped": "no training groups"})
                continue
            trainer = policy.trainer
            per_update = max(1, math.ceil(len(mine) / updates))
            metrics: dict[str, Any] = {}
            for chunk in split_updates(mine, per_update):
                metrics = trainer.update(chunk)
                ctx.advance()
            self.kill_point(ctx.key, "train-done")
            directory = self.run_dir / "ckpt" / role / f"step-{trainer.step:04d}"
            directory.parent.mkdir(parents=True, exist_ok=True)
            crash_env = None
            if self.kill_requested(ctx.key, "checkpoint"):
                from sptool.train.checkpoint import CRASH_ENV

                crash_env = CRASH_ENV
                os.environ[CRASH_ENV] = "kill"  # dies half-way through writing the checkpoint
            try:
                trainer.save(directory)
            finally:
                if crash_env:
                    os.environ.pop(crash_env, None)
            policy.after_update(str(directory))
            self._prune(role)
            out.append({"role": role, "step": trainer.step, "groups": len(mine), "updates": updates,
                        "checkpoint": str(directory.relative_to(self.run_dir)), "metrics": metrics})
        return out

    def _prune(self, role: str) -> None:
        keep = self.config["run"]["keep"]
        if not keep:
            return
        directories = sorted((p for p in (self.run_dir / "ckpt" / role).glob("step-*") if p.is_dir()),
                             key=lambda p: int(p.name.split("-")[1]))
        for old in directories[:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    # -- WIST -------------------------------------------------------------------------------

    def plan_wist(self, iteration: int) -> list[StageSpec]:
        return [StageSpec("tree-expand", "tree-expand", self.wist_expand),
                StageSpec("corpus-fetch", "corpus-fetch", self.wist_fetch),
                StageSpec("challenge", "challenge", self.wist_challenge),
                StageSpec("solve", "solve", lambda c: self._solve(c, c.output("challenge"), "solver",
                                                                  self.own["samples"])),
                StageSpec("verify", "verify", lambda c: self._verify(c, c.output("solve"), False)),
                StageSpec("filter", "filter", lambda c: self._filter(
                    c, c.output("verify"), sigma=self.own["sigma"],
                    invalid_penalty=self.own["invalid_penalty"])),
                StageSpec("train", "train", lambda c: self._train(c, c.output("filter"), self.roles())),
                StageSpec("posterior-update", "posterior-update", self.wist_posterior)]

    def wist_expand(self, ctx: StageContext) -> list[dict]:
        import copy

        from sptool.models.base import SamplingParams
        from sptool.titles import load_title_backend
        from sptool.tree import ExpandOptions, TreeExpander

        o = self.own
        tree = copy.deepcopy(self.tree)
        titles = load_title_backend(o["titles"] or None, o["wiki_url"] or None)
        params = SamplingParams(temperature=self.config["generation"]["temperature"],
                                max_new_tokens=o["expand_max_tokens"], seed=ctx.seed)
        options = ExpandOptions(tau_wiki=o["tau_wiki"], max_attempts=o["max_attempts"],
                                max_children=o["max_children"])
        expander = TreeExpander(self.policy("policy").backend, titles, params=params, options=options,
                                log=self.say)
        records = expander.expand(tree, o["paths"], ctx.seed)
        ctx.advance(len(records))
        self.tree = tree
        return records

    def wist_fetch(self, ctx: StageContext) -> list[dict]:
        from sptool.corpus.fetch import Fetcher
        from sptool.corpus.policy import load_policy
        from sptool.corpus.pool import LeafPool
        from sptool.corpus.search import load_search
        from sptool.corpus.stage import CorpusFetchStage

        o = self.own
        if self._encoder is None and o["encoder"].lower() != "none":
            from sptool.corpus.similarity import SentenceTransformerEncoder

            self._encoder = SentenceTransformerEncoder(o["encoder"])
        search = load_search(o["search"], url=o["search_url"] or None)
        fetcher = Fetcher(load_policy(None, allow_private=o["allow_private"]))
        stage = CorpusFetchStage(search, fetcher, encoder=self._encoder, tau_emb=o["tau_emb"],
                                 query_from=o["query_from"], min_chars=o["min_chars"],
                                 pool=LeafPool(self.run_dir / "pools"), log=self.say,
                                 now=lambda: "")
        documents = ctx.run_stage(stage, ctx.output("tree-expand"))
        # WIST §3: for each path, sample document(s) from its leaf's pool.
        rng = random.Random(ctx.seed)
        by_path: dict[str, list[dict]] = defaultdict(list)
        for document in documents:
            by_path[document["path_id"]].append(document)
        chosen = []
        for path_id in sorted(by_path):
            pool = sorted(by_path[path_id], key=lambda d: d["id"])
            chosen.extend(rng.sample(pool, min(o["docs_per_path"], len(pool))))
        return chosen

    def wist_challenge(self, ctx: StageContext) -> list[dict]:
        from sptool.challenge import DocumentChallengeStage

        stage = DocumentChallengeStage(self.policy("policy").backend, candidates=self.own["candidates"],
                                       params=self.params(ctx.seed), batch_size=4,
                                       max_document_chars=self.own["max_document_chars"])
        return ctx.run_stage(stage, ctx.output("corpus-fetch"))

    def wist_posterior(self, ctx: StageContext) -> list[dict]:
        import copy

        from sptool.tree import PosteriorUpdateStage

        tree = copy.deepcopy(self.tree)
        stage = PosteriorUpdateStage(tree, rule=self.own["posterior_rule"], tau_var=self.own["tau_var"],
                                     sigma=self.own["sigma"], rho=self.own["invalid_penalty"])
        records = ctx.run_stage(stage, ctx.output("verify"))
        self.tree = tree
        return [{"id": r.get("id"), "path_id": r.get("path_id"), "g": r.get("g")} for r in records]

    # -- SvS --------------------------------------------------------------------------------

    def plan_svs(self, iteration: int) -> list[StageSpec]:
        o = self.own
        is_variant = lambda r: r.get("valid") is not False  # noqa: E731
        return [StageSpec("sample", "sample", self.svs_sample),
                StageSpec("solve", "solve", lambda c: self._solve(c, c.output("sample"), "solver", o["samples"])),
                StageSpec("verify", "verify", lambda c: self._verify(c, c.output("solve"), False)),
                StageSpec("challenge", "challenge", self.svs_challenge),
                StageSpec("solve-variants", "solve", lambda c: self._solve(
                    c, c.output("challenge"), "solver", o["samples"], only=is_variant)),
                StageSpec("verify-variants", "verify", lambda c: self._verify(
                    c, c.output("solve-variants"), False, only=lambda r: bool(r.get("samples")))),
                StageSpec("filter", "filter", lambda c: self._filter(
                    c, c.output("verify") + c.output("verify-variants"),
                    synthesis_band=tuple(o["synthesis_band"]), negative_synthesis=o["negative_synthesis"],
                    format_weight=o["format_weight"])),
                StageSpec("train", "train", lambda c: self._train(c, c.output("filter"), self.roles()))]

    def svs_data(self) -> list[dict]:
        """The labelled training set (``--data``), read once."""
        if self._svs_data is None:
            path = self.own["data"]
            if not path:
                raise UsageError("svs needs a labelled problem set: --data FILE (JSONL with question, answer)")
            self._svs_data = read_labelled_problems(path, "SvS")
        return self._svs_data

    def svs_sample(self, ctx: StageContext) -> list[dict]:
        """``problems`` problems per iteration, walking seeded permutations of the data set."""
        data = self.svs_data()
        n, per = len(data), self.own["problems"]
        out = []
        for position in range((ctx.iteration - 1) * per, ctx.iteration * per):
            epoch, offset = divmod(position, n)
            order = list(range(n))
            random.Random(stage_seed(self.config["run"]["seed"], epoch, "svs-epoch")).shuffle(order)
            record = dict(data[order[offset]])
            record.setdefault("origin", "dataset")
            out.append(record)
            ctx.advance()
        return out

    def svs_challenge(self, ctx: StageContext) -> list[dict]:
        from sptool.challenge import SolutionChallengeStage

        o = self.own
        stage = SolutionChallengeStage(self.policy("policy").backend, candidates=o["variants"],
                                       params=self.params(ctx.seed), band=tuple(o["band"]),
                                       max_solutions=o["max_solutions"], batch_size=4)
        verified = [r for r in ctx.output("verify") if r.get("samples")]
        return ctx.run_stage(stage, verified)

    # -- R-Zero / R-Quest -------------------------------------------------------------------

    def plan_rzero(self, iteration: int) -> list[StageSpec]:
        o = self.own
        rquest = self.recipe == "rquest"
        specs: list[StageSpec] = []

        def block(prefix: str, questions: int, novelty: bool) -> None:
            p = prefix
            specs.append(StageSpec(f"{p}challenge", "challenge",
                                   lambda c: self.questioner_challenge(c, questions)))
            last = f"{p}challenge"
            if rquest:
                specs.append(StageSpec(f"{p}solve-validity", "solve", lambda c, src=last: self._solve(
                    c, c.output(src), "solver", o["validity_samples"], "validity",
                    only=lambda r: r.get("valid") is not False)))
                specs.append(StageSpec(f"{p}verify-validity", "verify", lambda c: self._verify(
                    c, c.output(f"{p}solve-validity"), True, only=lambda r: bool(r.get("samples")))))
                last = f"{p}verify-validity"
            passes = (lambda r: r.get("valid") is not False and (r.get("invalid_frac") or 0) <= 0.5) \
                if rquest else (lambda r: r.get("valid") is not False)
            specs.append(StageSpec(f"{p}solve", "solve", lambda c, src=last: self._solve(
                c, c.output(src), "solver", o["samples"], "math", only=passes)))
            specs.append(StageSpec(f"{p}verify", "verify", lambda c: self._verify(
                c, c.output(f"{p}solve"), True,
                only=lambda r: r.get("mode") == "math" and bool(r.get("samples")))))
            last = f"{p}verify"
            if novelty:
                specs.append(StageSpec(f"{p}novelty", "novelty", lambda c, src=last: self.novelty(c, c.output(src))))
                last = f"{p}novelty"
            return last

        for step in range(1, o["questioner_steps"] + 1):
            prefix = f"q{step}-"
            last = block(prefix, o["questions"], novelty=rquest)
            specs.append(StageSpec(f"{prefix}filter", "filter",
                                   lambda c, src=last: self._filter(c, c.output(src), **self.filter_extra())))
            specs.append(StageSpec(f"{prefix}train", "train", lambda c, p=prefix: self._train(
                c, [g for g in c.output(f"{p}filter") if g.get("role") == "questioner"], ["questioner"])))
        last = block("s-", o["solver_questions"], novelty=False)
        if rquest and o["replay"]:
            specs.append(StageSpec("s-replay-solve", "solve", self.replay_solve))
            specs.append(StageSpec("s-replay-verify", "verify", lambda c: self._verify(
                c, c.output("s-replay-solve"), False)))
        specs.append(StageSpec("s-filter", "filter", lambda c, src=last: self._filter(
            c, c.output(src), **self.filter_extra(replay=self._replay_file(c) if rquest and o["replay"] else None))))
        specs.append(StageSpec("s-train", "train", lambda c: self._train(
            c, [g for g in c.output("s-filter") if g.get("role") != "questioner"], ["solver"],
            updates=o["solver_steps"])))
        return specs

    def filter_extra(self, replay: str | None = None) -> dict:
        o = self.own
        extra = dict(bleu_threshold=o["bleu_threshold"], solver_band=tuple(o["solver_band"]),
                     format_weight=o["format_weight"])
        if self.recipe == "rzero":
            extra["uncertainty"] = o["uncertainty"]
        else:
            extra.update(replay=replay, replay_share=o["replay_share"])
        return extra

    def _replay_file(self, ctx: StageContext) -> str:
        key = next(k for k in self.manifest["order"]
                   if k.startswith(f"iter-{ctx.iteration:04d}/") and k.endswith("-s-replay-verify"))
        return str(self.run_dir / self.manifest["stages"][key]["output"])

    def questioner_challenge(self, ctx: StageContext, questions: int) -> list[dict]:
        from sptool.challenge import NothingChallengeStage

        stage = NothingChallengeStage(self.policy("questioner").backend, unseeded=True, candidates=questions,
                                      params=self.params(ctx.seed), batch_size=self.own["questioner_group"])
        return ctx.run_stage(stage, [])

    def novelty(self, ctx: StageContext, records: list[dict]) -> list[dict]:
        from sptool.novelty import NoveltyStage

        stage = NoveltyStage(self.judge, k=self.own["novelty_k"], seed=ctx.seed,
                             max_new_tokens=self.own["novelty_max_tokens"])
        return ctx.run_stage(stage, records)

    def replay_solve(self, ctx: StageContext) -> list[dict]:
        """Re-solve (validity mode) a seeded sample of the validity-initialisation set for replay."""
        from sptool.jsonl import read_records

        pool = list(read_records(self.own["replay"]))
        rng = random.Random(ctx.seed)
        chosen = rng.sample(pool, min(self.own["replay_problems"], len(pool)))
        return self._solve(ctx, chosen, "solver", self.own["validity_samples"], "validity")
