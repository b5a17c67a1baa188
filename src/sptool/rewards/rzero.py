"""R-Zero's questioner and solver rewards (Huang et al., 2025, arXiv 2508.05004, as summarised in
the WIST and R-Quest papers): uncertainty reward, questioner reward, the 0.9·correct + 0.1·format
solver reward on pseudo-labels and the solver-data band. The repetition penalty is in
:mod:`sptool.rewards.bleu`."""

from __future__ import annotations

from sptool.rewards.bands import in_band

FORMAT_FAILURE_REWARD = -1.0  # R-Zero / R-Quest: an unparsable questioner output
RZERO_SOLVER_BAND = (0.3, 0.8)   # R-Zero / R-Quest solver data: 0.3 ≤ p ≤ 0.8
PSEUDO_LABEL_FORMAT_WEIGHT = 0.1  # R-Zero / R-Quest solver reward 0.9·correct + 0.1·format


def uncertainty_reward(p: float, kind: str = "paper") -> float:
    """Questioner uncertainty reward on the solver's self-consistency p (R-Zero).

    ``kind="paper"``: r_unc = 1 − 2|p − ½| (R-Zero paper; peaks at 1 for p = ½).
    ``kind="reference"``: min(p, 1 − p) (R-Zero's reference code; peaks at ½) — also the
    uncertainty term of R-Quest's questioner reward.
    """
    if kind == "paper":
        return 1.0 - 2.0 * abs(p - 0.5)
    if kind in ("reference", "min"):
        return min(p, 1.0 - p)
    raise ValueError(f"unknown uncertainty kind '{kind}' (paper or reference)")


def rzero_questioner_reward(p: float | None, repetition_penalty: float, parsed: bool = True,
                            uncertainty: str = "paper", clip_at_zero: bool = False,
                            format_failure: float = FORMAT_FAILURE_REWARD) -> float:
    """R-Zero questioner reward: r_i = r_unc(x_i) − r_rep(x_i); −1 when the output cannot be
    parsed (no ``<question>``; WIST Table: R-Zero invalid penalty −1 for the Challenger).

    ``clip_at_zero`` applies max(0, r_unc − r_rep) as written in the R-Zero paper; the default
    (no floor) follows R-Zero's reference code.
    """
    if not parsed or p is None:
        return format_failure
    reward = uncertainty_reward(p, uncertainty) - repetition_penalty
    return max(0.0, reward) if clip_at_zero else reward


def pseudo_label_solver_reward(correct: bool | None, formatted: bool,
                               format_weight: float = PSEUDO_LABEL_FORMAT_WEIGHT) -> float:
    """Solver reward on pseudo-labelled questions (R-Quest "solver 奖励"; R-Zero §2.1):
    r = 0.9 · 1[answer ≡ majority pseudo-label] + 0.1 · 1[format: a \\boxed{} answer].

    ``format_weight`` w gives (1 − w)·correct + w·format; w = 0 is plain binary correctness.
    """
    return (1.0 - format_weight) * (1.0 if correct else 0.0) + format_weight * (1.0 if formatted else 0.0)


def rzero_solver_reward(correct: bool | None, formatted: bool,
                        format_weight: float = PSEUDO_LABEL_FORMAT_WEIGHT) -> float:
    """R-Zero solver reward 0.9·correct + 0.1·format (see :func:`pseudo_label_solver_reward`)."""
    return pseudo_label_solver_reward(correct, formatted, format_weight)


def keep_for_solver_training(p: float | None, majority: str | None,
                             band: tuple[float, float] = RZERO_SOLVER_BAND) -> bool:
    """R-Zero / R-Quest solver data: keep a question when 0.3 ≤ p ≤ 0.8 (p = s, the majority
    fraction) and the majority answer is non-empty."""
    return in_band(p, band) and bool(majority and str(majority).strip())
