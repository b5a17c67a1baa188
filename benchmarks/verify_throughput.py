"""sptool `verify` throughput against a single-process math-verify loop, and its scaling with workers.

The workload: N solved questions with K samples each, answers drawn from equivalent and
non-equivalent forms (fractions, decimals, expressions), so grading does real math-verify work.
Both paths do the same comparisons: each sample against the gold answer, and the answer
clustering for the majority vote. Run:

    python benchmarks/verify_throughput.py --questions 200 -k 8 --workers 1 2 4

``--records FILE.jsonl`` grades real solved records instead (a run's ``iter-*/NN-solve.jsonl``,
e.g. kept by ``learning_parity.py --keep-records``): each question once in this process, timed, then
the slowest questions with their answers, and the whole file through the stage with each
``--workers`` count (and each ``--vote``), so a slow loop step's grading can be traced to the completions that cost it.
"""

from __future__ import annotations

import argparse
import random
import time


def workload(n: int, k: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for i in range(n):
        a, b = rng.randint(1, 40), rng.randint(2, 12)
        forms = [rf"\frac{{{a}}}{{{b}}}", f"{a}/{b}", f"{a / b:.6g}", rf"\frac{{{2 * a}}}{{{2 * b}}}",
                 rf"\frac{{{a + 1}}}{{{b}}}", f"{a + b}", rf"\sqrt{{{a}}}", f"x+{a}"]
        samples = [{"text": rf"Reasoning ... so the answer is \boxed{{{rng.choice(forms)}}}."} for _ in range(k)]
        records.append({"id": str(i), "question": f"q{i}", "answer": rf"\frac{{{a}}}{{{b}}}",
                        "samples": samples})
    return records


def bare_loop(records: list[dict]) -> float:
    """What a user would write: math-verify parse/verify in one process, the same comparisons."""
    from math_verify import parse, verify

    start = time.perf_counter()
    for record in records:
        gold = parse("\\boxed{" + record["answer"] + "}")
        parsed = [parse(s["text"]) for s in record["samples"]]
        [verify(gold, p) for p in parsed]
        classes: list = []
        for p in parsed:
            for c in classes:
                if verify(c[0], p) or verify(p, c[0]):
                    c.append(p)
                    break
            else:
                classes.append([p])
    return time.perf_counter() - start


def sptool_verify(records: list[dict], workers: int, vote: str = "always") -> float:
    from sptool.stages.verify import VerifyStage

    stage = VerifyStage(workers=workers, deadline_s=60, vote=vote)
    # exclude worker start-up (a one-off per stage) from the steady-state figure
    list(stage.run(iter([dict(records[0], samples=list(records[0]["samples"]))])))
    start = time.perf_counter()
    out = list(stage.run(iter(records)))
    elapsed = time.perf_counter() - start
    stage.close()
    assert len(out) == len(records)
    return elapsed


def slowest_questions(paths: list[str], workers: list[int], show: int = 5, votes: tuple = ("always",)) -> None:
    """Time :func:`sptool.stages.verify.grade` per question of real solved records, then the stage."""
    import json
    import statistics

    from sptool.stages.verify import VerifyStage, grade, warm_up

    warm_up()
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            records = [json.loads(line) for line in handle if line.strip()]
        records = [record for record in records if record.get("samples")]
        if not records:
            print(f"{path}: no solved records with samples")
            continue
        stage = VerifyStage(workers=1)
        timed = []
        for record in records:
            task = stage._task(record)
            start = time.perf_counter()
            grade(task)
            timed.append((time.perf_counter() - start, record, task))
        stage.close()
        seconds = sorted(t for t, _, _ in timed)
        print(f"{path}: {len(records)} questions, {sum(len(r['samples']) for r in records)} samples; "
              f"grading in one process {sum(seconds):.3f} s (per question: median "
              f"{statistics.median(seconds) * 1e3:.1f} ms, max {seconds[-1] * 1e3:.1f} ms)")
        for elapsed, record, task in sorted(timed, key=lambda item: item[0], reverse=True)[:show]:
            answers = [text[-60:].replace("\n", " ") for text in task["texts"]]
            print(f"  {elapsed * 1e3:8.1f} ms  gold {task['gold']!r}  question {record.get('question', '')[:60]!r}")
            for answer in answers:
                print(f"             ...{answer!r}")
        for count in workers:
            for vote in votes if count else ():
                print(f"  sptool verify --workers {count} --vote {vote}: {sptool_verify(records, count, vote):.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("-k", type=int, default=8)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--records", nargs="+", metavar="FILE.jsonl",
                        help="real solved records (a run's iter-*/NN-solve.jsonl) instead of the synthetic workload")
    parser.add_argument("--show", type=int, default=5, help="--records: the slowest questions shown per file")
    parser.add_argument("--vote", nargs="+", default=["always"], choices=("always", "auto"),
                        help="--records: time the stage with each (auto: no majority vote beside a reference)")
    args = parser.parse_args()
    if args.records:
        slowest_questions(args.records, args.workers, args.show, tuple(args.vote))
        return
    records = workload(args.questions, args.k)
    bare = bare_loop(records)
    print(f"questions={args.questions} k={args.k} (samples graded: {args.questions * args.k})")
    print(f"{'path':<28}{'questions/s':>12}{'ratio vs bare':>15}")
    print(f"{'bare math-verify loop':<28}{args.questions / bare:>12.1f}{1.0:>15.2f}")
    for workers in args.workers:
        seconds = sptool_verify(records, workers)
        label = f"sptool verify --workers {workers}"
        print(f"{label:<28}{args.questions / seconds:>12.1f}{bare / seconds:>15.2f}")


if __name__ == "__main__":
    main()
