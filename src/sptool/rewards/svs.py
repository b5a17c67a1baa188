"""SvS's rules (self-play with variational problem synthesis, Liang et al., 2025, §3.3 Eqs. 4–6,
Algorithm 1): the solver gradient condition, underperforming problems, the synthesis reward
and which synthesis groups to keep."""

from __future__ import annotations

from typing import Sequence

from sptool.rewards.bands import in_band

SVS_UNDERPERFORMING_BAND = (0.125, 0.5)   # SvS §4 [acc_l, acc_h]
SVS_SYNTHESIS_BAND = (0.125, 0.625)       # SvS §4 [âcc_l, âcc_h]


def rewards_differ(rewards: Sequence[float]) -> bool:
    """Does the group carry a policy gradient? Its advantages r_i − mean(r) (Dr. GRPO) are all
    zero exactly when every reward is equal. For binary rewards this is SvS Algorithm 1 line 8:
    a problem trains the solver when 0 < Acc(x) < 1."""
    return len(rewards) > 1 and max(rewards) > min(rewards)


def svs_is_underperforming(acc: float | None,
                           band: tuple[float, float] = SVS_UNDERPERFORMING_BAND, *,
                           strict: bool = False) -> bool:
    """SvS §3.3: a challenging problem has Acc(x) ∈ [acc_l, acc_h] = [12.5%, 50%] (§4); its
    correct solutions feed variational problem synthesis.

    §3.3 writes the closed range [acc_l, acc_h]; Algorithm 1 line 11 writes
    acc_l < Acc(x) < acc_h (``strict=True``).
    """
    return in_band(acc, band, inclusive=not strict)


def synthesis_reward(acc: float | None, band: tuple[float, float] = SVS_SYNTHESIS_BAND,
                     negative: bool = False, negative_value: float = -1.0) -> float:
    """SvS Eq. 6: R_v(x̂) = 1(âcc_l ≤ Acc(x̂, a) ≤ âcc_h), [âcc_l, âcc_h] = [12.5%, 62.5%].

    Eq. 6 and Algorithm 1 (line 24) give 0 outside the band (default). The text beside
    Figure 4 says a variant that is fully solved or never solved "receives a negative reward"
    without giving a value: ``negative=True`` returns ``negative_value`` (−1 unless set)
    outside the band. A variant without an accuracy (unparsable, unsolved) is outside the band.
    """
    if in_band(acc, band):
        return 1.0
    return negative_value if negative else 0.0


def svs_keep_synthesis_group(accuracies: Sequence[float | None],
                             band: tuple[float, float] = SVS_SYNTHESIS_BAND) -> bool:
    """SvS Algorithm 1 lines 21–22: keep the synthesis group of a solution when |J_2| > 0, i.e.
    some variant's accuracy is in the positive synthesis band."""
    return any(in_band(acc, band) for acc in accuracies)
