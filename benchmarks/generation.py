"""Generation throughput: ``sptool solve``'s path against the bare library, per backend.

For each backend, one model is loaded once and the same workload is timed two ways, interleaved:

- **sptool**: a :class:`sptool.stages.solve.SolveStage` over question records (prompt templating,
  chat-template rendering, batching, answer extraction, sample records): what ``sptool solve``
  runs, minus JSONL parsing.
- **bare**: the library alone on the same rendered prompts, the same seeds and sampling
  settings: ``model.generate`` on the tokenised batch (hf), ``vllm.LLM.generate`` on the token
  ids (vllm), raw HTTP requests to the same server (openai).

Both paths generate the same sequences (same seeds), so tokens/s ratios are time ratios. The
table reports tokens/s (generated tokens, EOS included, divided by wall time) and
sptool / bare.

    python benchmarks/generation.py --backend hf,vllm --batch 16 --max-tokens 64
    python benchmarks/generation.py --backend hf --device cuda --shape 0.6b --batch 64,256 --static-cache

``--shape 0.6b`` builds a random-initialised Qwen3-0.6B-shaped model (with the tiny model's
tokenizer) in a temporary directory: for throughput only, its text is noise. vLLM needs the
entry point under ``if __name__ == "__main__"`` (it spawns processes).

``--stages`` (hf, issue 23): every generating stage of every recipe, built as ``sptool run``
builds it (the stage classes, the recipes' prompts, a backend over a live trainer's model as
:class:`sptool.run.session.Policy` makes it: compiled static-cache decoding on CUDA unless
``--no-compile``), each call timed, then the very same calls (same rendered prompts, same
batches, same new-token budget and stop strings) replayed through a bare eager
``model.generate``. One row per stage: decoding steps/s and tokens/s of both, × bare, and the
weights-read floor (parameter bytes / ``--hbm`` bytes/s: the steps/s a step that only read the
weights once would reach) beside the KV-read floor (weights + the static cache read once per
step). Then a loop step's peak GPU memory: one solve batch with log-probs, then one train-step
update on it (generation and training share the GPU; the static caches stay allocated).

    python benchmarks/generation.py --stages --device cuda --shape tiny --batch 512 --max-tokens 64

``--decoder step`` (issue 33): the sptool arm decodes with the step decoder
(:mod:`sptool.models.step_decoder`: shared-prompt prefill, one compiled step per token, no host
sync between checks) instead of transformers' ``generate``; ``--decoder generate,step`` measures
both arms, one row each per stage, against the same bare ``generate``.

    python benchmarks/generation.py --stages --device cuda --decoder generate,step
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

QWEN3_06B_SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6)


def build_shape_model(shape: str, workdir: str) -> str:
    """``tiny``, or a directory with a random-initialised model of the named shape."""
    if shape == "tiny":
        return "tiny"
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from sptool.models.resolve import resolve_model

    tiny = resolve_model("tiny")
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    config = Qwen3Config(**QWEN3_06B_SHAPE, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    target = os.path.join(workdir, "qwen3-0.6b-shape-random")
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def questions(count: int) -> list[dict]:
    """Short arithmetic questions (prompts of ≈60 tokens after the template)."""
    return [{"question": f"What is {17 + 3 * i} + {29 + 7 * i}? Give only the number.",
             "answer": str(46 + 10 * i)} for i in range(count)]


def time_sptool(backend, records: list[dict], params, batch: int) -> tuple[float, int]:
    """Run the SolveStage (k=1, all questions in one backend call); (seconds, tokens)."""
    from sptool.stages.solve import SolveStage

    stage = SolveStage(backend, samples=1, params=params, batch_size=batch)
    start = time.perf_counter()
    out = list(stage.run(json.loads(json.dumps(record)) for record in records))
    seconds = time.perf_counter() - start
    return seconds, sum(sample["n_tokens"] for record in out for sample in record["samples"])


def stage_params(params):
    """The parameters SolveStage hands the backend for its first (only) batch."""
    return dataclasses.replace(params, seed=params.seed * 7919 + 0)


def bare_hf(backend, prompts, params, same_options: bool = True) -> tuple[float, int]:
    """Bare transformers: tokenise the rendered batch, ``model.generate``, decode.

    ``same_options``: with the backend's cache/compile settings (the overhead measurement);
    else plain ``model.generate`` with its default dynamic cache (the speed-up baseline).
    """
    import torch

    params = stage_params(params)
    model, tokenizer = backend.model, backend.tokenizer
    eos = backend._eos_ids()
    start = time.perf_counter()
    texts = [backend.render(prompt) for prompt in prompts]
    encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(backend.device)
    options = dict(max_new_tokens=params.max_new_tokens, do_sample=params.temperature > 0,
                   pad_token_id=tokenizer.pad_token_id, eos_token_id=eos, return_dict_in_generate=True)
    if params.temperature > 0:
        options.update(temperature=params.temperature, top_p=params.top_p, top_k=0)
    if same_options and getattr(backend, "static_cache", False):
        options.update(cache_implementation="static", disable_compile=not backend.compile)
    else:
        options["disable_compile"] = True
    torch.manual_seed(params.seed * 1_000_003 + 0)
    with torch.inference_mode():
        output = model.generate(**encoded, **options)
    new = output.sequences[:, encoded["input_ids"].shape[1]:].tolist()
    tokens = 0
    for row in new:
        cut = next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
        tokenizer.decode(row[:cut], skip_special_tokens=True)
        tokens += cut
    return time.perf_counter() - start, tokens


def bare_vllm(backend, prompts, params) -> tuple[float, int]:
    """Bare vLLM: ``LLM.generate`` on the same token ids with the same per-request seeds."""
    params = stage_params(params)
    start = time.perf_counter()
    requests = [{"prompt_token_ids": backend.prompt_token_ids(prompt)} for prompt in prompts]
    sampling = [backend.sampling_params(1, params, params.seed * 1_000_003 + index)
                for index in range(len(prompts))]
    outputs = backend.llm.generate(requests, sampling, use_tqdm=False)
    tokens = sum(len(completion.token_ids) for output in outputs for completion in output.outputs)
    return time.perf_counter() - start, tokens


def bare_openai(backend, prompts, params) -> tuple[float, int]:
    """Bare HTTP: the same completion requests, one thread per prompt up to the same bound."""
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    params = stage_params(params)

    def post(index_prompt):
        index, prompt = index_prompt
        _, body = backend._body(prompt, 1, params, params.seed * 1_000_003 + index)
        request = urllib.request.Request(backend.base_urls[index % len(backend.base_urls)] + "/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            answer = json.loads(response.read())
        return sum(len(choice.get("token_ids") or []) for choice in answer["choices"])

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=min(backend.concurrency, len(prompts))) as pool:
        tokens = sum(pool.map(post, enumerate(prompts)))
    return time.perf_counter() - start, tokens


BARE = {"hf": bare_hf, "vllm": bare_vllm, "openai": bare_openai}


# -- --stages: every generating stage inside `sptool run` -------------------------------------

class Recorder:
    """A backend wrapper that times every generate call (synchronised) and keeps the call, so
    that the bare arm replays exactly the same calls."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def generate(self, prompts, n, params):
        steps = self.backend.decode_steps
        sync(self.backend)
        start = time.perf_counter()
        out = self.backend.generate(prompts, n, params)
        sync(self.backend)
        self.calls.append(dict(prompts=prompts, n=n, params=params, seconds=time.perf_counter() - start,
                               steps=self.backend.decode_steps - steps,
                               tokens=sum(sample.n_tokens for row in out for sample in row)))
        return out

    def close(self):
        pass


