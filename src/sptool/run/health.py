"""Curriculum health of a self-play run: is the questioner's curriculum collapsing?

Per iteration, from the iteration's step outputs (pure functions over records):

- ``valid_rate``: generated questions that parsed (and passed the recipe's validator);
- ``duplicate_share_within``: questions that near-duplicate an earlier question of the same
  iteration, and ``duplicate_share_earlier``: questions that near-duplicate one of an earlier
  iteration (normalised words: a shared run of 13, or MinHash Jaccard >= 0.7 over word pairs,
  as in ``sptool decontaminate``);
- ``difficulty``: the histogram of p̂ over graded questions (bins 0, (0, ¼], (¼, ½], (½, ¾],
  (¾, 1), 1): a curriculum collapsing to all-easy or all-impossible piles up at 1 or 0;
- ``signal_share``: graded questions with 0 < p̂ < 1, the ones whose group rewards differ (a
  group-relative advantage is zero otherwise), and ``group_signal_share``: training groups whose
  advantages are not all zero;
- ``pseudo_label_accuracy`` (with a labelled probe set): the majority answer's agreement with the
  reference on probe questions solved and voted on like generated ones.

:func:`collapse_reasons` compares them with the recipe's thresholds.
"""

from __future__ import annotations

from typing import Iterable

from sptool.run.config import HealthConfig

BINS = ("0", "(0,0.25]", "(0.25,0.5]", "(0.5,0.75]", "(0.75,1)", "1")


def difficulty_bin(p_hat: float) -> str:
    if p_hat <= 0.0:
        return BINS[0]
    if p_hat >= 1.0:
        return BINS[5]
    if p_hat <= 0.25:
        return BINS[1]
    if p_hat <= 0.5:
        return BINS[2]
    if p_hat <= 0.75:
        return BINS[3]
    return BINS[4]


def difficulty_histogram(p_hats: Iterable[float]) -> dict[str, float]:
    """Share of questions per p̂ bin (all bins present; empty input: all zero)."""
    values = [float(p) for p in p_hats if p is not None]
    counts = {label: 0 for label in BINS}
    for value in values:
        counts[difficulty_bin(value)] += 1
    return {label: (count / len(values) if values else 0.0) for label, count in counts.items()}


def signal_share(p_hats: Iterable[float]) -> float | None:
    """Share of graded questions with 0 < p̂ < 1 (their binary rewards differ)."""
    values = [float(p) for p in p_hats if p is not None]
    return sum(1 for v in values if 0.0 < v < 1.0) / len(values) if values else None


def group_signal_share(groups: Iterable[dict], eps: float = 1e-12) -> float | None:
    """Share of training groups whose advantages are not all zero."""
    groups = [g for g in groups if isinstance(g.get("advantages"), list)]
    if not groups:
        return None
    return sum(1 for g in groups if any(abs(a) > eps for a in g["advantages"])) / len(groups)


def duplicate_shares(questions: list[str], earlier=None) -> tuple[float | None, float | None]:
    """(share near-duplicating an earlier question of this list, share near-duplicating a
    question of ``earlier``, a :class:`~sptool.stages.decontaminate.TextIndex` or None)."""
    from sptool.stages.decontaminate import TextIndex

    questions = [q for q in questions if isinstance(q, str) and q.strip()]
    if not questions:
        return None, None
    seen = TextIndex()
    within = 0
    for index, question in enumerate(questions):
        if seen.match(question) is not None:
            within += 1
        seen.add("iteration", str(index), question)
    against = None
    if earlier is not None:
        against = sum(1 for q in questions if earlier.match(q) is not None) / len(questions)
    return within / len(questions), against




def collapse_reasons(health: dict, thresholds: HealthConfig) -> list[str]:
    """The thresholds ``[health]`` sets that an iteration's health crosses, as readable reasons
    (empty: healthy)."""
    reasons = []

    def below(key: str, limit: float, what: str) -> None:
        value = health.get(key)
        if value is not None and value < limit:
            reasons.append(f"{what} {value:.2f} < {limit:g} ({key})")

    below("valid_rate", thresholds.min_valid_rate, "valid-question rate")
    for key in ("duplicate_share_within", "duplicate_share_earlier"):
        value = health.get(key)
        if value is not None and value > thresholds.max_duplicate_share:
            reasons.append(f"near-duplicate share {value:.2f} > {thresholds.max_duplicate_share:g} ({key})")
    below("signal_share", thresholds.min_signal_share, "share of questions with a learning signal")
    below("pseudo_label_accuracy", thresholds.min_pseudo_label_accuracy, "pseudo-label accuracy")
    return reasons
