"""``eval``: greedy accuracy, mean@k and pass@k on benchmark JSONL (``question``, ``answer``).

Grading is the same as ``verify`` (math-verify, gold first; a sample without ``\\boxed{}`` falls back
to math-verify's own extraction unless ``require_boxed``). pass@k uses the unbiased
estimator of Chen et al. (2021), the standard in RLVR papers (SvS reports pass@k this way).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Iterable

from sptool.models.base import Backend, SamplingParams
from sptool.prompts import PromptSpec, load_prompt
from sptool.core.records import QUESTION, UsageError
from sptool.stages.solve import SolveStage
from sptool.stages.verify import VerifyStage


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with ``n`` samples of which ``c`` are correct.

    pass@k = 1 − C(n − c, k) / C(n, k)   (Chen et al., 2021, eq. 1)

    computed as 1 − Π_{i=n−c+1}^{n} (1 − k / i) for numerical stability.
    """
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if k < 1 or k > n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def mean_at_k(correct: list[bool]) -> float:
    """mean@k: the mean accuracy over the k samples of one problem."""
    return sum(correct) / len(correct) if correct else 0.0


@dataclass
class BenchmarkResult:
    name: str
    problems: int = 0
    samples_per_problem: int = 0
    greedy_accuracy: float | None = None
    # the share of greedy completions with a final answer the grader could read (a \boxed{} one
    # under require_boxed): a rise in greedy accuracy that this explains is format, not skill
    greedy_answered: float | None = None
    mean_at_k: float | None = 0.0
    pass_at: dict[int, float] = field(default_factory=dict)
    verify_errors: int = 0

    def as_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["pass_at"] = {f"pass@{k}": v for k, v in self.pass_at.items()}
        return data


def evaluate_benchmark(name: str, records: Iterable[dict], backend: Backend, *, samples: int = 8,
                       ks: tuple[int, ...] = (1, 8), params: SamplingParams | None = None,
                       greedy: bool = True, workers: int = 2, deadline_s: float = 30.0,
                       batch_size: int = 16, verifier: VerifyStage | None = None,
                       require_boxed: bool = False, prompt: str | PromptSpec | None = None,
                       greedy_batch_size: int | None = None) -> tuple[BenchmarkResult, list[dict]]:
    """Sample ``samples`` solutions per problem, grade them, aggregate. Returns the result and the
    graded records (so a caller can keep them). A caller's ``verifier`` is used and left open.
    ``prompt`` is the solver prompt (role ``solve``: a packaged name, a file or a spec).
    ``samples = 0`` with ``greedy``: the greedy accuracy alone. ``batch_size`` problems go into
    one generate call (``greedy_batch_size`` for the greedy pass; default the same)."""
    spec = prompt if isinstance(prompt, PromptSpec) else load_prompt("solve", prompt)
    params = params or SamplingParams()
    bad_ks = [k for k in ks if k > samples]
    if bad_ks:
        raise UsageError(f"pass@k needs k <= samples ({samples}), got {bad_ks}")
    problems = [QUESTION.validate(dict(r)) for r in records]
    for record in problems:
        if record.get("answer") is None:
            raise UsageError(f"benchmark '{name}': every problem needs an 'answer' "
                             f"(problem {record.get('id') or record['question'][:30]!r} has none)")
    result = BenchmarkResult(name=name, problems=len(problems), samples_per_problem=samples)
    own_verifier = verifier is None
    if own_verifier:
        verifier = VerifyStage(workers=workers, deadline_s=deadline_s, require_boxed=require_boxed)
    try:
        solved = list(SolveStage(backend, samples=samples, params=params, prompt=spec,
                                 batch_size=batch_size).run(iter(problems))) if samples else \
            [dict(record, samples=[]) for record in problems]
        graded = list(verifier.run(iter(solved))) if samples else solved
        per_problem = [[bool(s.get("correct")) for s in r["samples"]] for r in graded]
        result.verify_errors = sum(1 for r in graded if r.get("verify_error"))
        if not samples:
            result.mean_at_k = None  # greedy only
        elif problems:
            result.mean_at_k = sum(mean_at_k(c) for c in per_problem) / len(per_problem)
            for k in ks:
                result.pass_at[k] = sum(pass_at_k(len(c), sum(c), k) for c in per_problem) / len(per_problem)
        if greedy and problems:
            greedy_params = dataclasses.replace(params, temperature=0.0)
            fresh = [{key: value for key, value in r.items() if key in ("id", "question", "answer")}
                     for r in problems]
            greedy_solved = list(SolveStage(backend, samples=1, params=greedy_params, prompt=spec,
                                            batch_size=greedy_batch_size or batch_size).run(iter(fresh)))
            greedy_graded = list(verifier.run(iter(greedy_solved)))
            result.greedy_accuracy = sum(bool(r["samples"][0].get("correct")) for r in greedy_graded) / len(problems)
            result.greedy_answered = sum(r["samples"][0].get("answer") is not None
                                         for r in greedy_graded) / len(problems)
            for record, greedy_record in zip(graded, greedy_graded):
                record["greedy"] = greedy_record["samples"][0]
    finally:
        if own_verifier:
            verifier.close()
    return result, graded


def parse_ks(text: str) -> tuple[int, ...]:
    try:
        ks = tuple(sorted({int(part) for part in text.split(",")}))  # "1,,2": an empty k is an error
    except ValueError:
        raise UsageError(f"--pass-at expects comma-separated integers, got '{text}'") from None
    if not ks or min(ks) < 1:
        raise UsageError(f"--pass-at expects positive integers, got '{text}'")
    return ks


def log_comb(n: int, k: int) -> float:  # used by tests as an independent check
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