class PhaseClock:
    """While entered: the step decoder's prefill and its whole ``decode`` (prefill + token loop +
    read-back) timed with a synchronisation on each side, so a stage's seconds split into the
    prefill, the token loop and the host's work around them (rendering, tokenising, decoding text)."""

    def __init__(self, backend):
        self.backend, self.prefill_s, self.decode_s, self.encode_s = backend, 0.0, 0.0, 0.0
        self.render_s = self.pack_s = 0.0

    def _timed(self, function, total: str, synchronise: bool = True):
        """``function`` with its seconds added to ``total``; ``synchronise`` False for host-only work
        (rendering a prompt: no device work to wait for, and a wait per prompt would cost time)."""
        clock = self

        def timed(*args, **kwargs):
            if synchronise:
                sync(clock.backend)
            began = time.perf_counter()
            out = function(*args, **kwargs)
            if synchronise:
                sync(clock.backend)
            setattr(clock, total, getattr(clock, total) + time.perf_counter() - began)
            return out

        return timed

    def __enter__(self):
        from sptool.models.step_decoder import StepDecoder

        from sptool.models.hf import HFBackend
        from sptool.models.hf_decoding import packed_split_weights

        self.saved = (StepDecoder.prefill, StepDecoder.decode, HFBackend._encode, HFBackend.render_all,
                      packed_split_weights.__enter__)
        StepDecoder.prefill = self._timed(StepDecoder.prefill, "prefill_s")
        StepDecoder.decode = self._timed(StepDecoder.decode, "decode_s")
        HFBackend._encode = self._timed(HFBackend._encode, "encode_s")
        HFBackend.render_all = self._timed(HFBackend.render_all, "render_s", synchronise=False)
        packed_split_weights.__enter__ = self._timed(packed_split_weights.__enter__, "pack_s")
        return self

    def __exit__(self, *exc):
        from sptool.models.hf import HFBackend
        from sptool.models.hf_decoding import packed_split_weights
        from sptool.models.step_decoder import StepDecoder

        (StepDecoder.prefill, StepDecoder.decode, HFBackend._encode, HFBackend.render_all,
         packed_split_weights.__enter__) = self.saved
        return False

    def split(self, seconds: float, calls: int) -> dict:
        """Milliseconds a call: prefill, token loop (decode less prefill), host (the rest), and of
        the host's, rendering the prompts (``HFBackend.render_all``: the chat template), encoding them
        (``HFBackend._encode``: tokenising and the copy to the device) and packing the sampler's
        weights (``packed_split_weights``: the bf16-split sampler's ``[hi | lo]`` copies)."""
        if not self.decode_s:
            return {}
        per_call = 1000 / max(1, calls)
        return dict(prefill_ms=round(self.prefill_s * per_call, 1),
                    loop_ms=round((self.decode_s - self.prefill_s) * per_call, 1),
                    host_ms=round((seconds - self.decode_s) * per_call, 1),
                    encode_ms=round(self.encode_s * per_call, 1), render_ms=round(self.render_s * per_call, 1),
                    pack_ms=round(self.pack_s * per_call, 1))


