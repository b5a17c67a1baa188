"""One policy-gradient update from JSONL training groups (Dr. GRPO, GRPO, DAPO).

TRL's GRPOTrainer samples its own rollouts and cannot take pre-computed ones, so this is sptool's
own short torch loop (``sptool train-step``):

1. each training group (``prompt``, ``completions``, ``rewards``, optional ``advantages``,
   ``old_logprobs``, ``finish_reasons``) becomes sequences ``prompt tokens + completion tokens``;
   the prompt is rendered by :func:`sptool.models.tokenizer.render_prompt` (the function generation
   uses) and tokenized alone, the completion is tokenized after it, and EOS is appended to a
   completion that ended with a stop, so the trainer scores exactly the tokens that were sampled;
2. per-token weights from :mod:`sptool.train.losses` make the batch loss a plain sum, which is
   split into micro-batches under a token budget (gradient accumulation) and across ranks
   (DDP through ``accelerate``: the same command runs under ``accelerate launch``/``torchrun``);
3. one AdamW step (gradient clipping), then rank 0 writes the checkpoint atomically.

:class:`PolicyTrainer` is the Python API: ``trainer.update(groups)`` is one optimizer update,
callable several times in one process (the optimizer state carries over), ``trainer.save(OUT)``
writes a checkpoint."""

from __future__ import annotations

import contextlib
import math
import time
from typing import Callable, Sequence

from sptool.core.records import InputError, RuntimeFailure, UsageError
from sptool.train.losses import (group_advantages, objective_loss, selected_logprobs, sequence_token_weights,
                                 token_entropy, truncated_importance_weights)
from sptool.train.group import (  # noqa: F401 - re-exported: sptool.train.step's API
    TRAINING_GROUP, TrainingGroupKind, _check_logprob_lists, _check_numbers, _check_prompt,
    _check_stop_strings, _check_strings, _check_token_id_lists, _is_number, group_role,
    select_roles, split_updates)
from sptool.train.config import (  # noqa: F401 - re-exported: sptool.train.step's API
    TrainConfig, TrainSequence, plan_micro_batches)
from sptool.train.model import (  # noqa: F401 - re-exported: sptool.train.step's API
    PolicyModel, _LOGIT_TRANSFORMS, _bypassed, _one_sequence_a_row, _compile_decoder_layers, _identity, _uncompile,
    allocator_events, cuda_allocator_counts, peak_memory_mb)


#: the trainer's autocast precision on CUDA when none is asked for. bf16 with stochastic weight
#: rounding and the trainer's own log π_old (:func:`resolve_precision`) learnt at the float32 rate
#: on one H200 (learning_parity.py, 2 seeds, 30 steps: within 2 s.e. at every evaluation, 0.817
#: against 0.833 at 30) at 1.40x the bare bf16 step against float32's 0.18x
#: (``benchmarks/results/precision-h200/stochastic-rounding/``). bf16 with autocast's nearest cast
#: alone did not learn (0.24 at 30): an RL-sized update is rounded away in its forward.
DEFAULT_MIXED_PRECISION = "bf16"


MIXED_PRECISIONS = ("no", "bf16", "fp16")


def release_freed_host_memory() -> bool:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; False where there
    is none). A CPU update's activations below glibc's mmap threshold come from the heap and stay
    in the process once freed: a tiny R-Quest run held 7.1 GB between its updates (5.8 GB with the
    trim after each), beside other runs on the same machine."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return False
    trim(0)
    return True


def resolve_mixed_precision(requested: str | None, *, cuda: bool) -> str:
    """The autocast precision of the trainer's forwards: ``requested`` ("no", "bf16", "fp16"; None
    or "auto": :data:`DEFAULT_MIXED_PRECISION` on CUDA, "no" elsewhere)."""
    if requested in (None, "", "auto"):
        return DEFAULT_MIXED_PRECISION if cuda else "no"
    if requested not in MIXED_PRECISIONS:
        raise UsageError(f"--mixed-precision must be one of auto, {', '.join(MIXED_PRECISIONS)}, got '{requested}'")
    return requested


