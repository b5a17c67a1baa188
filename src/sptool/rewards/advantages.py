"""Group-relative advantages of one group of completions (Dr. GRPO, WIST Eq. 3; GRPO, SvS Eq. 2)."""

from __future__ import annotations

import math
from typing import Sequence

GRPO_EPSILON = 1e-6


def group_advantages(rewards: Sequence[float], kind: str = "dr_grpo",
                     epsilon: float = GRPO_EPSILON) -> list[float]:
    """Group-relative advantages of one group of completions of the same prompt.

    ``dr_grpo`` (default; WIST Eq. 3, Dr. GRPO): A_i = r_i − (1/G) Σ_j r_j.
    ``grpo`` (SvS Eq. 2 / DeepSeekMath): A_i = (r_i − mean(r)) / (std(r) + ε), with the sample
    standard deviation (Bessel-corrected, as torch.std in TRL/verl; 0 for a single completion)
    and ε = 1e-6.
    Empty group → []; a group of equal rewards → all zeros.
    """
    values = [float(r) for r in rewards]
    if not values:
        return []
    mean = sum(values) / len(values)
    centred = [r - mean for r in values]
    if kind == "dr_grpo":
        return centred
    if kind == "grpo":
        if len(values) > 1:
            std = math.sqrt(sum(c * c for c in centred) / (len(values) - 1))
        else:
            std = 0.0
        return [c / (std + epsilon) for c in centred]
    raise ValueError(f"unknown advantage kind '{kind}' (dr_grpo or grpo)")
