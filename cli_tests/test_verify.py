"""verify: math-verify equivalence, majority vote over equivalence classes, INVALID, deadlines."""

from __future__ import annotations

import time

import pytest

from conftest import read_jsonl, run_sptool, write_jsonl
from sptool.stages.verify import (VerifyStage, answers_equivalent, extract_final_answer, grade, last_boxed,
                                   majority_classes)


def samples(*texts):
    return [{"text": t} for t in texts]


def test_last_boxed_handles_nesting_and_takes_the_last():
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{3}{4}}.") == r"\frac{3}{4}"
    assert last_boxed(r"\boxed{ {a}+{b} }") == "{a}+{b}"
    assert last_boxed("no box") is None
    assert last_boxed(r"\boxed{unclosed") is None


def test_invalid_is_normalised():
    assert extract_final_answer(r"flawed: \boxed{INVALID}") == "INVALID"
    assert extract_final_answer(r"\boxed{\text{invalid}}") == "INVALID"
    assert extract_final_answer(r"\boxed{42}") == "42"


def test_grade_with_reference_uses_math_equivalence():
    result = grade({"texts": [r"\boxed{0.75}", r"\boxed{\frac{3}{4}}", r"\boxed{3/4}", r"\boxed{1}",
                              "no answer"], "gold": r"\frac{3}{4}"})
    assert result["correct"] == [True, True, True, False, False]
    assert result["p_hat"] == pytest.approx(3 / 5)
    assert result["var"] == pytest.approx(0.6 * 0.4)
    # 0.75, 3/4 and \frac{3}{4} are one class, not three strings
    assert result["majority_frac"] == pytest.approx(3 / 5)
    assert result["n_classes"] == 2
    assert result["label_source"] == "reference"


def test_plain_numbers_compare_by_value_as_math_verify_does(monkeypatch):
    """Two plain numbers (integers; decimals of at most 6 places and 12 digits) are equivalent
    exactly when their values are: math-verify's verdict on every pair below (signs, leading and
    trailing zeros, 30 digits, neighbours 10^-6 apart), reached without its parse and sympy."""
    import random
    from decimal import Decimal

    from math_verify import verify

    from sptool.stages import verify as verifying

    numbers = ["0", "-0", "+0", "007", "7", "-7", "+7", " 85", "85 ", "085", "85.0", "85.000", "1000000",
               "999999", "999999.999999", "123456789012345678901234567890", "123456789012345678901234567891",
               "431.2", "431.20", "431.21", "-0.125", "0.125", "1.000001", "1"]
    rng = random.Random(0)
    for _ in range(30):
        value = Decimal(f"{rng.randint(-10 ** 5, 10 ** 5)}.{rng.randint(0, 999999):06d}")
        numbers += [str(value), str(value + rng.choice([Decimal(0), Decimal("0.000001"), Decimal("0.1")]))]
    verifying._EQUIVALENT.clear()
    same = lambda a, b: verifying.equivalent(verifying.boxed_answer(a), verifying.boxed_answer(b))  # noqa: E731
    # other forms still go to math-verify: 7 places round to 6 there, "1_000" and "8 5" are no numbers
    assert same("0.3333333", "0.333333") and not same("1_000", "1000") and not same("8 5", "85")
    assert same(r"\frac{1}{8}", "0.125")

    def no_math_verify(*args, **kwargs):
        raise AssertionError("math-verify was called for two plain numbers")

    monkeypatch.setattr(verifying, "parse_answer", no_math_verify)
    import math_verify
    monkeypatch.setattr(math_verify, "verify", no_math_verify)
    pairs = [(a, b) for a in numbers for b in numbers]
    fast = {(a, b): same(a, b) for a, b in pairs}
    assert all(fast[a, b] == (Decimal(a.strip()) == Decimal(b.strip())) for a, b in pairs)
    monkeypatch.undo()
    for a, b in pairs[::7]:  # the values' verdict is math-verify's own
        assert fast[a, b] == bool(verify(verifying.parse_answer(a), verifying.parse_answer(b))), (a, b)


