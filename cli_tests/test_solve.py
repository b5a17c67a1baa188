"""solve: prompts, modes, batching and seeds; the real tiny model end to end."""

from __future__ import annotations

import json

import pytest

from conftest import FIXTURES, read_jsonl, run_sptool, write_jsonl
from sptool.models.base import SamplingParams
from sptool.models.scripted import ScriptedBackend
from sptool.stages.solve import SolveStage


def test_scripted_solve_adds_samples_answers_and_prompt():
    backend = ScriptedBackend(outputs=[r"so \boxed{4}", "no idea"])
    stage = SolveStage(backend, samples=2, batch_size=2)
    out = list(stage.run(iter([{"question": "2+2?", "answer": "4", "extra": 1},
                               {"question": "3+3?"}])))
    assert [len(r["samples"]) for r in out] == [2, 2]
    assert out[0]["samples"][0]["answer"] == "4" and out[0]["samples"][1]["answer"] is None
    assert out[0]["extra"] == 1 and out[0]["mode"] == "math"
    assert "2+2?" in out[0]["solve_prompt"][0]["content"]
    assert "\\boxed{}" in out[0]["solve_prompt"][0]["content"]
    assert len(backend.calls) == 1 and len(backend.calls[0]) == 2  # one batched call
    assert out[0]["id"] and out[0]["id"] != out[1]["id"]


def test_validity_mode_prompt_allows_invalid():
    backend = ScriptedBackend(outputs=[r"\boxed{INVALID}"])
    out = list(SolveStage(backend, samples=1, mode="validity").run(iter([{"question": "x/0?"}])))
    assert "INVALID" in out[0]["solve_prompt"][0]["content"]
    assert out[0]["samples"][0]["answer"] == "INVALID" and out[0]["mode"] == "validity"


def test_invalid_generated_questions_pass_through_unsolved():
    backend = ScriptedBackend(outputs=["x"])
    stage = SolveStage(backend, samples=3)
    out = list(stage.run(iter([{"question": "bad", "valid": False}, {"question": "good"}])))
    assert out[0]["samples"] == [] and len(out[1]["samples"]) == 3
    assert backend.calls == [[backend.render(out[1]["solve_prompt"])]]


def test_prompt_file_overrides_template(tmp_path, sptool):
    template = tmp_path / "p.txt"
    template.write_text("Q: {question} (topic {topic})")
    script = write_jsonl(tmp_path / "script.jsonl", [{"match": "Q: what", "output": "\\boxed{1}"}])
    questions = write_jsonl(tmp_path / "q.jsonl", [{"question": "what?", "topic": "sets"}])
    result = sptool("solve", "--backend", "scripted", "-m", str(script), "--prompt", str(template),
                    "-k", "2", str(questions))
    assert result.returncode == 0, result.stderr
    record = read_jsonl(result.stdout)[0]
    assert record["solve_prompt"][0]["content"] == "Q: what? (topic sets)"
    assert [s["answer"] for s in record["samples"]] == ["1", "1"]


def test_sampling_params_are_validated(sptool):
    result = sptool("solve", "--backend", "scripted", "--top-p", "0", input="")
    assert result.returncode == 2 and "--top-p must be in (0, 1]" in result.stderr


@pytest.mark.slow
def test_hf_backend_is_deterministic_under_a_seed_and_returns_logprobs():
    from sptool.models.hf import HFBackend

    backend = HFBackend("tiny", batch_size=4)
    prompt = [[{"role": "user", "content": "Name a prime number."}]]
    params = SamplingParams(max_new_tokens=12, seed=3, logprobs=True)
    first = backend.generate(prompt, 3, params)[0]
    again = backend.generate(prompt, 3, params)[0]
    other = backend.generate(prompt, 3, SamplingParams(max_new_tokens=12, seed=4))[0]
    assert [s.text for s in first] == [s.text for s in again]
    assert [s.text for s in first] != [s.text for s in other]
    for sample in first:
        assert 1 <= sample.n_tokens <= 12
        assert len(sample.logprobs) == sample.n_tokens
        assert all(lp <= 0 for lp in sample.logprobs)
    greedy = backend.generate(prompt, 2, SamplingParams(temperature=0, max_new_tokens=8))[0]
    assert greedy[0].text == greedy[1].text


@pytest.mark.slow
def test_real_pipeline_solve_then_verify_is_reproducible(tmp_path):
    """The issue's acceptance pipeline with the real tiny model, as real subprocesses."""
    import subprocess
    import sys

    from conftest import REPO, SPTOOL

    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(open(FIXTURES / "questions.jsonl").readlines()[:3]))
    command = (f"{' '.join(SPTOOL)} solve {questions} -k 4 --seed 0 --max-tokens 48 -q | "
               f"{' '.join(SPTOOL)} verify -q --workers 1")
    runs = [subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True,
                           text=True, cwd=REPO, timeout=600) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr
    first, second = read_jsonl(runs[0].stdout), read_jsonl(runs[1].stdout)
    assert first == second
    assert len(first) == 3
    for record in first:
        assert len(record["samples"]) == 4
        assert all(isinstance(s["correct"], bool) for s in record["samples"])
        assert 0.0 <= record["p_hat"] <= 1.0 and record["verify_error"] is None
        assert record["solver_model"] == "tiny"
        assert any(s["text"].strip() for s in record["samples"])  # the model really wrote text
