"""Do the step decoders sample the trainer's policy after real updates? (issue 33)

Over four seeds the captured step decoder's learning curve fell behind ``generate``'s, and its share
of samples cut at the token limit stayed near the base model's while ``generate``'s fell: after one
update already, in all four seed pairs. The sampling-law tests compare the decoders on the base
model only. This benchmark compares them on a policy that a real :class:`PolicyTrainer` updates, as
``sptool run`` does: one model shared by the trainer (its defaults: bf16 autocast, stochastic
weight rounding, regional compile on CUDA) and the samplers of it (``--decoders``: ``generate``,
the eager step decoder, the captured step decoder; ``step-compile`` and ``step-capture-noprefix``
on demand, all built as the ``learning_parity.py`` arms build them).

Each round, on the same 64 prompts: every decoder's samples (8 a prompt, one seed a round): the
share cut at the limit, the mean length, the mean log-probability a token the sampler recorded, and
the share of samples equal to the first decoder's; with ``--greedy`` also its greedy tokens (the
rows that differ from the first decoder's, and where). Then one update on the first decoder's
samples, as the ``rlvr`` loop trains them, rewarded for ending (EOS) within the limit: a policy
that learns to stop, so a sampler that does not see the update keeps cutting.

    python benchmarks/shared_policy_decoding.py --device cuda --steps 2 --json OUT.json

On the CPU (``--no-compile``) the step decoder draws ``generate``'s exact tokens: ``torch.multinomial``'s
one draw is the same exponential race over the same generator. On CUDA the captured and compiled
steps draw from inductor's random stream, so there the cut shares are compared, and ``step-eager``
(the step decoder without compile) is the control that draws ``generate``'s tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parent.parent


def prompts_of(count: int) -> list[list[dict]]:
    """The learning-parity task's solver prompts (zero-shot, chat messages) for ``count`` problems."""
    template = (ROOT / "benchmarks" / "prompt_zero_shot.txt").read_text()
    problems = [json.loads(line) for line in (ROOT / "fixtures" / "addition_train.jsonl").read_text().splitlines()
                if line.strip()][:count]
    return [[{"role": "user", "content": template.replace("{question}", p["question"])}] for p in problems]


def decoders(model, tokenizer, batch: int, which: list[str], compile: bool = True) -> dict:
    from sptool.models.hf import HFBackend

    made = {}
    for name in which:
        options = dict(model_id="tiny", batch_size=batch, compile=compile and name != "generate")
        if name == "step-compile":
            options.update(decoder="step", decode_attention="grouped", step_graph="compile")
        elif name in ("step-capture", "step-capture-noprefix"):
            options.update(decoder="step", decode_attention="grouped", step_graph="capture")
        elif name == "step-eager":  # the step decoder without compile or graphs
            options.update(decoder="step", decode_attention="grouped", compile=False)
        made[name] = HFBackend.from_model(model, tokenizer, log=lambda line: print(f"# {line}", file=sys.stderr),
                                          **options)
        if name.endswith("noprefix"):
            made[name].prefix_min_saved_tokens = 1 << 30
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=2, help="updates (rounds: one more)")
    parser.add_argument("--problems", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-4,
                        help="10x the loop's: a sampler that missed an update shows after one")
    parser.add_argument("--decoders", default="generate,step-eager,step-capture",
                        help="the first is the reference (generate: eager, no compile)")
    parser.add_argument("--greedy", action="store_true", help="also compare greedy tokens (more compiles)")
    parser.add_argument("--mixed-precision", default=None, help="the trainer's (default: its own)")
    parser.add_argument("--no-compile", action="store_true", help="eager decoders (a CPU smoke run)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch

    from sptool.models.base import SamplingParams
    from sptool.train.step import PolicyTrainer, TrainConfig

    trainer = PolicyTrainer(TrainConfig(model="tiny", device=args.device, loss="dr_grpo", learning_rate=args.lr,
                                        max_completion_tokens=args.max_tokens, max_tokens_per_micro_batch=8192,
                                        mixed_precision=args.mixed_precision))
    model = trainer.accelerator.unwrap_model(trainer.model)
    names = args.decoders.split(",")
    backends = decoders(model, trainer.tokenizer, args.problems * args.samples, names, not args.no_compile)
    prompts = prompts_of(args.problems)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=args.max_tokens)
    rows = []
    for step in range(args.steps + 1):
        row: dict = {"step": step}
        reference = None
        drawn = {}
        for name, backend in backends.items():
            start = time.perf_counter()
            differ, first = [], []
            if args.greedy:
                tokens = [s.token_ids for samples in backend.generate(prompts, 1, greedy) for s in samples]
                if reference is None:
                    reference = tokens
                differ = [i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b]
                first = [next((j for j, (x, y) in enumerate(zip(reference[i], tokens[i])) if x != y),
                              min(len(reference[i]), len(tokens[i]))) for i in differ]
            params = SamplingParams(temperature=1.0, max_new_tokens=args.max_tokens, seed=1000 + step, logprobs=True)
            samples = backend.generate(prompts, args.samples, params)
            drawn[name] = samples
            flat = [s for row_ in samples for s in row_]
            if name == names[0]:
                reference_draws = [s.token_ids for s in flat]
            # torch.multinomial's one draw is the same exponential race as the step decoder's: with one
            # seed, a sampler of the same policy that consumes the generator as generate does draws the
            # same tokens (up to numerical near-ties, after which a row goes its own way)
            same_draws = sum(s.token_ids == other for s, other in zip(flat, reference_draws)) / len(flat)
            cut = sum(s.finish_reason == "length" for s in flat) / len(flat)
            mean_len = sum(s.n_tokens for s in flat) / len(flat)
            sampler_lp = sum(sum(s.logprobs) for s in flat) / max(1, sum(s.n_tokens for s in flat))
            row[name] = {"greedy_rows_differing": len(differ), "first_difference_at": sorted(first)[:8],
                         "cut_share": round(cut, 4), "mean_tokens": round(mean_len, 2),
                         "sampler_logprob_per_token": round(sampler_lp, 4),
                         "draws_equal_to_reference": round(same_draws, 4),
                         "seconds": round(time.perf_counter() - start, 2)}
        print(json.dumps(row), flush=True)
        rows.append(row)
        if step == args.steps:
            break
        samples = drawn[names[0]]
        groups = [{"prompt": prompt, "completions": [s.text for s in row_],
                   "rewards": [1.0 if s.finish_reason == "stop" else 0.0 for s in row_],
                   "completion_ids": [s.token_ids for s in row_], "finish_reasons": [s.finish_reason for s in row_],
                   "old_logprobs": [s.logprobs for s in row_]} for prompt, row_ in zip(prompts, samples)]
        metrics = trainer.update(groups)
        print(f"# update {step + 1}: " + json.dumps({k: metrics.get(k) for k in ("loss", "grad_norm", "logprob_gap")}),
              file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=1))
    if torch.cuda.is_available():
        print(f"# torch {torch.__version__}, {torch.cuda.get_device_name()}", file=sys.stderr)


if __name__ == "__main__":
    main()
