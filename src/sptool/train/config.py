"""``train-step``'s settings (:class:`TrainConfig`), one encoded sequence (:class:`TrainSequence`),
micro-batch planning."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from sptool.core.records import UsageError
from sptool.train.losses import OBJECTIVES


#: where a rollout's log π_old comes from: the sampler's recorded log-probs, or the trainer's own forward
OLD_LOGPROBS = ("sampler", "trainer")
WEIGHT_ROUNDINGS = ("nearest", "split", "stochastic")  # sptool.train.rounding
#: "auto" (the default of both): chosen with the precision (sptool.train.step.resolve_precision)
AUTO = "auto"


@dataclass
class TrainConfig:
    """Everything one ``train-step`` needs; saved into the checkpoint as the config used."""

    model: str = "tiny"
    loss: str = "dr_grpo"
    beta: float = 0.0
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    clip_low: float | None = None       # default from the objective
    clip_high: float | None = None
    advantage_epsilon: float = 1e-6
    recompute_advantages: bool = False  # ignore the groups' stored advantages
    # The generation budget (max new tokens per completion): Dr. GRPO's normalising constant L in
    # N·L (Liu et al. 2025); without it, the longest completion of the batch stands in.
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    max_tokens_per_micro_batch: int = 4096
    roles: list[str] | None = None
    lora_r: int = 0
    lora_alpha: float | None = None     # default 2·r
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    ref_model: str | None = None
    chat_template: bool = True
    device: str | None = None
    mixed_precision: str | None = None  # "no", "bf16", "fp16"; None: DEFAULT_MIXED_PRECISION on CUDA, no on CPU
    seed: int = 0
    full_logits: bool = False           # the full-logits path: [tokens × vocabulary] logits (slower, larger)
    entropy: bool = True                # report the policy's entropy (one more pass over each logit chunk)
    compile: bool | None = None         # torch.compile each decoder layer (regional); default: on CUDA
    compile_kernels: bool | None = None  # torch.compile the log-prob chunk kernels; default: on CUDA
    logit_chunk_elements: int | None = None  # rows × vocabulary per logit chunk; default by device
    # Where log π_old comes from (OLD_LOGPROBS): "sampler", the log-probs the generator recorded;
    # "trainer", the trainer's own forward in its own precision (the first update from a rollout
    # has ratio exactly 1; the sampler's log-probs then feed only the gap metric and TIS); "auto":
    # trainer under bf16/fp16 autocast or with tis_cap, else sampler (resolve_precision).
    old_logprobs: str = AUTO
    # Truncated importance sampling (TIS): each token's policy-gradient term is multiplied by
    # min(exp(log π_old,trainer − log π_sampler), tis_cap); 0: off. Needs old_logprobs="trainer".
    tis_cap: float = 0.0
    fp32_head: bool = False             # LM head matmul and log-softmax in float32 on a bf16/fp16 autocast body
    # float32 matmuls on TF32 tensor cores (CUDA; torch's float32_matmul_precision "high"): float32
    # weights, activations and accumulation, products rounded to a 10-bit mantissa. Process-wide, so
    # a float32 sampler in the same process uses them too.
    tf32: bool = False
    # How a bf16/fp16 autocast forward rounds the float32 master weights (sptool.train.rounding):
    # "nearest" (autocast's cast: an RL-sized update below half a rounding step is invisible),
    # "split" (hi + lo, one more matmul per linear: every update seen), "stochastic" (bf16: an
    # unbiased stochastically rounded copy each forward, no extra matmul); "auto": stochastic under
    # bf16, else nearest (resolve_precision).
    weight_rounding: str = AUTO
    # Restore the AdamW state saved with ``model`` (a checkpoint): a resumed or chained run goes on
    # exactly. False: fresh moments (a run that starts from another run's checkpoint; see
    # ``train.start_optimizer`` in ``sptool run``).
    restore_optimizer: bool = True

    def __post_init__(self) -> None:
        objective = OBJECTIVES.get(self.loss)
        if self.clip_low is None:
            self.clip_low = objective.clip_low
        if self.clip_high is None:
            self.clip_high = objective.clip_high
        for name, value in vars(self).items():  # inf/nan would train NaN weights, silently
            if isinstance(value, float) and not math.isfinite(value):
                raise UsageError(f"--{name.replace('_', '-')} must be a finite number, got {value}")
        checks = [
            (self.learning_rate > 0, f"--learning-rate must be > 0, got {self.learning_rate}"),
            (self.beta >= 0, f"--beta must be >= 0, got {self.beta}"),
            (0 <= self.clip_low < 1, f"--clip-low must be in [0, 1), got {self.clip_low}"),
            (self.clip_high >= 0, f"--clip-high must be >= 0, got {self.clip_high}"),
            (self.temperature > 0, f"--temperature must be > 0, got {self.temperature}"),
            (self.max_tokens_per_micro_batch >= 1, "--max-tokens-per-micro-batch must be >= 1"),
            (self.lora_r >= 0, f"--lora-r must be >= 0, got {self.lora_r}"),
            (self.max_completion_tokens is None or self.max_completion_tokens > 0,
             f"--max-completion-tokens must be > 0, got {self.max_completion_tokens}"),
            (self.weight_decay >= 0, "--weight-decay must be >= 0"),
            (self.old_logprobs in (AUTO, *OLD_LOGPROBS),
             f"--old-logprobs must be one of {', '.join((AUTO, *OLD_LOGPROBS))}, got '{self.old_logprobs}'"),
            (self.tis_cap >= 0, f"--tis-cap must be >= 0 (0: off), got {self.tis_cap}"),
            (self.weight_rounding in (AUTO, *WEIGHT_ROUNDINGS),
             f"--weight-rounding must be one of {', '.join((AUTO, *WEIGHT_ROUNDINGS))}, got '{self.weight_rounding}'"),
            (not (self.weight_rounding == "stochastic" and self.mixed_precision == "fp16"),
             "--weight-rounding stochastic is for bf16 (--mixed-precision bf16); fp16 can use split"),
            (self.tis_cap == 0 or self.old_logprobs in (AUTO, "trainer"),
             "--tis-cap corrects the trainer's log π_old towards the sampler's: it needs --old-logprobs trainer"),
        ]
        for ok, message in checks:
            if not ok:
                raise UsageError(message)

    @property
    def objective(self):
        return OBJECTIVES.get(self.loss)


@dataclass
class TrainSequence:
    """One completion ready for the model: token ids, its advantage and (optionally) old log-probs.

    ``old_logprobs`` are the sampler's (log π_old with ``TrainConfig.old_logprobs="sampler"``; the
    sampler–trainer gap and TIS use them); ``trainer_logprobs`` the trainer's own, scored before
    a rollout's first update (log π_old with ``"trainer"``). Without the chosen one, log π_old is
    the update's own forward, detached: ratio 1."""

    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float
    reward: float = 0.0
    role: str = "policy"
    old_logprobs: list[float] | None = None
    trainer_logprobs: list[float] | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


def plan_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of sequences grouped into micro-batches whose padded size ``rows × longest`` stays
    within ``max_tokens`` (a longer single sequence gets a micro-batch of its own). Sequences are
    sorted by length (longest first) to waste little padding; the order is deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index in order:
        grown = max(longest, lengths[index])
        if current and grown * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, grown = [], lengths[index]
        current.append(index)
        longest = grown
    if current:
        batches.append(current)
    return batches