def verify_calls(monkeypatch) -> list[tuple]:
    """From now on, the arguments of every call of math-verify's ``verify`` (which still answers), with
    the grader's cache of verdicts emptied."""
    import math_verify
    from math_verify import verify

    from sptool.stages import verify as verifying

    calls: list[tuple] = []

    def counted(*args, **kwargs):
        calls.append(args)
        return verify(*args, **kwargs)

    monkeypatch.setattr(math_verify, "verify", counted)
    verifying._EQUIVALENT.clear()
    return calls


def test_parses_that_are_rational_numbers_compare_as_math_verify_does(monkeypatch):
    """Two answers whose math-verify parses are each one rational number (a completion's extracted
    "105", a boxed "\\frac{1}{2}", "0.5", "1,000", "-3") get math-verify's verdict without its
    ``verify``: every pair below, against ``verify`` itself; floats, percentages, powers and
    equations still go to ``verify``."""
    from math_verify import verify

    from sptool.stages import verify as verifying

    texts = ["The answer is 85.", "25 + 60 = 85", "So it is 085 apples", "\\boxed{85}", "\\boxed{105}",
             "\\boxed{\\frac{1}{2}}", "\\boxed{1/2}", "\\boxed{0.5}", "\\boxed{\\frac{2}{4}}",
             "\\boxed{-3}", "The result is -3.", "\\boxed{1,000}", "so 1,000 apples", "\\boxed{1000}",
             "The final answer is $\\frac{3}{7}$.", "\\boxed{0}", "\\boxed{-0}", "The sum is 12 and then 40."]
    others = ["\\boxed{85\\%}", "\\boxed{0.333333}", "\\boxed{2^{10}}", "\\boxed{1024}", "$x = 5$",
              "\\boxed{5}", "\\boxed{\\sqrt{4}}", "\\boxed{2}"]
    parses = {text: verifying.parse_completion(text) for text in texts + others}
    numbers = [text for text in texts if verifying._exact_number(parses[text]) is not None]
    assert numbers == texts  # every one of them takes the new path
    expected = {(a, b): bool(verify(parses[a], parses[b])) for a in texts + others for b in texts + others}
    assert expected["The answer is 85.", "\\boxed{85}"] and not expected["\\boxed{85}", "\\boxed{105}"]
    assert expected["\\boxed{0.5}", "\\boxed{\\frac{2}{4}}"] and expected["\\boxed{1,000}", "so 1,000 apples"]

    calls = verify_calls(monkeypatch)
    stated = lambda text: verifying.FinalAnswer(text, False, ("extracted", text), parses[text])  # noqa: E731
    for a in texts + others:
        for b in texts + others:
            assert verifying.equivalent(stated(a), stated(b)) == expected[a, b], (a, b)
    assert calls and all(verifying._exact_number(gold) is None or verifying._exact_number(predicted) is None
                         for gold, predicted in calls)  # only pairs with a non-number went to verify
    every = texts + others
    not_numbers = [text for text in every if verifying._exact_number(parses[text]) is None]
    assert not_numbers == others[:3] + others[4:5] + others[6:7]
    # each pair with a non-number once, but a text against itself (the same key: equivalent at once)
    assert len(calls) == len(every) ** 2 - (len(every) - len(not_numbers)) ** 2 - len(not_numbers)


