"""Precision probe: on ONE fixed batch of sampled completions and Dr. GRPO advantages, how far
do the bf16 paths of sampling and training move from float32?

The batch: the tiny model (float32, eager) samples ``--problems`` two-digit sums × ``--samples``
completions with the zero-shot prompt (temperature 1, no top-k); rewards are 1 (right boxed
answer), 0.1 (a box, wrong), 0 (no box); advantages ``r − mean(group)``. Then:

1. **Sampler.** The next-token distributions over the sampled tokens, teacher-forced with the
   generator's own layout (left padding, attention mask, positions), in float32 and under
   ``torch.autocast(bfloat16)`` (what a generator sharing accelerate's wrapped model computes):
   the per-token log-prob gap on the chosen tokens (mean |Δ|, RMS, max), the KL(fp32 ‖ bf16) per
   token, and how often the two distributions' top token differs. Also the gap between the sampler
   (left-padded forward) and the trainer (``PolicyTrainer.logprobs``: right-padded, chunked head)
   in each precision.
2. **Trainer.** The gradient of one Dr. GRPO update (no clipping) from ``PolicyTrainer`` under each
   ``mixed_precision`` and head path, against float32: cosine, relative norm, and the cosine and
   relative size of the first Adam update (fresh state: ``lr · g / (|g| + eps)``), overall and for
   the tied embedding / LM head alone.

    python benchmarks/precision_probe.py --device cuda              # the issue's 64 × 8, 64 tokens
    python benchmarks/precision_probe.py --device cpu --problems 4 --samples 2 --max-tokens 16

Prints a table and writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from learning_parity import read_jsonl, reward  # noqa: E402  (the parity benchmark's grader)


def sample_batch(model, tokenizer, problems, template, samples, max_tokens, device, seed):
    import torch

    from sptool.models.tokenizer import render_prompt

    texts = [render_prompt(tokenizer, [{"role": "user", "content": template.replace("{question}", p["question"])}])
             for p in problems]
    encoded = tokenizer([t for t in texts for _ in range(samples)], return_tensors="pt", padding=True,
                        add_special_tokens=False).to(device)
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(**encoded, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             max_new_tokens=max_tokens, pad_token_id=tokenizer.pad_token_id)
    prompt_len = encoded["input_ids"].shape[1]
    eos = {tokenizer.eos_token_id, *([model.generation_config.eos_token_id]
                                    if isinstance(model.generation_config.eos_token_id, int)
                                    else model.generation_config.eos_token_id or [])}
    groups = []
    completions_ids = []
    for i, problem in enumerate(problems):
        group = {"prompt": [{"role": "user", "content": template.replace("{question}", problem["question"])}],
                 "completions": [], "rewards": [], "finish_reasons": []}
        for j in range(samples):
            ids = out[i * samples + j, prompt_len:].tolist()
            finish = "length"
            for position, token in enumerate(ids):
                if token in eos:
                    ids, finish = ids[:position + 1], "stop"
                    break
            text = tokenizer.decode(ids, skip_special_tokens=True)
            group["completions"].append(text)
            group["rewards"].append(reward(text, problem["answer"]))
            group["finish_reasons"].append(finish)
            completions_ids.append(ids)
        mean = sum(group["rewards"]) / samples
        group["advantages"] = [r - mean for r in group["rewards"]]
        groups.append(group)
    return groups, encoded, out, completions_ids


def sampler_logprobs(model, encoded, sequences, completion_ids, autocast_dtype, device):
    """Per-token log-probs and full log-softmax rows of the sampled tokens, teacher-forced with the
    generator's layout (left padding + attention mask + positions), optionally under autocast."""
    import contextlib

    import torch

    prompt_len = encoded["input_ids"].shape[1]
    attention = torch.cat([encoded["attention_mask"], torch.zeros_like(sequences[:, prompt_len:])], dim=1)
    for row, ids in enumerate(completion_ids):
        attention[row, prompt_len:prompt_len + len(ids)] = 1
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    chosen, rows = [], []
    context = torch.autocast(device.split(":")[0], dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    with torch.inference_mode():
        for start in range(0, sequences.shape[0], 64):
            sl = slice(start, start + 64)
            with context:
                logits = model(input_ids=sequences[sl], attention_mask=attention[sl], position_ids=positions[sl]).logits
            logp = torch.log_softmax(logits[:, prompt_len - 1:-1].float(), dim=-1)
            for k, ids in enumerate(completion_ids[sl]):
                n = len(ids)
                rows.append(logp[k, :n])
                chosen.append(logp[k, :n].gather(-1, torch.tensor(ids, device=logp.device)[:, None]).squeeze(-1))
    return torch.cat(chosen), torch.cat(rows)


def gap(a, b) -> dict:
    d = (a - b).double()
    return {"mean_abs": d.abs().mean().item(), "rms": d.pow(2).mean().sqrt().item(), "max_abs": d.abs().max().item(),
            "rel_rms_pct": 100 * (d.pow(2).mean().sqrt() / b.double().abs().mean().clamp(min=1e-12)).item()}


def trainer_gradient(model_path, groups, precision, full_logits, device, lr, max_tokens):
    """Gradient of one update (no clipping), per parameter name, and the trainer's log-probs."""
    import torch

    from accelerate.state import AcceleratorState

    from sptool.train.step import PolicyTrainer, TrainConfig

    AcceleratorState._reset_state(True)  # one Accelerator per trainer, each its own precision
    config = TrainConfig(model=model_path, loss="dr_grpo", learning_rate=lr, beta=0.0, max_grad_norm=0.0,
                         device=device, mixed_precision=precision, full_logits=full_logits,
                         max_completion_tokens=max_tokens, max_tokens_per_micro_batch=16384, entropy=False)
    trainer = PolicyTrainer(config)
    sequences = [seq for group in groups for seq in trainer.encode_group(group)]
    logprobs = trainer.logprobs(sequences)
    captured = {}
    policy = trainer.accelerator.unwrap_model(trainer.model)

    def capture():
        for name, p in policy.named_parameters():
            if p.grad is not None:
                captured[name] = p.grad.detach().float().clone()

    trainer.optimizer.step = capture
    trainer.update_sequences(sequences)
    del trainer
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return captured, logprobs


def bare_gradient(model_path, encoded, sequences, completion_ids, groups, device, max_tokens, autocast_dtype=None):
    """The gradient of learning_parity's bare loss on the same batch: the generator's left-padded
    rows with positions from the attention mask, ``Σ A·(−log π)·mask / (N · max_tokens)``."""
    import contextlib

    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).train()
    sequences = sequences.clone()  # generated under inference_mode
    encoded = {key: value.clone() for key, value in encoded.items()}
    prompt_len = encoded["input_ids"].shape[1]
    completion = sequences[:, prompt_len:]
    mask = torch.zeros_like(completion)
    for row, ids in enumerate(completion_ids):
        mask[row, :len(ids)] = 1
    attention = torch.cat([encoded["attention_mask"], mask], dim=1)
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    advantages = torch.tensor([a for g in groups for a in g["advantages"]], device=device)
    n = sequences.shape[0]
    context = torch.autocast(device.split(":")[0], dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    for start in range(0, n, 128):
        rows = slice(start, start + 128)
        with context:
            logits = model(input_ids=sequences[rows], attention_mask=attention[rows], position_ids=positions[rows],
                           logits_to_keep=completion.shape[1] + 1).logits[:, :-1]
        nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), completion[rows].reshape(-1),
                              reduction="none").view(logits.shape[:2])
        ((advantages[rows, None] * nll * mask[rows]).sum() / (n * max_tokens)).backward()
    grads = {name: p.grad.detach().float().clone() for name, p in model.named_parameters() if p.grad is not None}
    del model
    return grads


