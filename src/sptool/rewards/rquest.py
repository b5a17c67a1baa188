"""R-Quest's gates and rewards: the validity gate, the questioner reward (validity, novelty,
uncertainty) and the validity-initialisation reward."""

from __future__ import annotations

from sptool.rewards.rzero import FORMAT_FAILURE_REWARD, uncertainty_reward


def validity_gate(u: float) -> float:
    """R-Quest validity gate: g_valid(q) = ½ − u(q), u = share of INVALID answers among the
    validity-mode samples (9 by default). The question is invalid when g_valid < 0 (more than
    half the answers are INVALID); u = ½ still passes."""
    return 0.5 - u


def passes_validity_gate(u: float) -> bool:
    """R-Quest: valid iff g_valid(q) = ½ − u(q) ≥ 0."""
    return validity_gate(u) >= 0


def rquest_questioner_reward(u: float | None, s: float | None, novel: bool | None,
                             parsed: bool = True,
                             format_failure: float = FORMAT_FAILURE_REWARD) -> float:
    """R-Quest questioner reward:

    - format failure (unparsable generation): −1;
    - g_valid(q) = ½ − u(q) < 0 (invalid): the reward is g_valid(q) itself (negative);
    - otherwise g_novel(q) · min{s(q), 1 − s(q)}, s = share of the largest answer class among the
      math-mode samples (10 by default), g_novel ∈ {0, 1} (``None``: no novelty verdict, taken
      as novel).
    """
    if not parsed or u is None:
        return format_failure
    gate = validity_gate(u)
    if gate < 0:
        return gate
    if s is None:
        raise ValueError("s (math-mode majority fraction) is needed for a question that passes the validity gate")
    novelty_gate = 0.0 if novel is False else 1.0
    return novelty_gate * uncertainty_reward(s, "reference")


def validity_init_reward(answer: str | None, *, problem_invalid: bool, correct: bool | None,
                         false_rejection_penalty: float = 0.5, empty_box: float = -0.1) -> float:
    """R-Quest validity-initialisation reward:
    R_init(q, a) = 1[a = a*(q)] − λ · 1[a = INVALID ∧ a*(q) ≠ INVALID], λ = 0.5, and −0.1 for
    an empty answer box.

    ``answer`` is the sample's extracted final answer (None: no or empty ``\\boxed{}``, → −0.1);
    ``problem_invalid``: the labelled answer a*(q) is INVALID (a flawed problem);
    ``correct``: the answer is equivalent to a*(q) on a valid problem (math-verify).
    So: 1 for a correct answer or a correct INVALID, −0.5 for rejecting a valid problem, 0 for
    anything else (a wrong answer, or answering a flawed problem).
    """
    if answer is None or not str(answer).strip():
        return empty_box
    said_invalid = str(answer).strip().upper() == "INVALID"
    if problem_invalid:
        return 1.0 if said_invalid else 0.0
    if said_invalid:
        return -false_rejection_penalty
    return 1.0 if correct else 0.0
