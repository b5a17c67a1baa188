"""`sptool run --log-with`: per-iteration metrics and the report's plots reach the trackers."""

from __future__ import annotations

import json
import sqlite3

import pytest

from conftest import run_sptool
from sptool.core.records import UsageError
from sptool.run.trackers import flatten, parse_log_with
from test_run import ENV, scripted_args


def test_flatten_keeps_numbers_only():
    assert flatten({"accuracy": 0.5, "groups": {"solver": 3}, "ok": True, "label": "x", "none": None,
                    "list": [1, 2]}, "verify") == {"verify/accuracy": 0.5, "verify/groups/solver": 3.0}


def test_parse_log_with():
    assert parse_log_with(["tensorboard,trackio", "tensorboard", "none"]) == ["tensorboard", "trackio"]
    assert parse_log_with([]) == []
    with pytest.raises(UsageError, match="^--log-with: unknown tracker 'tensorbord'. Did you mean 'tensorboard'\\? "
                                         "Choose from: tensorboard, trackio, wandb$"):
        parse_log_with(["tensorbord"])


@pytest.mark.slow
def test_run_logs_metrics_and_plots_that_tensorboard_and_trackio_read_back(tmp_path, random_policy):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "svs"
    trackio_dir = tmp_path / "trackio"
    result = run_sptool(*scripted_args("svs", run_dir, random_policy), "--log-with", "tensorboard,trackio",
                        env={**ENV, "TRACKIO_DIR": str(trackio_dir)})
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""  # tracker banners go to stderr
    [events_dir] = [p for p in (run_dir / "tensorboard").iterdir() if p.is_dir()]
    accumulator = EventAccumulator(str(events_dir), size_guidance={"images": 0, "scalars": 0})
    accumulator.Reload()
    tags = accumulator.Tags()
    # the svs tiny run has 2 iterations; verify's accuracy is logged once per iteration
    accuracy = accumulator.Scalars("verify/accuracy")
    assert [event.step for event in accuracy] == [1, 2]
    metrics = [line for line in map(json.loads,
                                    (run_dir / "metrics.jsonl").read_text().splitlines())
               if line["stage"] == "verify"]
    assert [round(event.value, 6) for event in accuracy] == [round(m["accuracy"], 6) for m in metrics]
    assert "filter/groups/solver" in tags["scalars"] and "train/records" in tags["scalars"]
    assert "report/accuracy" in tags["images"]
    assert {event.step for event in accumulator.Images("report/accuracy")} == {1, 2}
    # trackio: its local database holds the same metric
    [database] = list(trackio_dir.glob("*.db"))
    with sqlite3.connect(database) as connection:
        rows = connection.execute("SELECT step, metrics FROM metrics").fetchall()
    logged = [(step, json.loads(values)) for step, values in rows]
    assert [(step, round(values["verify/accuracy"], 6)) for step, values in logged if "verify/accuracy" in values] \
        == [(i + 1, round(m["accuracy"], 6)) for i, m in enumerate(metrics)]


@pytest.mark.slow
def test_unknown_or_missing_tracker_is_a_usage_error(tmp_path, random_policy):
    result = run_sptool(*scripted_args("svs", tmp_path / "r", random_policy), "--log-with", "tensorbord", env=ENV)
    assert result.returncode == 2 and "Did you mean 'tensorboard'?" in result.stderr
    assert not (tmp_path / "r").exists()