def test_a_number_against_letters_or_a_set_of_rationals_compares_as_math_verify_does(monkeypatch):
    """A number against a boxed word (latex2sympy's product of letters: "answer" is E*a*n*r*s*w),
    against letters with numbers ("6\\cdot L", "233f", "Tin + TwiceTint"), or a rational against a
    set of two or more rationals ("576, 721") gets math-verify's verdict without its ``verify``:
    every pair below, both ways, against ``verify`` itself. Negative powers, equations,
    single letters, sets with a float or a letter, and a set that collapses to one element still go
    to ``verify``."""
    from math_verify import verify

    from sptool.stages import verify as verifying

    numbers = ["85", "\\frac{1}{2}", "-3", "0", "1.15", "2"]
    letters = ["Tin + TwiceTint", "answer", "6\\cdot L", "233f", "e x", "\\pi r^2", "2x - x", "576, 721", "1, 2",
               "-3, 85, 0"]
    others = ["x", "\\frac{1}{x}", "1, 1", "0.5, 1", "x, 1", "x = 2", "2^{1}", "x - x + 2"]
    answers = numbers + letters + others
    parses = {text: verifying.parse_answer(text) for text in answers}
    expected = {(a, b): bool(verify(parses[a], parses[b])) for a in answers for b in answers}
    assert expected["2", "2^{1}"] and expected["2", "x - x + 2"]  # no shortcut may decide these
    decided = {(a, b) for a in answers for b in answers
               if verifying._number_against_non_number_verdict(parses[a], parses[b]) is not None}
    # every number against every letters answer, every rational (not the floats) against every set,
    # both ways, and nothing else
    sets, words, rationals = letters[-3:], letters[:-3], [n for n in numbers if n != "1.15"]
    shortcut = {(n, w) for n in numbers for w in words} | {(n, r) for n in rationals for r in sets}
    assert decided == shortcut | {(b, a) for a, b in shortcut}

    calls = verify_calls(monkeypatch)
    for a in answers:
        for b in answers:
            assert verifying.equivalent(verifying.boxed_answer(a), verifying.boxed_answer(b)) == expected[a, b], (a, b)
    called = {(a, b) for a in answers for b in answers for gold, predicted in calls
              if gold is parses[a] and predicted is parses[b]}
    assert called and not called & decided


def test_an_unevaluated_sum_of_the_question_is_no_answer():
    """math-verify simplifies "47+38" to 85; an RL policy learnt to box the question instead of the
    sum (sampled "accuracy" 0.99 after 14 steps on two-digit sums, 0.00 held out under a grader that
    wants the number). The part after the last "=" is the answer, and arithmetic on numbers left
    unevaluated is wrong and casts no vote; fractions, scientific notation and expressions with a
    variable are answers as before."""
    result = grade({"texts": [r"\boxed{47+38}", r"\boxed{47 + 38 = 85}", r"\boxed{85}", r"\boxed{12 \times 7}",
                              r"\boxed{(40+45)}"], "gold": "85", "require_boxed": True})
    assert result["correct"] == [False, True, True, False, False]
    assert result["boxed"] == [True] * 5  # still boxed: the format term is unchanged
    votes = grade({"texts": [r"\boxed{2+3}", r"\boxed{1+4}", r"\boxed{4+1}", r"\boxed{5}"], "gold": None})
    assert votes["majority"] == "5" and votes["n_classes"] == 1
    kept = grade({"texts": [r"\boxed{1/2}", r"\boxed{3 \times 10^{5}}", r"\boxed{x+1}"], "gold": None})
    assert kept["n_classes"] == 3
    assert grade({"texts": [r"\boxed{2+3i}"], "gold": "2+3i"})["correct"] == [True]


def test_grade_without_reference_pseudo_labels_by_majority():
    result = grade({"texts": [r"\boxed{2}", r"\boxed{2.0}", r"\boxed{5}", r"\boxed{INVALID}"],
                    "gold": None})
    assert result["majority"] in ("2", "2.0")
    assert result["correct"] == [True, True, False, False]
    assert result["majority_frac"] == pytest.approx(0.5)
    assert result["invalid_frac"] == pytest.approx(0.25)
    assert result["label_source"] == "majority"


