"""Experiment trackers for ``sptool run --log-with tensorboard|trackio|wandb`` (any subset).

The run's own ``metrics.jsonl`` and the report's PNGs stay the source of truth; a tracker gets a
copy so that a run can be watched beside others. Each finished step's metrics go to the tracker
at step = the iteration (held-out evaluations at their ``after_iteration``), as flat scalar keys
``<step name>/<metric>[/<sub-key>…]``; after each iteration and at the end the report's plots are
written and sent as images. The trackers are accelerate's (``accelerate.tracking``), so their
options and environment variables are the usual ones: TensorBoard writes event files under
``RUN_DIR/tensorboard``; trackio writes its local database (``TRACKIO_DIR``, default in the
Hugging Face cache); wandb follows ``WANDB_MODE`` (``offline`` for no network).
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

from sptool.core.records import UsageError
from sptool.core.registry import unknown_name_error
from sptool.run.run_dir import StepKey

TRACKERS = ("tensorboard", "trackio", "wandb")
_PACKAGES = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb"}


def parse_log_with(values: list[str]) -> list[str]:
    """``--log-with`` values (repeatable, comma-separated; ``none`` for none) as tracker names,
    each checked to be known and installed."""
    names: list[str] = []
    for value in values:
        for name in (part.strip().lower() for part in value.split(",")):
            if not name or name == "none":
                continue
            if name not in TRACKERS:
                raise UsageError(f"--log-with: {unknown_name_error('tracker', name, TRACKERS)}")
            if importlib.util.find_spec(_PACKAGES[name]) is None:
                raise UsageError(f"--log-with {name}: the {_PACKAGES[name]} package is not installed "
                                 f"(pip install {_PACKAGES[name]})")
            if name not in names:
                names.append(name)
    return names


def flatten(values: Any, prefix: str = "") -> dict[str, float]:
    """Nested metrics as ``a/b/c`` → number (booleans, None, text and lists left out)."""
    out: dict[str, float] = {}
    if isinstance(values, dict):
        for key, value in values.items():
            out.update(flatten(value, f"{prefix}/{key}" if prefix else str(key)))
    elif isinstance(values, (int, float)) and not isinstance(values, bool) and prefix:
        out[prefix] = float(values)
    return out


def _config_values(config: dict) -> dict[str, Any]:
    """The run configuration as flat hyperparameters (TensorBoard wants scalars or text)."""
    out: dict[str, Any] = {}
    for section, values in config.items():
        if isinstance(values, dict):
            for key, value in values.items():
                out[f"{section}.{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
        elif isinstance(values, (int, float, str, bool)):
            out[section] = values
    return out


class TrackerLog:
    """A driver event listener that forwards metrics and plots to accelerate's trackers.

    Trackers start on the first event (after the run directory is prepared, so a new run's
    directory is still empty when it is checked)."""

    def __init__(self, names: list[str], run_dir: str | Path, config: dict, *,
                 plots: Callable[[Path], list[Path]] | None = None):
        self.names = names
        self.run_dir = Path(run_dir)
        self.config = config
        self.run_name = self.run_dir.resolve().name
        self.trackers: list[Any] = []
        self._plots = plots
        self._iteration = 0
        self._started = False

    def _start(self) -> None:
        from accelerate.tracking import TensorBoardTracker, TrackioTracker, WandBTracker

        self._started = True
        for name in self.names:
            with _stdout_to_stderr():
                if name == "tensorboard":
                    tracker = TensorBoardTracker(self.run_name, self.run_dir / "tensorboard")
                elif name == "trackio":
                    tracker = TrackioTracker(f"sptool-{self.config.get('recipe', 'run')}", name=self.run_name)
                else:
                    tracker = WandBTracker(f"sptool-{self.config.get('recipe', 'run')}", name=self.run_name)
                tracker.start()
                tracker.store_init_configuration(_config_values(self.config))
            self.trackers.append(tracker)

    def __call__(self, event: dict) -> None:
        if not self.names:
            return
        if not self._started:
            self._start()
        kind = event.get("event")
        if kind == "iteration":
            if self._iteration:
                self.log_plots(self._iteration)
            self._iteration = event["iteration"]
        elif kind == "stage-done":
            metrics = dict(event.get("metrics") or {})
            step = event["iteration"]
            if metrics.get("after_iteration") is not None:  # held-out evaluations: after iteration N
                step = metrics["after_iteration"]
            name = StepKey.parse(event["stage"]).name
            values = flatten({"records": event.get("records"), "wall_s": event.get("wall_s"), **metrics},
                             name)
            self.log(values, step)

    def log(self, values: dict[str, float], step: int) -> None:
        if not values:
            return
        with _stdout_to_stderr():
            for tracker in self.trackers:
                tracker.log(values, step=step)

    def log_plots(self, step: int) -> None:
        """Write the report's plots and send them as images at ``step``."""
        if not self.trackers or not (self.run_dir / "metrics.jsonl").is_file():
            return
        if self._plots is not None:
            paths = self._plots(self.run_dir)
        else:
            from sptool.run.report import write_plots

            paths = write_plots(self.run_dir)
        if not paths:
            return
        import numpy as np
        from PIL import Image

        images = {f"report/{path.stem}": np.asarray(Image.open(path).convert("RGB")) for path in paths}
        with _stdout_to_stderr():
            for tracker in self.trackers:
                if tracker.name == "tensorboard":
                    tracker.log_images(images, step=step, dataformats="HWC")
                elif tracker.name == "wandb":
                    tracker.log_images(images, step=step)
                else:  # trackio: its own Image type through log
                    import trackio

                    tracker.log({key: trackio.Image(image) for key, image in images.items()}, step=step)

    def close(self) -> None:
        if not self._started:
            return
        try:
            if self._iteration:
                self.log_plots(self._iteration)
        finally:
            with _stdout_to_stderr():
                for tracker in self.trackers:
                    tracker.finish()
                    if tracker.name == "trackio":
                        _forget_trackio_run()
            self.trackers = []
            self._started = False


def _forget_trackio_run() -> None:
    """trackio finishes its current run again at exit, printing to stdout; it is finished."""
    try:
        from trackio import context_vars

        context_vars.current_run.set(None)
    except (ImportError, AttributeError):  # pragma: no cover - another trackio layout
        pass


@contextlib.contextmanager
def _stdout_to_stderr():
    """Trackers print banners; sptool keeps stdout for records."""
    with contextlib.redirect_stdout(sys.stderr):
        yield
