"""Generation throughput: ``sptool solve``'s path against the bare library, per backend.

For each backend, one model is loaded once and the same workload is timed two ways, interleaved:

- **sptool**: a :class:`sptool.solve.SolveStage` over question records (prompt templating,
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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

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
    from sptool.solve import SolveStage

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
    if same_options:
        options.update(getattr(backend, "generate_options", {}) or {})
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


def measure(name: str, model: str, batch: int, args) -> dict:
    from sptool.models.base import SamplingParams, load_backend
    from sptool.prompts import load_template
    from sptool.solve import solve_prompt

    options = dict(device=args.device, dtype=args.dtype, batch_size=batch, base_url=args.base_url)
    if args.static_cache:
        options["static_cache"] = True
    if args.compile:
        options["compile"] = True
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
        if args.compile:
            backend.model.generation_config.disable_compile = True
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
    return dict(**extra,backend=name, shape=args.shape, batch=batch, max_tokens=args.max_tokens,
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
    args = parser.parse_args()

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