def resolve_precision(config: TrainConfig, *, cuda: bool) -> TrainConfig:
    """``config`` with its precision settings resolved for this machine (the ``auto`` ones; an
    explicit value is kept):

    - ``mixed_precision``: :data:`DEFAULT_MIXED_PRECISION` on CUDA, ``no`` elsewhere;
    - ``old_logprobs``: ``trainer`` when the trainer computes in bf16/fp16 (the sampler's float32
      log-probs would put every first update off ratio 1) or ``tis_cap`` is on, else ``sampler``;
    - ``weight_rounding``: ``stochastic`` under bf16 (autocast's nearest cast hides an RL-sized
      update from the forward), else ``nearest``.

    The trainer keeps the resolved copy, so a checkpoint's ``state.json`` records what ran."""
    import dataclasses

    from sptool.train.config import AUTO

    mixed = resolve_mixed_precision(config.mixed_precision, cuda=cuda)
    old = config.old_logprobs
    if old == AUTO:
        old = "trainer" if mixed != "no" or config.tis_cap > 0 else "sampler"
    rounding = config.weight_rounding
    if rounding == AUTO:
        rounding = "stochastic" if mixed == "bf16" else "nearest"
    return dataclasses.replace(config, mixed_precision=mixed, old_logprobs=old, weight_rounding=rounding)


def _drop_forward_autocast(module) -> None:
    """Undo accelerate's wrapper of a prepared model's ``forward`` (autocast + outputs cast to
    float32). The wrapper stays on the module for every caller, so a generator sharing the
    trainer's model would sample in the training precision too (measured: sampling under bf16
    autocast made RLVR on the tiny model learn several times slower). The trainer enters
    ``accelerator.autocast()`` around its own forwards instead."""
    original = module.__dict__.pop("_original_forward", None)
    if original is None:
        return
    if getattr(original, "__func__", None) is getattr(type(module), "forward", None):
        module.__dict__.pop("forward", None)  # the class's own forward again
    else:
        module.forward = original


def completion_token_values(batch: Sequence[TrainSequence], weights: Sequence[float], old_source: str = "sampler"):
    """Per completion token of ``batch``, in order: its sequence's advantage, its row's weight,
    its log π_old (0 when the completion has none) and whether it has one, its sampler log-prob
    (0 when none) and whether it has one. ``old_source``: log π_old is the sampler's
    (``old_logprobs``) or the trainer's (``trainer_logprobs``)."""
    advantages: list[float] = []
    token_weights: list[float] = []
    old_values: list[float] = []
    has_old: list[bool] = []
    sampler_values: list[float] = []
    has_sampler: list[bool] = []
    for row, seq in enumerate(batch):
        n = len(seq.completion_ids)
        advantages += [seq.advantage] * n
        token_weights += [weights[row]] * n
        old = seq.trainer_logprobs if old_source == "trainer" else seq.old_logprobs
        old_values += old if old is not None else [0.0] * n
        has_old += [old is not None] * n
        sampler_values += seq.old_logprobs if seq.old_logprobs is not None else [0.0] * n
        has_sampler += [seq.old_logprobs is not None] * n
    return advantages, token_weights, old_values, has_old, sampler_values, has_sampler


#: the summed statistics of a micro-batch, in order (the totals tensor of ``update_sequences``)
SUMS = ("loss", "clipped", "kl", "entropy", "ratio", "completion_tokens", "tokens", "ratio_sq",
        "gap", "gap_sq", "gap_tokens", "tis", "tis_capped")
#: those summed per chunk of completion tokens (:func:`token_statistics`)
CHUNK_SUMS = ("clipped", "kl", "ratio", *SUMS[7:])
#: and the micro-batch's maxima (combined with max over micro-batches and ranks)
MAXIMA = ("ratio_max", "ratio_min_negated", "gap_max")


def token_statistics(current, old, trainer_old, sampler, has_sampler, clipped, kl, tis, cap: float):
    """No-grad per-token statistics of one chunk of completion tokens: ``(sums, maxima)``, the sums
    of :data:`CHUNK_SUMS` and the :data:`MAXIMA`.

    ``current``: the update's log-probs (detached); ``old``: its log π_old; ``trainer_old``: the
    trainer's log-probs before the update (``old`` with ``old_logprobs="trainer"``, else the
    update's own forward); ``sampler``/``has_sampler``: the sampler's log-probs and where they
    exist. The sampler–trainer gap is ``|trainer_old − sampler|`` over the tokens that have a
    sampler log-prob; ``tis``: the TIS weights (None: off), ``cap`` their cap."""
    import torch

    ratio = torch.exp(current - old).double()
    gap = (trainer_old - sampler).abs().double() * has_sampler
    zero = torch.zeros((), dtype=torch.float64, device=current.device)
    empty = ratio.numel() == 0
    sums = torch.stack([
        clipped.sum().double(), kl.sum().double() if kl is not None else zero, ratio.sum(),
        (ratio * ratio).sum(), gap.sum(), (gap * gap).sum(), has_sampler.sum().double(),
        (tis.double() * has_sampler).sum() if tis is not None else zero,
        ((tis >= cap) & has_sampler).sum().double() if tis is not None else zero,
    ])
    low = torch.full((), -math.inf, dtype=torch.float64, device=current.device)  # a fill: no host copy, no sync
    maxima = torch.stack([low, low, low]) if empty else torch.stack([ratio.max(), -ratio.min(), gap.max()])
    return sums, maxima


