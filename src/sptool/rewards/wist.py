"""WIST's rewards: solver correctness (Eq. 13), empirical accuracy and variance (Eq. 12), the
Challenger's Gaussian variance reward (Eq. 14) and the learnable-document rule (§3.4)."""

from __future__ import annotations

import math
from typing import Sequence

WIST_SIGMA = 0.02            # WIST Table "Challenger shaping width σ"
WIST_INVALID_PENALTY = -0.1  # WIST Table "Rule-validation penalty ρ"


def binary_correctness_reward(correct: bool | None) -> float:
    """Solver reward of WIST Eq. 13 (and SvS Eq. 4): r^sol_{i,k} = ℓ_{i,k} = v(ŷ_{i,k}, y*_i) ∈ {0, 1}.

    ``None`` (not gradable) counts as incorrect.
    """
    return 1.0 if correct else 0.0


def empirical_accuracy(correct: Sequence[bool | None]) -> float:
    """WIST Eq. 12: p̂_i = (1/K) Σ_k ℓ_{i,k} (0 for no samples)."""
    return sum(1 for c in correct if c) / len(correct) if correct else 0.0


def empirical_variance(p_hat: float) -> float:
    """WIST Eq. 12: Var̂_i = p̂_i (1 − p̂_i)."""
    return p_hat * (1.0 - p_hat)


def gaussian_variance_reward(var: float, sigma: float = WIST_SIGMA) -> float:
    """Challenger reward of a valid QA, WIST Eq. 14: r^cha_i = exp(−(Var̂_i − 0.25)² / σ).

    σ divides the squared distance directly (not 2σ²), as written in Eq. 14; σ = 0.02 (WIST
    Appendix D). Peaks at 1 for Var̂ = 0.25 (p̂ = 0.5); Var̂ = 0 gives exp(−3.125) ≈ 0.0439.
    """
    if sigma <= 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")
    return math.exp(-((var - 0.25) ** 2) / sigma)


def wist_challenger_reward(valid: bool, var: float | None, sigma: float = WIST_SIGMA,
                           invalid_penalty: float = WIST_INVALID_PENALTY) -> float:
    """WIST Eq. 14: Gaussian variance reward for (q_i, y*_i) ∈ Q(d), else ρ (ρ = −0.1 < 0)."""
    if not valid or var is None:
        return invalid_penalty
    return gaussian_variance_reward(var, sigma)


def wist_document_is_learnable(valid_variances: Sequence[float]) -> bool:
    """WIST §3.4: "If all valid QA pairs satisfy Var̂_i = 0 … we skip policy updates for this
    document." False when every valid QA has zero variance (also when there is none)."""
    return any(v > 0 for v in valid_variances)
