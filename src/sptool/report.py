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
  (iteration 0) and after the evaluated iterations.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from sptool.records import InputError, UsageError


def load_metrics(run_dir: str | Path) -> tuple[list[dict], dict]:
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UsageError(f"{run_dir}: no metrics.jsonl (not a `sptool run` directory?)")
    from sptool.jsonl import read_records

    lines = list(read_records(path))  # a corrupt line: one error at metrics.jsonl:LINE, exit 2
    manifest_path = run_dir / "manifest.json"
    manifest: dict = {}
    if manifest_path.is_file():
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise InputError(f"corrupt ({exc})", source=str(manifest_path)) from None
        if not isinstance(manifest, dict):
            raise InputError("corrupt (not a JSON object)", source=str(manifest_path))
    return lines, manifest


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
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
        elif kind == "posterior-update":
            for node in line.get("tree") or []:
                raw["tree"][f"{node['label']} (d{node['depth']})"][it].append(node["mean"])
    return {plot: {label: {it: _mean(values) for it, values in points.items()}
                   for label, points in labels.items()} for plot, labels in raw.items()}


TITLES = {
    "rewards": ("Mean reward per role", "mean reward"),
    "accuracy": ("Accuracy per verify stage (reference or majority pseudo-label)", "accuracy (mean p̂)"),
    "validity": ("Validity and novelty of generated questions", "rate"),
    "diversity": ("Question diversity", "value"),
    "tree": ("WIST tree: posterior mean per node", "posterior mean α̃/(α̃+β̃)"),
    "heldout": ("Held-out benchmarks (iteration 0: before training)", "accuracy"),
    "health": ("Curriculum health", "share"),
    "difficulty": ("Difficulty of graded questions (share per p̂ bin)", "share of questions"),
}
FILES = {"rewards": "rewards.png", "accuracy": "accuracy.png", "validity": "validity_novelty.png",
         "diversity": "diversity.png", "tree": "tree_posteriors.png", "heldout": "heldout.png",
         "health": "health.png", "difficulty": "difficulty.png"}


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
        if plot != "rewards" and plot != "tree":
            axes.set_ylim(-0.05, 1.05)
        axes.legend(fontsize=8, loc="best")
        figure.tight_layout()
        path = out / FILES[plot]
        figure.savefig(path)
        plt.close(figure)
        written.append(path)
    return written


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
    return "\n".join(out)
