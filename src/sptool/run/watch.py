"""Watching a run: benchmark decontamination of what it generates, and curriculum health.

- :func:`screen`: with ``decontaminate.benchmarks`` set, every generated question (the output of a
  step of kind ``challenge``, in every recipe) that overlaps a benchmark problem is kept but
  marked ``valid: false`` (the questioner gets the penalty of an invalid question, no solver sees
  it), and WIST's fetched documents (kind ``corpus-fetch``) that contain one are dropped; the
  step's metrics count them (``contaminated``).
- :func:`probe_steps` and :func:`health_step`: the steps the executor appends to every iteration:
  with ``health.probe``, the probe questions are solved and voted on like generated ones and the
  majority is graded against the reference; then ``health`` summarises the iteration
  (:mod:`sptool.run.health`). :func:`health_warnings` compares it with the thresholds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sptool.core.records import SptoolError, content_id
from sptool.run.steps import Step, StepContext

if TYPE_CHECKING:
    from sptool.run.config import Sections
    from sptool.run.session import Session

SCREENED_KINDS = ("challenge", "corpus-fetch")


class RunStopped(SptoolError):
    """A run stopped on purpose (curriculum collapse with ``run.stop_on_collapse``): exit code 3;
    every finished step is saved and ``--resume`` continues."""

    exit_code = 3


# ---------------------------------------------------------------- decontamination

def benchmark_paths(settings: "Sections") -> list[str]:
    return [p.strip() for p in settings.decontaminate.benchmarks.split(",") if p.strip()]


def decontamination_index(settings: "Sections"):
    """The benchmark index of ``decontaminate.benchmarks`` (built once per process), or None."""
    paths = benchmark_paths(settings)
    if not paths:
        return None
    from sptool.stages.decontaminate import load_index

    from sptool.stages.problemsets.columns import Mapping

    d = settings.decontaminate
    return load_index(paths, ngram=d.ngram, threshold=d.minhash_threshold or None,
                      mapping=Mapping(settings.eval.preset))


def screen(settings: "Sections", ctx: StepContext, kind: str, records: list[dict]) -> tuple[list[dict], int]:
    """Decontaminate a step's output when it generates questions or fetches documents; returns
    the records and how many were contaminated (marked invalid or dropped to the rejects)."""
    if kind not in SCREENED_KINDS:
        return records, 0
    index = decontamination_index(settings)
    if index is None:
        return records, 0
    from sptool.stages.decontaminate import DecontaminateStage

    stage = DecontaminateStage(index, mark_invalid=True)
    stage.on_drop = lambda record, reason: ctx.rejects.append({**record, "reject_reason": reason})
    out = list(stage.run(records))
    return out, sum(stage.stats.dropped.values()) + sum(1 for r in out if r.get("contamination"))


# ---------------------------------------------------------------- curriculum health

def probe_problems(settings: "Sections") -> list[dict]:
    path = settings.health.probe
    if not path:
        return []
    from sptool.stages.problemsets import read_labelled_problems

    return read_labelled_problems(path, "the health probe (health.probe)")


def probe_steps(session: "Session", samples: int) -> list[Step]:
    """Solve the probe questions ``samples`` times with the solver, vote, grade the majority."""
    problems = probe_problems(session.settings)

    def probe(ctx: StepContext, records: list[dict]) -> list[dict]:
        return [{**p, "id": p.get("id") or content_id("probe", p["question"])} for p in problems]

    def grade_majority(ctx: StepContext, records: list[dict]) -> list[dict]:
        """Each voted probe question's majority answer, graded against its reference."""
        from sptool.stages.verify import answers_equivalent

        out = []
        for record in records:
            majority = record.get("majority")
            correct = majority is not None and majority != "INVALID" and \
                answers_equivalent(str(record["answer"]), str(majority))
            out.append({"id": record["id"], "question": record["question"], "answer": record["answer"],
                        "majority": majority, "majority_frac": record.get("majority_frac"),
                        "pseudo_label_correct": correct})
            ctx.advance()
        return out

    return [Step("probe", probe, kind="probe-sample"),
            Step("probe-solve", session.solve(samples), inputs=["probe"], kind="probe-solve"),
            Step("probe-verify", session.verify(pseudo_label=True), inputs=["probe-solve"], kind="probe-verify"),
            Step("probe-grade", grade_majority, inputs=["probe-verify"], kind="probe")]


def health_step(session: "Session", steps: list[Step]) -> Step:
    """The iteration's health, from the outputs of its ``steps`` (and earlier iterations')."""
    # the outputs it reads, read in place: copying every output of the iteration took 0.1-0.4 s
    # of a 2.5 s loop step (an H100 parity run: 512 samples with their log-probabilities a step)
    read = ("challenge", "verify", "filter", "probe")
    kinds = {step.name: step.metrics_kind for step in steps if step.metrics_kind in read}

    def health(ctx: StepContext, records: list[dict]) -> list[dict]:
        from sptool.run import health as H

        by_kind: dict[str, list[dict]] = {}
        for name, kind in kinds.items():
            if name in ctx.outputs:
                by_kind.setdefault(kind, []).extend(ctx.read_only(name))
        generated = by_kind.get("challenge", [])
        valid = [r for r in generated if r.get("valid") is not False]
        questions = [r.get("question") for r in valid]
        # generated questions as graded by their vote (not the fresh rollouts of a solver step:
        # those pool questions were counted when they were voted on)
        graded = [r.get("p_hat") for r in by_kind.get("verify", [])
                  if r.get("samples") and r.get("mode") != "validity" and r.get("p_hat") is not None
                  and not r.get("pool")]
        # the earlier questions' index only where there are questions to hold against it: setting
        # up its MinHash LSH alone takes 11 ms here, in every loop step of a recipe that generates
        # none (rlvr, svs)
        within, earlier = H.duplicate_shares(questions, earlier_questions(session, ctx.iteration) if questions else None)
        probe = by_kind.get("probe", [])
        report = {
            "id": content_id("health", ctx.iteration),
            "iteration": ctx.iteration,
            "generated": len(generated),
            "valid_rate": len(valid) / len(generated) if generated else None,
            "duplicate_share_within": within,
            "duplicate_share_earlier": earlier,
            "graded": len(graded),
            "difficulty": H.difficulty_histogram(graded),
            "signal_share": H.signal_share(graded),
            "group_signal_share": H.group_signal_share(by_kind.get("filter", [])),
            "pseudo_label_accuracy": (sum(1 for r in probe if r["pseudo_label_correct"]) / len(probe)
                                      if probe else None),
        }
        ctx.advance()
        return [report]

    return Step("health", health, kind="health")


def earlier_questions(session: "Session", iteration: int):
    """A :class:`~sptool.stages.decontaminate.TextIndex` of the valid questions generated before
    ``iteration`` (read from the run directory), or None in the first iteration."""
    if iteration <= 1:
        return None
    from sptool.stages.decontaminate import TextIndex
    from sptool.run.run_dir import StepKey, read_jsonl

    index = TextIndex()
    run_dir = session.run_dir
    for key in run_dir.manifest.get("order", []):
        entry = run_dir.manifest["stages"][key]
        if entry.get("kind") != "challenge" or StepKey.parse(key).iteration >= iteration:
            continue
        for record in read_jsonl(run_dir.path / entry["output"]):
            if record.get("valid") is not False and isinstance(record.get("question"), str):
                index.add(key, str(record.get("id")), record["question"])
    return index


def health_warnings(settings: "Sections", report: dict) -> list[str]:
    from sptool.run.health import collapse_reasons

    return collapse_reasons(report, settings.health)
