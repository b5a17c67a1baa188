"""Policy-gradient objectives as pure functions: advantages, clipped surrogate, KL, aggregation.

Three objectives share one token-level form and differ in three knobs (:data:`OBJECTIVES`):

=========  ===========================  ==========================  =================
objective  advantage of completion i    token-sum normalisation     clip (low, high)
=========  ===========================  ==========================  =================
dr_grpo    r_i − mean(r)                global constant N · L       (0.2, 0.2)
grpo       (r_i − mean(r)) / (std + ε)  per sequence, 1/(N·|y_i|)   (0.2, 0.2)
dapo       (r_i − mean(r)) / (std + ε)  token-level, 1/Σ_j |y_j|    (0.2, 0.28)
=========  ===========================  ==========================  =================

Sources: Dr. GRPO as used by WIST §2.2 (eq. 3, "PPO-style clipped objective at the token level
with a global normalization constant"); GRPO as written in SvS §3.1 (eq. 1–2); DAPO's
clip-higher and token-level loss as adopted by SvS §4.1 (Yu et al. 2025).

Everything is expressed as **per-token weights** (:func:`sequence_token_weights`) so that the
loss of a batch is ``Σ_tokens w_i · ℓ_{i,t}``: a sum that splits across micro-batches and ranks
without changing its value (gradient accumulation and data parallelism stay exact).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from sptool import rewards as rewards_lib
from sptool.core.registry import Registry
from sptool.rewards import GRPO_EPSILON


@dataclass(frozen=True)
class Objective:
    """The knobs that define one objective (see the module table)."""

    name: str
    advantage: str        # a kind of :func:`sptool.rewards.group_advantages`: "dr_grpo" or "grpo"
    aggregation: str      # "global_constant", "sequence_mean" or "token_mean"
    clip_low: float
    clip_high: float


OBJECTIVES: Registry[Objective] = Registry("objective (--loss)", {
    "dr_grpo": Objective("dr_grpo", "dr_grpo", "global_constant", 0.2, 0.2),
    "grpo": Objective("grpo", "grpo", "sequence_mean", 0.2, 0.2),
    "dapo": Objective("dapo", "grpo", "token_mean", 0.2, 0.28),
})


def group_advantages(rewards: Sequence[float], objective: str = "dr_grpo",
                     epsilon: float = GRPO_EPSILON) -> list[float]:
    """Advantages of one group under ``objective``: :func:`sptool.rewards.group_advantages` of the
    objective's kind (dr_grpo: centred, WIST eq. 3; grpo and dapo: normalised, SvS eq. 1)."""
    return rewards_lib.group_advantages(rewards, OBJECTIVES.get(objective).advantage, epsilon)


def sequence_token_weights(lengths: Sequence[int], aggregation: str,
                           normaliser_length: int | None = None) -> list[float]:
    """The weight ``w_i`` every completion token of sequence ``i`` gets in ``L = Σ_i Σ_t w_i ℓ_{i,t}``.

    - ``sequence_mean`` (GRPO, SvS eq. 2): ``L = (1/N) Σ_i (1/|y_i|) Σ_t ℓ_{i,t}`` → ``w_i = 1/(N |y_i|)``
    - ``token_mean`` (DAPO): ``L = Σ_i Σ_t ℓ_{i,t} / Σ_i |y_i|`` → ``w_i = 1/Σ_j |y_j|``
    - ``global_constant`` (Dr. GRPO): loss ``Σ_i Σ_t ℓ_{i,t} / (N · L)`` → ``w_i = 1/(N L)`` with
      ``L`` = ``normaliser_length``, the generation budget (Liu et al. 2025, Dr. GRPO: the constant
      is the maximum completion length the sampler allows, ``MAX_TOKENS``); when it is not known,
      the longest completion of the batch stands in. The constant does not depend on each
      sequence's length, which removes GRPO's length bias.

    ``N`` is the number of completions in the whole batch (all micro-batches, all ranks).
    Zero-length completions get weight 0.
    """
    n = len(lengths)
    if n == 0:
        return []
    if aggregation == "sequence_mean":
        return [1.0 / (n * length) if length else 0.0 for length in lengths]
    if aggregation == "token_mean":
        total = sum(lengths)
        return [1.0 / total if total else 0.0 for _ in lengths]
    if aggregation == "global_constant":
        constant = normaliser_length if normaliser_length else max(lengths)
        return [1.0 / (n * constant) if constant else 0.0 for _ in lengths]
    raise ValueError(f"unknown aggregation '{aggregation}'")