class PolicyTrainer(PolicyModel):
    """Holds the policy, its optimizer, an optional frozen reference and the accelerator.

    ``PolicyTrainer(config)`` loads ``config.model`` (``tiny``, an HF directory, a LoRA adapter
    directory, or a previous ``train-step`` output whose optimizer state and step it resumes).
    Tests and benchmarks may pass a ready ``model`` (and ``tokenizer``) instead.
    """

    def __init__(self, config: TrainConfig, *, model=None, tokenizer=None, log: Callable[[str], None] | None = None):
        import torch
        from accelerate import Accelerator

        self.log = log or (lambda message: None)
        self.torch = torch
        cpu = (config.device or "").startswith("cpu") or not torch.cuda.is_available()
        if (config.device or "").startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeFailure(f"--device {config.device} asked for, but torch sees no CUDA GPU")
        rounding_asked = config.weight_rounding
        self.config = config = resolve_precision(config, cuda=not cpu)
        mixed = config.mixed_precision
        if config.tf32 and not cpu:
            torch.backends.cuda.matmul.allow_tf32 = True  # process-wide: a float32 sampler here too
            torch.backends.cudnn.allow_tf32 = True
        self.accelerator = Accelerator(cpu=cpu, mixed_precision=mixed)
        self.device = self.accelerator.device
        torch.manual_seed(config.seed)
        self.state: dict = {}
        self.step = 0
        self.roles_trained: set[str] = set()
        self.base_model: str | None = None
        self.reference_model: str | None = None
        self.old_logprob_mismatches = 0
        self.warned_advantage_kind = False
        if model is None:
            model, tokenizer = self._load_policy()
        else:
            self.base_model = getattr(getattr(model, "config", None), "_name_or_path", None) or "<in-memory>"
        self.tokenizer = tokenizer
        self.is_lora = hasattr(model, "peft_config")
        if self.is_lora and rounding_asked == "auto":  # LoRA's layers keep their own forward: nothing to round
            import dataclasses

            self.config = config = dataclasses.replace(config, weight_rounding="nearest")
        self.pad_id = self._pad_id(model)
        self.ref_model = self._load_reference(model) if config.beta > 0 and not self.is_lora else None
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise RuntimeFailure("the model has no trainable parameters")
        # CUDA: the fused AdamW kernel (one pass over parameters, gradients and moments; the same
        # update as the multi-tensor one, and the same state dict)
        fused = self.device.type == "cuda"  # trainable parameters are floating point
        optimizer = torch.optim.AdamW(params, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2),
                                      eps=config.adam_epsilon, weight_decay=config.weight_decay,
                                      **({"fused": True} if fused else {}))
        self._restore_optimizer(optimizer, len(params))
        self.params = params
        self.warned_normaliser = False
        cuda = self.device.type == "cuda"
        compile_kernels = True if config.compile_kernels is None else config.compile_kernels
        self.kernels_compiled = bool(compile_kernels) and cuda
        # the first micro-batch through compiled layers is tried once; a failure falls back to eager
        self._route_weight_rounding(model, mixed)
        self.compiled_layers = _compile_decoder_layers(model, log=self.log) \
            if (cuda if config.compile is None else config.compile) else []
        self.compile_proven = not self.compiled_layers
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        _drop_forward_autocast(self.accelerator.unwrap_model(self.model))
        self.output_layer = self._bypassable_head(model)
        self.head = None if config.full_logits else self.output_layer
        self.ref_head = self._bypassable_head(self.ref_model) if self.head is not None and self.ref_model is not None \
            else None
        # the head's matmuls in the autocast precision (bf16 or fp16), as autocast would run a plain
        # linear head; float32 (the weights' dtype) without autocast or with fp32_head. With a float32
        # head under fp16, the 0.5B-shape step ran at 0.61x the bare bf16 step, against bf16's 1.51x
        # (H200): the 151,936-row head's matmuls without tensor cores are the likely reason
        self.compute_dtype = None if config.fp32_head else \
            {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.accelerator.mixed_precision)
        # the LM head's rounding (it runs in compute_dtype; the body's linears were routed above)
        self.weight_rounding = config.weight_rounding if self.compute_dtype is not None else "nearest"
        if config.fp32_head and self.output_layer is None:
            self.log("note: --fp32-head needs a plain linear LM head; this model's head runs in the autocast precision")

    def _route_weight_rounding(self, model, mixed: str) -> None:
        """Every linear layer of the body through ``config.weight_rounding`` (the head the chunked
        path applies itself is left to it); a note when there is nothing to round."""
        rounding = self.config.weight_rounding
        if rounding == "nearest":
            return
        if mixed == "no":
            self.log(f"note: --weight-rounding {rounding} rounds bf16/fp16 autocast forwards; this trainer "
                     "runs in float32 (--mixed-precision no), so it changes nothing")
            return
        if self.is_lora:
            self.log(f"note: --weight-rounding {rounding} is for full fine-tuning; the LoRA layers keep their own")
            return
        from sptool.train.rounding import use_weight_rounding

        head = None if self.config.full_logits else self._bypassable_head(model)
        use_weight_rounding(model, rounding, skip=[head] if head is not None else [], device=self.device)

    def encode_group(self, group: dict) -> list[TrainSequence]:
        """Token sequences of one group: rendered prompt, then each completion (+ EOS on stop);
        a completion whose sampled token ids came with it (``completion_ids``) is trained as those.

        A prompt that ends with an assistant message (a response prefix) renders with the prefix,
        so a completion that begins with the prefix (the text parsing saw) is trained without it:
        the prefix tokens are prompt, not sampled. A completion that ended at a stop string
        (``stop_strings``) gets no EOS: the sampler did not emit one.
        """
        from sptool.models.base import split_response_prefix
        from sptool.models.tokenizer import render_prompt

        tokenizer = self.tokenizer
        rewards = [float(r) for r in group["rewards"]]
        advantages = group.get("advantages")
        wanted = self.config.objective.advantage
        if advantages is None or self.config.recompute_advantages:
            advantages = group_advantages(rewards, self.config.loss, self.config.advantage_epsilon)
        elif group.get("advantage") not in (None, wanted) and not self.warned_advantage_kind:
            self.warned_advantage_kind = True
            self.log(f"note: groups carry '{group.get('advantage')}' advantages, --loss {self.config.loss} "
                     f"normally uses '{wanted}'; using the stored ones (--recompute-advantages to recompute)")
        text = render_prompt(tokenizer, group["prompt"], self.config.chat_template)
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not prompt_ids:
            raise InputError("renders to no tokens", field="prompt")
        prefix = split_response_prefix(group["prompt"])[1]
        stop_strings = group.get("stop_strings") or [None] * len(group["completions"])
        finish = group.get("finish_reasons") or ["stop"] * len(group["completions"])
        old = group.get("old_logprobs") or [None] * len(group["completions"])
        # the trainer's own log-probs, when a rollout of several updates was scored before the first
        # (:meth:`fill_old_logprobs` with old_logprobs="trainer"); else each update's own forward
        own_old = group.get("trainer_logprobs") or [None] * len(group["completions"])
        sampled = group.get("completion_ids") or [None] * len(group["completions"])

        def sequence(ids: list[int], old_i: list[float] | None) -> TrainSequence:
            mine = own_old[i] if i < len(own_old) else None
            mine = mine if mine is not None and len(mine) == len(ids) else None
            return TrainSequence(prompt_ids, ids, float(advantages[i]), rewards[i], role, old_i, mine)

        eos = self.eos_id()
        role = group_role(group)
        sequences = []
        for i, completion in enumerate(group["completions"]):
            own = sampled[i] if i < len(sampled) else None
            if own:  # the sampler's own tokens (EOS included when it emitted one): trained as sampled
                if max(own) >= len(tokenizer):
                    raise InputError(f"completion {i}: token id {max(own)} is outside the tokenizer's "
                                     f"{len(tokenizer)} ids", field="completion_ids")
                old_i = old[i] if old[i] is not None and len(old[i]) == len(own) else None
                sequences.append(sequence(list(own), old_i))
                continue
            if prefix and completion.startswith(prefix):
                completion = completion[len(prefix):]
            ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
            old_i = old[i]
            stopped = finish[i] == "stop" and not (i < len(stop_strings) and stop_strings[i])
            if not group.get("finish_reasons") and old_i is not None and len(old_i) == len(ids):
                stopped = False  # no finish_reasons: the sampler's log-probs show no EOS was sampled
            if stopped and eos is not None:
                ids = ids + [eos]
            if old_i is not None and len(old_i) != len(ids):
                self.old_logprob_mismatches += 1  # re-tokenisation differs: fall back to ratio 1
                old_i = None
            sequences.append(sequence(ids, old_i))
        return sequences

    def update(self, groups: Sequence[dict]) -> dict:
        """One optimizer update over ``groups`` (all of them: one step). Returns the metrics."""
        sequences = [seq for group in groups for seq in self.encode_group(group)]
        for group in groups:
            self.roles_trained.add(group_role(group))
        metrics = self.update_sequences(sequences)
        metrics["groups"] = len(groups)
        return metrics

    def _clip_gradients(self, max_norm: float) -> float:
        """Clip the gradients to ``max_norm`` in total and return their norm before clipping, as
        ``accelerator.clip_grad_norm_`` does, but leaving them as they were when the norm is not
        finite (its clip multiplies every gradient by NaN, which hides the ones that were). FSDP,
        DeepSpeed and XLA keep accelerate's own clipping."""
        torch = self.torch
        distributed = str(self.accelerator.distributed_type)
        if any(name in distributed for name in ("FSDP", "DEEPSPEED", "MEGATRON", "XLA")):
            return float(self.accelerator.clip_grad_norm_(self.params, max_norm))
        self.accelerator.unscale_gradients()
        total = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
        norm = float(total)
        if math.isfinite(norm):
            torch.nn.utils.clip_grads_with_norm_(self.params, max_norm, total)
        return norm

    def _non_finite_gradients(self, loss_sum: float, limit: int = 3) -> str:
        """Where a non-finite gradient norm comes from, for its error line: whether this rank's
        loss was finite, and the first trainable parameters whose gradient is not."""
        torch = self.torch
        names = {id(p): name for name, p in self.accelerator.unwrap_model(self.model).named_parameters()}
        broken = [names.get(id(p), "?") for p in self.params
                  if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
        loss = "the loss was finite" if math.isfinite(loss_sum) else f"the loss was {loss_sum}"
        if not broken:
            return f"{loss}; every gradient is finite, their norm overflowed"
        more = f" and {len(broken) - limit} more" if len(broken) > limit else ""
        return f"{loss}; non-finite gradients in {', '.join(broken[:limit])}{more}"

    def update_sequences(self, sequences: Sequence[TrainSequence]) -> dict:
        """One optimizer update over already tokenized sequences (the global batch)."""
        torch = self.torch
        config = self.config
        accelerator = self.accelerator
        start = time.perf_counter()
        graphs_before = self._graphs_compiled()
        allocator_before = cuda_allocator_counts(self.device)
        world, rank = accelerator.num_processes, accelerator.process_index
        lengths = [len(seq.completion_ids) for seq in sequences]
        if config.objective.aggregation == "global_constant" and config.max_completion_tokens is None \
                and not self.warned_normaliser and sequences:
            self.warned_normaliser = True
            self.log(f"note: --loss {config.loss} normalises by N·L with L the generation budget; without "
                     f"--max-completion-tokens the longest completion of each batch stands in ({max(lengths)})")
        weights = sequence_token_weights(lengths, config.objective.aggregation, config.max_completion_tokens)
        nothing_to_learn = not sequences or (config.beta == 0 and all(seq.advantage == 0 for seq in sequences))
        # sums over this rank (SUMS) and maxima (MAXIMA)
        totals = torch.zeros(len(SUMS), dtype=torch.float64, device=self.device)
        maxima = torch.full((len(MAXIMA),), -math.inf, dtype=torch.float64, device=self.device)
        n_micro = 0
        grad_norm = 0.0
        if not nothing_to_learn:
            local = list(range(rank, len(sequences), world))
            count = True
            if not local:  # more ranks than sequences: take part in the all-reduce with weight 0
                local, count = [0], False
            plan = plan_micro_batches([sequences[i].length for i in local], config.max_tokens_per_micro_batch)
            self.model.train()
            for k, micro in enumerate(plan):
                indices = [local[j] for j in micro]
                batch = [sequences[i] for i in indices]
                batch_weights = [weights[i] if count else 0.0 for i in indices]
                sync = contextlib.nullcontext() if k == len(plan) - 1 else accelerator.no_sync(self.model)
                with sync:
                    try:
                        loss, stats = self._micro_batch_loss(batch, batch_weights)
                        accelerator.backward(loss * world)  # DDP averages gradients over ranks: undo it
                    except Exception as exc:  # noqa: BLE001 - only a first compiled step is retried
                        if self.compile_proven or k > 0:
                            raise
                        self._give_up_compile(exc)
                        loss, stats = self._micro_batch_loss(batch, batch_weights)
                        accelerator.backward(loss * world)
                    self.compile_proven = True
                if count:
                    totals += stats[:len(SUMS)]
                    maxima = torch.maximum(maxima, stats[len(SUMS):])
            n_micro = len(plan)
            if config.max_grad_norm and config.max_grad_norm > 0:
                grad_norm = self._clip_gradients(config.max_grad_norm)
            else:
                grad_norm = float(torch.norm(torch.stack([p.grad.norm() for p in self.params if p.grad is not None])))
            if not math.isfinite(grad_norm):
                where = self._non_finite_gradients(float(totals[0]))
                self.optimizer.zero_grad(set_to_none=True)
                raise RuntimeFailure(f"non-finite gradient norm ({grad_norm}) at step {self.step + 1} ({where}); "
                                     "no update written (lower --learning-rate or check the rewards)")
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if world > 1:
            totals = accelerator.reduce(totals, reduction="sum")
            maxima = accelerator.gather(maxima).reshape(world, -1).amax(0)
        self.step += 1
        if self.device.type == "cpu":
            release_freed_host_memory()
        seconds = time.perf_counter() - start
        sums = dict(zip(SUMS, totals.tolist()))
        sums.update(zip(MAXIMA, maxima.tolist()))
        if nothing_to_learn:
            sums["completion_tokens"] = float(sum(lengths))
            sums["tokens"] = float(sum(seq.length for seq in sequences))
        metrics = self._metrics(sequences, sums, seconds, grad_norm, n_micro, nothing_to_learn)
        metrics["graphs_compiled"] = self._graphs_compiled() - graphs_before
        metrics.update(allocator_events(allocator_before, cuda_allocator_counts(self.device)))
        return metrics

    def _graphs_compiled(self) -> int:
        """Graphs ``torch.compile`` has made in this process so far (dynamo's count; 0 when the
        trainer compiles nothing). An update that makes some paid for a compile: a new shape of
        its micro-batches, a recompile."""
        if not (self.compiled_layers or self.kernels_compiled):
            return 0
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])

    def _micro_batch_loss(self, batch: Sequence[TrainSequence], weights: Sequence[float]):
        """Loss of one micro-batch (a tensor to backpropagate) and its 7 summed statistics.

        Rows are right-padded, so causal attention never lets a real token see a pad: no
        attention mask is needed, and SDPA runs its causal (flash) kernel. The model returns its
        last hidden states (the head is bypassed); the head is applied in token chunks by
        :func:`sptool.train.logprobs.fused_policy_loss`, which never holds all logits at once."""
        if self.head is None:
            return self._micro_batch_loss_full(batch, weights)
        from sptool.train.logprobs import fused_policy_loss

        torch = self.torch
        config = self.config
        device = self.device
        input_ids, positions, targets, token_values = self._pack(batch, weights)
        with self.accelerator.autocast(), _bypassed(self.head), _one_sequence_a_row():
            hidden = self.model(input_ids=input_ids, use_cache=False).logits
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)
        ref = self._reference_logprobs(input_ids, None, None, targets, positions) if config.beta > 0 else None
        advantages, token_weights = token_values[:2]
        maxima = [torch.full((len(MAXIMA),), -math.inf, dtype=torch.float64, device=device)]

        def token_loss(logprobs, start: int, end: int):
            chunk = slice(start, end)
            loss, stats, chunk_maxima = self._token_loss(
                logprobs, token_values, chunk, ref[chunk] if ref is not None else None)
            maxima[0] = torch.maximum(maxima[0], chunk_maxima)
            return loss, stats

        loss, _, entropy, stats = fused_policy_loss(
            hidden, self.head.weight, self.head.bias, targets, token_loss, temperature=config.temperature,
            chunk_rows=self._chunk_rows(), compute_dtype=self.compute_dtype, entropy=config.entropy,
            compiled=self.kernels_compiled, rounding=self.weight_rounding)
        if stats is None:  # no completion tokens in this micro-batch
            stats = torch.zeros(len(CHUNK_SUMS), dtype=torch.float64, device=device)
        return loss, self._micro_batch_totals(loss, stats, entropy, targets, batch, maxima[0])

    def _token_loss(self, logprobs, token_values, chunk: slice, ref):
        """The objective of the completion tokens ``chunk`` of a micro-batch, given their log-probs
        under the update (``logprobs``, with a gradient): ``(loss, sums, maxima)`` (the statistics
        of :func:`token_statistics`). log π_old is the sequence's (``old_logprobs``) where it has
        one, else the update's own forward, detached (ratio 1)."""
        torch = self.torch
        config = self.config
        advantages, token_weights, old_values, has_old, sampler_values, has_sampler = \
            (values[chunk] for values in token_values)
        current = logprobs.detach()
        old = torch.where(has_old, old_values, current)
        trainer_old = old if config.old_logprobs == "trainer" else current
        tis = None
        if config.tis_cap > 0:
            tis = torch.where(has_sampler, truncated_importance_weights(trainer_old, sampler_values, config.tis_cap),
                              torch.ones_like(current))
        loss, _, kl, clipped = objective_loss(
            logprobs, old, ref, advantages, token_weights, clip_low=config.clip_low, clip_high=config.clip_high,
            beta=config.beta, importance_weights=tis)
        with torch.no_grad():
            sums, maxima = token_statistics(current, old, trainer_old, sampler_values, has_sampler, clipped, kl,
                                            tis, config.tis_cap)
        return loss, sums, maxima

    def _micro_batch_totals(self, loss, stats, entropy, targets, batch, maxima):
        """The micro-batch's :data:`SUMS` then :data:`MAXIMA`, one float64 tensor."""
        torch = self.torch
        device = self.device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return torch.cat([torch.stack([
            loss.detach().double(), stats[0], stats[1],
            entropy.sum().double() if entropy is not None else zero, stats[2],
            # fills, not copies from the host: a host-to-device copy of a pageable tensor waits for the
            # stream, which would stall the GPU between this micro-batch's forward and its backward
            torch.full((), float(targets.numel()), dtype=torch.float64, device=device),
            torch.full((), float(sum(seq.length for seq in batch)), dtype=torch.float64, device=device),
        ]), stats[3:], maxima])

    def _pack(self, batch: Sequence[TrainSequence], weights: Sequence[float]):
        """Right-padded ``input_ids`` ``[rows, width]``; the flat positions (row · width + t) whose
        hidden state predicts a completion token, and those tokens; per-completion-token tensors
        (advantage, weight, old log-prob, has-old). Built on the host, then moved by :meth:`_to_device`
        (pinned, asynchronous on CUDA: no device sync)."""
        torch = self.torch
        rows, width = len(batch), max(seq.length for seq in batch)
        input_ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        positions: list[int] = []
        targets: list[int] = []
        for row, seq in enumerate(batch):
            ids = seq.prompt_ids + seq.completion_ids
            input_ids[row, :len(ids)] = torch.tensor(ids)
            start = row * width + len(seq.prompt_ids) - 1  # position t predicts token t + 1
            positions += range(start, start + len(seq.completion_ids))
            targets += seq.completion_ids
        advantages, token_weights, old_values, has_old, sampler_values, has_sampler = \
            completion_token_values(batch, weights, self.config.old_logprobs)
        as_tensor = lambda values, dtype=torch.float32: self._to_device(torch.tensor(values, dtype=dtype))  # noqa: E731
        values = (as_tensor(advantages), as_tensor(token_weights), as_tensor(old_values), as_tensor(has_old, torch.bool),
                  as_tensor(sampler_values), as_tensor(has_sampler, torch.bool))
        return (self._to_device(input_ids), as_tensor(positions, torch.long), as_tensor(targets, torch.long), values)

    def _to_device(self, tensor):
        """A host tensor on the trainer's device. On CUDA through pinned memory with a non-blocking
        copy: a copy from pageable memory waits for the whole stream, so each micro-batch's inputs
        would wait for the previous micro-batch's backward and leave the GPU idle while the host
        packs and launches the next (issue 32: the 0.5B step's device was busy 0.48 s of 0.66).
        The caching host allocator keeps the pinned block until the copy has run."""
        if self.device.type != "cuda":
            return tensor.to(self.device)
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _micro_batch_loss_full(self, batch: Sequence[TrainSequence], weights: Sequence[float]):
        """The full-logits path (``full_logits``): the model's ``[rows, width, vocabulary]`` logits,
        the completion rows gathered and cast to float32, log-softmax and entropy over them."""
        torch = self.torch
        config = self.config
        rows, width = len(batch), max(seq.length for seq in batch)
        input_ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((rows, width), dtype=torch.long)
        completion = torch.zeros((rows, width), dtype=torch.bool)
        for row, seq in enumerate(batch):
            ids = seq.prompt_ids + seq.completion_ids
            input_ids[row, :len(ids)] = torch.tensor(ids)
            attention[row, :len(ids)] = 1
            completion[row, len(seq.prompt_ids):len(ids)] = True
        values = completion_token_values(batch, weights, self.config.old_logprobs)
        device = self.device
        input_ids, attention, completion = input_ids.to(device), attention.to(device), completion.to(device)
        targets_mask = completion[:, 1:]  # logits at position t predict token t + 1
        targets = input_ids[:, 1:][targets_mask]
        output = self.output_layer if config.fp32_head else None
        with self.accelerator.autocast(), (_bypassed(output) if output is not None else contextlib.nullcontext()):
            logits = self.model(input_ids=input_ids, attention_mask=attention, use_cache=False).logits
        if output is not None:  # the head in float32, outside autocast, on the body's hidden states
            with torch.autocast(device.type, enabled=False):
                logits = torch.nn.functional.linear(logits[:, :-1][targets_mask].float(), output.weight.float(),
                                                    output.bias.float() if output.bias is not None else None)
            selected = logits
        else:
            selected = logits[:, :-1][targets_mask].float()
        if config.temperature != 1.0:
            selected = selected / config.temperature
        logprobs = selected_logprobs(selected, targets)
        kinds = (torch.float32, torch.float32, torch.float32, torch.bool, torch.float32, torch.bool)
        token_values = [torch.tensor(v, dtype=kind, device=device) for v, kind in zip(values, kinds)]
        ref = None
        if config.beta > 0:
            ref = self._reference_logprobs(input_ids, attention, targets_mask, targets)
        loss, stats, maxima = self._token_loss(logprobs, token_values, slice(None), ref)
        with torch.no_grad():
            entropy = token_entropy(selected.detach()) if config.entropy else None
            totals = self._micro_batch_totals(loss, stats, entropy, targets, batch, maxima)
        return loss, totals

    def _metrics(self, sequences, sums: dict, seconds, grad_norm, n_micro, skipped) -> dict:
        """The update's metrics from the summed statistics (:data:`SUMS`, :data:`MAXIMA`). Ratio
        ``k = π_θ/π_old`` per completion token: mean, spread, max, min, clipped share; the
        sampler–trainer gap ``|log π_trainer − log π_sampler|`` over the tokens with sampler
        log-probs (trainer: log π_old with ``old_logprobs="trainer"``, else the update's own
        forward): mean, RMS, max (None without sampler log-probs); the TIS weight's mean and
        capped share when TIS is on."""
        by_role: dict[str, list[float]] = {}
        for seq in sequences:
            by_role.setdefault(seq.role, []).append(seq.reward)
        advantages = [seq.advantage for seq in sequences]
        mean = sum(advantages) / len(advantages) if advantages else 0.0
        std = math.sqrt(sum((a - mean) ** 2 for a in advantages) / len(advantages)) if advantages else 0.0
        completion_tokens, all_tokens = sums["completion_tokens"], sums["tokens"]
        tokens = max(completion_tokens, 1.0)
        trained = not skipped
        ratio_max, ratio_min = sums["ratio_max"], -sums["ratio_min_negated"]
        if not (trained and math.isfinite(ratio_max)):  # no completion tokens were scored
            ratio_max = ratio_min = 1.0
        ratio_mean = sums["ratio"] / tokens if trained else 1.0
        gap_tokens = sums["gap_tokens"]
        gapped = trained and gap_tokens > 0
        tis = trained and self.config.tis_cap > 0 and gap_tokens > 0
        return {
            "step": self.step,
            "objective": self.config.loss,
            "loss": sums["loss"] if trained else 0.0,
            "completions": len(sequences),
            "reward_mean": {role: sum(values) / len(values) for role, values in sorted(by_role.items())},
            "advantage": {"mean": mean, "std": std, "min": min(advantages, default=0.0),
                          "max": max(advantages, default=0.0)},
            "clip_fraction": sums["clipped"] / tokens if trained else 0.0,
            "ratio_mean": ratio_mean,
            "ratio_std": math.sqrt(max(0.0, sums["ratio_sq"] / tokens - ratio_mean ** 2)) if trained else 0.0,
            "ratio_max": ratio_max,
            "ratio_min": ratio_min,
            "logprob_gap": sums["gap"] / gap_tokens if gapped else None,
            "logprob_gap_rms": math.sqrt(sums["gap_sq"] / gap_tokens) if gapped else None,
            "logprob_gap_max": sums["gap_max"] if gapped else None,
            "tis_weight_mean": sums["tis"] / gap_tokens if tis else None,
            "tis_capped_fraction": sums["tis_capped"] / gap_tokens if tis else None,
            "kl": sums["kl"] / tokens if trained and self.config.beta > 0 else None,
            "entropy": sums["entropy"] / tokens if trained and self.config.entropy else None,
            "completion_tokens": int(completion_tokens),
            "tokens": int(all_tokens),
            "tokens_per_s": all_tokens / seconds if trained and seconds > 0 else 0.0,
            "grad_norm": grad_norm,
            "learning_rate": self.config.learning_rate,
            "micro_batches": n_micro,
            "world_size": self.accelerator.num_processes,
            "seconds": seconds,
            "peak_memory_mb": peak_memory_mb(self.device),
            "skipped": skipped,
            "old_logprob_mismatches": self.old_logprob_mismatches,
        }
