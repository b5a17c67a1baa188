"""sptool `solve` (SolveStage + hf backend) against a bare `model.generate` loop.

Same model object, same prompts (rendered by the same chat template), same sampling settings and
batch size; prints generated tokens/s of each and the ratio. Run:

    python benchmarks/solve_vs_generate.py --questions 16 -k 4 --max-tokens 64
    python benchmarks/solve_vs_generate.py --device cuda --questions 64 -k 4 --batch 256   # GPU
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64, help="sequences per generate call")
    parser.add_argument("--device", default=None)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    import torch

    from sptool.models.base import SamplingParams
    from sptool.models.hf import HFBackend
    from sptool.stages.solve import SolveStage, solve_prompt
    from sptool.prompts import load_template

    backend = HFBackend(args.model, device=args.device, batch_size=args.batch)
    tokenizer, model = backend.tokenizer, backend.model
    questions = [{"question": f"What is {a} + {b}?"} for a, b in
                 zip(range(11, 11 + args.questions), range(40, 40 + args.questions))]
    template = load_template("solve_math")
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=args.max_tokens, seed=0)
    eos = backend._eos_ids()

    def bare() -> int:
        texts = [backend.render(solve_prompt(template, q)) for q in questions]
        jobs = [t for t in texts for _ in range(args.k)]
        tokens = 0
        for start in range(0, len(jobs), args.batch):
            encoded = tokenizer(jobs[start:start + args.batch], return_tensors="pt", padding=True,
                                add_special_tokens=False).to(backend.device)
            torch.manual_seed(start)
            with torch.inference_mode():
                out = model.generate(**encoded, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                     max_new_tokens=args.max_tokens, pad_token_id=tokenizer.pad_token_id,
                                     eos_token_id=eos)
            for row in out[:, encoded["input_ids"].shape[1]:].tolist():
                n = len(row)
                for i, token in enumerate(row):
                    if token in eos:
                        n = i + 1
                        break
                tokens += n
        return tokens

    def sptool_solve() -> int:
        stage = SolveStage(backend, samples=args.k, params=params, batch_size=len(questions))
        records = list(stage.run(iter([dict(q) for q in questions])))
        return sum(s["n_tokens"] for r in records for s in r["samples"])

    def timed(function):
        if backend.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        tokens = function()
        if backend.device.startswith("cuda"):
            torch.cuda.synchronize()
        return tokens, time.perf_counter() - start

    timed(bare)  # warm-up
    rows = []
    for name, function in (("bare model.generate", bare), ("sptool solve", sptool_solve)):
        best = 0.0
        for _ in range(args.repeats):
            tokens, seconds = timed(function)
            best = max(best, tokens / seconds)
        rows.append((name, best))
    print(f"model={args.model} device={backend.device} dtype={backend.dtype} questions={args.questions} "
          f"k={args.k} max_tokens={args.max_tokens} batch={args.batch}")
    print(f"{'path':<22}{'tokens/s':>12}")
    for name, rate in rows:
        print(f"{name:<22}{rate:>12.1f}")
    print(f"{'ratio sptool/bare':<22}{rows[1][1] / rows[0][1]:>12.3f}")


if __name__ == "__main__":
    main()
