"""Benchmark: seconds per iteration of `sptool run` with the hf backend (generation shares the
trainer's weights) vs in-process vLLM (one engine, weights reloaded in place after each update).

    OMP_NUM_THREADS=1 python benchmarks/run_backends.py                   # svs --tiny, 3 iterations
    python benchmarks/run_backends.py --recipe svs --iterations 3 --backends hf,vllm --set svs.problems=8

Each backend runs the same recipe, seed and settings in a fresh run directory. From the run's
``metrics.jsonl`` the table gives, per backend, the mean seconds per iteration split into
generation (solve and challenge steps), training and the rest (grading, filtering), the first
iteration apart (it includes loading the policy and, for vLLM, starting the engine), and how many
engines were started (the ``vllm: starting the engine`` log lines; a run should start one).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GENERATION = {"solve", "challenge"}


def run(backend: str, args, root: Path) -> dict:
    run_dir = root / backend
    command = [sys.executable, "-m", "sptool.cli.main", "run", "--recipe", args.recipe, "--tiny",
               "-n", str(args.iterations), "--set", f"model.backend={backend}", "--run-dir", str(run_dir)]
    for item in args.set:
        command += ["--set", item]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    start = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.monotonic() - start
    if result.returncode != 0:
        raise SystemExit(f"{backend}: exit {result.returncode}\n{result.stderr[-2000:]}")
    per: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        part = "train" if m["kind"] == "train" else "generate" if m["kind"] in GENERATION else "other"
        per[m["iteration"]][part] += m["wall_s"]
    later = [c for i, c in per.items() if i > 1] or list(per.values())
    mean = {part: sum(c[part] for c in later) / len(later) for part in ("generate", "train", "other")}
    return {"backend": backend, "wall": wall, "first": sum(per[1].values()), **mean,
            "engines": result.stderr.count("vllm: starting the engine")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="svs")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--backends", default="hf,vllm")
    parser.add_argument("--set", action="append", default=[], help="extra --set key=value for both runs")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="sptool-bench-") as root:
        for backend in args.backends.split(","):
            rows.append(run(backend, args, Path(root)))
            print(f"{backend}: {rows[-1]['wall']:.0f}s", file=sys.stderr)
    print(f"| backend | iteration 1 s | later iterations: generate s | train s | other s | total s | engines started |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        total = r["generate"] + r["train"] + r["other"]
        print(f"| {r['backend']} | {r['first']:.1f} | {r['generate']:.1f} | {r['train']:.1f} | {r['other']:.1f} | "
              f"{total:.1f} | {r['engines'] if r['backend'] == 'vllm' else '-'} |")


if __name__ == "__main__":
    main()
