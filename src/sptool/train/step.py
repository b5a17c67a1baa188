"""One policy-gradient update from JSONL training groups (Dr. GRPO, GRPO, DAPO).

TRL's GRPOTrainer samples its own rollouts and cannot take pre-computed ones, so this is sptool's
own short torch loop (``sptool train-step``):

1. each training group (``prompt``, ``completions``, ``rewards``, optional ``advantages``,
   ``old_logprobs``, ``finish_reasons``) becomes sequences ``prompt tokens + completion tokens``;
   the prompt is rendered by :func:`sptool.models.hf.render_prompt` (the function generation
   uses) and tokenized alone, the completion is tokenized after it, and EOS is appended to a
   completion that ended with a stop, so the trainer scores exactly the tokens that were sampled;
2. per-token weights from :mod:`sptool.train.losses` make the batch loss a plain sum, which is
   split into micro-batches under a token budget (gradient accumulation) and across ranks
   (DDP through ``accelerate``: the same command runs under ``accelerate launch``/``torchrun``);
3. one AdamW step (gradient clipping), then rank 0 writes the checkpoint atomically.

:class:`PolicyTrainer` is the Python API: ``trainer.update(groups)`` is one optimizer update,
callable several times in one process (the optimizer state carries over), ``trainer.save(OUT)``
writes a checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Sequence

from sptool.records import Field, InputError, RecordKind, RuntimeFailure, UsageError, describe
from sptool.train import checkpoint as ckpt
from sptool.train.losses import (OBJECTIVES, group_advantages, objective_loss, selected_logprobs,
                                 sequence_token_weights, token_entropy)

# Config attributes of models whose logits are not simply ``lm_head(hidden)`` (soft-capping,
# scaling): those keep the full-logits path.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")

# ---------------------------------------------------------------------------------------------
# Input records


def _check_prompt(value: Any) -> str | None:
    if isinstance(value, str):
        return None if value else "expected a non-empty string or a list of chat messages"
    if not value:
        return "expected a non-empty list of chat messages"
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str) \
                or not isinstance(message.get("role"), str):
            return f"expected chat messages {{role, content}}, item {i} is {describe(message)}"
    return None


def _check_stop_strings(value: list) -> str | None:
    for i, item in enumerate(value):
        if item is not None and not isinstance(item, str):
            return f"expected a string or null per completion, item {i} is {describe(item)}"
    return None


def _check_strings(value: list) -> str | None:
    if not value:
        return "expected a non-empty list of strings"
    for i, item in enumerate(value):
        if not isinstance(item, str):
            return f"expected a list of strings, item {i} is {describe(item)}"
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_numbers(value: list) -> str | None:
    for i, item in enumerate(value):
        if not _is_number(item):
            return f"expected a list of finite numbers, item {i} is {describe(item)}"
    return None


def _check_token_id_lists(value: list) -> str | None:
    for i, ids in enumerate(value):
        if not isinstance(ids, list) or not all(type(t) is int and t >= 0 for t in ids):
            return f"completion {i}: expected a list of non-negative integer token ids"
    return None


def _check_logprob_lists(value: list) -> str | None:
    for i, item in enumerate(value):
        if item is None:
            continue
        if not isinstance(item, list) or any(not _is_number(x) for x in item):
            return f"expected a list of per-token number lists (or null), item {i} is {describe(item)}"
        positive = next((x for x in item if x > 0), None)
        if positive is not None:
            return (f"expected log-probabilities (numbers <= 0), item {i} holds {positive!r} "
                    "(a probability above 1)")
    return None


class TrainingGroupKind(RecordKind):
    """A training group; besides field types, every per-completion list has one entry per completion."""

    def validate(self, record: Any) -> dict:
        record = super().validate(record)
        n = len(record["completions"])
        for name in ("rewards", "advantages", "old_logprobs", "finish_reasons"):
            value = record.get(name)
            if value is not None and len(value) != n:
                raise InputError(f"expected {n} entries (one per completion), got {len(value)}", field=name)
        for i, reason in enumerate(record.get("finish_reasons") or []):
            if reason not in ("stop", "length"):
                raise InputError(f"expected 'stop' or 'length', item {i} is {describe(reason)}",
                                 field="finish_reasons")
        return record


TRAINING_GROUP = TrainingGroupKind("training group", (
    Field("prompt", (str, list), check=_check_prompt,
          help="chat messages (or plain text for base models), exactly as generation saw them"),
    Field("completions", (list,), check=_check_strings, help="the sampled completion texts"),
    Field("rewards", (list,), check=_check_numbers, help="one reward per completion"),
    Field("role", (str,), required=False, help="solver, challenger, questioner, synthesis, validity"),
    Field("advantages", (list,), required=False, nullable=True, check=_check_numbers),
    Field("old_logprobs", (list,), required=False, nullable=True, check=_check_logprob_lists),
    Field("completion_ids", (list,), required=False, nullable=True, check=_check_token_id_lists,
          help="each completion's sampled token ids (trained as sampled, not re-tokenised)"),
    Field("finish_reasons", (list,), required=False, nullable=True,
          help="'stop' (EOS appended) or 'length' per completion; default stop"),
    Field("stop_strings", (list,), required=False, nullable=True, check=_check_stop_strings,
          help="per completion, the stop string that ended it (no EOS appended) or null"),
))


def group_role(record: dict) -> str:
    return str(record.get("role") or "policy")


# ---------------------------------------------------------------------------------------------
# Configuration


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
    full_logits: bool = False           # the previous path: [tokens × vocabulary] logits (slower, larger)
    entropy: bool = True                # report the policy's entropy (one more pass over each logit chunk)
    compile: bool | None = None         # torch.compile each decoder layer (regional); default: on CUDA
    compile_kernels: bool | None = None  # torch.compile the log-prob chunk kernels; default: on CUDA
    logit_chunk_elements: int | None = None  # rows × vocabulary per logit chunk; default by device

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
        ]
        for ok, message in checks:
            if not ok:
                raise UsageError(message)

    @property
    def objective(self):
        return OBJECTIVES.get(self.loss)


@dataclass
class TrainSequence:
    """One completion ready for the model: token ids, its advantage and (optionally) old log-probs."""

    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float
    reward: float = 0.0
    role: str = "policy"
    old_logprobs: list[float] | None = None

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


# The trainer's autocast precision on CUDA when --mixed-precision is not given (the CPU runs fp32).
# float32, chosen by measurement (benchmarks/results/precision-h200/): under bf16 autocast every
# forward rounds the float32 master weights onto the bf16 grid, where an Adam step at RL learning
# rates (1e-6..1e-5) is mostly invisible (2% of the tiny model's weights change their bf16 value
# after one step at lr 1e-5, 16% after ten), so the policy a bf16 forward computes lags the one
# being trained. "bf16" stays available (train.mixed_precision, --mixed-precision): faster, and
# right for supervised learning rates.
DEFAULT_MIXED_PRECISION = "no"
MIXED_PRECISIONS = ("no", "bf16", "fp16")


def resolve_mixed_precision(requested: str | None, *, cuda: bool) -> str:
    """The autocast precision of the trainer's forwards: ``requested`` ("no", "bf16", "fp16"; None
    or "auto": :data:`DEFAULT_MIXED_PRECISION` on CUDA, "no" elsewhere)."""
    if requested in (None, "", "auto"):
        return DEFAULT_MIXED_PRECISION if cuda else "no"
    if requested not in MIXED_PRECISIONS:
        raise UsageError(f"--mixed-precision must be one of auto, {', '.join(MIXED_PRECISIONS)}, got '{requested}'")
    return requested


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


def _identity(hidden):
    return hidden


@contextlib.contextmanager
def _bypassed(head):
    """Inside, ``head`` returns its input: the model's ``.logits`` are its last hidden states."""
    head.forward = _identity
    try:
        yield
    finally:
        del head.forward


