"""What the policy wrote, step by step, in runs kept by ``learning_parity.py --keep-records``.

    python benchmarks/kept_samples.py OUT/sptool.seed0.run OUT/sptool-step-capture.seed0.run [--show 4]

For each run and each iteration's solve records: the share of samples cut at the token limit, the
mean completion length, the share with a ``\\boxed{}`` (all samples, and the cut ones), and the
share the grader found an answer in; then the first ``--show`` cut and stopped texts of the last
step. Two decoders' runs of one seed side by side say whether they learn the format at one pace
(issue 33: the captured step decoder's truncated share fell more slowly than ``generate``'s).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def step_summary(records: list[dict]) -> dict:
    """The shares of one step's samples: cut and mean length as the run's metrics count them
    (:func:`sptool.run.metrics.solve_metrics`), boxed (all, and the cut ones) and answered."""
    from sptool.run.metrics import solve_metrics

    samples = [s for r in records for s in r.get("samples") or []]
    cut = [s for s in samples if s.get("finish_reason") == "length"]

    def boxed(group: list[dict]) -> float:
        return sum("\\boxed{" in s.get("text", "") for s in group) / len(group) if group else 0.0

    counted = solve_metrics(records)
    return {"samples": counted["samples"], "truncated": counted["truncated_rate"],
            "mean_tokens": counted["mean_tokens"], "boxed": boxed(samples), "boxed_among_truncated": boxed(cut),
            "with_answer": sum(s.get("answer") is not None for s in samples) / len(samples)}


def run_summary(run: Path) -> list[dict]:
    """One :func:`step_summary` per ``iter-*/*solve*.jsonl`` of ``run``, in order, with ``step``
    and the last step's ``cut`` and ``stopped`` texts."""
    rows = []
    for step, path in enumerate(sorted(run.glob("iter-*/*solve*.jsonl")), 1):
        with path.open(encoding="utf-8") as handle:
            records = [json.loads(line) for line in handle if line.strip()]
        samples = [s for r in records for s in r.get("samples") or []]
        if samples:
            rows.append({"step": step, **step_summary(records),
                         "cut": [s["text"] for s in samples if s.get("finish_reason") == "length"],
                         "stopped": [s["text"] for s in samples if s.get("finish_reason") != "length"]})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="kept run directories (OUT/ARM.run)")
    parser.add_argument("--show", type=int, default=4, help="cut and stopped texts of the last step")
    args = parser.parse_args(argv)
    for run in args.runs:
        rows = run_summary(run)
        if not rows:
            print(f"{run}: no solve records with samples", file=sys.stderr)
            return 2
        print(f"##### {run.name}")
        for row in rows:
            print(f"step {row['step']:2d}: n {row['samples']} truncated {row['truncated']:.3f} mean tokens "
                  f"{row['mean_tokens']:.1f} boxed {row['boxed']:.3f} boxed among truncated "
                  f"{row['boxed_among_truncated']:.3f} with answer {row['with_answer']:.3f}")
        for label, texts, width in (("CUT ", rows[-1]["cut"], 220), ("STOP", rows[-1]["stopped"], 160)):
            for text in texts[:args.show]:
                print(f"   {label}  {text[:width]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
