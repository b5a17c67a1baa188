"""`sptool decontaminate` throughput: a 10,000-problem benchmark against 100,000 generated records.

Texts are word sequences drawn from a Zipf-distributed vocabulary (common words repeat as in real
problems, so MinHash LSH sees realistic candidate sets); 1% of the records are copies of a
benchmark problem (half exact, half with one word changed). Compared with what a user would write
with datasketch alone: a fresh ``MinHash()`` per record (its default hash and permutations) and an
LSH query, without the n-gram test. Run:

    OMP_NUM_THREADS=1 python benchmarks/decontaminate.py --problems 10000 --records 100000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time


def make_texts(problems: int, records: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    vocabulary = [f"w{i}" for i in range(20000)]
    weights = [1.0 / (rank + 1) for rank in range(len(vocabulary))]

    def text() -> str:
        return " ".join(rng.choices(vocabulary, weights, k=rng.randint(25, 60)))

    benchmark = [{"id": f"p{i}", "question": text()} for i in range(problems)]
    generated = []
    for i in range(records):
        if i % 100 == 0:
            words = rng.choice(benchmark)["question"].split()
            if i % 200 == 0:
                words[len(words) // 2] = "changed"
            generated.append({"id": f"r{i}", "question": " ".join(words)})
        else:
            generated.append({"id": f"r{i}", "question": text()})
    return benchmark, generated


def run_sptool(bench_path: str, records: list[dict]) -> tuple[float, float, int]:
    from sptool.stages.decontaminate import BenchmarkIndex, DecontaminateStage

    start = time.perf_counter()
    index = BenchmarkIndex([bench_path])
    built = time.perf_counter() - start
    stage = DecontaminateStage(index)
    start = time.perf_counter()
    kept = sum(1 for _ in stage.run(iter(records)))
    return built, time.perf_counter() - start, len(records) - kept


def run_bare(benchmark: list[dict], records: list[dict]) -> tuple[float, float, int]:
    from datasketch import MinHash, MinHashLSH

    def minhash(text: str) -> MinHash:
        words = text.lower().split()
        m = MinHash(num_perm=128)
        m.update_batch([" ".join(words[i:i + 2]).encode() for i in range(len(words) - 1)])
        return m

    start = time.perf_counter()
    lsh = MinHashLSH(threshold=0.7, num_perm=128)
    for problem in benchmark:
        lsh.insert(problem["id"], minhash(problem["question"]))
    built = time.perf_counter() - start
    start = time.perf_counter()
    hits = sum(1 for record in records if lsh.query(minhash(record["question"])))
    return built, time.perf_counter() - start, hits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=10000)
    parser.add_argument("--records", type=int, default=100000)
    parser.add_argument("--bare-records", type=int, default=10000,
                        help="records for the (slow) bare datasketch loop; its rate is per record")
    args = parser.parse_args()
    benchmark, records = make_texts(args.problems, args.records)
    with tempfile.TemporaryDirectory() as directory:
        bench_path = os.path.join(directory, "bench.jsonl")
        with open(bench_path, "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(problem) + "\n" for problem in benchmark)
        built, seconds, dropped = run_sptool(bench_path, records)
    bare_records = records[:args.bare_records]
    bare_built, bare_seconds, bare_hits = run_bare(benchmark, bare_records)
    print(f"benchmark: {args.problems} problems; records: {args.records} (1% copies); "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, {os.cpu_count()} CPUs")
    print(f"{'path':<44}{'index s':>9}{'records/s':>11}{'flagged':>9}")
    print(f"{'sptool decontaminate (n-gram + MinHash)':<44}{built:>9.1f}{args.records / seconds:>11.0f}"
          f"{dropped:>9}")
    print(f"{'bare datasketch MinHash + LSH (no n-grams)':<44}{bare_built:>9.1f}"
          f"{len(bare_records) / bare_seconds:>11.0f}{bare_hits:>9}  (first {len(bare_records)} records)")


if __name__ == "__main__":
    main()
