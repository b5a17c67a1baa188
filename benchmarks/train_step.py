"""Benchmark: sptool's train-step update vs a bare torch forward/backward/AdamW over the same batch.

    python benchmarks/train_step.py                          # CPU, small random Llama
    python benchmarks/train_step.py --device cuda --shape 0.5b   # GPU, ≈0.5B Qwen-like, bf16 autocast

Both paths get the same random-initialised model (copied), the same token batch (random ids:
``groups × group_size`` sequences of ``prompt_len + completion_len`` tokens, random advantages)
and the same micro-batch plan (``--max-tokens-per-micro-batch``). The bare path is the minimum
any trainer must do: forward, a policy-gradient loss −Σ A·log π over completion tokens,
backward, AdamW step. The sptool paths are ``PolicyTrainer.update_sequences`` (Dr. GRPO loss,
ratio, clipping, entropy and metrics, gradient clipping, accelerate wrapping):

- ``old``: ``--full-logits --no-compile``, the previous computation ([tokens × vocabulary]
  logits, float32 log-softmax and entropy over them, attention mask);
- ``chunked``: the head applied in token chunks with the loss gradient fused into the same pass,
  no attention mask, eager torch throughout (``--no-compile``; what CPUs run);
- ``kernels``: ``chunked`` with the chunk kernels compiled by torch.compile (CUDA);
- ``new``: the default: ``kernels`` plus regional torch.compile of the decoder layers (CUDA);
- ``new-noent``: the default without the entropy metric (``--no-entropy``);
- the trainer's precision (issue 32; ``new`` is whatever the default is, these name it):
  ``new-fp32`` (float32, no autocast), ``new-bf16`` (bf16 autocast, log π_old from the sampler),
  ``new-bf16-selfold`` (bf16, ``old_logprobs="trainer"``: the update's own forward gives log π_old,
  no extra pass), ``new-bf16-selfold-fp32head`` (also the LM head in float32), ``new-bf16-tis``
  (self-old with TIS, cap 2), ``new-fp16-selfold`` (fp16 autocast with the gradient scaler).
Compile time falls in each path's untimed warm-up step. Every sequence carries sampler log-probs
(random, as a run's groups carry the sampler's), so the gap and TIS statistics are computed as
in a run.

Each path runs alone (the previous one's model and optimizer are freed first), one untimed
warm-up step, then ``--repeats`` timed steps. Prints a table with tokens/s (prompt + completion
tokens per second of the update), the ratio to bare, peak memory (CUDA: the allocator's peak;
CPU: the process's peak resident memory, reset before each path) and, on CUDA, model FLOPs
utilisation against ``--peak-tflops`` (default 790, bf16 dense) using FLOPs/token =
6·N + 12·L·d·T (PaLM appendix B; N = parameters in matmuls, L layers, d hidden size, T sequence
length).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from pathlib import Path

SHAPES = {
    # name: (hidden, intermediate, layers, heads, kv_heads, vocab, family)
    "small": (256, 704, 4, 4, 2, 49152, "llama"),
    "tiny": (576, 1536, 30, 9, 3, 49152, "llama"),       # SmolLM2-135M's shape
    "0.5b": (896, 4864, 24, 14, 2, 151936, "qwen2"),     # Qwen2.5-0.5B's shape (≈494M parameters)
}


def build_model(shape: str, seed: int):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    hidden, intermediate, layers, heads, kv_heads, vocab, family = SHAPES[shape]
    cls = Qwen2Config if family == "qwen2" else LlamaConfig
    config = cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                 num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                 tie_word_embeddings=True, pad_token_id=0)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32), config


def make_batch(args, vocab: int):
    import random

    from sptool.train.step import TrainSequence

    rng = random.Random(args.seed)
    sequences = []
    for _ in range(args.groups):
        prompt = [rng.randrange(1, vocab) for _ in range(args.prompt_len)]
        rewards = [float(rng.random() < 0.5) for _ in range(args.group_size)]
        mean = sum(rewards) / len(rewards)
        for reward in rewards:
            completion = [rng.randrange(1, vocab) for _ in range(args.completion_len)]
            sampled = [math.log(rng.uniform(0.05, 1.0)) for _ in completion]  # the sampler's log-probs
            sequences.append(TrainSequence(prompt, completion, reward - mean + rng.uniform(-0.1, 0.1), reward,
                                           old_logprobs=sampled))
    return sequences


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bare_step(model, optimizer, sequences, plan, device: str, autocast_dtype):
    import torch

    for micro in plan:
        batch = [sequences[i] for i in micro]
        ids = torch.tensor([s.prompt_ids + s.completion_ids for s in batch], device=device)
        prompt_len = len(batch[0].prompt_ids)
        adv = torch.tensor([s.advantage for s in batch], device=device)
        with torch.autocast(device_type="cuda" if device.startswith("cuda") else "cpu",
                            dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = model(input_ids=ids, use_cache=False).logits
        logits = logits[:, prompt_len - 1:-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, prompt_len:, None]).squeeze(-1)
        loss = -(adv[:, None] * logp).sum() / (len(sequences) * logp.shape[1])
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def flops_per_token(model, config, seq_len: int) -> float:
    n = sum(p.numel() for p in model.parameters())
    if not getattr(config, "tie_word_embeddings", False):
        n -= config.vocab_size * config.hidden_size  # the input embedding is a lookup, not a matmul
    return 6 * n + 12 * config.num_hidden_layers * config.hidden_size * seq_len


PATHS = {
    "bare": ("bare torch fwd/bwd/AdamW", None),
    "bare-fused": ("bare torch fwd/bwd/AdamW(fused=True)", None),
    "old": ("sptool, old (--full-logits --no-compile)", dict(full_logits=True, compile=False, compile_kernels=False)),
    "chunked": ("sptool, chunked log-probs, eager (--no-compile)", dict(compile=False, compile_kernels=False)),
    "kernels": ("sptool, chunked + compiled chunk kernels", dict(compile=False)),
    "new": ("sptool, default (CUDA: bf16, stochastic rounding, trainer log π_old; compiled layers)", dict()),
    "new-noent": ("sptool, new default, --no-entropy", dict(entropy=False)),
    "new-fp32": ("sptool, float32 (mixed_precision=no)", dict(mixed_precision="no")),
    "new-tf32": ("sptool, float32 with TF32 matmuls (tf32)", dict(mixed_precision="no", tf32=True)),
    "new-bf16": ("sptool, bf16 autocast, log π_old from the sampler", dict(mixed_precision="bf16")),
    "new-bf16-selfold": ("sptool, bf16, old_logprobs=trainer", dict(mixed_precision="bf16", old_logprobs="trainer")),
    "new-bf16-selfold-fp32head": ("sptool, bf16, old_logprobs=trainer, fp32_head",
                                  dict(mixed_precision="bf16", old_logprobs="trainer", fp32_head=True)),
    "new-bf16-tis": ("sptool, bf16, old_logprobs=trainer, tis_cap=2",
                     dict(mixed_precision="bf16", old_logprobs="trainer", tis_cap=2.0)),
    "new-fp16-selfold": ("sptool, fp16 + scaler, old_logprobs=trainer",
                         dict(mixed_precision="fp16", old_logprobs="trainer")),
    "new-fp16-selfold-fp32head": ("sptool, fp16 + scaler, old_logprobs=trainer, fp32_head",
                                  dict(mixed_precision="fp16", old_logprobs="trainer", fp32_head=True)),
    "new-bf16-split-selfold": ("sptool, bf16, old_logprobs=trainer, weight_rounding=split",
                               dict(mixed_precision="bf16", old_logprobs="trainer", weight_rounding="split")),
    "new-bf16-sr-selfold": ("sptool, bf16, old_logprobs=trainer, weight_rounding=stochastic",
                            dict(mixed_precision="bf16", old_logprobs="trainer", weight_rounding="stochastic")),
}
# paths measured when a low-precision trainer defaulted to the sampler's log π_old and the nearest
# cast keep those; "new" is the default (on CUDA: bf16, stochastic rounding, the trainer's log π_old)
for _label, _options in PATHS.values():
    if _options and _options.get("mixed_precision") in ("bf16", "fp16"):
        _options.setdefault("old_logprobs", "sampler")
        _options.setdefault("weight_rounding", "nearest")


def reset_peak(cuda: bool) -> None:
    import torch

    if cuda:
        torch.cuda.reset_peak_memory_stats()
        return
    try:  # Linux: writing 5 to clear_refs resets the peak resident set size (VmHWM)
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pass


def peak_gib(cuda: bool) -> float | None:
    import torch

    if cuda:
        return torch.cuda.max_memory_allocated() / 2**30
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def run_shape(args, shape: str, paths: list[str]) -> None:
    import gc

    import torch

    from sptool.train.step import PolicyTrainer, TrainConfig, plan_micro_batches

    cuda = args.device.startswith("cuda")
    model, config = build_model(shape, args.seed)
    sequences = make_batch(args, config.vocab_size)
    plan = plan_micro_batches([s.length for s in sequences], args.max_tokens_per_micro_batch)
    tokens = sum(s.length for s in sequences)
    n_params = sum(p.numel() for p in model.parameters())
    autocast_dtype = torch.bfloat16 if cuda else None
    seq_len = args.prompt_len + args.completion_len
    flops = flops_per_token(model, config, seq_len) * tokens
    print(f"shape {shape} ({n_params / 1e6:.1f}M parameters), device {args.device}, "
          f"batch {len(sequences)} sequences × {seq_len} tokens = {tokens} tokens, "
          f"{len(plan)} micro-batches of ≤ {args.max_tokens_per_micro_batch} tokens, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.repeats} timed steps"
          + (f", sptool paths LoRA r={args.lora_r}" if args.lora_r else ""), flush=True)
    header = "| path | s/step | tokens/s | × bare |" + (" MFU |" if cuda else "") + " peak GiB |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1), flush=True)

    def profiled(name: str, step) -> None:
        """One more (warm) step under ``torch.profiler``: ``--profile DIR/SHAPE-PATH.txt``, the ops by
        self device time on CUDA (self CPU time otherwise), and the device's busy share of the step:
        where the step's time goes, the bare step's beside sptool's."""
        from torch.profiler import ProfilerActivity, profile

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from generation import device_busy_us

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        started = time.perf_counter()
        with profile(activities=activities) as prof:
            step()
            sync(args.device)
        wall = time.perf_counter() - started
        events = prof.key_averages()
        busy = device_busy_us(events) / 1e6 if cuda else None
        out = Path(args.profile)
        out.mkdir(parents=True, exist_ok=True)
        table = events.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=40)
        head = f"{shape} {name}: one step in {wall:.3f} s under the profiler" + \
            (f", the device busy {busy:.3f} s of it" if busy is not None else "")
        (out / f"{shape}-{name}.txt").write_text(head + "\n\n" + table + "\n", encoding="utf-8")
        print(f"# {head} -> {out / (shape + '-' + name + '.txt')}", file=sys.stderr, flush=True)

    def synchronizing(name: str, step) -> None:
        """``--sync-debug``: one more (warm) step with ``torch.cuda.set_sync_debug_mode("warn")``,
        the host-synchronising calls counted by the Python line that made them (stderr). A sync
        inside the micro-batch loop leaves the GPU idle while the host packs and launches."""
        import collections
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        where = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                                    if "synchroniz" in str(w.message))
        total = sum(where.values())
        lines = ", ".join(f"{place} ×{n}" for place, n in where.most_common(12)) or "none"
        print(f"# {shape} {name}: {total} synchronising calls in one step: {lines}", file=sys.stderr, flush=True)

    def timed(step) -> tuple[float, float | None]:
        step()  # warm-up (allocations, kernels, compilation)
        sync(args.device)
        reset_peak(cuda)
        start = time.perf_counter()
        for _ in range(args.repeats):
            step()
        sync(args.device)
        return (time.perf_counter() - start) / args.repeats, peak_gib(cuda)

    bare_s = None
    for name in paths:
        label, options = PATHS[name]
        copy_ = copy.deepcopy(model)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        try:
            if options is None:
                bare_model = copy_.to(args.device)
                bare_model.train()
                bare_optimizer = torch.optim.AdamW(bare_model.parameters(), lr=1e-6, weight_decay=0.0,
                                                   **({"fused": True} if name == "bare-fused" else {}))
                seconds, peak = timed(lambda: bare_step(bare_model, bare_optimizer, sequences, plan, args.device,
                                                        autocast_dtype))
                if args.profile:
                    profiled(name, lambda: bare_step(bare_model, bare_optimizer, sequences, plan, args.device,
                                                     autocast_dtype))
                if args.sync_debug and cuda:
                    synchronizing(name, lambda: bare_step(bare_model, bare_optimizer, sequences, plan, args.device,
                                                          autocast_dtype))
                del bare_model, bare_optimizer
            else:
                if args.lora_r:
                    from peft import LoraConfig, get_peft_model

                    copy_ = get_peft_model(copy_, LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r,
                                                             target_modules="all-linear", task_type="CAUSAL_LM"))
                from accelerate.state import AcceleratorState

                AcceleratorState._reset_state(True)  # each path its own precision (one per process otherwise)
                trainer = PolicyTrainer(TrainConfig(model="<benchmark>", learning_rate=1e-6, device=args.device,
                                                    max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
                                                    max_completion_tokens=args.completion_len, **options),
                                        model=copy_,
                                        log=lambda message: print(message, file=sys.stderr, flush=True))
                seconds, peak = timed(lambda: trainer.update_sequences(sequences))
                if args.profile:
                    profiled(name, lambda: trainer.update_sequences(sequences))
                if args.sync_debug and cuda:
                    synchronizing(name, lambda: trainer.update_sequences(sequences))
                del trainer
        except Exception as exc:  # noqa: BLE001 - one path failing must not hide the others
            print(f"| {label} | failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]} |", flush=True)
            continue
        finally:
            del copy_
        if name == "bare":
            bare_s = seconds
        row = f"| {label} | {seconds:.3f} | {tokens / seconds:,.0f} | " + \
              (f"{bare_s / seconds:.2f} |" if bare_s else "– |")
        if cuda:
            row += f" {flops / seconds / (args.peak_tflops * 1e12):.1%} |"
        row += f" {peak:.1f} |" if peak is not None else " – |"
        print(row, flush=True)
    print(flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default=None, help=f"comma-separated, of {sorted(SHAPES)}; "
                        "default: small on CPU, 0.5b on CUDA")
    parser.add_argument("--paths", default=None, help=f"comma-separated, of {list(PATHS)}; "
                        "default: bare,old,new,new-noent (CPU), bare,old,chunked,kernels,new,new-noent (CUDA)")
    parser.add_argument("--groups", type=int, default=None)
    parser.add_argument("--group-size", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--completion-len", type=int, default=None)
    parser.add_argument("--max-tokens-per-micro-batch", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", default=None, metavar="DIR", help="each path once more under torch.profiler "
                        "(after its timed steps): the top ops in DIR/SHAPE-PATH.txt")
    parser.add_argument("--sync-debug", action="store_true", help="cuda: each path once more with "
                        "torch.cuda.set_sync_debug_mode('warn'); the synchronising calls by line (stderr)")
    parser.add_argument("--lora-r", type=int, default=0, help="sptool paths train a LoRA adapter of this rank "
                        "(the bare path stays full fine-tuning)")
    parser.add_argument("--peak-tflops", type=float, default=790.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    defaults = dict(shape="0.5b", groups=16, group_size=8, prompt_len=128, completion_len=384,
                    max_tokens_per_micro_batch=16384) if cuda else \
        dict(shape="small", groups=2, group_size=4, prompt_len=32, completion_len=64,
             max_tokens_per_micro_batch=512)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    paths = (args.paths or ("bare,old,chunked,kernels,new,new-noent" if cuda else "bare,old,new,new-noent")).split(",")
    shapes = args.shape.split(",")
    for name in paths:
        if name not in PATHS:
            parser.error(f"unknown path '{name}' (known: {', '.join(PATHS)})")
    for name in shapes:
        if name not in SHAPES:
            parser.error(f"unknown shape '{name}' (known: {', '.join(SHAPES)})")
    for shape in shapes:
        run_shape(args, shape, paths)


if __name__ == "__main__":
    sys.exit(main())