def sync(backend) -> None:
    import torch

    if str(backend.device).startswith("cuda"):
        torch.cuda.synchronize()


def bare_replay(backend, calls, model=None, fit: dict | None = None, log=None) -> tuple[float, int, int]:
    """The recorded calls through bare eager ``model.generate`` (dynamic cache, no compile), in
    the backend's batches: (seconds, decoding steps, generated tokens). ``model``: another model
    over the same tokenizer (:func:`bare_copy`), else the backend's. Timed as sptool's call is, from
    prompts to texts: the chat template, tokenising, ``generate`` and ``batch_decode`` of the new
    tokens (the runs in ``benchmarks/results`` up to 2026-12-06 left the template and the decoding
    out of the bare arm's time).

    A batch whose ``generate`` runs out of device memory is generated in halves (and so on), as a
    user would; ``fit`` (shared by a warm-up and its timed replay) keeps the rows that fit, and only
    the runs that completed are timed. A batch's decoding steps are then its longest part's, so
    steps/s stays the steps of the whole batch a second. (Bare float32 ``generate`` at 512 rows x 448
    positions of the 0.6B model grows a 49 GiB cache by concatenation, and failed on an 80 GB card
    with 29 GiB reserved but unused, 2026-12-06.)

    The model is the trainer's, whose decoder layers are regionally compiled on CUDA: they run
    their plain forward here (``regional_compile_off``), as in the sptool arm. Until 2026-12-06 they
    did not. The bare arm then recompiled the shared layer forward for each ``layer_idx`` and cache
    length until dynamo's recompile limit (64), the warning of every CUDA ``--stages`` run. So the
    bare arm was partly compiled, not eager, and the training graphs lost their recompile budget."""
    import torch

    from sptool.models.hf_decoding import regional_compile_off

    model, tokenizer = model if model is not None else backend.model, backend.tokenizer
    fit = {} if fit is None else fit
    eos = backend._eos_ids()
    seconds = steps = tokens = 0
    for call in calls:
        params = call["params"]
        began = time.perf_counter()  # the chat template is the bare arm's work too (sptool's call renders)
        texts = [text for text in backend.render_all(call["prompts"]) for _ in range(call["n"])]
        seconds += time.perf_counter() - began
        options = dict(max_new_tokens=params.max_new_tokens, do_sample=params.temperature > 0,
                       pad_token_id=tokenizer.pad_token_id, eos_token_id=eos,
                       return_dict_in_generate=True, disable_compile=True)
        if params.temperature > 0:
            options.update(temperature=params.temperature, top_p=params.top_p, top_k=0)
        else:
            options.update(temperature=None, top_p=None, top_k=None)
        if params.stop:
            options.update(stop_strings=list(params.stop), tokenizer=tokenizer)
        for start in range(0, len(texts), backend.batch_size):
            batch = texts[start:start + backend.batch_size]
            batch_steps, part = 0, 0
            while part < len(batch):
                rows = min(fit.get("rows", len(batch)), len(batch) - part)
                sync(backend)
                began = time.perf_counter()
                short = False
                try:
                    encoded = tokenizer(batch[part:part + rows], return_tensors="pt", padding=True,
                                        add_special_tokens=False).to(backend.device)
                    torch.manual_seed(params.seed)
                    with torch.inference_mode(), regional_compile_off(model):
                        output = model.generate(**encoded, **options)
                    new = output.sequences[:, encoded["input_ids"].shape[1]:]
                    tokenizer.batch_decode(new, skip_special_tokens=True)  # texts out, as sptool's call
                    sync(backend)
                except torch.OutOfMemoryError:
                    if rows == 1:
                        raise
                    short = True
                if short:  # outside the except block: the error's frames (and their tensors) are gone
                    encoded = output = None
                    gc.collect()
                    torch.cuda.empty_cache()
                    fit["rows"] = (rows + 1) // 2
                    if log is not None:
                        log(f"bare generate ran out of memory at {rows} rows; {fit['rows']} at a time")
                    continue
                seconds += time.perf_counter() - began
                batch_steps = max(batch_steps, new.shape[1])
                tokens += sum(next((i + 1 for i, t in enumerate(row) if t in eos), len(row)) for row in new.tolist())
                part += rows
            steps += batch_steps
    return seconds, steps, tokens


def bare_copy(model, dtype):
    """A copy of ``model`` with its weights in ``dtype``, for bare ``generate``: what a user of
    transformers samples with after loading the checkpoint with ``dtype=torch.bfloat16``. The
    bf16-split sampler's fair baseline: bare ``generate`` on the float32 trainer's model is slower
    for its float32 weights and cache alone, not for anything the step decoder does."""
    import torch
    from transformers import AutoModelForCausalLM

    device = next(model.parameters()).device
    with torch.device(device):
        copy = AutoModelForCausalLM.from_config(model.config, dtype=dtype)
    copy.load_state_dict(model.state_dict())
    copy.generation_config = model.generation_config
    return copy.eval()


