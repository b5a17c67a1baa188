"""The hf backend's step decoder (issue 33, ``model.decoder = "step"``): a gpt-fast-style token
loop over a transformers causal LM, instead of transformers' ``generate``.

Design. A batch is decoded in three parts:

- **shared-prompt prefill**: each distinct prompt of the batch (left padded, position ids from
  the attention mask as ``generate`` makes them) runs through the model once, into a dynamic
  cache; its keys and values are then copied (``index_select`` on the rows) into the batch's
  :class:`transformers.StaticCache`, one copy per sample row. ``n`` samples of a prompt cost one
  prefill, not ``n``. **A prefix common to the distinct prompts** (the chat template's system
  message and the task's instructions: 55 of an eval prompt's 69 tokens) runs once when that
  saves :data:`PREFIX_MIN_SAVED_TOKENS` or more: :func:`prefix_first` lays the prompts out as
  ``[prefix | left-padded rest]`` (same positions, a padding gap in the mask), the prefix runs
  in two rows (the plain prefill's graph), its keys and values are expanded over the rows and
  the rests run on top of them (greedy eval, 512 prompts, on H100s: 52 ms of prefill, 64 without).
  With ``compile`` the prefill goes through ``torch.compile`` with dynamic
  shapes (one graph for every rows x length; no CUDA graphs): an eager prefill is bound by its
  kernel launches (an H100: 84 ms for 64 short prompts of the tiny model, 153 ms for 512).
- **the decoding step**: one function does the model's forward on the last tokens (the static
  cache, a full-length attention mask with the prompt's padding masked), temperature and top-p
  sampling without a host synchronisation (the argmax of ``probs / Exponential(1)`` noise: a
  sample from ``probs`` with no ``torch.multinomial``), the chosen token's log-probability under
  the raw logits when the call asks for log-probabilities (what
  :class:`sptool.models.hf_decoding.LogprobRecorder` records on the ``generate`` path), and the
  finished-row bookkeeping (EOS ends a row; finished rows emit the pad token; each row's length
  counts its tokens up to and including EOS). On CUDA with ``compile`` the whole step goes
  through ``torch.compile(mode="reduce-overhead")``: one CUDA graph replay per token
  (``graph="compile"``, the default). With ``graph="capture"`` the step is
  compiled without torch's CUDA graphs and sptool captures it itself, one
  :class:`torch.cuda.CUDAGraph` per cache and sampling variant over buffers it keeps
  (:class:`CudaGraphStep`): a token then costs the host one ``replay()``, not dynamo's guards and
  the graph tree's input copies (an H100 profile: 7.1 ms of wall time a solve step for 4.66 ms of
  device time). Elsewhere the step runs eagerly.
- **the KV window**: with the grouped decode attention (:mod:`sptool.models.decode_attention`) a
  step reads only the cache's first ``decode_window`` positions, the next multiple of
  :data:`~sptool.models.decode_attention.WINDOW` above every position written so far; the window
  grows during a call, the loop's buffers handed from one captured step to the next. A greedy
  eval call of 78-token prompts and 64 new tokens reads 128 positions for its first 49 steps where
  the cache holds 192. Each window is a compile of its own (a 448-position cache has up to 6);
  with ``dynamic_window`` the window is a dynamic size of the compiled step (the length of a
  tensor argument), so one graph serves every window shorter than the cache, one the whole cache.
- **the loop**: nothing in it reads a device value back, so the host only queues work; every
  :data:`CHECK_EVERY` steps one check synchronises: all real rows finished ends the batch early,
  rows whose text so far holds a stop string are finished, the progress listener is told the
  tokens generated since the last check, and the deadline (``params.seconds_left()``) is honoured.

Stop strings are applied after decoding, as on the ``generate`` path (the backend cuts the text
and ids with ``_cut_at_stop``); the checks only let a batch end early.

Fallback. :func:`unsupported` names why a model can't be decoded this way (an encoder-decoder,
a cache layer that is not a plain full-attention :class:`transformers.cache_utils.StaticLayer`,
e.g. sliding-window or linear-attention layers), and the backend's first step-decoded call that
raises falls back too: either way the backend logs one line and uses ``generate`` from then on.
A compiled prefill whose first call fails is said in one line and runs eagerly from then on.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from sptool.core.records import first_line

CHECK_EVERY = 16        # decoding steps between the host's checks (finished rows, stops, deadline)
#: the least prompt tokens a shared prefix must save (its length x the other prompts) to be run once
#: apart: the extra forward costs a compiled prefill's launches (about 600 kernels for the tiny
#: model), and an H100 prefilled 512 eval prompts at about 1.8 µs a token (64 ms for 35,000 tokens)
PREFIX_MIN_SAVED_TOKENS = 2048


def prefix_first(input_ids, attention_mask, pad_id: int, min_saved_tokens: int = PREFIX_MIN_SAVED_TOKENS):
    """Left-padded prompts (rows x width, CPU or device) laid out as ``[common prefix | left-padded
    rest]``: ``(input_ids, attention_mask, prefix_length)``. Each row keeps its columns and
    positions (the position ids come from the mask's running count), only the padding moves to
    between the prefix and the rest, so a prefill over the new layout attends to the same tokens
    at the same positions. The prefix leaves every row at least one token of its own (the last
    position's logits come from the rest's forward); none (``prefix_length`` 0, the inputs
    unchanged) for a single prompt or when it saves fewer than ``min_saved_tokens`` tokens."""
    import torch

    rows, width = input_ids.shape
    if rows < 2 or width < 2:
        return input_ids, attention_mask, 0
    lengths = attention_mask.sum(-1)
    starts = width - lengths  # left padding: row i's tokens are columns starts[i]..width-1
    shortest = int(lengths.min())
    if shortest < 2:
        return input_ids, attention_mask, 0
    columns = torch.arange(shortest - 1, device=input_ids.device)
    heads = input_ids.gather(1, starts.unsqueeze(1) + columns)  # each row's first tokens
    same = (heads == heads[:1]).all(0)
    prefix_length = int(same.long().cumprod(0).sum())
    if prefix_length * (rows - 1) < max(1, min_saved_tokens):
        return input_ids, attention_mask, 0
    column = torch.arange(width, device=input_ids.device)
    rest = column.unsqueeze(0) >= (starts + prefix_length).unsqueeze(1)
    laid_out = torch.where(rest, input_ids, torch.full_like(input_ids, pad_id))
    laid_out[:, :prefix_length] = heads[0, :prefix_length]
    mask = (rest | (column < prefix_length).unsqueeze(0)).to(attention_mask.dtype)
    return laid_out, mask, prefix_length


#: how the compiled step becomes a CUDA graph: torch.compile's own (reduce-overhead), or captured by
#: sptool per cache and sampling variant (:class:`CudaGraphStep`)
STEP_GRAPHS = ("compile", "capture")


# generation_config settings that make ``generate`` change the logits or the stopping beyond what
# the step decoder does (temperature, top-p, EOS), with their neutral values: a model whose
# generation_config sets one (e.g. a repetition penalty) is decoded by ``generate``
GENERATE_ONLY = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "bad_words_ids": None, "min_length": 0,
                 "min_new_tokens": 0, "suppress_tokens": None, "begin_suppress_tokens": None,
                 "forced_bos_token_id": None, "forced_eos_token_id": None, "sequence_bias": None,
                 "exponential_decay_length_penalty": None, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
                 "typical_p": 1.0, "min_p": None, "encoder_repetition_penalty": 1.0, "guidance_scale": None,
                 "watermarking_config": None, "renormalize_logits": False}


def unsupported(model, cache) -> str | None:
    """Why ``model`` (with ``cache``, a StaticCache built for it) can't be step-decoded; None: it can."""
    from transformers.cache_utils import StaticLayer

    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    generation = getattr(model, "generation_config", None)
    for name, neutral in GENERATE_ONLY.items():
        value = getattr(generation, name, None)
        if value not in (None, neutral, [], {}):
            return f"its generation_config sets {name}={value!r}, which only generate applies"
    layers = getattr(cache, "layers", None)
    if not layers:
        return "its static cache has no layers"
    plain = (StaticLayer, casting_static_layer())
    odd = sorted({type(layer).__name__ for layer in layers if type(layer) not in plain})
    if odd:
        return f"cache layers of type {', '.join(odd)} (only full attention is step-decoded)"
    return None


@functools.cache
def casting_static_layer():
    """:class:`transformers.cache_utils.StaticLayer` whose ``update`` first casts the new keys and
    values to the cache's dtype. Under autocast a Llama layer's keys leave the rotary embedding in
    the residual stream's float32 while its values leave ``v_proj`` in bf16, and ``index_copy_``
    takes one dtype: eager decoding failed (inductor cast silently). The cache is made in the
    sampler's dtype (:meth:`StepDecoder.prefill`): a bf16 sampler's holds bf16 keys and values."""
    from transformers.cache_utils import StaticLayer

    class CastingStaticLayer(StaticLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:  # generate's first update: the keys' dtype, as StaticLayer
                self.lazy_initialization(key_states, value_states)
            key_states, value_states = key_states.to(self.keys.dtype), value_states.to(self.values.dtype)
            return super().update(key_states, value_states, *args, **kwargs)

    return CastingStaticLayer


def cast_on_store(cache):
    """``cache`` (a :class:`transformers.StaticCache`) with its full-attention layers made casting
    layers (:func:`casting_static_layer`): the hf backend makes every static cache so, for
    ``generate`` and the step decoder alike."""
    from transformers.cache_utils import StaticLayer

    for layer in cache.layers:
        if type(layer) is StaticLayer:
            layer.__class__ = casting_static_layer()
    return cache


@dataclass
class Decoded:
    """One batch's result: per row (real rows only) the generated ids (through EOS), and their
    log-probabilities when asked for; ``steps``: the generated columns (prefill's token included)."""

    ids: list[list[int]]
    logprobs: list[list[float]] | None
    steps: int


def choose(logits, finished, lengths, temperature, top_p, eos, pad: int, sample: bool, nucleus: bool,
           record: bool = True):
    """The next token of every row from its ``logits`` (rows x vocabulary), sync-free.

    Returns ``(token, log-probability of token under the raw logits, finished, lengths)``:
    finished rows get ``pad``; a row's length grows while it is unfinished; EOS finishes it.
    ``record`` False (no log-probabilities asked for, e.g. greedy evaluation): the log-probability
    is None, and the step skips the log-sum-exp over the vocabulary."""
    import torch

    raw = logits.float()
    if sample:
        scaled = raw / temperature
        if nucleus:  # transformers' TopPLogitsWarper: drop the low tail whose mass is <= 1 - top_p
            ordered, order = scaled.sort(dim=-1, descending=False)
            cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
            remove = cumulative <= 1 - top_p
            remove[..., -1:] = False
            scaled = scaled.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(1)
        token = (probs / noise).argmax(dim=-1)
    else:
        token = raw.argmax(dim=-1)
    token = torch.where(finished, torch.full_like(token, pad), token)
    chosen = raw.gather(-1, token.unsqueeze(-1)).squeeze(-1) - raw.logsumexp(dim=-1) if record else None
    lengths = lengths + (~finished).long()
    finished = finished | (token.unsqueeze(-1) == eos.unsqueeze(0)).any(dim=-1)
    return token, chosen, finished, lengths


class CapturedStep:
    """One cache's decoding step over buffers of its own: the loop's state (the current token,
    positions, mask, finished rows, lengths, temperature, top-p, EOS ids) lives in :attr:`inputs`,
    which the step reads and the loop updates in place, so that a captured graph can replay it.

    This base class replays by calling the step (any device: the CPU tests' stand-in);
    :class:`CudaGraphStep` captures it once as a CUDA graph. :meth:`stale` says whether a weight
    has moved since (a parameter or buffer replaced, not updated in place): a graph reads the
    addresses it was captured with, so a stale step is made again."""

    def __init__(self, function, cache, inputs, constants, weights, pool=None):
        self.function = function
        self.cache = weakref.ref(cache)  # the decoder keys its steps by the cache: no strong reference
        self.constants = tuple(constants)
        self.inputs = [tensor.clone() for tensor in inputs]
        self.weights = weights
        self.pointers = [tensor.data_ptr() for tensor in weights]
        self.pool = pool
        self.outputs = None

    @staticmethod
    def memory_pool():
        """The memory pool the steps of one decoder share (none: nothing is captured here)."""
        return None

    def stale(self) -> bool:
        return [tensor.data_ptr() for tensor in self.weights] != self.pointers

    def load(self, inputs) -> None:
        for own, given in zip(self.inputs, inputs):
            own.copy_(given)

    def replay(self):
        if self.outputs is None:
            self.outputs = self.capture()
            return self.outputs
        return self._replay()

    def capture(self):
        return self._call()

    def _replay(self):
        return self._call()

    def _call(self):
        return self.function(self.cache(), *self.inputs, *self.constants)


class CudaGraphStep(CapturedStep):
    """The step captured as one :class:`torch.cuda.CUDAGraph` (after two warm-up calls on a side
    stream, which compile it): each token is then one ``replay()``. The warm-up calls write the
    first step's keys and values where the first replay writes them again; the cache layers'
    position counters and the random generator's state they advance are put back (a seed draws the
    same samples in a call that captures as in one that replays). A replay draws new noise: the
    generator's offset moves on at each. Every graph of a decoder shares one memory pool: a
    replay's outputs are copied out before the next replay of any graph."""

    graph = None  # the captured torch.cuda.CUDAGraph

    @staticmethod
    def memory_pool():
        import torch

        return torch.cuda.graph_pool_handle()

    def capture(self):
        import torch

        layers = getattr(self.cache(), "layers", [])
        counters = [layer.cumulative_length.clone() for layer in layers]
        random_state = torch.cuda.get_rng_state()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._call()
                for layer, counter in zip(layers, counters):
                    layer.cumulative_length.copy_(counter)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.set_rng_state(random_state)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool):
            outputs = self._call()
        self.graph.replay()  # capture runs nothing: this is the first step
        return outputs

    def _replay(self):
        self.graph.replay()
        return self.outputs


class StepDecoder:
    """Decodes batches of a causal LM step by step over a kept :class:`transformers.StaticCache`.

    ``compile``: the decoding step through ``torch.compile(mode="reduce-overhead")`` (CUDA graphs;
    use on CUDA); ``compile_options`` overrides ``torch.compile``'s arguments (tests: ``aot_eager``).
    ``graph="capture"`` (with ``compile``): compiled without torch's CUDA graphs, and each cache's
    step captured by ``captured_step`` (:class:`CudaGraphStep`; the tests pass the base class).
    ``dynamic_window``: the KV window as a dynamic size of the compiled step, one graph for every
    window shorter than the cache, where each window is otherwise a compile of its own (not yet
    the default: its token loop has not been timed against the static windows' on a GPU).
    The model's parameters are read in place: an optimizer step on them shows in the next call."""

    def __init__(self, model, *, compile: bool = False, compile_options: dict | None = None,
                 check_every: int = CHECK_EVERY, share_prefill: bool = True, graph: str = "compile",
                 captured_step: type[CapturedStep] | None = None, compile_prefill: bool = True,
                 dynamic_window: bool = False, log: Callable[[str], None] | None = None):
        if graph not in STEP_GRAPHS:
            raise ValueError(f"unknown step graph {graph!r}; choose from {', '.join(STEP_GRAPHS)}")
        self.model = model
        self.log = log
        self.check_every = max(1, int(check_every))
        self.share_prefill = share_prefill
        self.compile = compile
        self.dynamic_window = dynamic_window
        self.graph = graph if compile else "compile"
        self.captured_step = captured_step or CudaGraphStep
        self._captured: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> {variant: step}
        self._pool = None
        self._step = self._forward_and_choose
        if compile:
            import torch

            reduce_overhead = dict(mode="reduce-overhead") if self.graph == "compile" else {}
            options = compile_options or dict(**reduce_overhead, fullgraph=False, dynamic=False)
            # one graph per (rows, cache length) bucket, sampling variant (greedy, sampled, top-p, with
            # log-probabilities or not) and KV window: more than dynamo's default 8 in a run with several
            # stages (past the limit a new variant runs its step eagerly)
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 128)
            self._step = torch.compile(self._forward_and_choose, **options)
        self._prefill_forward = self._prompt_forward
        self._prefill_proven: set[str] = set()
        self._window_markers: dict[tuple[int, str], Any] = {}  # (window, device) -> its size tensor
        if compile and compile_prefill:
            import torch

            # one graph for every batch of prompts (dynamic rows and length), no CUDA graphs: an eager
            # prefill is bound by its kernel launches (tiny model, H100: 84 ms for 64 prompts)
            options = {key: value for key, value in (compile_options or {}).items() if key != "mode"}
            self._prefill_forward = torch.compile(self._prompt_forward, **{**options, "dynamic": True})

    def _forward_and_choose(self, cache, tokens, positions, mask, finished, lengths, temperature, top_p, eos,
                            pad: int, sample: bool, nucleus: bool, record: bool, window):
        # window: None, or the KV window (the grouped decode attention reads the cache's first that
        # many positions): an int (a constant of the compiled step: each window a graph of its own),
        # or with dynamic_window a tensor of that length (a dynamic size: one graph for every window)
        extra = {} if window is None else {"decode_window": window if isinstance(window, int) else window.shape[0]}
        logits = self.model(input_ids=tokens.unsqueeze(-1), position_ids=positions.unsqueeze(-1),
                            attention_mask=mask, past_key_values=cache, use_cache=True, **extra).logits[:, -1]
        return choose(logits, finished, lengths, temperature, top_p, eos, pad, sample, nucleus, record)

    def _prompt_forward(self, input_ids, attention_mask, positions, prefix=None):
        """The prompts through the model into a new dynamic cache: the last position's logits and
        each layer's ``(keys, values)``. ``prefix``: each layer's keys and values of a prefix in one
        row, put in front of every row first (``attention_mask`` then covers prefix and prompts)."""
        from transformers import DynamicCache

        prompt_cache = DynamicCache(config=self.model.config)
        if prefix is not None:
            rows = input_ids.shape[0]
            for index, (keys, values) in enumerate(prefix):
                prompt_cache.update(keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1), index)
        output = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                            past_key_values=prompt_cache, use_cache=True, logits_to_keep=1)
        return output.logits[:, -1], [(layer.keys, layer.values) for layer in prompt_cache.layers]

    def _prompts_through_model(self, input_ids, attention_mask, positions, prefix=None):
        """:meth:`_prompt_forward`, compiled when the decoder compiles; a compiled prefill whose first
        call of a kind (with a prefix or without) fails is said once and runs eagerly from then on."""
        kind = "" if prefix is None else " on a prefix"
        if kind in self._prefill_proven or self._prefill_forward == self._prompt_forward:
            return self._prefill_forward(input_ids, attention_mask, positions, prefix)
        import torch

        try:
            out = self._prefill_forward(input_ids, attention_mask, positions, prefix)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - only a first compiled prefill falls back
            if self.log is not None:
                self.log(f"note: the step decoder's compiled prefill failed on its first call{kind} "
                         f"({type(exc).__name__}: {first_line(exc)}); prefilling eagerly")
            self._prefill_forward = self._prompt_forward
            return self._prompt_forward(input_ids, attention_mask, positions, prefix)
        self._prefill_proven.add(kind)
        return out

    def prefill(self, cache, input_ids, attention_mask, row_map, prefix_length: int = 0):
        """The distinct prompts (``input_ids``/``attention_mask``: prompts x length, left padded, or
        laid out by :func:`prefix_first` with a common prefix of ``prefix_length`` columns) through
        the model once, the common prefix once (in two rows); their keys and values copied into
        ``cache``'s rows as ``row_map`` (sample row -> prompt row) says. Returns the last position's
        logits per sample row."""
        import torch

        positions = attention_mask.long().cumsum(-1) - 1
        positions.masked_fill_(attention_mask == 0, 1)
        if prefix_length:
            # the prefix in the first two rows (the same tokens), not one: a compiled prefill
            # specialises a batch of one row (a graph more to compile), two rows take the plain
            # prefill's graph with its dynamic shapes
            _, both = self._prompts_through_model(input_ids[:2, :prefix_length], attention_mask[:2, :prefix_length],
                                                  positions[:2, :prefix_length])
            prefix = [(keys[:1], values[:1]) for keys, values in both]
            del both
            last_logits, layers = self._prompts_through_model(input_ids[:, prefix_length:], attention_mask,
                                                              positions[:, prefix_length:], prefix)
            del prefix
        else:
            last_logits, layers = self._prompts_through_model(input_ids, attention_mask, positions)
        length = input_ids.shape[1]
        rows = row_map.shape[0]
        device_type = input_ids.device.type
        # the cache in the sampler's dtype: autocast's (a bf16 sampler keeps a bf16 cache, half the
        # bytes to hold and to read each step), else the model's; its layers cast what they store
        # (the backend's caches are cast_on_store's)
        cache_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        for layer, (keys, values) in zip(cache.layers, layers):
            if not layer.is_initialized:
                dtype = cache_dtype or keys.dtype
                layer.lazy_initialization(keys.new_empty((rows, *keys.shape[1:]), dtype=dtype),
                                          values.new_empty((rows, *values.shape[1:]), dtype=dtype))
            if layer.keys.shape[0] != rows or layer.max_cache_len < length:
                raise ValueError(f"static cache of {layer.keys.shape[0]} rows x {layer.max_cache_len} "
                                 f"positions for {rows} rows x {length}")
            layer.keys[:, :, :length].copy_(keys.index_select(0, row_map))
            layer.values[:, :, :length].copy_(values.index_select(0, row_map))
            layer.cumulative_length.fill_(length)
        del layers
        return last_logits.index_select(0, row_map), positions[:, -1].index_select(0, row_map)

    def decode(self, cache, input_ids, attention_mask, row_map, *, real_rows: int, max_new_tokens: int,
               temperature: float, top_p: float, eos_ids: list[int], pad_id: int, logprobs: bool,
               stop_check: Callable[[int, list[list[int]]], list[int]] | None = None,
               listener: Callable[[int], None] | None = None,
               seconds_left: Callable[[], float | None] | None = None, prefix_length: int = 0) -> Decoded:
        """One batch: ``row_map`` (sample rows, padding rows included) picks each row's prompt
        (``prefix_length``: the prompts' common prefix, laid out by :func:`prefix_first`);
        rows from ``real_rows`` on are padding, finished from the start. ``stop_check(columns,
        ids)`` gets the unfinished real rows' ids so far (at each check) and returns the indices
        (into that list) of the rows a stop string has ended."""
        import torch

        device = input_ids.device
        rows = row_map.shape[0]
        prompt_length = input_ids.shape[1]
        sample = temperature > 0
        nucleus = sample and top_p < 1.0
        temperature_t = torch.tensor(float(temperature) if sample else 1.0, device=device)
        top_p_t = torch.tensor(float(top_p), device=device)
        eos = torch.tensor(eos_ids or [pad_id], dtype=torch.long, device=device)
        tokens = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
        chosen_logprobs = torch.zeros((rows, max_new_tokens), dtype=torch.float32, device=device) if logprobs else None
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        finished[real_rows:] = True
        lengths = torch.zeros(rows, dtype=torch.long, device=device)

        logits, last_positions = self.prefill(cache, input_ids, attention_mask, row_map, prefix_length)
        token, chosen, finished, lengths = choose(logits, finished, lengths, temperature_t, top_p_t, eos, pad_id,
                                                  sample, nucleus, logprobs)
        del logits
        tokens[:, 0] = token
        if chosen_logprobs is not None:
            chosen_logprobs[:, 0] = chosen
        # the step's inputs: our own buffers, updated in place (a CUDA graph's outputs are overwritten
        # by its next replay, so they are copied out at once)
        current = token.clone()
        positions = last_positions + 1
        cache_length = cache.layers[0].max_cache_len
        mask = torch.ones((rows, cache_length), dtype=attention_mask.dtype, device=device)
        mask[:, :prompt_length] = attention_mask.index_select(0, row_map)
        cuda = device.type == "cuda"
        constants = (pad_id, sample, nucleus, logprobs)
        window_at = self._windows(prompt_length, cache_length)
        window = window_at(1)
        captured = None
        if self.graph == "capture":
            state = [current, positions, mask, finished, lengths, temperature_t, top_p_t, eos]
            captured = self._captured_step(cache, state, (*constants, self._window_size(window, device)))
            captured.load(state)
            # the loop's state is the captured step's own buffers from here on
            current, positions, mask, finished, lengths = captured.inputs[:5]

        def step():
            if captured is not None:
                return captured.replay()
            if cuda and self.compile:
                torch.compiler.cudagraph_mark_step_begin()
            return self._step(cache, current, positions, mask, finished, lengths, temperature_t, top_p_t, eos,
                              *constants, self._window_size(window, device))
        columns, reported = 1, 0
        stopped: set[int] = set()
        while columns < max_new_tokens:
            if window_at(columns) != window:  # the written positions outgrew the window: the next one
                window = window_at(columns)
                if captured is not None:
                    state = captured.inputs
                    captured = self._captured_step(cache, state, (*constants, self._window_size(window, device)))
                    captured.load(state)
                    current, positions, mask, finished, lengths = captured.inputs[:5]
            if columns % self.check_every == 0:
                if listener is not None:
                    listener(real_rows * (columns - reported))
                    reported = columns
                if self._check(tokens, finished, lengths, real_rows, columns, stop_check, stopped):
                    break
                left = seconds_left() if seconds_left is not None else None
                if left is not None and left <= 0:
                    break
            out = step()
            current.copy_(out[0])
            tokens[:, columns].copy_(out[0])
            if chosen_logprobs is not None:
                chosen_logprobs[:, columns].copy_(out[1])
            finished = finished.copy_(out[2])
            lengths = lengths.copy_(out[3])
            del out
            positions.add_(1)
            columns += 1
        if listener is not None and columns > reported:
            listener(real_rows * (columns - reported))
        lengths_host = lengths[:real_rows].tolist()
        ids = tokens[:real_rows, :columns].tolist()
        ids = [row[:length] for row, length in zip(ids, lengths_host)]
        values = None
        if chosen_logprobs is not None:
            values = chosen_logprobs[:real_rows, :columns].tolist()
            values = [row[:length] for row, length in zip(values, lengths_host)]
        return Decoded(ids=ids, logprobs=values, steps=columns)

    def _windows(self, prompt_length: int, cache_length: int) -> Callable[[int], int | None]:
        """The KV window of the step that feeds the token of column ``columns`` (None: the whole
        cache): the next multiple of :data:`sptool.models.decode_attention.WINDOW` above every
        written position (``prompt_length + columns - 1``), while that is shorter than the cache,
        for a model whose attention is the grouped decode attention (others read the whole cache).
        The whole cache is a graph of its own: a window as long as the cache would make the dynamic
        window's graph specialise (a slice of the whole mask is contiguous, a shorter one is not)."""
        from sptool.models import decode_attention

        if getattr(self.model.config, "_attn_implementation", None) != decode_attention.NAME:
            return lambda columns: None
        size = decode_attention.WINDOW

        def window_at(columns: int) -> int | None:
            window = -(-(prompt_length + columns) // size) * size
            return window if window < cache_length else None

        return window_at

    def _window_size(self, window: int | None, device):
        """The step's ``window`` argument: None or the int; with ``dynamic_window`` a tensor of
        ``window`` bytes whose length dynamo treats as dynamic (``mark_dynamic``), kept per window
        so a captured graph's input stays put."""
        if window is None or not self.dynamic_window:
            return window
        marker = self._window_markers.get((window, str(device)))
        if marker is None:
            import torch

            marker = torch.empty(window, dtype=torch.uint8, device=device)
            if self.compile:
                torch._dynamo.mark_dynamic(marker, 0)
            self._window_markers[(window, str(device))] = marker
        return marker

    def _captured_step(self, cache, inputs, constants) -> CapturedStep:
        """The kept captured step of ``cache`` for this sampling variant and buffer shapes; a new one
        when there is none or a weight has moved since its capture."""
        variant = (*(tuple(value.shape) if hasattr(value, "shape") else value for value in constants),
                   *(tuple(tensor.shape) for tensor in inputs))
        steps = self._captured.setdefault(cache, {})
        captured = steps.get(variant)
        if captured is None or captured.stale():
            steps.pop(variant, None)  # a stale step's graph is on its way out: no user of the pool
            if self._pool is None or not self._pool_in_use():
                # a CUDA graphs' memory pool lives while a graph captured into it does: once the last
                # one is gone (its cache dropped for room), torch refuses a capture into the pool's
                # old handle (an internal assert in the caching allocator), so a new pool begins
                self._pool = self.captured_step.memory_pool()
            weights = [*self.model.parameters(), *self.model.buffers()]
            captured = steps[variant] = self.captured_step(self._step, cache, inputs, constants, weights,
                                                           pool=self._pool)
        return captured

    def _pool_in_use(self) -> bool:
        """Whether a kept step has captured its graph (into the decoder's pool)."""
        return any(step.outputs is not None for steps in list(self._captured.values()) for step in steps.values())

    @staticmethod
    def _check(tokens, finished, lengths, real_rows: int, columns: int, stop_check, stopped: set[int]) -> bool:
        """The every-N-steps check (one host synchronisation): rows a stop string has ended are
        finished; True when every real row is finished."""
        done = finished[:real_rows].tolist()
        if stop_check is not None:
            open_rows = [row for row in range(real_rows) if not done[row] and row not in stopped]
            if open_rows:
                lengths_host = lengths.tolist()
                history = tokens[:real_rows, :columns].tolist()
                ended = stop_check(columns, [history[row][:lengths_host[row]] for row in open_rows])
                for index in ended:
                    row = open_rows[index]
                    stopped.add(row)
                    done[row] = True
                    finished[row] = True
        return all(done)


def row_map_of(batch_prompts: list[Any], rows: int, share: bool = True) -> tuple[list[Any], list[int]]:
    """The distinct prompts of a batch (first-seen order) and each row's index into them; rows
    beyond the batch (padding) repeat the last one. ``share`` False: every row its own prompt."""
    distinct: list[Any] = []
    where: dict[Any, int] = {}
    row_map = []
    for prompt in batch_prompts:
        if share and prompt in where:
            row_map.append(where[prompt])
            continue
        where.setdefault(prompt, len(distinct))
        row_map.append(len(distinct))
        distinct.append(prompt)
    row_map += row_map[-1:] * (rows - len(row_map))
    return distinct, row_map
