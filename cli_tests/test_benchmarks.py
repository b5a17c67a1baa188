"""Smoke test of ``benchmarks/learning_parity.py`` on CPU with the real tiny model: the bare loop and
``sptool run --recipe rlvr`` each train 2 steps on the same problems, with the same prompt, prefix
and stop string (`--task small`: the assistant prefix starts inside the box), and the table reports both (not a speed claim: the figures are the GPU's)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


def test_learning_parity_cpu_smoke_runs_bare_and_sptool_arms(tmp_path):
    out = tmp_path / "parity"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "learning_parity.py"), "--device", "cpu", "--steps", "2",
         "--eval-every", "2", "--arms", "bare,sptool", "--task", "small", "--out", str(out)],
        capture_output=True, text=True, timeout=900, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    table = result.stdout
    assert "held-out greedy accuracy after N steps" in table and "seconds per step" in table
    for arm in ("bare", "sptool"):
        data = json.loads((out / f"{arm}.json").read_text())
        assert [s["step"] for s in data["steps"]] == [1, 2]
        assert [e["step"] for e in data["evals"]] == [0, 2]
        assert all(0.0 <= e["greedy_accuracy"] <= 1.0 for e in data["evals"])
        assert all(s["total"] > 0 and s["generation"] > 0 for s in data["steps"])
        # the assistant reply starts inside the box (the prefix), so boxed answers earn reward
        assert all(s["mean_reward"] > 0 for s in data["steps"]), data["steps"]
        assert any(line.startswith(arm) for line in table.splitlines())
    sptool = json.loads((out / "sptool.json").read_text())
    # the checkpoint written for the evaluation after step 2 is shown apart, not in the step's time
    first, last = sptool["steps"]
    assert first["checkpoint"] == 0 and last["checkpoint"] > 0 and last["training"] >= 0
    assert "ckpt" in table
    # each step says how long Python's garbage collector held it up (the stages' gc_s)
    assert all(s["gc_s"] is not None and 0 <= s["gc_s"] < s["total"] for s in sptool["steps"])
    assert "--recipe rlvr" in sptool["notes"]["command"] and "prompts.solve_prefix" in sptool["notes"]["command"]
    # both arms start from the same weights and the same greedy evaluation
    bare = json.loads((out / "bare.json").read_text())
    assert bare["evals"][0]["greedy_accuracy"] == sptool["evals"][0]["greedy_accuracy"]


def test_verify_throughput_times_grading_on_a_runs_solve_records():
    """``verify_throughput.py --records``: every question of real solved records graded once in this
    process and timed, the slowest shown with their completions, then the file through the stage,
    with the majority vote and without it."""
    records = REPO / "fixtures" / "verified_svs.jsonl"
    questions = sum(1 for line in records.read_text().splitlines() if line.strip() and json.loads(line)["samples"])
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "verify_throughput.py"), "--records", str(records),
         "--workers", "1", "--show", "1", "--vote", "always", "auto"], capture_output=True, text=True, timeout=300,
        cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"{records}: {questions} questions, ") and "grading in one process" in lines[0]
    shown = [line for line in lines if " ms  gold " in line]
    assert len(shown) == 1
    after = lines[lines.index(shown[0]) + 1:lines.index(shown[0]) + 5]  # its 4 completions' ends
    assert len(after) == 4 and all(line.startswith("             ...'") and "boxed{" in line for line in after)
    # the stage with the vote beside the reference answer and without it (verify.vote)
    assert lines[-2].startswith("  sptool verify --workers 1 --vote always: ") and lines[-2].endswith(" s")
    assert lines[-1].startswith("  sptool verify --workers 1 --vote auto: ") and lines[-1].endswith(" s")


def test_kept_samples_gives_each_steps_truncated_boxed_and_answered_shares(tmp_path):
    """``benchmarks/kept_samples.py`` over a kept run: one line a step, in step order, with the
    shares of its samples cut at the limit, boxed and answered; the last step's cut texts; exit 2
    and one line for a directory without solve records."""
    run = tmp_path / "sptool.seed0.run"

    def sample(text, reason, answer):
        return {"text": text, "finish_reason": reason, "n_tokens": 64 if reason == "length" else 4, "answer": answer}

    steps = [[sample("7 + 8 is", "length", None), sample("\\boxed{15}", "stop", "15")],
             [sample("\\boxed{15} and so on", "length", "15"), sample("\\boxed{15}", "stop", "15")]]
    for number, samples in enumerate(steps, 1):
        (run / f"iter-{number:04d}").mkdir(parents=True)
        (run / f"iter-{number:04d}" / "02-solve.jsonl").write_text(json.dumps({"samples": samples}) + "\n")
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kept_samples.py"), str(run), "--show", "1"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "##### sptool.seed0.run"
    assert lines[1] == ("step  1: n 2 truncated 0.500 mean tokens 34.0 boxed 0.500 boxed among truncated 0.000 "
                        "with answer 0.500")
    assert lines[2].startswith("step  2:") and "boxed 1.000 boxed among truncated 1.000 with answer 1.000" in lines[2]
    assert "CUT   '\\\\boxed{15} and so on'" in lines[3]
    empty = tmp_path / "empty.run"
    empty.mkdir()
    failed = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kept_samples.py"), str(empty)],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert failed.returncode == 2 and failed.stderr.strip() == f"{empty}: no solve records with samples"