def room_for_bare(backend, dtype, log=None) -> float:
    """Make room for bare ``generate``'s dynamic cache: when the device cannot hold one as large
    as sptool's largest kept cache (same rows and positions) in ``dtype`` beside the kept caches,
    drop them (the next stage's untimed warm-up makes its own again). Returns the GiB dropped.
    At the 0.6B shape, 512 rows x 448 positions, bare float32 ``generate`` needs 49 GiB beside
    sptool's 35 GiB of bf16 caches: out of memory on an 80 GB card (2026-12-06)."""
    if not backend._caches or not str(backend.device).startswith("cuda"):
        return 0.0
    need = max(backend.new_cache_bytes(rows, length, dtype) for rows, length in backend._caches)
    if backend._room_for(need):
        return 0.0
    held = backend.cache_bytes() / 1024 ** 3
    backend.release_caches()
    import torch

    torch.cuda.empty_cache()
    if log is not None:
        log(f"dropped sptool's kept KV caches ({held:.2f} GiB) to give bare generate's "
            f"{need / 1024 ** 3:.2f} GiB cache room")
    return held


def stage_workloads(batch: int, max_tokens: int):
    """(stage, recipe, build) for every generating stage inside `sptool run`: ``build(backend)``
    returns the stage and its input records, one backend batch (``batch`` sequences) each."""
    from sptool.stages.challenge import DocumentChallengeStage, QuestionerStage, SolutionChallengeStage
    from sptool.models.base import SamplingParams
    from sptool.stages.novelty import NoveltyStage
    from sptool.prompts import prompt_spec
    from sptool.recipes import load_config
    from sptool.stages.solve import SolveStage

    k = 8
    groups = max(1, batch // k)
    configs = {name: load_config(name) for name in ("rlvr", "rquest", "rzero", "wist", "svs")}
    questioner_group = configs["rzero"]["rzero"]["questioner_group"]

    def sampled(seed=0, logprobs=True, tokens=max_tokens):
        return SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=tokens, seed=seed, logprobs=logprobs)

    problems = questions(max(batch, groups))
    documents = [{"id": f"d{i}", "title": f"Note {i}",
                  "text": f"Ledger {i}: the village stores {12 + i} sacks of grain and trades {3 + i % 5} "
                          f"of them each week for salt; a sack weighs {40 + i % 7} kilograms. " * 3}
                 for i in range(groups)]
    verified = [{**problem, "id": f"v{i}", "p_hat": 0.25,
                 "samples": [{"text": f"{problem['question']} Adding gives \\boxed{{{problem['answer']}}}.",
                              "answer": problem["answer"], "correct": True}]
                 + [{"text": "I think it is 3.", "answer": "3", "correct": False}] * 3}
                for i, problem in enumerate(problems[:groups])]
    candidates = [{"id": f"c{i}", "question": problem["question"], "valid": True}
                  for i, problem in enumerate(problems[:max(2, groups)])]
    return [
        ("solve", "rlvr/svs/wist/rzero/rquest", lambda b: (SolveStage(
            b, samples=k, params=sampled(), batch_size=groups,
            prompt=prompt_spec(configs["rlvr"], "solve")), problems[:groups])),
        ("validity", "rquest", lambda b: (SolveStage(
            b, samples=k, mode="validity", params=sampled(), batch_size=groups,
            prompt=prompt_spec(configs["rquest"], "validity")), problems[:groups])),
        ("questioner", "rzero/rquest", lambda b: (QuestionerStage(
            b, unseeded=True, candidates=min(batch, 4 * questioner_group), params=sampled(),
            batch_size=questioner_group, prompt=prompt_spec(configs["rzero"], "questioner")), [])),
        ("challenger", "wist", lambda b: (DocumentChallengeStage(
            b, candidates=k, params=sampled(), batch_size=groups,
            prompt=prompt_spec(configs["wist"], "challenger")), documents)),
        ("synthesis", "svs", lambda b: (SolutionChallengeStage(
            b, candidates=k, params=sampled(), batch_size=groups, max_solutions=1,
            prompt=prompt_spec(configs["svs"], "synthesis")), verified)),
        ("novelty judge", "rquest", lambda b: (NoveltyStage(
            b, k=k, seed=0, max_new_tokens=16, judge_batch_size=batch,
            prompt=prompt_spec(configs["rquest"], "novelty")), candidates)),
        ("eval (greedy)", "every recipe", lambda b: (SolveStage(
            b, samples=1, params=SamplingParams(temperature=0.0, max_new_tokens=max_tokens), batch_size=batch,
            prompt=prompt_spec(configs["rlvr"], "solve")), problems[:batch])),
    ]


def measure_stages(model: str, args) -> list[dict]:
    """One trainer (as ``sptool run`` loads it); per ``--decoder``, one backend over its live
    model, every stage."""
    import torch

    from sptool.train.step import PolicyTrainer, TrainConfig

    cuda = str(args.device or "").startswith("cuda") or (args.device is None and torch.cuda.is_available())
    # --sampler bf16-split: as a run with model.dtype = "bf16" and train.weight_rounding = "split"
    # (a bf16 trainer whose linears the split rounding routes; the sampler under bf16 autocast)
    precision = dict(mixed_precision="bf16", weight_rounding="split") if args.sampler == "bf16-split" else {}
    trainer = PolicyTrainer(TrainConfig(model=model, device=args.device, max_completion_tokens=args.max_tokens,
                                        **precision))
    rows = []
    for decoder in args.decoder:
        for attention in args.attention:
            for graph in (args.step_graph if decoder == "step" else ["compile"]):
                for window in (args.window if decoder == "step" and attention == "grouped" else ["static"]):
                    rows += measure_decoder(trainer, model, decoder, args, cuda, attention, graph, window)
    return rows


