"""The posterior formulas (WIST §3.5): sliding-window Beta posteriors, learnability observations."""

from __future__ import annotations

from typing import Sequence

DEFAULT_TAU_VAR = 0.20         # learnability threshold τ_var
REFERENCE_GROUP_THRESHOLD = 0.4  # reference code: g = 1(max challenger reward in group > 0.4)


# --------------------------------------------------------------------------------------------
# Formulas (pure functions)

def beta_posterior(window: Sequence[int]) -> tuple[int, int]:
    """Effective Beta parameters over the sliding window (WIST eq. 17), prior (1, 1).

    α̃ = 1 + Σ_{τ∈W} g^(τ),   β̃ = 1 + Σ_{τ∈W} (1 − g^(τ)).
    """
    successes = sum(int(g) for g in window)
    return 1 + successes, 1 + len(window) - successes


def posterior_mean(window: Sequence[int]) -> float:
    """Mean of Beta(α̃, β̃): α̃ / (α̃ + β̃)."""
    alpha, beta = beta_posterior(window)
    return alpha / (alpha + beta)


def learnability_observation(var: float, tau_var: float = DEFAULT_TAU_VAR) -> int:
    """Bernoulli learnability observation of one valid QA (WIST eq. 15): g = 1(Var ≥ τ_var)."""
    return int(var >= tau_var)


def slide_window(window: Sequence[int], g: int, size: int) -> list[int]:
    """Append ``g`` and keep only the most recent ``size`` observations (W_{i,j} in eq. 17)."""
    return ([*window, int(g)])[-size:] if size > 0 else []


def group_learnability_observation(max_challenger_reward: float,
                                   threshold: float = REFERENCE_GROUP_THRESHOLD) -> int:
    """Reference code's path-level rule: g = 1(max challenger reward in the group > 0.4)."""
    return int(max_challenger_reward > threshold)
