"""Policy-gradient training from JSONL training groups: Dr. GRPO, GRPO, DAPO (``sptool train-step``).

- :mod:`sptool.train.losses` — the objectives as pure functions (advantages, clipped surrogate,
  k3 KL, normalisation weights), each with its equation.
- :mod:`sptool.train.group` — the training-group record and which groups an update takes.
- :mod:`sptool.train.config` — :class:`~sptool.train.config.TrainConfig`, encoded sequences,
  micro-batch planning.
- :mod:`sptool.train.model` — loading the policy and the KL reference (LoRA, compile, head
  bypass), log-probabilities, optimizer state and saving (``PolicyModel``).
- :mod:`sptool.train.step` — :class:`~sptool.train.step.PolicyTrainer`: one optimizer update per
  call (the loss over micro-batches), distributed through ``accelerate``; it re-exports the names
  above.
- :mod:`sptool.train.checkpoint` — atomic HF-format checkpoints with optimizer state.

Nothing here is imported by ``sptool --help``; torch loads inside the functions that need it.
"""