def measure_decoder(trainer, model: str, decoder: str, args, cuda: bool, attention: str = "model",
                    graph: str = "compile", window: str = "static") -> list[dict]:
    """Every stage through one backend (``decoder``: generate or step) over the trainer's live model,
    the sptool arm with ``model.decode_attention = attention`` (model: the model's own SDPA, or
    grouped: ``sptool.models.decode_attention``) and, for the step decoder, ``graph`` (compile:
    torch.compile's CUDA graphs; capture: sptool's own per cache) and ``window`` (static: a compiled
    step per KV window; dynamic: one for all, ``StepDecoder(dynamic_window=True)``); the bare arm
    always eager ``generate`` with the model's own attention."""
    from sptool.models.hf import HFBackend

    import torch

    live = trainer.accelerator.unwrap_model(trainer.model)
    backend = HFBackend.from_model(live, trainer.tokenizer, model_id=model, batch_size=args.batch[0],
                                   compile=not args.no_compile, decoder=decoder, decode_attention=attention,
                                   step_graph=graph,
                                   log=lambda m: print("#", m, file=sys.stderr),
                                   autocast=torch.bfloat16 if args.sampler == "bf16-split" else None)
    backend.dynamic_window = window == "dynamic"
    arm = f"{decoder}, {attention}, {graph}" + (", dynamic window" if window == "dynamic" else "")
    weight_bytes = sum(p.numel() * p.element_size() for p in live.parameters())
    # the bf16-split sampler is also held against bare generate on a bf16 copy (same precision)
    bf16_model = bare_copy(live, torch.bfloat16) if args.sampler == "bf16-split" else None
    rows = []
    only = {name.strip() for name in (args.only or "").split(",") if name.strip()}
    for stage_name, recipe, build in stage_workloads(args.batch[0], args.max_tokens):
        if only and stage_name.split()[0] not in only:
            continue
        recorder = Recorder(backend)
        compile_start = time.perf_counter()
        stage, records = build(recorder)
        list(stage.run(json.loads(json.dumps(records))))  # warm-up: compile / record the graphs
        warm_s = time.perf_counter() - compile_start
        recorder.calls = []
        stage, records = build(recorder)
        with PhaseClock(backend) as phases:
            list(stage.run(json.loads(json.dumps(records))))
        calls = recorder.calls
        if not calls:
            print(f"# {stage_name}: no generate call at this size", file=sys.stderr)
            continue
        seconds = sum(c["seconds"] for c in calls)
        steps, tokens = sum(c["steps"] for c in calls), sum(c["tokens"] for c in calls)
        kv = backend.cache_bytes() / max(1, len(backend._caches)) if backend._caches else 0
        room_for_bare(backend, live.dtype, log=lambda m: print(f"# {stage_name}: {m}", file=sys.stderr))
        say = lambda m: print(f"# {stage_name}: {m}", file=sys.stderr)  # noqa: E731
        fit: dict = {}  # the rows bare generate fits at once, found by the warm-up
        bare_replay(backend, calls[:1], fit=fit, log=say)  # warm-up of the bare arm (allocator, kernels)
        bare_s, bare_steps, bare_tokens = bare_replay(backend, calls, fit=fit, log=say)
        bare_columns = {}
        if "rows" in fit:
            bare_columns["bare_rows_at_once"] = fit["rows"]
        if bf16_model is not None:
            fit_bf16: dict = {}
            bare_replay(backend, calls[:1], bf16_model, fit=fit_bf16, log=say)
            bf16_s, bf16_steps, _ = bare_replay(backend, calls, bf16_model, fit=fit_bf16, log=say)
            bare_columns.update(bare_bf16_steps_s=round(bf16_steps / bf16_s, 1),
                                x_bare_bf16=round((steps / seconds) / (bf16_steps / bf16_s), 2))
            if "rows" in fit_bf16:
                bare_columns["bare_bf16_rows_at_once"] = fit_bf16["rows"]
        row = dict(stage=stage_name, recipe=recipe, shape=args.shape, decoder=decoder, attention=attention,
                   graph=graph, window=window, sampler=args.sampler, decoding=backend.decoding,
                   calls=len(calls), rows=max(len(c["prompts"]) * c["n"] for c in calls),
                   max_tokens=max(c["params"].max_new_tokens for c in calls), warmup_s=round(warm_s, 1),
                   steps_s=round(steps / seconds, 1), tok_s=round(tokens / seconds, 1),
                   bare_steps_s=round(bare_steps / bare_s, 1), bare_tok_s=round(bare_tokens / bare_s, 1),
                   x_bare=round((steps / seconds) / (bare_steps / bare_s), 2),
                   floor_steps_s=round(args.hbm / weight_bytes), kv_floor_steps_s=round(args.hbm / (weight_bytes + kv)),
                   **bare_columns, **phases.split(seconds, len(calls)))
        rows.append(row)
        where = (f" (a call: prefill {row['prefill_ms']} ms, token loop {row['loop_ms']} ms, host {row['host_ms']} ms, "
                 f"of it {row['render_ms']} ms rendering, {row['encode_ms']} ms encoding prompts, {row['pack_ms']} ms "
                 f"packing weights)" if "loop_ms" in row else "")
        bf16 = (f"; vs bare on a bf16 copy {row['bare_bf16_steps_s']} steps/s: x{row['x_bare_bf16']}"
                if "x_bare_bf16" in row else "")
        print(f"# {stage_name} ({arm}): {row['steps_s']} steps/s ({row['tok_s']} tok/s) vs bare {row['bare_steps_s']} "
              f"steps/s: x{row['x_bare']}{bf16}{where}", file=sys.stderr, flush=True)
        if args.profile:
            tag = f"{decoder}-{attention}" + ("-capture" if graph == "capture" else "") + \
                ("-dynamic-window" if window == "dynamic" else "")
            row.update(profile_stage(build, backend, stage_name, tag, Path(args.profile), cuda))
    rows.append(dict(loop_step_memory(trainer, backend, args, cuda), decoder=decoder, attention=attention,
                     graph=graph, window=window, sampler=args.sampler))
    backend.close()
    del bf16_model
    if cuda:
        torch.cuda.empty_cache()
    return rows


