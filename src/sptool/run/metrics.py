"""Per-kind summary numbers of a step's output, for ``metrics.jsonl`` and ``sptool report``.

One function per step kind (``METRICS``); a kind without one gets no numbers beyond the counts
the executor adds (records, rejected, wall time).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

from sptool import rewards as R
from sptool.run.report import mean


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
        out["mean_bleu_distance"] = mean(pairs)
    return out


def challenge_metrics(records: list[dict]) -> dict:
    valid = [r for r in records if r.get("valid") is not False]
    return {"candidates": len(records), "valid_rate": len(valid) / len(records) if records else None,
            **question_diversity([r.get("question") for r in valid])}


def verify_metrics(records: list[dict]) -> dict:
    graded = [r for r in records if r.get("samples") and r.get("p_hat") is not None]
    metrics: dict[str, Any] = {
        "graded": len(graded),
        "accuracy": mean(r["p_hat"] for r in graded),
        "mean_var": mean(r.get("var") for r in graded),
        "majority_frac": mean(r.get("majority_frac") for r in graded),
        "invalid_frac": mean(r.get("invalid_frac") for r in graded),
        "verify_errors": sum(1 for r in records if r.get("verify_error")),
    }
    if graded and any(r.get("mode") == "validity" for r in graded):
        # R-Quest's validity gate passes a question when at most half the samples say INVALID
        metrics["validity_pass_rate"] = mean(1.0 if R.passes_validity_gate(r.get("invalid_frac") or 0)
                                             else 0.0 for r in graded)
    return metrics


def novelty_metrics(records: list[dict]) -> dict:
    judged = [r["novelty"].get("novel") for r in records if isinstance(r.get("novelty"), dict)]
    return {"novel_rate": mean(1.0 if v else 0.0 for v in judged if v is not None)}


def filter_metrics(records: list[dict]) -> dict:
    by_role: dict[str, list[float]] = defaultdict(list)
    groups: dict[str, int] = defaultdict(int)
    for group in records:
        role = str(group.get("role"))
        groups[role] += 1
        by_role[role].extend(float(r) for r in group.get("rewards") or [])
    return {"groups": dict(groups), "mean_reward": {role: mean(v) for role, v in by_role.items()}}


def solve_metrics(records: list[dict]) -> dict:
    samples = [s for r in records for s in r.get("samples") or []]
    return {"samples": len(samples), "mean_tokens": mean(s.get("n_tokens") for s in samples),
            "truncated_rate": mean(1.0 if s.get("finish_reason") == "length" else 0.0 for s in samples)}


def train_metrics(records: list[dict]) -> dict:
    """The last update's numbers per role, and how many of the step's groups had a non-zero
    advantage (a learning signal)."""
    roles = {}
    for r in records:
        numbers = {k: v for k, v in (r.get("metrics") or {}).items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if r.get("groups_with_signal") is not None:
            numbers["groups_with_signal"] = r["groups_with_signal"]
        roles[r["role"]] = numbers
    return {"roles": roles}


def eval_metrics(records: list[dict]) -> dict:
    return {"after_iteration": records[0]["after_iteration"] if records else None,
            "benchmarks": {r["benchmark"]: {"greedy": r.get("greedy_accuracy"),
                                            "answered": r.get("greedy_answered"), "mean@k": r.get("mean_at_k"),
                                            **(r.get("pass_at") or {})} for r in records}}


def corpus_fetch_metrics(records: list[dict]) -> dict:
    return {"documents": len(records), "leaves": len({r.get("leaf") for r in records})}


def health_metrics(records: list[dict]) -> dict:
    """The iteration's curriculum health (one record, see :mod:`sptool.run.health`)."""
    return {key: value for key, value in (records[0] if records else {}).items() if key not in ("id", "iteration")}


def probe_metrics(records: list[dict]) -> dict:
    return {"pseudo_label_accuracy": mean(1.0 if r.get("pseudo_label_correct") else 0.0 for r in records)}


METRICS: dict[str, Callable[[list[dict]], dict]] = {
    "challenge": challenge_metrics, "verify": verify_metrics, "novelty": novelty_metrics,
    "filter": filter_metrics, "solve": solve_metrics, "train": train_metrics, "eval": eval_metrics,
    "corpus-fetch": corpus_fetch_metrics, "health": health_metrics, "probe": probe_metrics,
}


def step_metrics(kind: str, records: list[dict]) -> dict:
    """Summary numbers of one step's output (empty for a kind without a metrics function)."""
    function = METRICS.get(kind)
    return function(records) if function else {}
