"""Policy-gradient training from JSONL training groups: Dr. GRPO, GRPO, DAPO (``sptool train-step``).

- :mod:`sptool.train.losses` — the objectives as pure functions (advantages, clipped surrogate,
  k3 KL, normalisation weights), each with its equation.
- :mod:`sptool.train.step` — :class:`~sptool.train.step.PolicyTrainer`: one optimizer update per
  call, micro-batched, LoRA, distributed through ``accelerate``.
- :mod:`sptool.train.checkpoint` — atomic HF-format checkpoints with optimizer state.

Nothing here is imported by ``sptool --help``; torch loads inside the functions that need it.
"""