def clipped_surrogate_loss(logprobs, old_logprobs, advantages, clip_low: float, clip_high: float):
    """Per-token PPO clipped surrogate, as a loss (negated objective).

    ``k_t = exp(log π_θ(y_t) − log π_old(y_t))``,
    ``ℓ_t = −min(k_t · A_t, clip(k_t, 1 − ε_low, 1 + ε_high) · A_t)``.

    With ``old_logprobs = logprobs.detach()`` the ratio is 1 and the gradient is the plain
    policy gradient ``−A_t ∇ log π_θ(y_t)``. Returns ``(loss, clipped)`` where ``clipped`` is a
    bool tensor marking tokens whose clipped branch is active (zero gradient).
    """
    import torch

    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped_term = clipped_ratio * advantages
    loss = -torch.minimum(unclipped, clipped_term)
    clipped = ((ratio < 1.0 - clip_low) & (advantages < 0)) | ((ratio > 1.0 + clip_high) & (advantages > 0))
    return loss, clipped


def k3_kl(logprobs, ref_logprobs):
    """Per-token low-variance KL estimator (Schulman's k3, used by GRPO):

    ``D_KL(π_θ ‖ π_ref) ≈ exp(log π_ref − log π_θ) − (log π_ref − log π_θ) − 1`` (≥ 0, unbiased).
    """
    import torch

    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1.0


def token_entropy(logits):
    """Per-position entropy ``H = −Σ_v p_v log p_v`` of ``softmax(logits)`` (nats), for reporting."""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def selected_logprobs(logits, targets):
    """``log softmax(logits)[target] = logit_target − logsumexp(logits)`` per row: the
    log-probability of each sampled token, without materialising the full log-softmax (the same
    computation as TRL's ``selective_log_softmax``; TRL itself is not imported: it costs seconds
    at start-up and is missing on some machines)."""
    import torch

    logits = logits.float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def truncated_importance_weights(trainer_logprobs, sampler_logprobs, cap: float):
    """Truncated importance sampling (TIS) between the sampler and the trainer, per token:
    ``ρ_t = min(exp(log π_trainer(y_t) − log π_sampler(y_t)), C)``, no gradient.

    The sampler (another precision, another kernel, vLLM) is not exactly the policy the trainer
    computes, so its tokens are off-policy by ``π_trainer/π_sampler``; the truncated weight
    multiplies each token's clipped policy-gradient term (Yao et al. 2025, "Your Efficient RL
    Framework Secretly Brings You Off-Policy RL Training"; veRL's rollout correction and TRL's
    ``vllm_importance_sampling_correction`` with ``vllm_importance_sampling_cap``)."""
    import torch

    return torch.exp((trainer_logprobs - sampler_logprobs).detach()).clamp(max=cap)


def objective_loss(logprobs, old_logprobs, ref_logprobs, advantages, weights, *, clip_low: float,
                   clip_high: float, beta: float = 0.0, importance_weights=None):
    """The batch loss ``L = Σ_tokens w_i · (ρ_t · ℓ^clip_{i,t} + β · KL^k3_{i,t})`` over flat token tensors.

    All arguments are 1-D tensors over the completion tokens of the (micro-)batch; ``advantages``
    and ``weights`` are per token (each token carries its sequence's value). ``ref_logprobs``
    may be None when ``beta == 0``; ``importance_weights`` (ρ, :func:`truncated_importance_weights`)
    None means 1. Returns ``(loss, per_token_surrogate, kl or None, clipped)``.
    """
    surrogate, clipped = clipped_surrogate_loss(logprobs, old_logprobs, advantages, clip_low, clip_high)
    per_token = surrogate if importance_weights is None else surrogate * importance_weights
    kl = None
    if beta and ref_logprobs is not None:
        kl = k3_kl(logprobs, ref_logprobs)
        per_token = per_token + beta * kl
    return (per_token * weights).sum(), surrogate, kl, clipped
