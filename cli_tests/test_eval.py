"""eval: the unbiased pass@k estimator on hand-computed cases, and a real run."""

from __future__ import annotations

import json
import math

import pytest

from conftest import FIXTURES, run_sptool
from sptool.stages.evaluate import evaluate_benchmark, mean_at_k, pass_at_k, parse_ks
from sptool.models.scripted import ScriptedBackend


def test_pass_at_k_hand_computed():
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n=5, c=2, k=3: 1 - C(3,3)/C(5,3) = 1 - 1/10
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)
    # k=1 is the plain accuracy c/n
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    # all wrong / all right / n - c < k
    assert pass_at_k(8, 0, 4) == 0.0
    assert pass_at_k(8, 8, 4) == 1.0
    assert pass_at_k(4, 3, 2) == 1.0


def test_pass_at_k_matches_the_binomial_formula_on_a_grid():
    for n in range(1, 12):
        for c in range(n + 1):
            for k in range(1, n + 1):
                expected = 1.0 - (math.comb(n - c, k) / math.comb(n, k))
                assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_rejects_impossible_inputs():
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_mean_at_k_and_parse_ks():
    assert mean_at_k([True, False, False, True]) == 0.5
    assert parse_ks("8,1, 4") == (1, 4, 8)


def test_evaluate_benchmark_with_scripted_answers():
    # problem 1 answered right by 2 of 4 samples, problem 2 never; greedy takes the queue's next
    outputs = [r"\boxed{3}", r"\boxed{3}", r"\boxed{4}", r"\boxed{5}"]
    backend = ScriptedBackend(responder=lambda text, i: outputs[i] if "1+2" in text else r"\boxed{0}")
    records = [{"question": "1+2?", "answer": "3"}, {"question": "5+5?", "answer": "10"}]
    result, graded = evaluate_benchmark("t", records, backend, samples=4, ks=(1, 2), workers=0)
    assert result.mean_at_k == pytest.approx((0.5 + 0.0) / 2)
    assert result.pass_at[1] == pytest.approx(0.25)
    assert result.pass_at[2] == pytest.approx((pass_at_k(4, 2, 2) + 0.0) / 2)
    assert result.greedy_accuracy == pytest.approx(0.5)  # greedy sample 0 of problem 1 is right
    assert result.greedy_answered == 1.0  # both greedy answers are readable; one is wrong


def test_evaluate_grades_unboxed_answers_unless_require_boxed():
    backend = ScriptedBackend(responder=lambda text, i: "The final answer is $3$.")
    records = [{"question": "1+2?", "answer": "3"}]
    lenient, graded = evaluate_benchmark("t", records, backend, samples=2, ks=(1,), workers=0)
    assert lenient.mean_at_k == 1.0 and lenient.greedy_accuracy == 1.0
    assert graded[0]["samples"][0]["boxed"] is False
    strict, _ = evaluate_benchmark("t", records, backend, samples=2, ks=(1,), workers=0, require_boxed=True)
    assert strict.mean_at_k == 0.0 and strict.greedy_accuracy == 0.0
    # the strict grader reads no answer: the miss is format, which greedy_answered tells apart
    assert lenient.greedy_answered == 1.0 and strict.greedy_answered == 0.0


def test_eval_cli_requires_k_not_above_samples(tmp_path):
    result = run_sptool("eval", "--backend", "scripted", "-k", "2", "--pass-at", "4",
                        str(FIXTURES / "bench" / "basic_algebra.jsonl"))
    assert result.returncode == 2 and "pass@k needs k <= samples" in result.stderr


@pytest.mark.slow
def test_eval_real_tiny_model_json(tmp_path):
    bench = tmp_path / "basic_algebra.jsonl"
    bench.write_text("".join((FIXTURES / "bench" / "basic_algebra.jsonl").read_text().splitlines(True)[:4]))
    result = run_sptool("eval", "-k", "2", "--pass-at", "1,2", "--max-tokens", "32", "--json",
                        "--workers", "1", "-q", str(bench))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    bench = report["benchmarks"][0]
    assert bench["name"] == "basic_algebra" and bench["problems"] == 4
    assert 0.0 <= bench["pass_at"]["pass@1"] <= bench["pass_at"]["pass@2"] <= 1.0
    assert bench["greedy_accuracy"] is not None