def test_beside_a_reference_the_vote_is_taken_only_when_asked(monkeypatch):
    """vote=False: the reference grades the samples with k comparisons and the majority vote's
    pairwise ones are not made (math-verify is called for the reference only); the verdict is the
    same and the vote's fields are null. Without a reference the vote is the label: always taken."""
    texts = [r"\boxed{x+1}", r"\boxed{1+x}", r"\boxed{2x}", r"\boxed{x^2}", r"\boxed{y}"]
    calls = verify_calls(monkeypatch)
    voted = grade({"texts": texts, "gold": "x+1"})
    voted_calls = len(calls)
    calls.clear()
    from sptool.stages import verify as verifying
    verifying._EQUIVALENT.clear()
    unvoted = grade({"texts": texts, "gold": "x+1", "vote": False})
    assert unvoted["correct"] == voted["correct"] == [True, True, False, False, False]
    assert unvoted["p_hat"] == voted["p_hat"] and unvoted["label_source"] == "reference"
    assert voted["majority_frac"] == pytest.approx(2 / 5) and voted["n_classes"] == 4
    assert unvoted["majority"] is None and unvoted["majority_frac"] is None and unvoted["n_classes"] is None
    assert len(calls) == len(texts) - 1 < voted_calls  # one against the reference each (x+1 itself: none)
    label = grade({"texts": texts, "gold": None, "vote": False})
    assert label["majority_frac"] == pytest.approx(2 / 5) and label["label_source"] == "majority"


def test_verify_vote_auto_leaves_the_vote_to_questions_it_labels(tmp_path):
    labelled = {"id": "a", "question": "2*3?", "answer": "6", "samples": samples(r"\boxed{6}", r"\boxed{5}", r"\boxed{5}")}
    unlabelled = {"id": "b", "question": "2*4?", "samples": samples(r"\boxed{8}", r"\boxed{8}", r"\boxed{9}")}
    path = write_jsonl(tmp_path / "in.jsonl", [labelled, unlabelled])
    auto = run_sptool("verify", "--workers", "1", "--vote", "auto", str(path))
    assert auto.returncode == 0, auto.stderr
    a, b = read_jsonl(auto.stdout)
    assert [s["correct"] for s in a["samples"]] == [True, False, False] and a["p_hat"] == pytest.approx(1 / 3)
    assert a["majority"] is None and a["majority_frac"] is None and a["verdicts"]["math"]["n_classes"] is None
    assert b["majority"] == "8" and b["majority_frac"] == pytest.approx(2 / 3) and b["label_source"] == "majority"
    always = run_sptool("verify", "--workers", "1", str(path))  # the command's default: every question
    assert always.returncode == 0, always.stderr
    assert read_jsonl(always.stdout)[0]["majority"] == "5"
    wrong = run_sptool("verify", "--workers", "1", "--vote", "never", str(path))
    assert wrong.returncode == 2 and "--vote" in wrong.stderr and "Traceback" not in wrong.stderr


def test_majority_classes_largest_first_ties_by_first_occurrence():
    classes = majority_classes(["1", "2", "2", None, "1", "3", "INVALID"])
    assert classes == [[0, 4], [1, 2], [5]]


def test_all_correct_none_correct_single_sample():
    assert grade({"texts": [r"\boxed{4}"] * 3, "gold": "4"})["var"] == 0.0
    none = grade({"texts": [r"\boxed{5}"] * 3, "gold": "4"})
    assert none["p_hat"] == 0.0 and none["majority"] == "5" and none["majority_frac"] == 1.0
    single = grade({"texts": [r"\boxed{4}"], "gold": "4"})
    assert single["p_hat"] == 1.0


