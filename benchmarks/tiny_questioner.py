"""Does the tiny questioner write well-formed questions, and do they carry signal for the solver?

With the real tiny model (SmolLM2-135M-Instruct, CPU, offline) this samples N questioner replies
with each questioner prompt (the two-step ``arithmetic`` prompt and R-Zero's free-form ``rzero``
prompt, same token budget), counts the well-formed ones (``<question>…</question>`` and a
``\\boxed{}`` answer: ``valid`` from ``challenge --from nothing``), then lets the solver answer each
well-formed question K times (``solve --prompt direct``) and grades the answers:

- against the questioner's own answer (``correct``), and
- among themselves (R-Zero's pseudo-label: the majority answer and its share p̂; a question whose
  K answers are not all equal gives a group with non-zero advantages);

and asks the validity solver (``solve --mode validity --prompt direct``) whether each question is
flawed (``\\boxed{INVALID}``). It prints one table and writes the records under ``--out``.

    PYTHONPATH=src python benchmarks/tiny_questioner.py --samples 32 --out /tmp/tiny-questioner

Not a speed claim: the seconds are printed only so a reader knows what the run cost.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32, help="questioner replies per prompt")
    parser.add_argument("--group", type=int, default=16, help="questioner replies per backend call")
    parser.add_argument("--solver-samples", type=int, default=4, help="K answers per question")
    parser.add_argument("--max-tokens", type=int, default=48, help="questioner token budget")
    parser.add_argument("--solver-max-tokens", type=int, default=16)
    parser.add_argument("--prompts", default="arithmetic,rzero", help="questioner prompts to compare")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="folder for the records (default: none written)")
    args = parser.parse_args()

    from sptool.stages.challenge import QuestionerStage
    from sptool.models.base import SamplingParams, load_backend
    from sptool.stages.solve import SolveStage
    from sptool.stages.verify import VerifyStage

    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    backend = load_backend("hf", "tiny", device="cpu")
    verifier = VerifyStage(workers=1)
    rows = []
    try:
        for name in args.prompts.split(","):
            start = time.monotonic()
            stage = QuestionerStage(backend, candidates=args.samples, batch_size=args.group, prompt=name,
                                    params=SamplingParams(temperature=1.0, max_new_tokens=args.max_tokens,
                                                          seed=args.seed))
            questions = list(stage.run(iter(())))
            asked = time.monotonic() - start
            valid = [dict(q, answer=q["questioner_answer"]) for q in questions if q["valid"]]
            row = {"prompt": name, "replies": len(questions), "well_formed": len(valid),
                   "reasons": dict(stage.stats.notes), "questioner_s": round(asked, 1)}
            if valid:
                params = SamplingParams(temperature=1.0, max_new_tokens=args.solver_max_tokens, seed=args.seed)
                solved = list(SolveStage(backend, samples=args.solver_samples, prompt="direct",
                                         params=params).run(iter([dict(q) for q in valid])))
                graded = list(verifier.run(iter(solved)))
                checks = [s.get("correct") for r in graded for s in r["samples"]]
                # R-Zero's pseudo-label: a majority answer (p̂ >= 1/2) that is not unanimous gives a
                # group with non-zero advantages
                voted = [r for r in graded if r.get("majority_frac") is not None and 0.5 <= r["majority_frac"] < 1]
                mixed = [r for r in graded if 0 < (r.get("p_hat") or 0) < 1]
                judged = list(SolveStage(backend, samples=1, mode="validity", prompt="direct",
                                         params=params).run(iter([dict(q) for q in valid])))
                invalid = sum(1 for r in judged if (r["samples"][0].get("answer") or "").strip().upper() == "INVALID")
                row.update(solver_right=sum(1 for c in checks if c), solver_answers=len(checks),
                           questions_mixed=len(mixed), questions_voted=len(voted),
                           judged_invalid=invalid, solve_s=round(time.monotonic() - start - asked, 1))
                if out:
                    write(out / f"{name}.solved.jsonl", graded)
                    write(out / f"{name}.validity.jsonl", judged)
            if out:
                write(out / f"{name}.questions.jsonl", questions)
            rows.append(row)
    finally:
        verifier.close()
        backend.close()

    print(f"tiny questioner, {args.samples} replies per prompt, {args.max_tokens} tokens, temperature 1.0, "
          f"seed {args.seed}; solver: direct, K={args.solver_samples}")
    print("| prompt | well-formed | solver answers = questioner's | questions with some = and some != "
          "| questions with a non-unanimous majority (p̂ in [0.5, 1)) | validity solver says INVALID "
          "| seconds (questioner, solvers) |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        wf = row["well_formed"]
        if wf:
            print(f"| {row['prompt']} | {wf}/{row['replies']} = {wf / row['replies']:.2f} "
                  f"| {row['solver_right']}/{row['solver_answers']} | {row['questions_mixed']}/{wf} "
                  f"| {row['questions_voted']}/{wf} | {row['judged_invalid']}/{wf} "
                  f"| {row['questioner_s']}, {row['solve_s']} |")
        else:
            print(f"| {row['prompt']} | 0/{row['replies']} = 0.00 | - | - | - | - | {row['questioner_s']}, - |")
    for row in rows:
        print(f"{row['prompt']}: {row['reasons']}")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    main()
