"""``benchmarks/learning_parity.py --seeds``: the report's mean and standard error over seeds and
its comparison of every arm with the reference arm (issue 32's bar: at least the float32 arm − 2
s.e.), on results written the way the workers write them (no model)."""

from __future__ import annotations

import json
import math
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import learning_parity  # noqa: E402


def write(out, arm: str, seed: int, accuracy: dict[int, float], tag: bool = True, problems: int = 300,
          truncated: dict[int, float] | None = None) -> None:
    settings = {"problems": 64, "samples": 8, "max_tokens": 64, "lr": 1e-5, "device": "cuda", "seed": seed,
                "heldout": "/elsewhere/addition_heldout_300.jsonl", "heldout_limit": 0}
    evals = [{"step": step, "greedy_accuracy": value, "seconds": 1.0, "problems": problems}
             for step, value in accuracy.items()]
    steps = [{"step": step, "total": 2.0, "generation": 1.0, "grading": 0.1, "training": 0.8, "other": 0.1,
              "truncated_rate": (truncated or {}).get(step)} for step in sorted({1, *(truncated or {})})]
    name = f"{arm}{learning_parity.seed_tag(seed) if tag else ''}.json"
    (out / name).write_text(json.dumps({"arm": arm, "settings": settings, "steps": steps, "evals": evals}))


def test_seeds_give_a_mean_a_spread_and_a_verdict_against_the_reference(tmp_path):
    # the reference: 3 seeds whose spread at step 5 is wide, at step 10 narrow
    for seed, (at5, at10) in enumerate([(0.30, 0.60), (0.40, 0.61), (0.50, 0.62)]):
        write(tmp_path, "sptool", seed, {0: 0.0, 5: at5, 10: at10})
    # a candidate 0.1 behind at step 5 (inside the wide spread), 0.2 behind at step 10 (outside)
    for seed, (at5, at10) in enumerate([(0.20, 0.40), (0.30, 0.41), (0.40, 0.42)]):
        write(tmp_path, "sptool-bf16-trainer-selfold", seed, {0: 0.0, 5: at5, 10: at10})
    (tmp_path / "parity.json").write_text("{}")  # an earlier report is not a result
    text = learning_parity.report(tmp_path)
    summary = json.loads((tmp_path / "parity.json").read_text())
    assert set(summary["arms"]) == {f"sptool s{k}" for k in range(3)} | {
        f"sptool-bf16-trainer-selfold s{k}" for k in range(3)}
    ref = summary["mean_over_seeds"]["sptool"]["5"]
    assert math.isclose(ref["mean"], 0.40) and ref["seeds"] == 3 and ref["se_from"] == "seeds"
    assert math.isclose(ref["se"], 0.1 / math.sqrt(3))  # sample s.d. 0.1 over 3 seeds
    verdict = summary["against_reference"]["arms"]["sptool-bf16-trainer-selfold"]
    assert math.isclose(verdict["steps"]["5"]["difference"], -0.10)
    assert math.isclose(verdict["steps"]["5"]["se"], math.sqrt(2) * 0.1 / math.sqrt(3))
    assert verdict["steps"]["5"]["within"] is True        # −0.10 ≥ −2 × 0.082
    assert verdict["steps"]["10"]["within"] is False       # −0.20 < −2 × 0.008
    assert verdict["within_everywhere"] is False and "0" not in verdict["steps"]
    assert "seeds 0, 1, 2" in text and "mean over seeds" in text
    row = next(line for line in text.splitlines() if line.startswith("sptool-bf16-trainer-selfold ")
               and "!" in line)
    assert row.split()[-1] == "no" and "-0.200" in row


def test_one_seed_per_arm_is_held_to_the_binomial_error(tmp_path):
    """A single-seed run (the files of earlier runs: ARM.json) is still reported, each arm against
    the reference with the binomial error of its held-out size."""
    write(tmp_path, "sptool", 0, {0: 0.0, 5: 0.5}, tag=False)
    write(tmp_path, "sptool-tf32", 0, {0: 0.0, 5: 0.4}, tag=False)
    text = learning_parity.report(tmp_path)
    summary = json.loads((tmp_path / "parity.json").read_text())
    assert set(summary["arms"]) == {"sptool", "sptool-tf32"} and "mean over seeds" not in text
    step5 = summary["against_reference"]["arms"]["sptool-tf32"]["steps"]["5"]
    assert math.isclose(step5["se"], math.sqrt(0.25 / 300 + 0.24 / 300))
    assert step5["within"] is False  # −0.10 < −2 × 0.040