def device_busy_us(events) -> float:
    """The device's busy time in a profile: the self device time of the device's own activities
    (kernels, memsets, copies), which have no CPU time of their own. An operator's self device time
    repeats its kernels', and CUPTI's "Command Buffer Full" under CUDA graphs claims tens of seconds,
    so summing every event counted the same kernel twice or more (the H200 profile of the step
    decoder said 693 ms a step of a 30 ms step)."""
    return sum(e.self_device_time_total for e in events
               if not (e.self_cpu_time_total or 0) and (e.self_device_time_total or 0) > 0)


def profile_stage(build, backend, stage_name: str, decoder: str, out_dir: Path, cuda: bool) -> dict:
    """The stage once more (warm) under ``torch.profiler``: where a decoding step's time goes.
    Writes ``OUT_DIR/<stage>-<decoder>.txt`` (the ops by self device time on CUDA, by self CPU time
    otherwise) and returns the step's wall time and the device's busy time per step: a step much
    longer than its device time is bound by the host (Python, launches, synchronisations)."""
    from torch.profiler import ProfilerActivity, profile

    recorder = Recorder(backend)
    stage, records = build(recorder)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        list(stage.run(json.loads(json.dumps(records))))
        sync(backend)
    wall = time.perf_counter() - started
    steps = max(1, sum(c["steps"] for c in recorder.calls))
    events = prof.key_averages()
    device_us = device_busy_us(events) if cuda else 0
    figures = dict(profile_ms_per_step=round(1000 * wall / steps, 3),
                   profile_device_ms_per_step=round(device_us / 1000 / steps, 3) if cuda else None)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^a-z0-9]+", "-", f"{stage_name}-{decoder}".lower()).strip("-")
    table = events.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=40)
    (out_dir / f"{name}.txt").write_text(
        f"{stage_name} ({decoder}): {steps} decoding steps in {wall:.3f} s under the profiler: "
        f"{figures['profile_ms_per_step']} ms a step"
        + (f", the device busy {figures['profile_device_ms_per_step']} ms of it" if cuda else "") + "\n\n" + table + "\n",
        encoding="utf-8")
    print(f"# {stage_name} ({decoder}) profile: {figures['profile_ms_per_step']} ms/step"
          + (f", device {figures['profile_device_ms_per_step']} ms/step" if cuda else "")
          + f" -> {out_dir / (name + '.txt')}", file=sys.stderr, flush=True)
    return figures