def _compile_decoder_layers(model, log: Callable[[str], None]) -> list:
    """``torch.compile`` each decoder layer in place (regional compilation: the layers share one
    compiled graph, so compiling costs one layer's time; module names and checkpoints unchanged).
    Returns the compiled layers (:func:`_uncompile` undoes it)."""
    layers = None
    for module in model.modules():
        if module.__class__.__name__.endswith("DecoderLayer"):
            layers = layers or []
            layers.append(module)
    if not layers:
        log("note: --compile found no decoder layers to compile; running eagerly")
        return []
    for layer in layers:
        layer.compile()
    return layers


def _uncompile(layers) -> None:
    for layer in layers:
        layer._compiled_call_impl = None  # what nn.Module.compile set


def peak_memory_mb(device) -> float:
    import torch

    if getattr(device, "type", str(device)).startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# ---------------------------------------------------------------------------------------------
# The trainer


class PolicyTrainer:
    """Holds the policy, its optimizer, an optional frozen reference and the accelerator.

    ``PolicyTrainer(config)`` loads ``config.model`` (``tiny``, an HF directory, a LoRA adapter
    directory, or a previous ``train-step`` output whose optimizer state and step it resumes).
    Tests and benchmarks may pass a ready ``model`` (and ``tokenizer``) instead.
    """

    def __init__(self, config: TrainConfig, *, model=None, tokenizer=None, log: Callable[[str], None] | None = None):
        import torch
        from accelerate import Accelerator

        self.config = config
        self.log = log or (lambda message: None)
        self.torch = torch
        cpu = (config.device or "").startswith("cpu") or not torch.cuda.is_available()
        if (config.device or "").startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeFailure(f"--device {config.device} asked for, but torch sees no CUDA GPU")
        mixed = resolve_mixed_precision(config.mixed_precision, cuda=not cpu)
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
        self.pad_id = self._pad_id(model)
        self.ref_model = self._load_reference(model) if config.beta > 0 and not self.is_lora else None
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise RuntimeFailure("the model has no trainable parameters")
        optimizer = torch.optim.AdamW(params, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2),
                                      eps=config.adam_epsilon, weight_decay=config.weight_decay)
        self._restore_optimizer(optimizer, len(params))
        self.params = params
        self.warned_normaliser = False
        cuda = self.device.type == "cuda"
        compile_kernels = True if config.compile_kernels is None else config.compile_kernels
        self.kernels_compiled = bool(compile_kernels) and cuda
        # the first micro-batch through compiled layers is tried once; a failure falls back to eager
        self.compiled_layers = _compile_decoder_layers(model, log=self.log) \
            if (cuda if config.compile is None else config.compile) else []
        self.compile_proven = not self.compiled_layers
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        _drop_forward_autocast(self.accelerator.unwrap_model(self.model))
        self.head = None if config.full_logits else self._bypassable_head(model)
        self.ref_head = self._bypassable_head(self.ref_model) if self.head is not None and self.ref_model is not None \
            else None
        self.compute_dtype = torch.bfloat16 if self.accelerator.mixed_precision == "bf16" else None

    # -- loading ---------------------------------------------------------------------------

    def _load_policy(self):
        import transformers
        from transformers import AutoModelForCausalLM

        from sptool.models.hf import load_tokenizer
        from sptool.models.resolve import resolve_model

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
        config = self.config
        path = resolve_model(config.model, log=self.log)
        if os.path.isdir(path):
            path = os.path.abspath(path)
            self.state = ckpt.read_state(path) or {}
        self.step = int(self.state.get("step", 0))
        self.roles_trained = set(self.state.get("roles", []))
        adapter = os.path.isfile(os.path.join(path, "adapter_config.json"))
        dtype = self.torch.float32  # master weights in fp32: small updates are not rounded away
        try:
            tokenizer = load_tokenizer(path)
            if adapter:
                from peft import PeftConfig, PeftModel

                base_path = PeftConfig.from_pretrained(path).base_model_name_or_path
                base = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype)
                model = PeftModel.from_pretrained(base, path, is_trainable=True)
                self.base_model = base_path
                if config.lora_r and config.lora_r != model.peft_config["default"].r:
                    self.log(f"note: {config.model} is a LoRA adapter of rank "
                             f"{model.peft_config['default'].r}; --lora-r {config.lora_r} ignored")
            else:
                model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
                self.base_model = path
                if config.lora_r:
                    from peft import LoraConfig, get_peft_model

                    targets = config.lora_target_modules
                    lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha or 2 * config.lora_r,
                                      lora_dropout=config.lora_dropout, task_type="CAUSAL_LM",
                                      target_modules=targets[0] if targets == ["all-linear"] else targets)
                    model = get_peft_model(model, lora)
        except ImportError as exc:
            raise RuntimeFailure(f"LoRA needs peft: pip install 'sptool[train]' ({exc})") from None
        except (OSError, ValueError) as exc:
            from sptool.models.resolve import load_failure

            raise load_failure(config.model, exc) from None
        self.base_model = self.state.get("base_model", self.base_model)
        return model, tokenizer

    def _load_reference(self, policy):
        """The frozen reference for the KL term: ``--ref-model``, else the reference recorded in the
        input checkpoint, else the input model itself (the first step of a run)."""
        from transformers import AutoModelForCausalLM

        from sptool.models.resolve import resolve_model

        source = self.config.ref_model or self.state.get("reference_model")
        if source is None:
            source = self.base_model if self.base_model and self.base_model != "<in-memory>" else None
        if source is None:  # in-memory model: copy it
            import copy

            reference = copy.deepcopy(policy)
            self.reference_model = "<in-memory copy>"
        else:
            path = resolve_model(source, log=self.log)
            path = os.path.abspath(path) if os.path.isdir(path) else path
            try:
                reference = AutoModelForCausalLM.from_pretrained(path, dtype=self.torch.float32)
            except OSError as exc:
                raise RuntimeFailure(f"cannot load reference model '{source}': {str(exc).splitlines()[0]}") from None
            self.reference_model = path
        reference.eval().requires_grad_(False)
        return reference.to(self.device)

    def _restore_optimizer(self, optimizer, n_params: int) -> None:
        if self.config.model is None or not os.path.isdir(str(self.config.model)):
            return
        saved = ckpt.load_optimizer_state(self.config.model)
        if saved is None:
            return
        kind = "lora" if self.is_lora else "full"
        saved_params = sum(len(group["params"]) for group in saved.get("param_groups", []))
        if self.state.get("trainable") != kind or saved_params != n_params:
            self.log(f"note: optimizer state in {self.config.model} does not match this model "
                     f"({self.state.get('trainable')}, {saved_params} tensors); starting a fresh optimizer")
            return
        optimizer.load_state_dict(saved)
        for group in optimizer.param_groups:  # this invocation's hyperparameters win
            group.update(lr=self.config.learning_rate, weight_decay=self.config.weight_decay,
                         betas=(self.config.adam_beta1, self.config.adam_beta2), eps=self.config.adam_epsilon)

    def _pad_id(self, model) -> int:
        if self.tokenizer is not None and self.tokenizer.pad_token_id is not None:
            return int(self.tokenizer.pad_token_id)
        return int(getattr(model.config, "pad_token_id", None) or 0)

    def _give_up_compile(self, exc: Exception) -> None:
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        self.log(f"note: the compiled decoder layers failed on their first step ({type(exc).__name__}: "
                 f"{first}); running them eagerly (--no-compile)")
        _uncompile(self.compiled_layers)
        self.compiled_layers = []
        self.compile_proven = True
        self.optimizer.zero_grad(set_to_none=True)

    def _bypassable_head(self, model):
        """The model's output layer when the chunked log-prob path applies to it (a plain
        ``nn.Linear`` head whose output is the logits, no FSDP/DeepSpeed sharding), else None."""
        torch = self.torch
        distributed = str(getattr(self.accelerator, "distributed_type", ""))
        if any(name in distributed for name in ("FSDP", "DEEPSPEED", "MEGATRON", "XLA")):
            return None
        try:
            head = model.get_output_embeddings()
        except (AttributeError, NotImplementedError):
            return None
        config = getattr(model, "config", None)
        if type(head) is not torch.nn.Linear or "forward" in vars(head) or hasattr(head, "_hf_hook") \
                or any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS):
            return None
        return head

    def eos_id(self) -> int | None:
        return self.tokenizer.eos_token_id if self.tokenizer is not None else None

    # -- encoding --------------------------------------------------------------------------

    def encode_group(self, group: dict) -> list[TrainSequence]:
        """Token sequences of one group: rendered prompt, then each completion (+ EOS on stop);
        a completion whose sampled token ids came with it (``completion_ids``) is trained as those.

        A prompt that ends with an assistant message (a response prefix) renders with the prefix,
        so a completion that begins with the prefix (the text parsing saw) is trained without it:
        the prefix tokens are prompt, not sampled. A completion that ended at a stop string
        (``stop_strings``) gets no EOS: the sampler did not emit one.
        """
        from sptool.models.base import split_response_prefix
        from sptool.models.hf import render_prompt

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
        sampled = group.get("completion_ids") or [None] * len(group["completions"])
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
                sequences.append(TrainSequence(prompt_ids, list(own), float(advantages[i]), rewards[i], role, old_i))
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
            sequences.append(TrainSequence(prompt_ids, ids, float(advantages[i]), rewards[i], role, old_i))
        return sequences

    # -- the update ------------------------------------------------------------------------

    def update(self, groups: Sequence[dict]) -> dict:
        """One optimizer update over ``groups`` (all of them: one step). Returns the metrics."""
        sequences = [seq for group in groups for seq in self.encode_group(group)]
        for group in groups:
            self.roles_trained.add(group_role(group))
        metrics = self.update_sequences(sequences)
        metrics["groups"] = len(groups)
        return metrics

    def update_sequences(self, sequences: Sequence[TrainSequence]) -> dict:
        """One optimizer update over already tokenized sequences (the global batch)."""
        torch = self.torch
        config = self.config
        accelerator = self.accelerator
        start = time.perf_counter()
        world, rank = accelerator.num_processes, accelerator.process_index
        lengths = [len(seq.completion_ids) for seq in sequences]
        if config.objective.aggregation == "global_constant" and config.max_completion_tokens is None \
                and not self.warned_normaliser and sequences:
            self.warned_normaliser = True
            self.log(f"note: --loss {config.loss} normalises by N·L with L the generation budget; without "
                     f"--max-completion-tokens the longest completion of each batch stands in ({max(lengths)})")
        weights = sequence_token_weights(lengths, config.objective.aggregation, config.max_completion_tokens)
        nothing_to_learn = not sequences or (config.beta == 0 and all(seq.advantage == 0 for seq in sequences))
        # sums over this rank: loss, clipped tokens, kl, entropy, ratio, completion tokens, all tokens
        totals = torch.zeros(7, dtype=torch.float64, device=self.device)
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
                    totals += stats
            n_micro = len(plan)
            if config.max_grad_norm and config.max_grad_norm > 0:
                grad_norm = float(accelerator.clip_grad_norm_(self.params, config.max_grad_norm))
            else:
                grad_norm = float(torch.norm(torch.stack([p.grad.norm() for p in self.params if p.grad is not None])))
            if not math.isfinite(grad_norm):
                self.optimizer.zero_grad(set_to_none=True)
                raise RuntimeFailure(f"non-finite gradient norm ({grad_norm}) at step {self.step + 1}; "
                                     "no update written (lower --learning-rate or check the rewards)")
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        totals = accelerator.reduce(totals, reduction="sum") if world > 1 else totals
        self.step += 1
        seconds = time.perf_counter() - start
        loss_sum, clipped, kl_sum, entropy_sum, ratio_sum, completion_tokens, all_tokens = totals.tolist()
        if nothing_to_learn:
            completion_tokens = float(sum(lengths))
            all_tokens = float(sum(seq.length for seq in sequences))
        return self._metrics(sequences, loss_sum, clipped, kl_sum, entropy_sum, ratio_sum, completion_tokens,
                             all_tokens, seconds, grad_norm, n_micro, nothing_to_learn)

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
        with self.accelerator.autocast(), _bypassed(self.head):
            hidden = self.model(input_ids=input_ids, use_cache=False).logits
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)
        ref = self._reference_logprobs(input_ids, None, None, targets, positions) if config.beta > 0 else None
        advantages, token_weights, old_values, has_old = token_values
        zero = torch.zeros((), dtype=torch.float64, device=device)

        def token_loss(logprobs, start: int, end: int):
            old = torch.where(has_old[start:end], old_values[start:end], logprobs.detach())
            loss, _, kl, clipped = objective_loss(
                logprobs, old, ref[start:end] if ref is not None else None, advantages[start:end],
                token_weights[start:end], clip_low=config.clip_low, clip_high=config.clip_high, beta=config.beta)
            with torch.no_grad():
                stats = torch.stack([clipped.sum().double(), kl.sum().double() if kl is not None else zero,
                                     torch.exp(logprobs.detach() - old).sum().double()])
            return loss, stats

        loss, _, entropy, stats = fused_policy_loss(
            hidden, self.head.weight, self.head.bias, targets, token_loss, temperature=config.temperature,
            chunk_rows=self._chunk_rows(), compute_dtype=self.compute_dtype, entropy=config.entropy,
            compiled=self.kernels_compiled)
        if stats is None:  # no completion tokens in this micro-batch
            stats = torch.zeros(3, dtype=torch.float64, device=device)
        totals = torch.stack([
            loss.detach().double(), stats[0], stats[1],
            entropy.sum().double() if entropy is not None else zero, stats[2],
            torch.tensor(float(targets.numel()), dtype=torch.float64, device=device),
            torch.tensor(float(sum(seq.length for seq in batch)), dtype=torch.float64, device=device),
        ])
        return loss, totals

    def _chunk_rows(self) -> int:
        from sptool.train.logprobs import chunk_rows_for

        return chunk_rows_for(self.head.weight.shape[0], self.device.type, self.config.logit_chunk_elements)

    def _pack(self, batch: Sequence[TrainSequence], weights: Sequence[float]):
        """Right-padded ``input_ids`` ``[rows, width]``; the flat positions (row · width + t) whose
        hidden state predicts a completion token, and those tokens; per-completion-token tensors
        (advantage, weight, old log-prob, has-old). Built on the host, then moved: no device sync."""
        torch = self.torch
        rows, width = len(batch), max(seq.length for seq in batch)
        input_ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        positions: list[int] = []
        targets: list[int] = []
        advantages, token_weights, old_values, has_old = [], [], [], []
        for row, seq in enumerate(batch):
            ids = seq.prompt_ids + seq.completion_ids
            input_ids[row, :len(ids)] = torch.tensor(ids)
            start = row * width + len(seq.prompt_ids) - 1  # position t predicts token t + 1
            positions += range(start, start + len(seq.completion_ids))
            targets += seq.completion_ids
            n = len(seq.completion_ids)
            advantages += [seq.advantage] * n
            token_weights += [weights[row]] * n
            old_values += seq.old_logprobs if seq.old_logprobs is not None else [0.0] * n
            has_old += [seq.old_logprobs is not None] * n
        device = self.device
        as_tensor = lambda values, dtype=torch.float32: torch.tensor(values, dtype=dtype, device=device)  # noqa: E731
        values = (as_tensor(advantages), as_tensor(token_weights), as_tensor(old_values), as_tensor(has_old, torch.bool))
        return (input_ids.to(device), as_tensor(positions, torch.long), as_tensor(targets, torch.long), values)

    def _micro_batch_loss_full(self, batch: Sequence[TrainSequence], weights: Sequence[float]):
        """The previous path (``full_logits``): the model's ``[rows, width, vocabulary]`` logits,
        the completion rows gathered and cast to float32, log-softmax and entropy over them."""
        torch = self.torch
        config = self.config
        rows, width = len(batch), max(seq.length for seq in batch)
        input_ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((rows, width), dtype=torch.long)
        completion = torch.zeros((rows, width), dtype=torch.bool)
        advantages, token_weights, old_values, has_old = [], [], [], []
        for row, seq in enumerate(batch):
            ids = seq.prompt_ids + seq.completion_ids
            input_ids[row, :len(ids)] = torch.tensor(ids)
            attention[row, :len(ids)] = 1
            completion[row, len(seq.prompt_ids):len(ids)] = True
            n = len(seq.completion_ids)
            advantages += [seq.advantage] * n
            token_weights += [weights[row]] * n
            old_values += seq.old_logprobs if seq.old_logprobs is not None else [0.0] * n
            has_old += [seq.old_logprobs is not None] * n
        device = self.device
        input_ids, attention, completion = input_ids.to(device), attention.to(device), completion.to(device)
        targets_mask = completion[:, 1:]  # logits at position t predict token t + 1
        targets = input_ids[:, 1:][targets_mask]
        with self.accelerator.autocast():
            logits = self.model(input_ids=input_ids, attention_mask=attention, use_cache=False).logits
        selected = logits[:, :-1][targets_mask].float()
        if config.temperature != 1.0:
            selected = selected / config.temperature
        logprobs = selected_logprobs(selected, targets)
        as_tensor = lambda values, dtype=torch.float32: torch.tensor(values, dtype=dtype, device=device)  # noqa: E731
        old = torch.where(as_tensor(has_old, torch.bool), as_tensor(old_values), logprobs.detach())
        ref = None
        if config.beta > 0:
            ref = self._reference_logprobs(input_ids, attention, targets_mask, targets)
        loss, _, kl, clipped = objective_loss(
            logprobs, old, ref, as_tensor(advantages), as_tensor(token_weights),
            clip_low=config.clip_low, clip_high=config.clip_high, beta=config.beta)
        with torch.no_grad():
            entropy = token_entropy(selected.detach()) if config.entropy else torch.zeros(1, device=device)
            stats = torch.stack([
                loss.detach().double(), clipped.sum().double(),
                kl.sum().double() if kl is not None else torch.zeros((), dtype=torch.float64, device=device),
                entropy.sum().double(), torch.exp(logprobs.detach() - old).sum().double(),
                torch.tensor(float(targets.numel()), dtype=torch.float64, device=device),
                attention.sum().double(),
            ])
        return loss, stats

    def _reference_logprobs(self, input_ids, attention, targets_mask, targets, positions=None):
        """log π_ref of the targets: from the hidden states at ``positions`` through the chunked
        path (no attention mask: right padding) when given and the head allows, else from full
        logits at ``targets_mask``."""
        torch = self.torch
        if positions is not None and (self.is_lora or self.ref_head is not None):
            from sptool.train.logprobs import chunked_selected_logprobs

            with torch.no_grad():
                if self.is_lora:
                    policy, head = self.accelerator.unwrap_model(self.model), self.head
                    with policy.disable_adapter(), self.accelerator.autocast(), _bypassed(head):
                        hidden = policy(input_ids=input_ids, use_cache=False).logits
                else:
                    head = self.ref_head
                    with self.accelerator.autocast(), _bypassed(head):
                        hidden = self.ref_model(input_ids=input_ids, use_cache=False).logits
                logprobs, _ = chunked_selected_logprobs(
                    hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions), head.weight, head.bias, targets,
                    temperature=self.config.temperature, chunk_rows=self._chunk_rows(),
                    compute_dtype=self.compute_dtype, compiled=self.kernels_compiled)
                return logprobs
        with torch.no_grad():
            if self.is_lora:
                policy = self.accelerator.unwrap_model(self.model)
                with policy.disable_adapter(), self.accelerator.autocast():
                    logits = policy(input_ids=input_ids, attention_mask=attention, use_cache=False).logits
            else:
                with self.accelerator.autocast():
                    logits = self.ref_model(input_ids=input_ids, attention_mask=attention, use_cache=False).logits
            selected = logits[:, :-1][targets_mask].float()
            if self.config.temperature != 1.0:
                selected = selected / self.config.temperature
            return selected_logprobs(selected, targets)

    def fill_old_logprobs(self, groups: Sequence[dict]) -> int:
        """Give every completion of ``groups`` without sampling log-probabilities (a backend that
        does not return them, a two-phase reply with forced text between its phases) its
        per-token log π under the current policy, in place (``old_logprobs``). Called before a
        rollout's first update, while the current policy is the one that sampled the rollout, so
        its later updates have a behaviour ratio (otherwise they fall back to ratio 1). Returns
        how many completions were filled. Every rank computes every group (the same forwards on
        each, as sharded models need)."""
        todo: list[tuple[dict, list, list[int]]] = []
        sequences: list[TrainSequence] = []
        mismatches = self.old_logprob_mismatches
        for group in groups:
            old = list(group.get("old_logprobs") or [None] * len(group["completions"]))
            missing = [i for i, values in enumerate(old) if values is None]
            if missing:
                encoded = self.encode_group(group)
                todo.append((group, old, missing))
                sequences += [encoded[i] for i in missing]
        self.old_logprob_mismatches = mismatches  # counted once, by the update itself
        if not sequences:
            return 0
        values = iter(self.logprobs(sequences))
        for group, old, missing in todo:
            for i in missing:
                old[i] = next(values)
            group["old_logprobs"] = old
        return len(sequences)

    def logprobs(self, sequences: Sequence[TrainSequence]) -> list[list[float]]:
        """Per-token log-probs of each sequence's completion under the current policy (no
        gradient; e.g. behaviour log-probs for a sampler that did not record them), through the
        same chunked path as the update (the full-logits path with ``full_logits``)."""
        torch = self.torch
        config = self.config
        out: list[list[float]] = [[] for _ in sequences]
        plan = plan_micro_batches([seq.length for seq in sequences], config.max_tokens_per_micro_batch)
        training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for micro in plan:
                    batch = [sequences[i] for i in micro]
                    input_ids, positions, targets, _ = self._pack(batch, [0.0] * len(batch))
                    if self.head is not None:
                        from sptool.train.logprobs import chunked_selected_logprobs

                        with self.accelerator.autocast(), _bypassed(self.head):
                            hidden = self.model(input_ids=input_ids, use_cache=False).logits
                        values, _ = chunked_selected_logprobs(
                            hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions), self.head.weight,
                            self.head.bias, targets,
                            temperature=config.temperature, chunk_rows=self._chunk_rows(),
                            compute_dtype=self.compute_dtype, compiled=self.kernels_compiled)
                    else:
                        with self.accelerator.autocast():
                            logits = self.model(input_ids=input_ids, use_cache=False).logits
                        selected = logits.reshape(-1, logits.shape[-1]).index_select(0, positions).float() \
                            / config.temperature
                        values = selected_logprobs(selected, targets)
                    values = values.tolist()
                    for i in micro:
                        n = len(sequences[i].completion_ids)
                        out[i], values = values[:n], values[n:]
        finally:
            self.model.train(training)
        return out

    def _metrics(self, sequences, loss_sum, clipped, kl_sum, entropy_sum, ratio_sum, completion_tokens,
                 all_tokens, seconds, grad_norm, n_micro, skipped) -> dict:
        by_role: dict[str, list[float]] = {}
        for seq in sequences:
            by_role.setdefault(seq.role, []).append(seq.reward)
        advantages = [seq.advantage for seq in sequences]
        mean = sum(advantages) / len(advantages) if advantages else 0.0
        std = math.sqrt(sum((a - mean) ** 2 for a in advantages) / len(advantages)) if advantages else 0.0
        tokens = max(completion_tokens, 1.0)
        trained = not skipped
        return {
            "step": self.step,
            "objective": self.config.loss,
            "loss": loss_sum if trained else 0.0,
            "completions": len(sequences),
            "reward_mean": {role: sum(values) / len(values) for role, values in sorted(by_role.items())},
            "advantage": {"mean": mean, "std": std, "min": min(advantages, default=0.0),
                          "max": max(advantages, default=0.0)},
            "clip_fraction": clipped / tokens if trained else 0.0,
            "ratio_mean": ratio_sum / tokens if trained else 1.0,
            "kl": kl_sum / tokens if trained and self.config.beta > 0 else None,
            "entropy": entropy_sum / tokens if trained and self.config.entropy else None,
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

    # -- saving ----------------------------------------------------------------------------

    def checkpoint_state(self) -> dict:
        config = asdict(self.config)
        return {
            "step": self.step,
            "roles": sorted(self.roles_trained),
            "trainable": "lora" if self.is_lora else "full",
            "base_model": self.base_model,
            "reference_model": self.reference_model or self.state.get("reference_model") or self.base_model,
            "parent": self.config.model,
            "config": config,
        }

    def non_finite_parameters(self) -> list[str]:
        """Names of trainable parameters holding NaN or infinite values (none after a sane update)."""
        torch = self.torch
        policy = self.accelerator.unwrap_model(self.model)
        with torch.no_grad():
            return [name for name, param in policy.named_parameters()
                    if param.requires_grad and not bool(torch.isfinite(param).all())]

    def save(self, output: str | os.PathLike) -> None:
        """Rank 0 writes the checkpoint atomically; other ranks wait for it. Weights that are
        not finite are never written (the input checkpoint stays the latest good one). Under FSDP
        every rank takes part in gathering the full weights, which rank 0 saves in the ordinary HF
        format (the sharded optimizer state is not saved: a resumed FSDP run starts a fresh optimizer)."""
        accelerator = self.accelerator
        broken = self.non_finite_parameters()
        if broken:
            more = f" and {len(broken) - 3} more" if len(broken) > 3 else ""
            raise RuntimeFailure(f"the update made weights non-finite (NaN/inf in {', '.join(broken[:3])}{more}); "
                                 f"checkpoint {output} not written (lower --learning-rate or check the rewards)")
        accelerator.wait_for_everyone()
        full_state = None
        fsdp = str(accelerator.distributed_type).endswith("FSDP")
        if fsdp:
            full_state = accelerator.get_state_dict(self.model)  # collective: full weights at rank 0
        if accelerator.is_main_process:
            import transformers

            transformers.utils.logging.disable_progress_bar()
            policy = accelerator.unwrap_model(self.model)

            def save_model(directory: str) -> None:
                policy.save_pretrained(directory, safe_serialization=True, state_dict=full_state)
                if self.tokenizer is not None:
                    self.tokenizer.save_pretrained(directory)

            ckpt.save_checkpoint(output, save_model=save_model,
                                 optimizer_state=None if fsdp else self.optimizer.state_dict(),
                                 state=self.checkpoint_state())
        accelerator.wait_for_everyone()

    @property
    def is_main_process(self) -> bool:
        return self.accelerator.is_main_process


def split_updates(groups: list[dict], groups_per_update: int | None) -> list[list[dict]]:
    """All groups in one update (default), or consecutive chunks of ``groups_per_update`` groups."""
    if not groups_per_update or groups_per_update >= len(groups):
        return [groups]
    return [groups[i:i + groups_per_update] for i in range(0, len(groups), groups_per_update)]


def select_roles(groups: Iterable[dict], roles: list[str] | None, on_skip: Callable[[dict], None]) -> list[dict]:
    selected = []
    for group in groups:
        if roles and group_role(group) not in roles:
            on_skip(group)
            continue
        selected.append(group)
    return selected
