"""The ``hf`` backend: batched sampling with transformers' ``generate`` (left padding, KV cache).

Runs on CPU or GPU. Deterministic under a seed for the same prompts, ``n`` and batch size: the
torch generator is re-seeded from ``(seed, batch index)`` before every batch.

Two decoding paths, both transformers' own ``generate``:

- **eager** (the default on CPU): a dynamic KV cache, every step run op by op;
- **static** (``static_cache``; with ``compile`` on CUDA: ``sptool run``'s default there): a
  pre-allocated :class:`transformers.StaticCache` and, with ``compile``, the decoding step
  through ``torch.compile`` in ``reduce-overhead`` mode (CUDA graphs: one launch per step).
  Shapes are bucketed so that a run records a few graphs, not one per call: a batch's rows are
  padded to a power of two (at most ``batch_size``; the padding rows are finished from the first
  step, so they never keep a call running) and the cache length to a multiple of 64
  (:mod:`sptool.models.hf_decoding`). One cache per bucket is kept between calls
  (reset, not reallocated: CUDA graphs read fixed addresses); the model's parameters are read
  in place, so the compiled step sees every optimizer update of a shared trainer's weights.

With ``decoder="step"`` (``model.decoder``; issue 33) a batch goes through
:mod:`sptool.models.step_decoder` instead: one prefill per distinct prompt, then a sampling step
with no host synchronisation (compiled whole with ``compile``); a model it can't run falls back
to ``generate`` with one logged line.

Sampling log-probabilities are gathered step by step (one step's logits held at a time, not
``output_logits``' batch x steps x vocabulary).
"""

from __future__ import annotations

import os
from typing import Any

from sptool.models.base import Prompt, Sample, SamplingParams, cut_at_stop, split_response_prefix, token_listener
from sptool.models.hf_decoding import (FinishedRows, LogprobRecorder, TokenProgress, bucket_length, bucket_rows,
                                       packed_split_weights, regional_compile_off)
from sptool.models.resolve import resolve_model
from sptool.models.step_decoder import STEP_GRAPHS
from sptool.models.tokenizer import PromptEncoder, TextDecoder, load_tokenizer, render_prompt, render_prompts
from sptool.core.records import RuntimeFailure, UsageError, first_line

MAX_CACHES = 4          # static caches kept between calls (least recently used dropped first)
CACHE_HEADROOM = 1.25   # a new static cache is made when the device can hold this many times its bytes
DECODERS = ("generate", "step")
#: attention while decoding: the model's own, or sptool's grouped one-position attention
#: (:mod:`sptool.models.decode_attention`; prefill and training keep SDPA)
DECODE_ATTENTIONS = ("model", "grouped")


