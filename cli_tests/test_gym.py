"""data gym: reproducible labelled sets from reasoning-gym; graded by math-verify or the task's scorer."""

from __future__ import annotations

import pytest

from conftest import read_jsonl, run_sptool, write_jsonl
from sptool.gym import MATH_TASKS, generate
from sptool.stages.verify import VerifyStage


def verify_records(records: list[dict], **options) -> list[dict]:
    stage = VerifyStage(workers=0, **options)
    try:
        return list(stage.run(iter(records)))
    finally:
        stage.close()


def test_same_arguments_give_identical_files(tmp_path):
    outputs = []
    for name in ("a.jsonl", "b.jsonl", "c.jsonl"):
        seed = "1" if name == "c.jsonl" else "0"
        result = run_sptool("data", "gym", "basic_arithmetic", "-n", "100", "--seed", seed, "-o",
                            str(tmp_path / name))
        assert result.returncode == 0, result.stderr
        outputs.append((tmp_path / name).read_bytes())
    assert outputs[0] == outputs[1]
    assert outputs[0] != outputs[2]
    records = read_jsonl(tmp_path / "a.jsonl")
    assert len(records) == 100 and len({r["id"] for r in records}) == 100
    first = records[0]
    assert first["task"] == "basic_arithmetic" and first["grader"] == "math-verify"
    assert first["question"] and first["answer"] and first["metadata"]["expression"]
    assert first["gym"] == {"seed": 0, "index": 0, "config": {}}


def test_several_tasks_params_and_stdout():
    result = run_sptool("data", "gym", "chain_sum", "word_sorting", "-n", "3", "--param", "max_terms=2")
    # word_sorting has no max_terms: one line naming the task, and nothing written (not even chain_sum's)
    assert result.returncode == 2 and "word_sorting" in result.stderr and "bad --param" in result.stderr
    assert result.stdout == ""
    result = run_sptool("data", "gym", "chain_sum", "word_sorting", "-n", "3")
    assert result.returncode == 0, result.stderr
    records = read_jsonl(result.stdout)
    assert [r["task"] for r in records] == ["chain_sum"] * 3 + ["word_sorting"] * 3
    assert [r["grader"] for r in records] == ["math-verify"] * 3 + ["reasoning-gym"] * 3
    assert "data gym: 6 problems" in result.stderr


def test_unknown_task_and_bad_arguments_are_one_line_errors():
    result = run_sptool("data", "gym", "basic_arithmatic", "-n", "3")
    assert result.returncode == 2
    assert ("unknown reasoning-gym task 'basic_arithmatic'. Did you mean 'basic_arithmetic'? "
            "`sptool data gym --list` lists every task") in result.stderr
    assert "Traceback" not in result.stderr
    assert run_sptool("data", "gym", "-n", "3").returncode == 2
    assert run_sptool("data", "gym", "chain_sum", "-n", "0").returncode == 2
    listed = run_sptool("data", "gym", "--list")
    assert listed.returncode == 0 and "basic_arithmetic\tmath-verify" in listed.stdout
    assert "word_sorting\treasoning-gym" in listed.stdout


@pytest.mark.parametrize("task", sorted(MATH_TASKS))
def test_math_tasks_are_graded_by_math_verify(task):
    records = list(generate(task, n=3, seed=0))
    for record in records:
        record["samples"] = [{"text": f"So the answer is \\boxed{{{record['answer']}}}."},
                             {"text": "So the answer is \\boxed{123456789.5}."}]
    graded = verify_records(records)
    assert [[s["correct"] for s in r["samples"]] for r in graded] == [[True, False]] * 3


def test_other_tasks_use_their_own_scorer():
    # fraction_simplification wants lowest terms: math-verify would call 2/4 equal to 1/2
    fraction = next(r for r in generate("fraction_simplification", n=20, seed=0)
                    if r["metadata"]["numerator"] != r["metadata"]["simplified_numerator"])
    meta = fraction["metadata"]
    unsimplified = f"\\boxed{{\\dfrac{{{meta['numerator']}}}{{{meta['denominator']}}}}}"
    fraction["samples"] = [{"text": f"\\boxed{{{fraction['answer']}}}"}, {"text": unsimplified}]
    words = next(generate("word_sorting", n=1, seed=0))
    right = ", ".join(words["metadata"]["sorted_words"])
    wrong = ", ".join(reversed(words["metadata"]["sorted_words"]))
    words["samples"] = [{"text": f"Sorted: \\boxed{{\\text{{{right}}}}}"},       # boxed text
                        {"text": f"<answer>{right}</answer>"},                       # reasoning-gym's tag
                        {"text": f"Here they are.\nFinal answer: {right}"},          # a stated answer
                        {"text": f"\\boxed{{{wrong}}}"}]                              # partial credit only
    graded = verify_records([fraction, words])
    assert [s["correct"] for s in graded[0]["samples"]] == [True, False]
    assert [s["correct"] for s in graded[1]["samples"]] == [True, True, True, False]
    assert [s["boxed"] for s in graded[1]["samples"]] == [True, False, False, True]
    assert graded[1]["majority"] == right and graded[1]["majority_frac"] == 0.75
    strict = verify_records([dict(words, samples=[dict(s) for s in words["samples"]])], require_boxed=True)
    assert [s["correct"] for s in strict[0]["samples"]] == [True, False, False, False]


def test_gym_records_through_the_verify_command(tmp_path):
    result = run_sptool("data", "gym", "word_sorting", "-n", "2", "--seed", "3")
    records = read_jsonl(result.stdout)
    for record in records:
        record["samples"] = [{"text": f"\\boxed{{{record['answer']}}}"}, {"text": "\\boxed{no idea}"}]
    path = write_jsonl(tmp_path / "solved.jsonl", records)
    verified = run_sptool("verify", "--workers", "1", str(path))
    assert verified.returncode == 0, verified.stderr
    assert [r["p_hat"] for r in read_jsonl(verified.stdout)] == [0.5, 0.5]


@pytest.mark.slow
def test_a_gym_file_trains_through_run(tmp_path, random_policy):
    """The labelled set feeds a training run (svs: the recipe that takes a labelled --data file)."""
    from test_run import ENV, scripted_args

    data = tmp_path / "gym.jsonl"
    made = run_sptool("data", "gym", "basic_arithmetic", "chain_sum", "-n", "8", "--seed", "0", "-o", str(data))
    assert made.returncode == 0, made.stderr
    args = scripted_args("svs", tmp_path / "run", random_policy)
    args[args.index("--data") + 1] = str(data)
    result = run_sptool(*args, "-n", "1", env=ENV)
    assert result.returncode == 0, result.stderr
    sampled = read_jsonl(next((tmp_path / "run" / "iter-0001").glob("*-sample.jsonl")))
    assert {r["task"] for r in sampled} <= {"basic_arithmetic", "chain_sum"} and sampled
