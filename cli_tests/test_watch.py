"""`sptool run` watches itself: decontamination of generated questions and documents, and
curriculum health per iteration (warnings, stop_on_collapse, resume after raising a threshold)."""

from __future__ import annotations

import json

import pytest

from conftest import FIXTURES, read_jsonl, run_sptool
from test_run import ENV, scripted_args

LEAKED = FIXTURES / "bench" / "leaked.jsonl"


def metrics_of(run_dir) -> list[dict]:
    return read_jsonl(run_dir / "metrics.jsonl")


@pytest.mark.slow
def test_rquest_run_marks_benchmark_copies_invalid_and_counts_them(tmp_path, random_policy):
    run_dir = tmp_path / "rquest"
    result = run_sptool(*scripted_args("rquest", run_dir, random_policy),
                        "--set", f'decontaminate.benchmarks="{LEAKED}"', env=ENV)
    assert result.returncode == 0, result.stderr
    lines = metrics_of(run_dir)
    challenge = [line for line in lines if line["kind"] == "challenge"]
    assert challenge and all(line["contaminated"] > 0 for line in challenge)
    generated = read_jsonl(run_dir / "iter-0001" / "01-q1-challenge.jsonl")
    copies = [r for r in generated if r.get("question") == "What is 40 + 2?"]
    assert copies and all(r["valid"] is False and r["contamination"]["problem_id"] == "leak-add" for r in copies)
    assert sum(line["contaminated"] for line in challenge) == sum(
        1 for path in run_dir.glob("iter-*/*challenge.jsonl") for r in read_jsonl(path) if r.get("contamination"))
    # no solver ever sees a copy
    solved = [r for path in run_dir.glob("iter-*/*-solve.jsonl") for r in read_jsonl(path)]
    assert not any(r.get("samples") and r.get("contamination") for r in solved)
    report = run_sptool("report", str(run_dir))
    assert "decontamination:" in report.stdout + report.stderr


@pytest.mark.slow
def test_wist_run_drops_fetched_documents_that_contain_a_benchmark_problem(tmp_path, random_policy):
    run_dir = tmp_path / "wist"
    # the offline corpus's pages do not hold the leaked problems: a clean run counts 0
    result = run_sptool(*scripted_args("wist", run_dir, random_policy), "-n", "1",
                        "--set", f'decontaminate.benchmarks="{LEAKED}"', env=ENV)
    assert result.returncode == 0, result.stderr
    fetch = [line for line in metrics_of(run_dir) if line["kind"] == "corpus-fetch"]
    assert fetch and all(line["contaminated"] == 0 for line in fetch)
    challenge = [line for line in metrics_of(run_dir) if line["kind"] == "challenge"]
    # the scripted challenger writes the leaked triangle question: marked invalid
    assert challenge[0]["contaminated"] >= 1


@pytest.mark.slow
def test_every_run_reports_curriculum_health(tmp_path, random_policy):
    run_dir = tmp_path / "svs"
    result = run_sptool(*scripted_args("svs", run_dir, random_policy), "--probe",
                        str(FIXTURES / "bench" / "addition_heldout.jsonl"), env=ENV)
    assert result.returncode == 0, result.stderr
    health = [line for line in metrics_of(run_dir) if line["kind"] == "health"]
    assert [line["iteration"] for line in health] == [1, 2]
    first = health[0]
    assert set(first["difficulty"]) == {"0", "(0,0.25]", "(0.25,0.5]", "(0.5,0.75]", "(0.75,1)", "1"}
    assert abs(sum(first["difficulty"].values()) - 1.0) < 1e-9
    assert 0 <= first["signal_share"] <= 1 and first["duplicate_share_earlier"] is None
    assert health[1]["duplicate_share_earlier"] is not None
    # the scripted solver answers 42 to everything: the probe's majority is right only for 42
    probe = read_jsonl(run_dir / "iter-0001" / next(p.name for p in (run_dir / "iter-0001").glob("*-probe-grade.jsonl")))
    expected = sum(1 for p in read_jsonl(FIXTURES / "bench" / "addition_heldout.jsonl") if p["answer"] == "42")
    assert first["pseudo_label_accuracy"] == expected / len(probe)
    assert (run_dir / "report").exists() is False
    run_sptool("report", str(run_dir))
    assert (run_dir / "report" / "health.png").is_file() and (run_dir / "report" / "difficulty.png").is_file()


