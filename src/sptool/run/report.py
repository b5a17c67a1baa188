"""``sptool report RUN_DIR``: plots (PNG) and a text summary of a run's ``metrics.jsonl``.

Plots, one file each (only those the run has data for):

- ``rewards.png``: mean reward per role per iteration (from the filter stages);
- ``accuracy.png``: accuracy (mean p̂ against the reference or the majority pseudo-label) per
  verify stage per iteration;
- ``validity_novelty.png``: the Γ/parse validity rate of generated questions, R-Quest's
  validity-gate pass rate and the novelty rate;
- ``diversity.png``: distinct-question ratio and mean pairwise 1 − BLEU of the generated questions;
- ``tree_posteriors.png`` (WIST): each tree node's posterior mean after every posterior update;
- ``health.png``: curriculum health per iteration (valid-question rate, near-duplicate shares,
  learning-signal shares, pseudo-label accuracy on the ``--probe`` set);
- ``difficulty.png``: the share of graded questions per p̂ bin (all-easy or all-impossible piles up
  at 1 or 0);
- ``heldout.png``: greedy accuracy, mean@k and pass@k on the ``--eval`` benchmarks, before training
  (iteration 0) and after the evaluated iterations;
- ``precision.png``: per role, each iteration's last update: the ratio π_θ/π_old's mean and max,
  the clipped share, the mean sampler–trainer log-prob gap |log π_trainer − log π_sampler| and the
  TIS weight's mean (a gap that drifts upwards is a sampler that no longer matches the trainer).

And ``questions.md``: per iteration and challenge step, example generated questions, kept and
rejected with the reason (malformed, the validity gate, the novelty gate, outside the solver
pool), the gates' counts and the training groups with a learning signal per role
(:func:`question_outcomes`); the text summary ends with the same counts.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from sptool.core.records import Field, InputError, RecordKind, UsageError, describe
from sptool.run.run_dir import StepKey


def _roles_check(value: dict) -> str | None:
    for role, metrics in value.items():
        if not isinstance(metrics, dict):
            return f"expected an object per role, '{role}' is {describe(metrics)}"
        signal = metrics.get("groups_with_signal")
        if signal is not None and (isinstance(signal, bool) or not isinstance(signal, (int, float))):
            return f"expected a number for '{role}.groups_with_signal', got {describe(signal)}"
    return None


def _count_check(value: int) -> str | None:
    return None if value >= 0 else f"expected a count >= 0, got {value}"


#: One line of ``metrics.jsonl`` as ``sptool run`` writes it: the fields every view of the report
#: reads (a wrong type is one ``metrics.jsonl:LINE`` error, not a traceback in a plot).
class _MetricsLineKind(RecordKind):
    """Only the metrics line's own fields (not :func:`~sptool.core.records.check_known_fields`: its
    ``samples``, ``p_hat`` … are counts and means, not a stage record's fields)."""

    def validate(self, record: Any) -> dict:
        if not isinstance(record, dict):
            raise InputError(f"expected a JSON object (a metrics line), got {describe(record)}")
        for f in self.fields:
            f.validate(record)
        return record


METRICS_LINE = _MetricsLineKind("metrics line", (
    Field("iteration", (int,), check=_count_check),
    Field("stage", (str,)),
    Field("kind", (str,), required=False),
    Field("records", (int,), required=False, check=_count_check),
    Field("wall_s", (float,), required=False, nullable=True),
    Field("rejected", (int,), required=False, check=_count_check),
    Field("roles", (dict,), required=False, nullable=True, check=_roles_check),
))


class UnexpectedMetric(InputError):
    """A metric deeper in a line of an unexpected type, found while summarising or plotting."""


def guard_metrics(run_dir: str | Path, action):
    """Run ``action()``; a metric of an unexpected type deeper in a line (a hand-edited or
    foreign ``metrics.jsonl``) becomes one error naming the file, not a traceback."""
    try:
        return action()
    except (TypeError, AttributeError, KeyError, ValueError) as exc:
        raise UnexpectedMetric(f"a metric of an unexpected type ({type(exc).__name__}: {exc}); "
                               "is it a metrics.jsonl written by `sptool run`?",
                               source=str(Path(run_dir) / "metrics.jsonl")) from None