def test_stage_keeps_order_and_fields_with_workers(tmp_path):
    records = [{"id": str(i), "question": "q", "answer": str(i % 3),
                "samples": samples(rf"\boxed{{{i % 3}}}", r"\boxed{7}")} for i in range(12)]
    stage = VerifyStage(workers=2, deadline_s=30)
    try:
        out = list(stage.run(iter(records)))
    finally:
        stage.close()
    assert [r["id"] for r in out] == [str(i) for i in range(12)]
    assert all(r["samples"][0]["correct"] and not r["samples"][1]["correct"] for r in out)
    assert all(r["p_hat"] == 0.5 and r["verdicts"]["math"]["p_hat"] == 0.5 for r in out)


def test_hanging_item_becomes_verify_error_within_the_deadline(tmp_path):
    """A power tower makes math-verify spin for its own 5 s timeout per comparison (several
    comparisons per record); the hard deadline of 1.5 s kills the worker, marks that record
    verify_error, and the records around it are verified normally."""
    tower = r"\boxed{9^{9^{9^{9}}}}"
    records = [
        {"id": "before", "question": "q", "answer": "2", "samples": samples(r"\boxed{2}")},
        {"id": "hang", "question": "q", "answer": "5", "samples": samples(tower, r"\boxed{8^{8^{8^{8}}}}")},
        {"id": "after", "question": "q", "answer": "3", "samples": samples(r"\boxed{3}", r"\boxed{4}")},
    ]
    path = write_jsonl(tmp_path / "in.jsonl", records)
    started = time.monotonic()
    result = run_sptool("verify", "--workers", "2", "--deadline", "1.5", str(path))
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    out = {r["id"]: r for r in read_jsonl(result.stdout)}
    assert out["hang"]["verify_error"].startswith("timed out after 1.5s")
    assert out["hang"]["p_hat"] is None
    assert out["before"]["p_hat"] == 1.0 and out["after"]["p_hat"] == 0.5
    assert "1 verify_error" in result.stderr
    assert elapsed < 20  # bounded: not the ≥10 s math-verify would spend on the tower pair


def test_records_without_samples_pass_through(tmp_path):
    stage = VerifyStage(workers=0)
    out = list(stage.run(iter([{"question": "q", "valid": False, "samples": []}])))
    assert out[0]["samples"] == [] and "p_hat" not in out[0]


def test_no_eval_of_model_text(tmp_path):
    marker = tmp_path / "pwned"
    evil = rf"\boxed{{__import__('os').system('touch {marker}')}}"
    grade({"texts": [evil], "gold": "0"})
    assert not marker.exists()


# ---------------------------------------------------------------- answers without \boxed{}
# Phrasings of the kinds in math-verify's regression tables (written for this project): with no
# boxed answer, grading falls back to math-verify's own extraction; --require-boxed does not.

@pytest.mark.parametrize("text,gold,expected", [
    ("The final answer is $6$.", "6", True),
    ("The final answer is $7$.", "6", False),
    ("Final Answer: The final answer is $\\frac{3}{4}$. I hope it is correct.", "0.75", True),
    ("Answer: \\( \\frac{10}{9} \\)", "10/9", True),
    ("Working it out we get\n\\[\n2\\sqrt{2}\n\\]", "\\sqrt{8}", True),
    ("So the total is $1,250.50 after tax.", "1250.5", True),
    ("Therefore the answer is x = 12", "12", True),
    ("The interval is $[0, 1)$.", "[0,1)", True),
    ("The interval is $(0, 1]$.", "[0,1)", False),
    ("Thus the remainder is 4 and the quotient 17, so the answer is 17", "17", True),
    # boxes: intermediate boxes then a stated final answer; two boxes side by side are one answer
    ("Half is \\boxed{200}, then \\boxed{255}. Final Answer: The final answer is $10,455$. I hope it is correct.",
     "10455", True),
    ("The integers are \\boxed{-2} and \\boxed{1}.", "1, -2", True),
    ("The integers are \\boxed{-2} and \\boxed{1}.", "1", False),
    ("First \\boxed{3}. Much later, after more work, we see the answer is \\boxed{4}.", "4", True),
])
def test_grading_without_a_box_falls_back_to_math_verify_extraction(text, gold, expected):
    result = grade({"texts": [text], "gold": gold})
    assert result["correct"] == [expected], result["answers"]