def loop_step_memory(trainer, backend, args, cuda: bool) -> dict:
    """Peak GPU memory of one loop step: a solve batch with log-probs, then a train-step update
    on it (the static caches kept beside the optimizer state). On CPU: the step's seconds only."""
    import torch

    from sptool.models.base import SamplingParams
    from sptool.stages.solve import SolveStage

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    k = 8
    records = questions(max(1, args.batch[0] // k))
    stage = SolveStage(backend, samples=k, params=SamplingParams(max_new_tokens=args.max_tokens, logprobs=True),
                       batch_size=len(records))
    start = time.perf_counter()
    solved = list(stage.run(records))
    generate_s = time.perf_counter() - start
    generate_peak = torch.cuda.max_memory_allocated() if cuda else 0
    groups = [{"prompt": r["solve_prompt"], "completions": [s["text"] for s in r["samples"]],
               "rewards": [float(i % 2) for i, _ in enumerate(r["samples"])],
               "old_logprobs": [s.get("logprobs") for s in r["samples"]]} for r in solved]
    start = time.perf_counter()
    gib = 1024 ** 3
    row = {"stage": "loop-step memory", "shape": args.shape, "rows": len(records) * k,
           "generate_s": round(generate_s, 2), "kv_cache_gib": round(backend.cache_bytes() / gib, 2)}
    try:
        trainer.update(groups)
    except Exception as exc:  # noqa: BLE001 - the stages' rows are kept; the row says why it has no update
        from sptool.core.records import first_line

        row["update_error"] = f"{type(exc).__name__}: {first_line(exc)}"
        print(f"# loop-step memory: the update failed ({row['update_error']})", file=sys.stderr, flush=True)
    if cuda:
        torch.cuda.synchronize()
        row.update(generate_peak_gib=round(generate_peak / gib, 2),
                   step_peak_gib=round(torch.cuda.max_memory_allocated() / gib, 2),
                   reserved_gib=round(torch.cuda.memory_reserved() / gib, 2))
    row["train_s"] = round(time.perf_counter() - start, 2)
    return row


STAGE_HEADER = ["stage", "recipe", "shape", "decoder", "attention", "graph", "window", "sampler", "decoding", "calls", "rows", "max_tokens", "warmup_s", "steps_s",
                "tok_s", "bare_steps_s", "bare_tok_s", "x_bare", "bare_bf16_steps_s", "x_bare_bf16", "bare_rows_at_once",
                "bare_bf16_rows_at_once", "floor_steps_s", "kv_floor_steps_s",
                "prefill_ms", "loop_ms", "host_ms", "render_ms", "encode_ms", "pack_ms"]


#: issue 33's target: every generating stage at this many times bare ``generate``'s decode steps/s
TARGET_X_BARE = {"tiny": 5.0, "0.6b": 3.0}


def target_lines(rows: list[dict]) -> list[str]:
    """Per sptool arm (shape, decoder, attention, step graph, a dynamic KV window, sampler): its
    slowest stage against bare ``generate`` and whether every stage reaches :data:`TARGET_X_BARE`
    for its shape."""
    arms: dict[tuple, list[dict]] = {}
    for row in rows:
        if "x_bare" in row:
            window = ("dynamic-window",) if row.get("window") == "dynamic" else ()
            key = (row["shape"], row["decoder"], row["attention"], row["graph"], *window, row["sampler"])
            arms.setdefault(key, []).append(row)
    lines = []
    for (shape, *arm), stages in arms.items():
        target = TARGET_X_BARE.get(shape)

        def against(key: str) -> str:
            slowest = min(stages, key=lambda row: row[key])
            verdict = "" if target is None else (f"; every stage >= {target:g}x: "
                                                 + ("yes" if slowest[key] >= target else "no"))
            return f"{slowest['stage']} at {slowest[key]}x{verdict}"

        counted = f"{len(stages)} stages" if len(stages) > 1 else "1 stage"
        line = f"{shape} {'/'.join(arm)}: slowest of {counted} against bare generate: {against('x_bare')}"
        if all("x_bare_bf16" in row for row in stages):
            line += f"; against bare generate on a bf16 copy: {against('x_bare_bf16')}"
        lines.append(line)
    return lines


def measure(name: str, model: str, batch: int, args) -> dict:
    from sptool.models.base import SamplingParams, load_backend
    from sptool.prompts import load_template
    from sptool.stages.solve import solve_prompt

    options = dict(device=args.device, dtype=args.dtype, batch_size=batch, base_url=args.base_url)
    if args.static_cache:
        options["static_cache"] = True
    if args.compile:
        options["compile"] = True
    if name == "hf":
        options["decoder"] = args.decoder[0]
    load_start = time.perf_counter()
    backend = load_backend(name, model, **options)
    load_s = time.perf_counter() - load_start
    records = questions(batch)
    template = load_template("solve_math")
    prompts = [solve_prompt(template, record) for record in records]
    params = SamplingParams(temperature=args.temperature, top_p=1.0, max_new_tokens=args.max_tokens,
                            seed=args.seed)
    # warm-up at the full batch shape for both paths (kernel selection, allocator, compile)
    time_sptool(backend, records, params, batch)
    BARE[name](backend, prompts, params)
    sptool_runs, bare_runs = [], []
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits both
        sptool_runs.append(time_sptool(backend, records, params, batch))
        bare_runs.append(BARE[name](backend, prompts, params))
    default_runs = []
    if name == "hf" and (args.static_cache or args.compile):
        bare_hf(backend, prompts[:min(batch, 4)], params, same_options=False)
        default_runs = [bare_hf(backend, prompts, params, same_options=False) for _ in range(args.repeats)]
    backend.close()

    def rate(runs):
        return statistics.median(tokens / seconds for seconds, tokens in runs)

    sptool_rate, bare_rate = rate(sptool_runs), rate(bare_runs)
    extra = {}
    if default_runs:
        extra = dict(default_bare_tok_s=round(rate(default_runs), 1),
                     speedup_vs_default_bare=round(sptool_rate / rate(default_runs), 2))
    return dict(**extra, backend=name, decoder=options.get("decoder", ""), shape=args.shape, batch=batch, max_tokens=args.max_tokens,
                tokens=sptool_runs[-1][1], bare_tokens=bare_runs[-1][1], load_s=round(load_s, 1),
                sptool_tok_s=round(sptool_rate, 1), bare_tok_s=round(bare_rate, 1),
                ratio=round(sptool_rate / bare_rate, 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="hf,vllm", help="comma-separated: hf, vllm, openai")
    parser.add_argument("--batch", default="16", help="sequences per call, comma-separated list")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", default=None, help="cpu, cuda (default: cuda when available)")
    parser.add_argument("--dtype", default=None, help="auto, bf16, fp32 (default: the backend's)")
    parser.add_argument("--shape", choices=["tiny", "0.6b"], default="tiny")
    parser.add_argument("--static-cache", action="store_true", help="hf: static KV cache")
    parser.add_argument("--compile", action="store_true", help="hf: torch.compile the decode step")
    parser.add_argument("--base-url", default=None, help="openai: server(s), comma-separated")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="also print each row as JSON")
    parser.add_argument("--stages", action="store_true",
                        help="hf: every generating stage inside `sptool run` against bare generate")
    parser.add_argument("--no-compile", action="store_true", help="--stages: eager decoding (the off switch)")
    parser.add_argument("--only", default="", help="--stages: these stages only (solve,validity,questioner,"
                        "challenger,synthesis,novelty,eval)")
    parser.add_argument("--decoder", default="generate",
                        help="hf: the sptool arm's decoder, comma-separated: generate (transformers' generate), "
                        "step (sptool's step decoder, issue 33); --stages measures each, other runs the first")
    parser.add_argument("--attention", default="model",
                        help="--stages: the sptool arm's model.decode_attention, comma-separated: model (the "
                        "model's own SDPA), grouped (sptool.models.decode_attention: one decoding position "
                        "against the cache, read once)")
    parser.add_argument("--step-graph", default="compile",
                        help="--stages: how the step decoder's step becomes a CUDA graph, comma-separated: compile "
                        "(torch.compile's reduce-overhead) or capture (sptool captures each cache's step itself: "
                        "one replay a token)")
    parser.add_argument("--window", default="static",
                        help="--stages with the step decoder and grouped attention, comma-separated: static (a "
                        "compiled step per KV window, the default) or dynamic (the window a dynamic size of "
                        "one compiled step: fewer compiles; its token loop against static's is the question)")
    parser.add_argument("--sampler", default="fp32", choices=["fp32", "bf16-split"],
                        help="--stages: the sptool arm's sampling precision: fp32 (the trainer's float32 policy, "
                        "the default) or bf16-split (bf16 autocast with train.weight_rounding = split, which sees "
                        "every update); the bare arm is the float32 model's generate, and with bf16-split also "
                        "generate on a bf16 copy of the model (x_bare_bf16: the same precision)")
    parser.add_argument("--hbm", type=float, default=4.3e12, help="--stages: HBM bytes/s of the floor")
    parser.add_argument("--profile", default=None, metavar="DIR", help="--stages: each stage once more under "
                        "torch.profiler; ms per decoding step (wall and device) and the top ops in DIR/STAGE-DECODER.txt")
    args = parser.parse_args()
    args.decoder = [item.strip() for item in args.decoder.split(",") if item.strip()] or ["generate"]
    if not set(args.decoder) <= {"generate", "step"}:
        parser.error(f"--decoder: generate or step, not {args.decoder}")
    args.attention = [item.strip() for item in args.attention.split(",") if item.strip()] or ["model"]
    if not set(args.attention) <= {"model", "grouped"}:
        parser.error(f"--attention: model or grouped, not {args.attention}")
    args.step_graph = [item.strip() for item in args.step_graph.split(",") if item.strip()] or ["compile"]
    if not set(args.step_graph) <= {"compile", "capture"}:
        parser.error(f"--step-graph: compile or capture, not {args.step_graph}")
    args.window = [item.strip() for item in args.window.split(",") if item.strip()] or ["static"]
    if not set(args.window) <= {"static", "dynamic"}:
        parser.error(f"--window: static or dynamic, not {args.window}")
    if args.stages:
        args.batch = [int(item) for item in args.batch.split(",")]
        with tempfile.TemporaryDirectory(prefix="sptool-bench-") as workdir:
            model = build_shape_model(args.shape, workdir)
            if model == "tiny":
                from sptool.models.resolve import resolve_model

                model = resolve_model("tiny")
            rows = measure_stages(model, args)
        for row in rows:
            if args.json:
                print(json.dumps(row), flush=True)
        print("| " + " | ".join(STAGE_HEADER) + " |")
        print("|" + "---|" * len(STAGE_HEADER))
        for row in rows:
            if "steps_s" in row:
                print("| " + " | ".join(str(row.get(key, "")) for key in STAGE_HEADER) + " |")
        for row in rows:
            if "steps_s" not in row:
                print("# " + json.dumps(row))
        for line in target_lines(rows):
            print("# " + line)
            print("# " + line, file=sys.stderr)
        return

    rows = []
    with tempfile.TemporaryDirectory(prefix="sptool-bench-") as workdir:
        model = build_shape_model(args.shape, workdir)
        for name in [item.strip() for item in args.backend.split(",") if item.strip()]:
            for batch in [int(item) for item in args.batch.split(",")]:
                row = measure(name, model, batch, args)
                rows.append(row)
                if args.json:
                    print(json.dumps(row), flush=True)
                print(f"# {name} batch {batch}: sptool {row['sptool_tok_s']} tok/s, "
                      f"bare {row['bare_tok_s']} tok/s, ratio {row['ratio']}", file=sys.stderr, flush=True)
    header = ["backend", "shape", "batch", "max_tokens", "tokens", "sptool_tok_s", "bare_tok_s", "ratio"]
    if any("speedup_vs_default_bare" in row for row in rows):
        header += ["default_bare_tok_s", "speedup_vs_default_bare"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(row.get(key, "")) for key in header) + " |")


if __name__ == "__main__":
    main()