def load_metrics(run_dir: str | Path) -> tuple[list[dict], dict]:
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UsageError(f"{run_dir}: no metrics.jsonl (not a `sptool run` directory?)")
    from sptool.core.jsonl import decode_json, iter_lines

    # a corrupt line: one error at metrics.jsonl:LINE, exit 2; the metrics line's own fields, not
    # a stage record kind's (a metrics line's "samples" is a count, not `sptool solve`'s list)
    lines = []
    with open(path, "rb") as handle:
        for number, raw in iter_lines(handle, str(path)):
            if raw.strip():
                line = decode_json(raw, source=str(path), line=number)
                try:
                    lines.append(METRICS_LINE.validate(line))
                except InputError as error:
                    raise error.at(str(path), number) from None
    manifest_path = run_dir / "manifest.json"
    manifest: dict = {}
    if manifest_path.is_file():
        try:
            from sptool.core.jsonl import loads_strict

            manifest = loads_strict(manifest_path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise InputError(f"corrupt ({exc})", source=str(manifest_path)) from None
        if not isinstance(manifest, dict):
            raise InputError("corrupt (not a JSON object)", source=str(manifest_path))
    return lines, manifest


def mean(values: Iterable[float | None]) -> float | None:
    """The mean of the values that are not None (None when there are none)."""
    values = [float(v) for v in values if v is not None]
    return sum(values) / len(values) if values else None


def series(lines: list[dict]) -> dict[str, dict[str, dict[int, float]]]:
    """Per plot, per line label: iteration → value (averaged over the iteration's stages)."""
    raw: dict[str, dict[str, dict[int, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for line in lines:
        it, stage, kind = line["iteration"], line["stage"], line.get("kind")
        if kind == "filter":
            for role, value in (line.get("mean_reward") or {}).items():
                if value is not None:
                    raw["rewards"][role][it].append(value)
        elif kind == "verify":
            if line.get("accuracy") is not None:
                if re.match(r"s\d+-", stage):
                    label = "solver rollouts (vs the pool's pseudo-label)"
                elif re.match(r"init\d+-", stage):
                    label = "validity initialisation (vs the labels)"
                else:
                    label = stage.split("-", 1)[1] if stage[:1] in "qs" and "-" in stage else stage
                raw["accuracy"][label][it].append(line["accuracy"])
            if line.get("validity_pass_rate") is not None:
                raw["validity"]["validity gate pass rate"][it].append(line["validity_pass_rate"])
        elif kind == "challenge":
            if line.get("valid_rate") is not None:
                raw["validity"]["well-formed question rate"][it].append(line["valid_rate"])
            for key, label in (("distinct_ratio", "distinct-question ratio"),
                               ("mean_bleu_distance", "mean pairwise 1 - BLEU")):
                if line.get(key) is not None:
                    raw["diversity"][label][it].append(line[key])
        elif kind == "novelty":
            if line.get("novel_rate") is not None:
                raw["validity"]["novelty rate"][it].append(line["novel_rate"])
        elif kind == "eval":
            after = line.get("after_iteration", it)
            for name, values in (line.get("benchmarks") or {}).items():
                for metric, value in values.items():
                    # the unbiased pass@1 is mean@k by definition: one line, not two on top of each other
                    if value is not None and not (metric == "pass@1" and "mean@k" in values):
                        raw["heldout"][f"{name} {metric}"][after].append(value)
        elif kind == "health":
            for key, label in (("valid_rate", "valid-question rate"),
                               ("duplicate_share_within", "near-duplicates within the iteration"),
                               ("duplicate_share_earlier", "near-duplicates of earlier iterations"),
                               ("signal_share", "questions with a learning signal (0 < p̂ < 1)"),
                               ("group_signal_share", "training groups with a non-zero advantage"),
                               ("pseudo_label_accuracy", "pseudo-label accuracy on the probe set")):
                if line.get(key) is not None:
                    raw["health"][label][it].append(line[key])
            if line.get("graded"):
                for label, share in (line.get("difficulty") or {}).items():
                    raw["difficulty"][f"p̂ {label}"][it].append(share)
        elif kind == "train":
            for role, metrics in (line.get("roles") or {}).items():
                for key, label in PRECISION_SERIES:
                    if metrics.get(key) is not None:
                        raw["precision"][f"{role} {label}"][it].append(metrics[key])
        elif kind == "posterior-update":
            for node in line.get("tree") or []:
                raw["tree"][f"{node['label']} (d{node['depth']})"][it].append(node["mean"])
    return {plot: {label: {it: mean(values) for it, values in points.items()}
                   for label, points in labels.items()} for plot, labels in raw.items()}


#: the train metrics plotted in ``precision.png`` (see :meth:`PolicyTrainer._metrics`)
PRECISION_SERIES = (("ratio_mean", "ratio mean"), ("ratio_max", "ratio max"), ("clip_fraction", "clip fraction"),
                    ("logprob_gap", "sampler-trainer log-prob gap (mean, nats)"),
                    ("tis_weight_mean", "TIS weight mean"))

TITLES = {
    "rewards": ("Mean reward per role", "mean reward"),
    "accuracy": ("Accuracy per verify stage (reference or majority pseudo-label)", "accuracy (mean p̂)"),
    "validity": ("Validity and novelty of generated questions", "rate"),
    "diversity": ("Question diversity", "value"),
    "tree": ("WIST tree: posterior mean per node", "posterior mean α̃/(α̃+β̃)"),
    "heldout": ("Held-out benchmarks (iteration 0: before training)", "accuracy"),
    "health": ("Curriculum health", "share"),
    "difficulty": ("Difficulty of graded questions (share per p̂ bin)", "share of questions"),
    "precision": ("Update ratio and sampler-trainer gap (each iteration's last update)", "value"),
}
FILES = {"rewards": "rewards.png", "accuracy": "accuracy.png", "validity": "validity_novelty.png",
         "diversity": "diversity.png", "tree": "tree_posteriors.png", "heldout": "heldout.png",
         "health": "health.png", "difficulty": "difficulty.png", "precision": "precision.png"}


def write_plots(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the PNGs for the run; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines, manifest = load_metrics(run_dir)
    out = Path(out_dir) if out_dir else Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    recipe = manifest.get("recipe", "?")
    written = []
    for plot, labels in series(lines).items():
        if not labels:
            continue
        title, ylabel = TITLES[plot]
        figure, axes = plt.subplots(figsize=(7.5, 4.5), dpi=110)
        for label, points in sorted(labels.items()):
            xs = sorted(it for it, v in points.items() if v is not None)
            if not xs:
                continue
            axes.plot(xs, [points[x] for x in xs], marker="o", label=label)
        axes.set_title(f"{recipe}: {title}")
        axes.set_xlabel("iteration")
        axes.set_ylabel(ylabel)
        axes.grid(alpha=0.3)
        iterations = sorted({it for points in labels.values() for it in points})
        if 0 < len(iterations) <= 30:
            axes.set_xticks(iterations)
        if plot not in ("rewards", "tree", "precision"):
            axes.set_ylim(-0.05, 1.05)
        axes.legend(fontsize=8, loc="best")
        figure.tight_layout()
        path = out / FILES[plot]
        figure.savefig(path)
        plt.close(figure)
        written.append(path)
    return written


def training_signal(lines: list[dict]) -> dict[int, dict[str, int]]:
    """Per iteration and role: the training groups with a non-zero advantage (the ones that
    move the weights) over the iteration's train stages."""
    out: dict[int, dict[str, int]] = {}
    for line in lines:
        if line.get("kind") != "train":
            continue
        for role, metrics in (line.get("roles") or {}).items():
            if metrics.get("groups_with_signal") is not None:
                roles = out.setdefault(line["iteration"], {})
                roles[role] = roles.get(role, 0) + int(metrics["groups_with_signal"])
    return out


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


def summary_text(run_dir: str | Path) -> str:
    """A few lines: iterations, wall time, and first → last value of every series."""
    lines, manifest = load_metrics(run_dir)
    iterations = sorted({line["iteration"] for line in lines})
    wall = sum(line.get("wall_s", 0.0) for line in lines)
    checkpoints = []
    for line in lines:
        if line.get("kind") == "train":
            for role, metrics in (line.get("roles") or {}).items():
                checkpoints.append(role)
    out = [f"run {run_dir}: recipe {manifest.get('recipe', '?')}, {len(iterations)} iteration(s), "
           f"{len(lines)} stages, {wall:.1f}s of stage time, {len(checkpoints)} training update(s)"]
    screened = [line for line in lines if "contaminated" in line]
    if screened:
        out.append(f"decontamination: {sum(line['contaminated'] for line in screened)} generated question(s) "
                   f"or document(s) overlapped a benchmark, in {len(screened)} screened stage(s)")
    for plot, labels in series(lines).items():
        if plot == "tree":
            last = max(iterations)
            ranked = sorted(((points.get(last), label) for label, points in labels.items()
                             if points.get(last) is not None), reverse=True)
            out.append("tree posterior (last iteration): " +
                       ", ".join(f"{label} {value:.2f}" for value, label in ranked[:6]))
            continue
        for label, points in sorted(labels.items()):
            xs = sorted(it for it, v in points.items() if v is not None)
            if xs:
                out.append(f"{plot}: {label}: {_fmt(points[xs[0]])} (iter {xs[0]}) -> "
                           f"{_fmt(points[xs[-1]])} (iter {xs[-1]})")
    for label, points in sorted(series(lines).get("precision", {}).items()):
        if "gap" in label and points:  # its largest value: a gap that drifted and came back shows too
            worst = max(points, key=lambda it: points[it] if points[it] is not None else -1.0)
            out.append(f"precision: {label}: largest {_fmt(points[worst])} (iter {worst})")
    for iteration, roles in training_signal(lines).items():
        out.append(f"training groups with a non-zero advantage, iteration {iteration}: "
                   + ", ".join(f"{role} {count}" for role, count in sorted(roles.items())))
    for step in question_outcomes(run_dir):
        counts = ", ".join(f"{name} {value}" for name, value in outcome_counts(step).items())
        groups = ", ".join(f"{role} {signal}/{total}" for role, (signal, total) in sorted(step["groups"].items()))
        out.append(f"questions: {step['step']}: {counts}"
                   + (f"; groups with a non-zero advantage: {groups}" if groups else ""))
    return "\n".join(out)


# -- what the questioner wrote ------------------------------------------------------------------

def _step_records(run_dir: Path, entry: dict) -> list[dict]:
    from sptool.core.jsonl import read_records

    path = run_dir / entry["output"]
    return list(read_records(path)) if path.is_file() else []


def _gate_outcome(record: dict, pool: set[str] | None, questions: dict[str, str]) -> str | None:
    """Why a generated question was rejected, or None when it was kept."""
    if record.get("valid") is False:
        return f"malformed ({record.get('invalid_reason') or 'no question'})"
    validity = (record.get("verdicts") or {}).get("validity")
    if validity and (validity.get("invalid_frac") or 0) > 0.5:
        return (f"validity gate: {validity['invalid_frac']:.0%} of the solver's validity answers "
                f"were INVALID")
    novelty = record.get("novelty") or {}
    if novelty.get("novel") is False:
        same = [entry for entry in novelty.get("compared", []) if entry.get("verdict") == "same"]
        partner = questions.get(same[0]["id"], "?") if same else "?"
        return f"novelty gate: the same type as \"{_shorten(partner, 90)}\" ({same[0]['raw'] if same else ''})"
    if pool is not None and record.get("id") not in pool:
        return "not in the solver pool (agreement outside the band, or no majority)"
    return None


def _shorten(text: str, width: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[:width - 1] + "…"


def question_outcomes(run_dir: str | Path) -> list[dict]:
    """Per challenge step of the run: the generated questions with what became of them.

    Each entry: ``{iteration, step, questions: [{question, answer, kept, reason, s, majority,
    reward}], pool, groups: {role: [trained groups with a non-zero advantage, trained groups]}}``. A question's record is followed through
    the steps after its challenge step (every step passes all records on, adding its verdicts)
    up to the next challenge step; the filter's groups give the questioner's reward per question,
    the train step the roles it trained and how many of their groups carry a learning signal.
    """
    run_dir = Path(run_dir)
    _, manifest = load_metrics(run_dir)
    stages, order = manifest.get("stages", {}), manifest.get("order", [])
    out: list[dict] = []
    current: dict | None = None
    for key in order:
        entry = stages.get(key)
        if entry is None:
            continue
        iteration = StepKey.parse(key).iteration if key.startswith("iter-") else 0
        kind = entry.get("kind")
        if kind == "challenge":
            records = _step_records(run_dir, entry)
            current = {"iteration": iteration, "step": key, "latest": {r.get("id"): r for r in records},
                       "order": [r.get("id") for r in records], "pool": None, "rewards": {},
                       "groups": {}}
            out.append(current)
            continue
        if current is None or current["iteration"] != iteration:
            continue
        records = _step_records(run_dir, entry)
        if kind == "train":  # the roles it trained, and how many of their groups carry a signal
            for record in records:
                if record.get("groups_with_signal") is not None:
                    counts = current["groups"].setdefault(record.get("role", "?"), [0, 0])
                    counts[0] += record["groups_with_signal"]
                    counts[1] += record.get("groups") or 0
            continue
        if kind == "pool":
            current["pool"] = {r.get("id") for r in records}
            current = None  # later steps sample from the pool: rollouts, not these questions
            continue
        if kind == "filter":  # the questioner's reward per question
            for group in records:
                if group.get("role") != "solver":
                    for source, reward in zip(group.get("source_ids") or [], group.get("rewards") or []):
                        current["rewards"][source] = reward
            continue
        for record in records:  # later steps add fields (verdicts, novelty, WIST's g)
            if record.get("id") in current["latest"]:
                current["latest"][record["id"]] = {**current["latest"][record["id"]], **record}
    for step in out:
        latest = step.pop("latest")
        ids = step.pop("order")
        questions = {i: (r.get("question") or "") for i, r in latest.items()}
        rows = []
        for i in ids:
            record = latest[i]
            reason = _gate_outcome(record, step["pool"], questions)
            verdict = (record.get("verdicts") or {}).get("math") or record
            rows.append({"question": record.get("question") or record.get("raw") or "",
                         "answer": record.get("questioner_answer") or record.get("answer"),
                         "kept": reason is None, "reason": reason,
                         "s": verdict.get("majority_frac"), "majority": verdict.get("majority"),
                         "reward": step["rewards"].get(i)})
        step["questions"] = rows
        del step["rewards"]
    return out


def outcome_counts(step: dict) -> dict[str, int]:
    """Counts of one challenge step: proposed, well-formed, and passed/rejected per gate."""
    counts = {"proposed": len(step["questions"])}
    reasons = [row["reason"] or "" for row in step["questions"]]
    counts["well-formed"] = sum(not r.startswith("malformed") for r in reasons)
    for gate in ("validity gate", "novelty gate", "not in the solver pool"):
        counts[f"{gate}: rejected"] = sum(r.startswith(gate) for r in reasons)
    counts["kept"] = sum(row["kept"] for row in step["questions"])
    return counts


def write_question_page(run_dir: str | Path, out_dir: str | Path | None = None,
                        per_step: int = 12) -> Path | None:
    """``questions.md``: per iteration and challenge step, example questions kept and rejected
    (with the reason), the gates' counts and the training groups with a learning signal."""
    steps = question_outcomes(run_dir)
    if not steps:
        return None
    out = Path(out_dir) if out_dir else Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# Generated questions: {run_dir}", ""]
    for step in steps:
        counts = outcome_counts(step)
        lines += [f"## iteration {step['iteration']}, {step['step'].split('/', 1)[-1]}", "",
                  ", ".join(f"{name} {value}" for name, value in counts.items()), ""]
        if step["groups"]:
            lines += ["training groups with a non-zero advantage: " + ", ".join(
                f"{role} {signal}/{total}" for role, (signal, total) in sorted(step["groups"].items())), ""]
        kept = [row for row in step["questions"] if row["kept"]]
        rejected = [row for row in step["questions"] if not row["kept"]]
        half = max(1, per_step // 2)
        shown = kept[:max(half, per_step - len(rejected))] + rejected[:max(half, per_step - len(kept))]
        for row in shown:
            detail = [f"answer {row['answer']}" if row["answer"] is not None else "",
                      f"solver majority {row['majority']} (s = {row['s']:.2f})" if row["s"] is not None else "",
                      f"questioner reward {row['reward']:.3f}" if row["reward"] is not None else ""]
            status = "kept" if row["kept"] else f"rejected: {row['reason']}"
            lines.append(f"- **{status}**: {_shorten(row['question'], 200)}"
                         + "".join(f"; {d}" for d in detail if d))
        if len(shown) < len(step["questions"]):
            lines.append(f"- … {len(step['questions']) - len(shown)} more in {step['step']}.jsonl")
        lines.append("")
    path = out / "questions.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
