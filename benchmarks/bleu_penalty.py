"""R-Zero's BLEU repetition penalty on a batch: 512 questions x 400 words by default.

Texts are word sequences from a Zipf-distributed vocabulary (common words repeat as in real
questions); a tenth of the questions are near-copies of another (a few words changed), so the
clustering has clusters to find. Times ``rewards.bleu_repetition_penalties`` (the indexed BLEU:
an inverted n-gram index and sparse products, then average linkage) and, with ``--pairwise N``,
the pairwise loop on the first N questions, extrapolated to the full batch by the pair count
(the loop is quadratic: n(n-1)/2 pairs of two sentence BLEUs). Run:

    OMP_NUM_THREADS=2 python benchmarks/bleu_penalty.py --questions 512 --words 400 --pairwise 64
"""

from __future__ import annotations

import argparse
import random
import time


def make_questions(count: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    vocabulary = [f"w{i}" for i in range(5000)]
    weights = [1.0 / (rank + 1) for rank in range(len(vocabulary))]
    questions = [" ".join(rng.choices(vocabulary, weights, k=words)) for _ in range(count)]
    for index in range(0, count, 10):  # near-copies of the question before
        if index:
            tokens = questions[index - 1].split()
            for _ in range(max(1, words // 50)):
                tokens[rng.randrange(len(tokens))] = rng.choice(vocabulary)
            questions[index] = " ".join(tokens)
    return questions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=512)
    parser.add_argument("--words", type=int, default=400)
    parser.add_argument("--pairwise", type=int, default=0, help="time the old pairwise loop on N questions")
    args = parser.parse_args()

    from sptool import rewards as R

    questions = make_questions(args.questions, args.words)
    start = time.perf_counter()
    penalties = R.bleu_repetition_penalties(questions)
    seconds = time.perf_counter() - start
    clusters = len(set(penalties)) if penalties else 0
    print(f"indexed: {args.questions} questions x {args.words} words: {seconds:.2f} s "
          f"(max penalty {max(penalties):.4f}, {clusters} distinct penalties)")
    if args.pairwise:
        sample = questions[:args.pairwise]
        start = time.perf_counter()
        slow = R.bleu_distance_matrix_pairwise(sample)
        pairwise = time.perf_counter() - start
        fast = R.bleu_distance_matrix(sample)
        worst = max(abs(a - b) for row_a, row_b in zip(slow, fast) for a, b in zip(row_a, row_b))
        scale = (args.questions * (args.questions - 1)) / (len(sample) * (len(sample) - 1))
        print(f"pairwise: {len(sample)} questions: {pairwise:.2f} s; extrapolated to {args.questions} "
              f"(x{scale:.0f} pairs): {pairwise * scale:.0f} s; largest difference to the indexed "
              f"distances {worst:.1e}")


if __name__ == "__main__":
    main()