def gradient_scale(g, eps=1e-8) -> dict:
    import torch

    flat = torch.cat([v.reshape(-1) for v in g.values()]).abs()
    sample = flat[torch.randperm(flat.numel(), device=flat.device)[:1_000_000]]
    return {"norm": flat.norm().item(), "median_abs": sample.median().item(),
            "share_below_adam_eps": (sample < eps).double().mean().item()}


def compare_gradients(g, ref, lr, eps=1e-8) -> dict:
    import torch

    def flat(d, names):
        return torch.cat([d[n].reshape(-1) for n in names])

    names = sorted(ref)
    head = [n for n in names if "embed" in n or "lm_head" in n]
    out = {}
    for label, subset in (("all", names), ("embedding/head", head)):
        if not subset:
            continue
        a, b = flat(g, subset).double(), flat(ref, subset).double()
        ua, ub = lr * a / (a.abs() + eps), lr * b / (b.abs() + eps)  # first Adam step, fresh state
        out[label] = {"grad_cosine": torch.nn.functional.cosine_similarity(a, b, dim=0).item(),
                      "grad_rel_norm": (a.norm() / b.norm()).item(),
                      "grad_rel_error": ((a - b).norm() / b.norm()).item(),
                      "adam_update_cosine": torch.nn.functional.cosine_similarity(ua, ub, dim=0).item(),
                      "adam_update_rel_norm": (ua.norm() / ub.norm()).item(),
                      "adam_sign_agreement": (torch.sign(a) == torch.sign(b)).double().mean().item()}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None)
    parser.add_argument("--problems", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", default=str(ROOT / "fixtures/addition_train.jsonl"))
    parser.add_argument("--prompt", default=str(ROOT / "benchmarks/prompt_zero_shot.txt"))
    parser.add_argument("--arms", default="no,bf16,bf16-full,fp16,bare",
                        help="trainer precisions (no, bf16, fp16; -full: the full-logits path) and bare")
    parser.add_argument("--stochastic-draws", type=int, default=8,
                        help="forwards averaged for the stochastic weight rounding's update visibility")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from sptool.models.tokenizer import load_tokenizer
    from sptool.models.resolve import resolve_model

    transformers.utils.logging.set_verbosity_error()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    path = resolve_model("tiny")
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    template = Path(args.prompt).read_text(encoding="utf-8").strip()
    problems = read_jsonl(args.train)[:args.problems]
    began = time.perf_counter()
    groups, encoded, sequences, completion_ids = sample_batch(model, tokenizer, problems, template, args.samples,
                                                              args.max_tokens, device, args.seed)
    rewards = [r for g in groups for r in g["rewards"]]
    result: dict = {"settings": vars(args), "device": device,
                    "batch": {"completions": len(rewards), "tokens": sum(len(c) for c in completion_ids),
                              "accuracy": sum(r == 1.0 for r in rewards) / len(rewards),
                              "boxed": sum(r > 0 for r in rewards) / len(rewards),
                              "groups_with_signal": sum(max(g["rewards"]) > min(g["rewards"]) for g in groups)}}
    print(f"batch: {result['batch']} ({time.perf_counter() - began:.1f} s)", file=sys.stderr)

    # 1. the sampler
    lp32, rows32 = sampler_logprobs(model, encoded, sequences, completion_ids, None, device)
    sampler = {}
    low = [("bf16", torch.bfloat16)] + ([("fp16", torch.float16)] if device.startswith("cuda") else [])
    for name, dtype in low:
        lp, rows = sampler_logprobs(model, encoded, sequences, completion_ids, dtype, device)
        kl = (rows32.exp() * (rows32 - rows)).sum(-1)
        sampler[name] = {"chosen_logprob_gap": gap(lp, lp32), "kl_per_token_mean": kl.mean().item(),
                         "kl_per_token_max": kl.max().item(),
                         "argmax_differs": (rows.argmax(-1) != rows32.argmax(-1)).double().mean().item(),
                         "seq_logprob_gap_mean_abs": None}
        # the same gap summed over each completion (what the sequence-level ratio sees)
        seq_gaps, start = [], 0
        for ids in completion_ids:
            seq_gaps.append((lp[start:start + len(ids)] - lp32[start:start + len(ids)]).sum().abs().item())
            start += len(ids)
        sampler[name]["seq_logprob_gap_mean_abs"] = sum(seq_gaps) / len(seq_gaps)
    result["sampler_vs_fp32_sampler"] = sampler
    del model
    # 2. the trainer
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    grads, trainer_lps = {}, {}
    for arm in [a for a in arms if a != "bare"]:
        precision = arm.split("-")[0]
        if precision == "fp16" and not device.startswith("cuda"):
            continue
        begin = time.perf_counter()
        grads[arm], trainer_lps[arm] = trainer_gradient(path, groups, precision, arm.endswith("-full"), device,
                                                        args.lr, args.max_tokens)
        print(f"trainer {arm}: {time.perf_counter() - begin:.1f} s", file=sys.stderr)
    result["trainer_logprob_vs_fp32_sampler"] = {}
    for arm, per_sequence in trainer_lps.items():
        mine, theirs, start = [], [], 0
        for ids, values in zip(completion_ids, per_sequence):
            if len(values) == len(ids):  # same tokens (re-tokenisation may differ; EOS appended)
                mine += values
                theirs.append(lp32[start:start + len(ids)])
            start += len(ids)
        if mine:
            result["trainer_logprob_vs_fp32_sampler"][arm] = {
                **gap(torch.tensor(mine, device=lp32.device), torch.cat(theirs)), "tokens": len(mine)}
    if "bare" in arms:
        grads["bare"] = bare_gradient(path, encoded, sequences, completion_ids, groups, device, args.max_tokens)
    grads = {arm: g for arm, g in grads.items() if g}  # an update with no signal computes none
    result["gradient_scale"] = {arm: gradient_scale(g) for arm, g in grads.items()}
    reference = grads.get("no")
    result["gradient_vs_fp32_trainer"] = {arm: compare_gradients(g, reference, args.lr)
                                          for arm, g in grads.items() if arm != "no"} if reference else {}
    # 3. update visibility: after one (and five) first-step Adam updates of the float32 weights at --lr
    # (the fp32 trainer's gradient), how much do the sampler's log-probs move in each precision?
    if reference is not None:
        from sptool.train.rounding import use_weight_rounding

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        # each low precision with autocast's nearest cast and with sptool's weight roundings
        # (train.weight_rounding); a stochastic forward is averaged over --stochastic-draws
        views = [("bf16", torch.bfloat16, "nearest"), ("bf16-split", torch.bfloat16, "split"),
                 ("bf16-stochastic", torch.bfloat16, "stochastic")]
        if device.startswith("cuda"):
            views += [("fp16", torch.float16, "nearest"), ("fp16-split", torch.float16, "split")]

        def view_logprobs(dtype, rounding):
            use_weight_rounding(model, rounding)
            draws = args.stochastic_draws if rounding == "stochastic" else 1
            total = sum(sampler_logprobs(model, encoded, sequences, completion_ids, dtype, device)[0]
                        for _ in range(draws))
            use_weight_rounding(model, "nearest")
            return total / draws

        before = {name: view_logprobs(dtype, rounding) for name, dtype, rounding in views}
        before["fp32"] = lp32
        visibility = {}
        for steps in (1, 5):
            with torch.no_grad():
                for name, param in model.named_parameters():
                    g = reference.get(name)
                    if g is not None:
                        param -= args.lr * (steps if steps == 1 else steps - 1) * g / (g.abs() + 1e-8)
            moved32 = sampler_logprobs(model, encoded, sequences, completion_ids, None, device)[0] - before["fp32"]
            for name, dtype, rounding in views:
                moved = view_logprobs(dtype, rounding) - before[name]
                visibility[f"{name}_after_{steps}"] = {
                    "cosine_with_fp32_change": torch.nn.functional.cosine_similarity(
                        moved.double(), moved32.double(), dim=0).item(),
                    "relative_size": (moved.norm() / moved32.norm()).item()}
                print(f"visibility after {steps} update(s), {name}: {visibility[f'{name}_after_{steps}']}",
                      file=sys.stderr)
            visibility[f"fp32_change_rms_after_{steps}"] = moved32.pow(2).mean().sqrt().item()
        weights = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
        start_params = dict(weights.named_parameters())
        counts = {"bf16": 0, "fp16": 0, "total": 0}
        for name, param in model.named_parameters():
            old = start_params[name].detach()
            counts["bf16"] += int((param.to(torch.bfloat16) != old.to(torch.bfloat16)).sum())
            counts["fp16"] += int((param.to(torch.float16) != old.to(torch.float16)).sum())
            counts["total"] += param.numel()
        visibility["weights_whose_cast_changed_after_5"] = {k: counts[k] / counts["total"] for k in ("bf16", "fp16")}
        result["update_visibility"] = visibility
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