def test_kept_records_are_the_runs_step_files_and_metrics_without_checkpoints(tmp_path):
    """``--keep-records``: a copy of each step's records and ``metrics.jsonl``, and no checkpoint."""
    run = tmp_path / "run"
    (run / "iter-0001").mkdir(parents=True)
    (run / "iter-0001" / "03-verify.jsonl").write_text('{"id": "q1"}\n')
    (run / "metrics.jsonl").write_text('{"stage": "verify"}\n')
    (run / "ckpt" / "policy" / "step-0001").mkdir(parents=True)
    (run / "ckpt" / "policy" / "step-0001" / "model.safetensors").write_bytes(b"weights")
    kept = tmp_path / "out" / "sptool.s0.run"
    learning_parity.keep_records(run, kept)
    assert sorted(str(path.relative_to(kept)) for path in kept.rglob("*") if path.is_file()) == [
        "iter-0001/03-verify.jsonl", "metrics.jsonl"]
    assert (kept / "iter-0001" / "03-verify.jsonl").read_text() == '{"id": "q1"}\n'


def test_the_report_gives_each_arms_share_of_samples_cut_at_the_token_limit(tmp_path):
    """The truncated share at step 1 and at each evaluation step, per arm over its seeds (the
    captured decoder's curve was first told apart by it); an arm without it (TRL's) has no row."""
    write(tmp_path, "sptool", 0, {0: 0.0, 4: 0.2}, truncated={1: 0.41, 2: 0.39, 4: 0.30})
    write(tmp_path, "sptool", 1, {0: 0.0, 4: 0.3}, truncated={1: 0.43, 2: 0.35, 4: 0.20})
    write(tmp_path, "trl", 0, {0: 0.0, 4: 0.1}, tag=False)
    text = learning_parity.report(tmp_path)
    shares = json.loads((tmp_path / "parity.json").read_text())["truncated_share"]
    assert shares["steps"] == [1, 4] and set(shares["arms"]) == {"sptool"}
    assert math.isclose(shares["arms"]["sptool"]["4"]["mean"], 0.25)  # JSON keys: the steps as text
    assert shares["arms"]["sptool"]["1"]["values"] == [0.41, 0.43]
    row = next(line for line in text.splitlines() if line.startswith("sptool (2)") and "/" in line)
    assert row.split()[2:] == ["0.42", "(0.41/0.43)", "0.25", "(0.30/0.20)"]


def test_an_arms_environment_reaches_its_sptool_run_and_the_others_start_without_it(tmp_path, monkeypatch):
    """``ARM_ENVIRONMENT``: the expandable-segments arm's ``sptool run`` starts with
    ``PYTORCH_CUDA_ALLOC_CONF`` set (it must be set before CUDA starts), with the captured step's
    settings; the other arms start with the caller's environment. Stopped at the process start."""
    started = {}

    class Started(Exception):
        pass

    def popen(command, env, **options):
        started.update(command=command, env=env)
        raise Started

    monkeypatch.setattr(learning_parity.subprocess, "Popen", popen)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    settings = learning_parity.Settings(device="cpu", steps=1, problems=2, samples=2, max_tokens=4, lr=1e-5,
                                        seed=0, eval_every=0, micro_batch=2)
    for arm, expected in (("sptool-step-capture-expandable", "expandable_segments:True"),
                          ("sptool-step-capture", None)):
        recorder = learning_parity.Recorder(arm, settings)
        try:
            learning_parity.run_sptool(settings, recorder, tmp_path / arm, arm)
        except Started:
            pass
        assert started["env"].get("PYTORCH_CUDA_ALLOC_CONF") == expected, arm
        assert "model.step_graph=\"capture\"" in started["command"], arm
        assert recorder.notes.get("environment") == ({"PYTORCH_CUDA_ALLOC_CONF": expected} if expected else None)