def test_fallback_answers_are_marked_unboxed_and_require_boxed_is_strict():
    texts = [r"so \boxed{6}.", "The final answer is $6$.", "I am not sure."]
    lenient = grade({"texts": texts, "gold": "6"})
    assert lenient["answers"] == ["6", "6", None]
    assert lenient["boxed"] == [True, False, False]
    assert lenient["correct"] == [True, True, False]
    assert lenient["majority_frac"] == pytest.approx(2 / 3)
    restated = grade({"texts": [r"\boxed{6}. So the final answer is 6."], "gold": "6"})
    assert restated["boxed"] == [True] and restated["correct"] == [True]
    strict = grade({"texts": texts, "gold": "6", "require_boxed": True})
    assert strict["answers"] == ["6", None, None] and strict["correct"] == [True, False, False]


def test_verify_cli_grades_unboxed_answers_and_require_boxed_restores_strictness(tmp_path):
    record = {"id": "q", "question": "2*3?", "answer": "6",
              "samples": samples("The final answer is $6$.", r"It is \boxed{6}.", "The final answer is $5$.")}
    path = write_jsonl(tmp_path / "in.jsonl", [record])
    lenient = run_sptool("verify", "--workers", "1", str(path))
    assert lenient.returncode == 0, lenient.stderr
    [out] = read_jsonl(lenient.stdout)
    assert [s["correct"] for s in out["samples"]] == [True, True, False]
    assert [s["boxed"] for s in out["samples"]] == [False, True, False]
    assert out["p_hat"] == pytest.approx(2 / 3)
    assert "2 answers found without \\boxed{}" in lenient.stderr
    strict = run_sptool("verify", "--workers", "1", "--require-boxed", str(path))
    assert strict.returncode == 0, strict.stderr
    [out] = read_jsonl(strict.stdout)
    assert [s["correct"] for s in out["samples"]] == [False, True, False]
    assert [s["answer"] for s in out["samples"]] == [None, "6", None]


def test_an_equation_on_numbers_is_graded_by_its_value():
    """math-verify compares two equations by lhs − rhs, so "47 + 38 = 85" and "57 + 76 = 133" are
    "equivalent" (both 0). A majority answer written as an equation then became a pseudo-label that
    any true equation matched, and the random-label control learnt to box true equations. The
    value after the last "=" is the answer: the majority is "85", and an equation for another sum,
    true or not, is wrong against it."""
    votes = grade({"texts": [r"\boxed{47 + 38 = 85}", r"\boxed{57 + 76 = 133}", r"\boxed{1 + 1 = 2}",
                             r"\boxed{85}"], "gold": None})
    assert votes["majority"] == "85" and votes["n_classes"] == 3
    assert votes["correct"] == [True, False, False, True]
    against_equation = grade({"texts": [r"\boxed{57 + 76 = 133}", r"\boxed{2 + 2 = 5}", r"\boxed{40+45 = 85}",
                                        r"\boxed{85}"], "gold": "47 + 38 = 85"})
    assert against_equation["correct"] == [False, False, True, True]
    assert answers_equivalent("47 + 38 = 85", "85") and answers_equivalent("85", "47 + 38 = 85")
    assert not answers_equivalent("47 + 38 = 85", "57 + 76 = 133")
    assert not answers_equivalent("1 + 1 = 3", "2 + 2 = 5")  # both off by one: equal to math-verify
    assert not answers_equivalent("85", "47 + 38")  # unevaluated, as in grade
    # equations with a variable are math-verify's, as before
    assert grade({"texts": [r"\boxed{x = 5}", r"\boxed{5}"], "gold": "5"})["correct"] == [True, True]
    assert grade({"texts": [r"\boxed{y = 2x + 1}"], "gold": "y = 2x + 1"})["correct"] == [True]
