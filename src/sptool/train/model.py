"""The policy's model besides the update: loading (LoRA, regional compile, LM-head bypass), the KL reference,
log-probabilities of sampled completions, the optimizer state and atomic saving."""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict
from typing import Callable, Sequence

from sptool.core.records import RuntimeFailure
from sptool.train import checkpoint as ckpt
from sptool.train.losses import selected_logprobs
from sptool.train.config import TrainSequence, plan_micro_batches


_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


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


def _no_packed_sequences(position_ids):
    return None


@contextlib.contextmanager
def _one_sequence_a_row():
    """Inside, transformers' mask code takes each row of a forward as one sequence. Given no
    attention mask and no cache it looks for sequences packed into a row (position ids that
    restart), and its ``.all()`` waits for the GPU before every forward: 4 of the 7 host syncs left
    in a 0.5B train step (issue 32). The trainer puts one right-padded sequence in each row, so the
    check's answer is always "none", which is what this gives without asking the GPU."""
    try:
        from transformers import masking_utils
    except ImportError:  # an older transformers: no such check
        masking_utils = None
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = _no_packed_sequences
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


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


#: torch's caching-allocator counters an update reports the change of: ``alloc_retries`` (a request
#: the cached blocks could not serve: the allocator synchronised the device, released its cached
#: blocks and called ``cudaMalloc`` again) and ``device_mallocs`` / ``device_frees`` (calls of
#: ``cudaMalloc`` / ``cudaFree``; each ``cudaFree`` synchronises the device).
ALLOCATOR_COUNTERS = {"alloc_retries": "num_alloc_retries", "device_mallocs": "num_device_alloc",
                      "device_frees": "num_device_free"}


def cuda_allocator_counts(device) -> dict[str, int] | None:
    """The caching allocator's event counts on a CUDA ``device`` so far (:data:`ALLOCATOR_COUNTERS`);
    None elsewhere. Host-side counters: reading them waits for nothing."""
    if not getattr(device, "type", str(device)).startswith("cuda"):
        return None
    import torch

    stats = torch.cuda.memory_stats(device)
    return {name: int(stats.get(key, 0)) for name, key in ALLOCATOR_COUNTERS.items()}


def allocator_events(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int | None]:
    """What the allocator did between two :func:`cuda_allocator_counts`: each counter's change, None
    off CUDA. An update that paid for ``cudaMalloc``/``cudaFree`` or a retry shows it here (the
    captured step decoder's graph pools hold memory beside the trainer's; issue 33)."""
    if before is None or after is None:
        return {name: None for name in ALLOCATOR_COUNTERS}
    return {name: after[name] - before[name] for name in ALLOCATOR_COUNTERS}


class PolicyModel:
    """What :class:`~sptool.train.step.PolicyTrainer` does with its model besides the update:
    loading the policy and the KL reference (LoRA, compile, head bypass), log-probabilities,
    the optimizer state and saving. Its attributes are set by ``PolicyTrainer.__init__``."""

    def _load_policy(self):
        import transformers
        from transformers import AutoModelForCausalLM

        from sptool.models.tokenizer import load_tokenizer
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
        if not self.config.restore_optimizer:
            if ckpt.optimizer_state_file(self.config.model).is_file():
                self.log(f"note: a fresh optimizer; the AdamW state saved in {self.config.model} is not restored")
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

    def _chunk_rows(self) -> int:
        from sptool.train.logprobs import chunk_rows_for

        return chunk_rows_for(self.head.weight.shape[0], self.device.type, self.config.logit_chunk_elements)

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
                    with policy.disable_adapter(), self.accelerator.autocast(), _bypassed(head), \
                            _one_sequence_a_row():
                        hidden = policy(input_ids=input_ids, use_cache=False).logits
                else:
                    head = self.ref_head
                    with self.accelerator.autocast(), _bypassed(head), _one_sequence_a_row():
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
        each, as sharded models need).

        With ``old_logprobs="trainer"`` every completion is scored, into ``trainer_logprobs`` (the
        sampler's ``old_logprobs`` stay, for the gap metric and TIS): log π_old is then the
        trainer's own, in its own precision, for every update from the rollout."""
        todo: list[tuple[dict, list, list[int]]] = []
        sequences: list[TrainSequence] = []
        mismatches = self.old_logprob_mismatches
        key = "trainer_logprobs" if self.config.old_logprobs == "trainer" else "old_logprobs"
        for group in groups:
            old = list(group.get(key) or [None] * len(group["completions"]))
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
            group[key] = old
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

                        with self.accelerator.autocast(), _bypassed(self.head), _one_sequence_a_row():
                            hidden = self.model(input_ids=input_ids, use_cache=False).logits
                        values, _ = chunked_selected_logprobs(
                            hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions), self.head.weight,
                            self.head.bias, targets,
                            temperature=config.temperature, chunk_rows=self._chunk_rows(),
                            compute_dtype=self.compute_dtype, compiled=self.kernels_compiled,
                            rounding=getattr(self, "weight_rounding", "nearest"))
                    else:
                        with self.accelerator.autocast(), _one_sequence_a_row():
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
