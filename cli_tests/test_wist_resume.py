"""WIST's kill-resume equality at every hook point, metrics included (issue 26, class 5).

A kill at ``2/corpus-fetch:save`` used to leave the leaf pools of the killed attempt on disk: the
resumed step served the leaves from them, fetched nothing, dropped nothing, and wrote
``rejected=0`` where the uninterrupted run has 2. Pools written by a step that never finished no
longer count (``LeafPool``'s step markers). Scripted backend, 1-layer random policy."""

from __future__ import annotations

import signal

import pytest

from conftest import run_sptool, stable_metrics
from test_run import ENV, checkpoint_weights, scripted_args, scripted_run, shares_run, stage_outputs  # noqa: F401 - fixture

# Every hook point once (start, mid, train-done, save, checkpoint, done), in run order, each in a
# later step than the last (a killed run resumes up to the next point).
WIST_KILL_POINTS = ["1/corpus-fetch:start", "1/challenge:mid", "1/train:train-done", "2/corpus-fetch:save",
                    "2/train:checkpoint", "2/posterior-update:done"]


@pytest.mark.slow  # like test_run's kill-resume tests: 7 runs of the 1-layer random policy, ~3.5 min on 2 busy cores
@shares_run("wist")
def test_wist_sigkill_at_every_hook_point_then_resume_equals_uninterrupted_run(tmp_path, random_policy,
                                                                             scripted_run):
    reference = scripted_run("wist")
    killed = tmp_path / "killed"
    for point in WIST_KILL_POINTS:
        args = scripted_args("wist", killed, random_policy)
        if (killed / "manifest.json").exists():
            args.append("--resume")
        result = run_sptool(*args, env={**ENV, "SPTOOL_TEST_KILL_AT": point})
        assert result.returncode in (-signal.SIGKILL, 137), (point, result.returncode, result.stderr[-2000:])
    result = run_sptool(*scripted_args("wist", killed, random_policy), "--resume", env=ENV)
    assert result.returncode == 0, result.stderr
    assert stage_outputs(killed) == stage_outputs(reference)
    assert checkpoint_weights(killed) == checkpoint_weights(reference)
    fetch = [m for m in stable_metrics(reference) if m["stage"] == "corpus-fetch"]
    assert fetch[-1]["rejected"] > 0  # the reference drops documents in iteration 2's fetch
    assert stable_metrics(killed) == stable_metrics(reference)  # rejected counts too