@pytest.mark.slow
def test_collapse_warns_stops_and_resumes_after_raising_the_threshold(tmp_path, random_policy):
    """The scripted questioner asks the same two questions every time: near-duplicates pile up."""
    run_dir = tmp_path / "rzero"
    base = [*scripted_args("rzero", run_dir, random_policy), "-n", "2"]
    stopped = run_sptool(*base, "--set", "health.max_duplicate_share=0.5", "--set", "run.stop_on_collapse=true",
                         env=ENV)
    assert stopped.returncode == 3, stopped.stderr
    assert "warning: iteration 1: curriculum health: near-duplicate share" in stopped.stderr  # even with -q
    assert "run stopped after iteration 1 (run.stop_on_collapse): near-duplicate share" in stopped.stderr
    assert "Traceback" not in stopped.stderr
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["order"][-1].endswith("-health") and not any(k.startswith("iter-0002") for k in manifest["order"])

    again = run_sptool(*base, "--resume", "--set", "health.max_duplicate_share=0.5", "--set",
                       "run.stop_on_collapse=true", env=ENV)
    assert again.returncode == 3  # the same thresholds: stopped again, nothing re-run
    resumed = run_sptool(*base, "--resume", "--set", "health.max_duplicate_share=1.0", "--set",
                         "run.stop_on_collapse=true", env=ENV)
    assert resumed.returncode == 0, resumed.stderr
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["order"][-1].startswith("iter-0002/") and manifest["order"][-1].endswith("-health")


def test_the_health_step_reads_only_the_outputs_it_uses_and_copies_none():
    """Health reads the verify, filter, challenge and probe outputs in place: a copy of every output
    of the iteration (a solve step's 512 samples with their log-probabilities among them) took
    0.1-0.4 s of a 2.5 s loop step. The solve output is never read, and none is copied."""
    from sptool.run import steps as steps_module
    from sptool.run.steps import Step, StepContext
    from sptool.run.watch import health_step

    def never():
        raise AssertionError("health read the solve output")

    verified = [{"id": "a", "samples": [{"text": "x"}], "p_hat": 0.5}, {"id": "b", "samples": [{"text": "y"}], "p_hat": 1.0}]
    filtered = [{"id": "a", "advantages": [0.5, -0.5]}, {"id": "b", "advantages": [0.0, 0.0]}]
    steps = [Step("solve", None), Step("verify", None, kind="verify"), Step("filter", None, kind="filter")]
    step = health_step(session=None, steps=steps)
    copies = []
    original = steps_module.json_copy
    steps_module.json_copy = lambda records: copies.append(len(records)) or original(records)
    try:
        ctx = StepContext(lambda event: None, 1, "iter-0001/04-health", step, 0,
                          {"solve": never, "verify": lambda: verified, "filter": lambda: filtered})
        [report] = step.fn(ctx, [])
    finally:
        steps_module.json_copy = original
    assert report["graded"] == 2 and report["signal_share"] == 0.5 and report["group_signal_share"] == 0.5
    assert copies == [] and verified[0] == {"id": "a", "samples": [{"text": "x"}], "p_hat": 0.5}
    # a later iteration without generated questions indexes no earlier ones (the run directory,
    # here absent, is never read): its duplicate shares are None
    ctx = StepContext(lambda event: None, 2, "iter-0002/04-health", step, 0,
                      {"solve": never, "verify": lambda: verified, "filter": lambda: filtered})
    [later] = step.fn(ctx, [])
    assert later["graded"] == 2 and later["duplicate_share_within"] is None and later["duplicate_share_earlier"] is None