def pick_device(device: str | None) -> str:
    import torch

    if device in (None, "", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeFailure(f"--device {device} asked for, but torch sees no CUDA GPU")
    return device


def pick_dtype(dtype: str | None, device: str):
    import torch

    if dtype in (None, "", "auto"):
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
             "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
    if dtype not in table:
        raise UsageError(f"unknown --dtype '{dtype}'; choose from auto, {', '.join(table)}")
    return table[dtype]


# The precision a generator that shares the trainer's float32 policy samples in, when model.dtype
# is not given: float32 (measured on the tiny model: sampling under bf16 autocast made RLVR learn
# several times slower than the float32 sampler; see benchmarks/results/precision-h200/).
DEFAULT_SHARED_SAMPLER_DTYPE = "fp32"


def shared_sampler_autocast(dtype: str | None, device: str):
    """The autocast dtype (None: the weights' own float32) for sampling from a trainer's policy."""
    import torch

    name = DEFAULT_SHARED_SAMPLER_DTYPE if dtype in (None, "", "auto") else dtype
    chosen = pick_dtype(name, device)
    return None if chosen == torch.float32 else chosen


class HFBackend:
    """Generation with a transformers causal LM (a hub id, a local directory, or ``tiny``)."""

    name = "hf"

    def __init__(self, model: str = "tiny", *, device: str | None = None, dtype: str | None = None,
                 batch_size: int = 64, chat_template: bool = True, static_cache: bool = False,
                 compile: bool = False, decoder: str = "generate", decode_attention: str = "model",
                 step_graph: str = "compile", log=None, **_: Any):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()

        path = resolve_model(model, log=log)
        device = pick_device(device)
        torch_dtype = pick_dtype(dtype, device)
        try:
            tokenizer = load_tokenizer(path)
            if os.path.isfile(os.path.join(path, "adapter_config.json")):
                from peft import AutoPeftModelForCausalLM

                model_obj = AutoPeftModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
                model_obj = model_obj.merge_and_unload()
            else:
                model_obj = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
        except OSError as exc:
            from sptool.models.resolve import load_failure

            raise load_failure(model, exc) from None
        self._attach(model_obj.to(device).eval(), tokenizer, model_id=model, path=path, device=device,
                     batch_size=batch_size, chat_template=chat_template, static_cache=static_cache,
                     compile=compile, decoder=decoder, decode_attention=decode_attention, step_graph=step_graph,
                     log=log)

    @classmethod
    def from_model(cls, model, tokenizer=None, *, model_id: str, batch_size: int = 64,
                   chat_template: bool = True, static_cache: bool = False, compile: bool = False,
                   decoder: str = "generate", decode_attention: str = "model", step_graph: str = "compile",
                   log=None, autocast=None) -> "HFBackend":
        """A backend over an already loaded ``model`` (e.g. a trainer's policy: no copy, so it
        always generates with the current weights, whatever their dtype; the compiled path reads
        the parameters in place too). ``tokenizer`` None: loaded from ``model_id``.
        ``autocast`` (a torch dtype, e.g. ``torch.bfloat16``): sample under autocast in that dtype
        instead of the weights' own (float32 master weights: full precision).
        The caller keeps owning the model; :meth:`close` only drops this reference."""
        backend = cls.__new__(cls)
        backend._attach(model, tokenizer if tokenizer is not None else load_tokenizer(model_id),
                        model_id=model_id, path=model_id, batch_size=batch_size, chat_template=chat_template,
                        static_cache=static_cache, compile=compile, decoder=decoder,
                        decode_attention=decode_attention, step_graph=step_graph, log=log)
        backend.autocast = autocast
        return backend

    @property
    def precision(self) -> str:
        """The precision generation computes in: the autocast dtype, else the weights' dtype."""
        return str(self.autocast or self.dtype).replace("torch.", "")

    def _attach(self, model, tokenizer, *, model_id: str, path: str, batch_size: int, chat_template: bool,
                device: str | None = None, static_cache: bool = False, compile: bool = False,
                decoder: str = "generate", decode_attention: str = "model", step_graph: str = "compile",
                log=None) -> None:
        """Every attribute a backend has, set in one place (by ``__init__`` and ``from_model``).

        ``compile`` is honoured on CUDA only (elsewhere it is ignored: eager decoding, unless
        ``static_cache`` asks for the static cache alone); it implies the static cache.
        ``decoder``: ``generate`` (transformers' own) or ``step`` (:mod:`sptool.models.step_decoder`;
        ``compile`` then compiles its whole step). ``decode_attention``: ``model`` (the model's own
        attention) or ``grouped`` (:mod:`sptool.models.decode_attention`, switched on around each
        ``generate`` call only, so a shared trainer's forwards keep the model's own). ``step_graph``
        (the step decoder on CUDA): ``compile`` (torch.compile's CUDA graphs) or ``capture`` (sptool
        captures each cache's step itself: :class:`sptool.models.step_decoder.CudaGraphStep`)."""
        import torch

        if decoder not in DECODERS:
            raise UsageError(f"unknown decoder '{decoder}'; choose from {', '.join(DECODERS)}")
        if decode_attention not in DECODE_ATTENTIONS:
            raise UsageError(f"unknown decode attention '{decode_attention}'; choose from "
                             f"{', '.join(DECODE_ATTENTIONS)}")
        if step_graph not in STEP_GRAPHS:
            raise UsageError(f"unknown step graph '{step_graph}'; choose from {', '.join(STEP_GRAPHS)}")

        parameter = next(model.parameters())
        self.model_id, self.path = model_id, path
        self.device = device or str(parameter.device)
        self.dtype = parameter.dtype
        self.batch_size = max(1, int(batch_size))
        self.chat_template = chat_template
        tokenizer.padding_side = "left"
        self.tokenizer = tokenizer
        self._prompt_encoder = None  # made at the first call
        self._decoder_of_text = None  # likewise
        self.model = model
        self._torch = torch
        self.autocast = None  # a dtype: generate under torch.autocast in it
        self.generate_options: dict[str, Any] = {}
        self.log = log
        self.compile = bool(compile) and self.device.startswith("cuda")
        self.static_cache = bool(static_cache) or self.compile
        self._compile_config = None
        if self.compile:
            from transformers import CompileConfig

            # transformers' own defaults (inductor, reduce-overhead: CUDA graphs); dynamic=None lets
            # dynamo generalise a second shape instead of recompiling for every bucket
            self._compile_config = CompileConfig()
        self._caches: dict[tuple[int, int], Any] = {}  # (rows, length) -> StaticCache, in use order
        self.shapes_seen: set[tuple[int, int]] = set()
        self.decode_steps = 0  # decoding steps run (generated columns, summed over batches)
        self._compile_proven = False  # a compiled call succeeded (later failures are real errors)
        self.decoder = decoder
        self.decode_attention = decode_attention
        self.share_prefill = True  # step decoder: one prefill per distinct prompt of a batch
        # step decoder: the distinct prompts' common prefix prefilled once, when it saves at
        # least this many prompt tokens (None: step_decoder.PREFIX_MIN_SAVED_TOKENS; 0: whenever any)
        self.prefix_min_saved_tokens: int | None = None
        self.step_graph = step_graph
        # step decoder: the KV window as a dynamic size (one compiled step for every window); off
        # until its token loop is timed against the static windows' (benchmarks/generation.py --window)
        self.dynamic_window = False
        self._step_decoder = None  # built on the first step-decoded call
        self._step_proven = False  # a step-decoded call succeeded (later failures are real errors)

    def _give_up_compile(self, exc: Exception) -> None:
        """The first compiled call failed: say why once and decode eagerly from now on."""
        if self.log is not None:
            self.log(f"note: compiled decoding failed on its first call ({type(exc).__name__}: {first_line(exc)}); "
                     f"decoding eagerly (model.compile_generation=false)")
        self.compile = self.static_cache = False
        self._caches.clear()

    def _give_up_step(self, why: str) -> None:
        """The step decoder can't run this model: say why once and use ``generate`` from now on."""
        if self.log is not None:
            self.log(f"note: the step decoder can't run this model ({why[:200]}); decoding with "
                     f"transformers' generate (model.decoder=generate)")
        self.decoder = "generate"
        self._step_decoder = None
        self._caches.clear()

    def _give_up_capture(self, why: str) -> None:
        """The step decoder's first captured call failed: say why once and let torch.compile make its
        CUDA graphs from now on (the step decoder itself stays)."""
        if self.log is not None:
            self.log(f"note: capturing the step decoder's CUDA graph failed on its first call ({why[:200]}); "
                     f"its graphs come from torch.compile instead (model.step_graph=compile)")
        self.step_graph = "compile"
        self._step_decoder = None
        self._caches.clear()

    @property
    def decoding(self) -> str:
        """How this backend decodes: ``compiled`` (static cache + CUDA graphs), ``static`` or ``eager``;
        ``step`` or ``step-compiled`` with the step decoder."""
        if self.decoder == "step":
            return "step-compiled" if self.compile else "step"
        return "compiled" if self.compile else "static" if self.static_cache else "eager"

    def cache_bytes(self) -> int:
        """The bytes the kept static KV caches hold (0 on the eager path)."""
        total = 0
        for cache in self._caches.values():
            for layer in getattr(cache, "layers", []):
                for name in ("keys", "values"):
                    tensor = getattr(layer, name, None)
                    if tensor is not None:
                        total += tensor.numel() * tensor.element_size()
        return total

    def release_caches(self) -> None:
        """Drop the kept static caches (their memory returns to the allocator)."""
        self._caches.clear()

    def _static_cache(self, rows: int, length: int):
        """The kept cache of ``(rows, length)``, reset; a new one (the least recently used one
        dropped beyond :data:`MAX_CACHES`, or while the device lacks the room for the new one)
        announced with its size beside the allocated memory."""
        from transformers import StaticCache

        key = (rows, length)
        cache = self._caches.pop(key, None)
        fresh = cache is None
        if fresh:
            need = self.new_cache_bytes(rows, length)
            while self._caches:
                full = len(self._caches) >= MAX_CACHES
                if not full and self._room_for(need):
                    break
                old_rows, old_length = next(iter(self._caches))
                del self._caches[(old_rows, old_length)]
                if not full and self.log is not None:
                    self.log(f"hf: dropped the KV cache of {old_rows} rows x {old_length} positions to make "
                             f"room for {rows} x {length} ({need / 1024 ** 3:.2f} GiB)")
            from sptool.models.step_decoder import cast_on_store

            # under bf16 autocast a layer's keys are float32 and its values bf16: the layers cast
            cache = cast_on_store(StaticCache(config=self.model.config, max_cache_len=length))
        else:
            cache.reset()
        self._caches[key] = cache
        return cache, fresh

    def new_cache_bytes(self, rows: int, length: int, dtype=None) -> int:
        """What a new static cache of ``rows`` x ``length`` will hold: keys and values of every
        layer, in ``dtype`` or the dtype it will take: the step decoder's is autocast's (else the
        weights'), ``generate``'s takes its first keys', the weights' dtype (under autocast the keys
        leave the rotary embedding in float32)."""
        config = self.model.config
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = getattr(config, "num_attention_heads", None) or 1
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or (getattr(config, "hidden_size", 0) // heads)
        layers = getattr(config, "num_hidden_layers", None) or 0
        dtype = dtype or (self.autocast if self.decoder == "step" else None) or self.model.dtype
        return 2 * layers * rows * kv_heads * length * head_dim * dtype.itemsize

    def _room_for(self, need: int) -> bool:
        """Whether the device can hold ``need`` more bytes (with :data:`CACHE_HEADROOM`): its free
        memory plus what the allocator holds unused. Always on a CPU."""
        if not self.device.startswith("cuda"):
            return True
        torch = self._torch
        free, _ = torch.cuda.mem_get_info(self.device)
        spare = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return need * CACHE_HEADROOM <= free + spare

    def _report_cache(self, rows: int, length: int) -> None:
        if self.log is None:
            return
        torch = self._torch
        gib = 1024 ** 3
        beside = ""
        if self.device.startswith("cuda"):
            beside = (f"; GPU {torch.cuda.memory_allocated(self.device) / gib:.2f} GiB allocated, "
                      f"{torch.cuda.max_memory_allocated(self.device) / gib:.2f} GiB peak")
        self.log(f"hf: {self.decoding} decoding, new KV cache {rows} rows x {length} positions; "
                 f"caches hold {self.cache_bytes() / gib:.2f} GiB{beside}")

    def render(self, prompt: Prompt) -> str:
        return render_prompt(self.tokenizer, prompt, self.chat_template)

    def render_all(self, prompts: list[Prompt]) -> list[str]:
        """:meth:`render` of each prompt, the chat-templated ones in one template call."""
        return render_prompts(self.tokenizer, prompts, self.chat_template)

    def generate(self, prompts: list[Prompt], n: int, params: SamplingParams) -> list[list[Sample]]:
        if self.decode_attention == "model":
            return self._generate(prompts, n, params)
        from sptool.models.decode_attention import attention_implementation

        with attention_implementation(self.model, self.decode_attention):
            return self._generate(prompts, n, params)

    def _generate(self, prompts: list[Prompt], n: int, params: SamplingParams) -> list[list[Sample]]:
        if self.decoder == "step":
            return self._generate_step(prompts, n, params)
        torch = self._torch
        self.model.eval()  # a shared trainer's model may be left in train mode (dropout)
        texts = self.render_all(prompts)
        prefixes = [split_response_prefix(p)[1] for p in prompts]
        jobs = [(index, text) for index, text in enumerate(texts) for _ in range(n)]
        results: list[list[Sample]] = [[] for _ in prompts]
        eos_ids = self._eos_ids()
        for batch_index in range(0, len(jobs), self.batch_size):
            batch = jobs[batch_index:batch_index + self.batch_size]
            batch_texts = [text for _, text in batch]
            rows = bucket_rows(len(batch), self.batch_size) if self.static_cache else len(batch)
            batch_texts += batch_texts[-1:] * (rows - len(batch))  # padding rows, finished at once
            encoded = self._encode(batch_texts)
            prompt_length = encoded["input_ids"].shape[1]
            sampling = params.temperature > 0
            options: dict[str, Any] = dict(
                max_new_tokens=params.max_new_tokens, do_sample=sampling,
                pad_token_id=self.tokenizer.pad_token_id, eos_token_id=eos_ids,
                return_dict_in_generate=True,
            )
            options.update(self.generate_options)
            if params.stop:
                options.update(stop_strings=list(params.stop), tokenizer=self.tokenizer)
            left = params.seconds_left()
            if left is not None:
                if left <= 0:
                    break  # past the deadline: the caller sees missing samples and drops the batch
                options["max_time"] = left
            processors = []
            recorder = LogprobRecorder() if params.logprobs else None
            if recorder is not None:
                processors.append(recorder)  # first: it sees the raw logits, as output_logits did
            if sampling:
                # the warpers are ours (after the recorder), in generate's own order
                from transformers import TemperatureLogitsWarper, TopPLogitsWarper

                options.update(temperature=1.0, top_p=1.0, top_k=0)
                if params.temperature != 1.0:
                    processors.append(TemperatureLogitsWarper(params.temperature))
                if params.top_p < 1.0:
                    processors.append(TopPLogitsWarper(params.top_p))
            else:
                options.update(temperature=None, top_p=None, top_k=None)
            if processors:
                from transformers import LogitsProcessorList

                options["logits_processor"] = LogitsProcessorList(processors)
            criteria = []
            listener = token_listener()
            if listener is not None:
                criteria.append(TokenProgress(listener, len(batch)))
            if self.static_cache:
                length = bucket_length(prompt_length + params.max_new_tokens)
                with torch.inference_mode():  # the cache holds inference tensors: reset in that mode
                    cache, fresh = self._static_cache(rows, length)
                options["past_key_values"] = cache
                options["disable_compile"] = not self.compile
                if self.compile:
                    options["compile_config"] = self._compile_config
                if rows > len(batch):
                    done = torch.zeros(rows, dtype=torch.bool, device=self.device)
                    done[len(batch):] = True
                    criteria.append(FinishedRows(done))
                if self.compile and (rows, length) not in self.shapes_seen and self.log is not None:
                    self.log(f"hf: new decoding shape {rows} rows x {length} positions: compiling or "
                             f"recording its CUDA graph (the first compile takes a while)")
                self.shapes_seen.add((rows, length))
            if criteria:
                from transformers import StoppingCriteriaList

                options["stopping_criteria"] = StoppingCriteriaList(criteria)
            torch.manual_seed(params.seed * 1_000_003 + batch_index)
            with torch.inference_mode(), regional_compile_off(self.model), self._autocast():
                try:
                    output = self.model.generate(**encoded, **options)
                except Exception as exc:  # noqa: BLE001 - only a first compiled call falls back
                    if not self.compile or self._compile_proven or isinstance(exc, torch.cuda.OutOfMemoryError):
                        raise
                    self._give_up_compile(exc)
                    return self._generate(prompts, n, params)
            self._compile_proven = True
            if self.static_cache and fresh:
                self._report_cache(rows, length)
            self.decode_steps += output.sequences.shape[1] - prompt_length
            sequences = output.sequences[:len(batch)]
            del output  # it holds the cache too; the backend keeps that one
            new_tokens = sequences[:, prompt_length:].tolist()
            logprob_rows = recorder.rows(sequences[:, prompt_length:]) if recorder else None
            self._collect(results, batch, new_tokens, logprob_rows, prefixes, params, eos_ids)
        return results

    def _collect(self, results: list[list[Sample]], batch: list[tuple[int, str]], ids: list[list[int]],
                 logprobs: list[list[float]] | None, prefixes: list[str], params: SamplingParams,
                 eos_ids: list[int]) -> None:
        """Each row of a batch's generated ids as a Sample of its prompt in ``results``: cut after
        the first EOS, its text decoded with the batch's (:class:`TextDecoder`: a few threads), then
        cut at a stop string."""
        eos = set(eos_ids)
        cut, finishes = [], []
        for row in ids[:len(batch)]:
            end = next((position + 1 for position, token in enumerate(row) if token in eos), None)
            cut.append(row if end is None else row[:end])
            finishes.append("length" if end is None else "stop")
        texts = self._text_decoder()(cut)
        for row, (prompt_index, _) in enumerate(batch):
            row_ids, text, finish, stop_string = cut[row], texts[row], finishes[row], None
            if params.stop:
                row_ids, text, stop_string = self._cut_at_stop(row_ids, text, params.stop)
                finish = "stop" if stop_string is not None else finish
            row_logprobs = logprobs[row][:len(row_ids)] if logprobs is not None else None
            results[prompt_index].append(Sample(text=prefixes[prompt_index] + text, n_tokens=len(row_ids),
                                                finish_reason=finish, logprobs=row_logprobs, token_ids=row_ids,
                                                stop_string=stop_string))

    def _text_decoder(self) -> TextDecoder:
        if self._decoder_of_text is None or self._decoder_of_text.tokenizer is not self.tokenizer:
            self._decoder_of_text = TextDecoder(self.tokenizer)
        return self._decoder_of_text

    def _generate_step(self, prompts: list[Prompt], n: int, params: SamplingParams) -> list[list[Sample]]:
        """``generate`` through the step decoder (:mod:`sptool.models.step_decoder`): the same
        batches, samples and contract; each distinct prompt of a batch prefilled once."""
        from concurrent.futures import ThreadPoolExecutor

        from sptool.models.step_decoder import row_map_of

        torch = self._torch
        self.model.eval()
        texts = self.render_all(prompts)
        prefixes = [split_response_prefix(p)[1] for p in prompts]
        jobs = [(index, text) for index, text in enumerate(texts) for _ in range(n)]
        results: list[list[Sample]] = [[] for _ in prompts]
        eos_ids = self._eos_ids()
        pad_id = self.tokenizer.pad_token_id
        pad_id = pad_id if pad_id is not None else (eos_ids[0] if eos_ids else 0)
        listener = token_listener()
        stop_check = None
        if params.stop:
            def stop_check(columns, rows):
                decoded = self._text_decoder()(rows)
                return [index for index, text in enumerate(decoded) if cut_at_stop(text, params.stop)[1]]
        batches = []  # (first job, jobs, rows, distinct prompts, row map)
        for batch_index in range(0, len(jobs), self.batch_size):
            batch = jobs[batch_index:batch_index + self.batch_size]
            # rows bucketed when compiled (few CUDA graphs); the padding rows finish at once
            rows = bucket_rows(len(batch), self.batch_size) if self.compile else len(batch)
            batches.append((batch_index, batch, rows, *row_map_of([text for _, text in batch], rows,
                                                                   self.share_prefill)))
        # the split sampler's weights are packed once a call, while the first batch's prompts are
        # tokenised on other threads (the Rust encoder and torch's kernel launches free the GIL)
        again = False  # the step decoder (or its captured graph) was given up: the call starts again
        with ThreadPoolExecutor(1, thread_name_prefix="sptool-prompts") as prompts_pool, \
                torch.inference_mode(), regional_compile_off(self.model), self._autocast():
            first = prompts_pool.submit(self._encode, batches[0][3], True) if batches else None
            with packed_split_weights(self.model, self.autocast):
                for batch_index, batch, rows, distinct, row_map in batches:
                    encoded = first.result() if batch_index == 0 else self._encode(distinct, True)
                    left = params.seconds_left()
                    if left is not None and left <= 0:
                        break  # past the deadline: the caller sees missing samples and drops the batch
                    decoded = self._step_decode(batch_index, batch, rows, encoded, row_map, params, eos_ids,
                                                 pad_id, stop_check, listener)
                    if decoded is None:
                        again = True
                        break
                    self._collect(results, batch, decoded.ids, decoded.logprobs, prefixes, params, eos_ids)
        return self._generate(prompts, n, params) if again else results

    def _step_decode(self, batch_index, batch, rows, encoded, row_map, params, eos_ids, pad_id, stop_check,
                     listener):
        """One batch through the step decoder, inside the sampler's contexts: its ``Decoded``, or None
        when this call gave up the step decoder (or its captured graph) and must start again."""
        from sptool.models.step_decoder import StepDecoder, unsupported

        torch = self._torch
        prompt_length = encoded["input_ids"].shape[1]
        length = bucket_length(prompt_length + params.max_new_tokens)
        cache, fresh = self._static_cache(rows, length)
        if self._step_decoder is None:
            why = unsupported(self.model, cache) or (f"generate_options {sorted(self.generate_options)}"
                                                     if self.generate_options else None)
            if why is not None:
                self._give_up_step(why)
                return None
            self._step_decoder = StepDecoder(self.model, compile=self.compile, graph=self.step_graph,
                                             dynamic_window=self.dynamic_window, log=self.log)
        if self.compile and (rows, length) not in self.shapes_seen and self.log is not None:
            self.log(f"hf: new decoding shape {rows} rows x {length} positions: compiling or "
                     f"recording the step decoder's CUDA graph (the first compile takes a while)")
        self.shapes_seen.add((rows, length))
        torch.manual_seed(params.seed * 1_000_003 + batch_index)
        try:
            decoded = self._step_decoder.decode(
                cache, encoded["input_ids"], encoded["attention_mask"],
                torch.tensor(row_map, dtype=torch.long, device=self.device), real_rows=len(batch),
                max_new_tokens=params.max_new_tokens, temperature=params.temperature,
                top_p=params.top_p, eos_ids=eos_ids, pad_id=pad_id, logprobs=params.logprobs,
                stop_check=stop_check, listener=listener, seconds_left=params.seconds_left,
                prefix_length=encoded.get("prefix_length", 0))
        except Exception as exc:  # noqa: BLE001 - only a first step-decoded call falls back
            if self._step_proven or isinstance(exc, torch.cuda.OutOfMemoryError):
                raise
            why = f"{type(exc).__name__}: {first_line(exc)}"
            if self._step_decoder.graph == "capture":
                self._give_up_capture(why)
            else:
                self._give_up_step(f"its first call failed: {why}")
            return None
        self._step_proven = True
        if fresh:
            self._report_cache(rows, length)
        self.decode_steps += decoded.steps
        return decoded

    def _encode(self, texts: list[str], prefix_first: bool = False) -> dict:
        """The rendered prompts' left-padded ``input_ids`` and ``attention_mask`` on the device
        (:class:`~sptool.models.tokenizer.PromptEncoder`: a large batch on a few threads).
        ``prefix_first`` (the step decoder): laid out by :func:`~sptool.models.step_decoder.prefix_first`
        with the prompts' common prefix first, its length under ``prefix_length``."""
        if self._prompt_encoder is None or self._prompt_encoder.tokenizer is not self.tokenizer:
            self._prompt_encoder = PromptEncoder(self.tokenizer)
        input_ids, attention_mask = self._prompt_encoder(texts)
        if not prefix_first:
            return {"input_ids": input_ids.to(self.device), "attention_mask": attention_mask.to(self.device)}
        from sptool.models import step_decoder

        minimum = self.prefix_min_saved_tokens
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        input_ids, attention_mask, prefix_length = step_decoder.prefix_first(
            input_ids, attention_mask, pad_id, step_decoder.PREFIX_MIN_SAVED_TOKENS if minimum is None else minimum)
        return {"input_ids": input_ids.to(self.device), "attention_mask": attention_mask.to(self.device),
                "prefix_length": prefix_length}

    def _autocast(self):
        import contextlib

        if self.autocast is None:
            return contextlib.nullcontext()
        return self._torch.autocast(self.device.split(":")[0], dtype=self.autocast)

    def _cut_at_stop(self, ids: list[int], text: str, stop) -> tuple[list[int], str, str | None]:
        """Ids, text and stop string when a stop string ends the text: the text is cut right after
        it, the ids after the first token that completes it (found by bisection)."""
        text, stop_string = cut_at_stop(text, stop)
        if stop_string is None:
            return ids, text, None
        low, high = 1, len(ids)  # the shortest prefix of ids whose text holds the stop string
        while low < high:
            middle = (low + high) // 2
            if cut_at_stop(self.tokenizer.decode(ids[:middle], skip_special_tokens=True), stop)[1]:
                high = middle
            else:
                low = middle + 1
        return ids[:low], text, stop_string

    def _eos_ids(self) -> list[int]:
        ids = self.model.generation_config.eos_token_id
        ids = list(ids) if isinstance(ids, (list, tuple)) else [ids] if ids is not None else []
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(self.tokenizer.eos_token_id)
        return ids

    def close(self) -> None:
        self._caches.clear()
        self.model = None
