"""Test-only fault injection, in one place: where a test may kill or crash a run.

Production code calls these hooks at fixed points; with the variables unset they do nothing.

- ``SPTOOL_TEST_KILL_AT=[ITER/]STEP:POINT``: SIGKILL the ``sptool run`` process at ``POINT`` of
  that step (``start``, ``mid`` = after its first item, ``save`` = output written but not yet
  renamed, ``train-done``, ``checkpoint`` = half-way through writing the checkpoint, ``done``).
- ``SPTOOL_TEST_CRASH_DURING_SAVE=1|raise|kill``: a checkpoint writer crashes after writing the
  model weights (raise an error, or exit 137 with no clean-up, like a SIGKILL).
"""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from typing import Iterator

KILL_ENV = "SPTOOL_TEST_KILL_AT"
CRASH_ENV = "SPTOOL_TEST_CRASH_DURING_SAVE"

_armed_crash: str | None = None  # set by crash_next_checkpoint (in-process, not via os.environ)


def kill_requested(key, point: str) -> bool:
    """Does ``SPTOOL_TEST_KILL_AT`` name this step and point? ``key`` is the step's
    :class:`~sptool.run.run_dir.StepKey` (``iter-0002/05-train``: its ``folder``, ``stem``,
    ``iteration`` and ``name``)."""
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return False
    where, _, wanted = spec.rpartition(":")
    targets = {key.stem, key.name, f"{key.folder}/{key.stem}", f"{key.folder}/{key.name}",
               f"{key.iteration}/{key.name}"}
    return wanted == point and where in targets


def kill_point(key: str, point: str) -> None:
    """SIGKILL this process at the point ``SPTOOL_TEST_KILL_AT`` names."""
    if kill_requested(key, point):
        os.kill(os.getpid(), signal.SIGKILL)


@contextmanager
def checkpoint_kill_point(key: str) -> Iterator[None]:
    """Around a step's checkpoint save: with ``KILL_AT=STEP:checkpoint`` the writer dies half-way."""
    global _armed_crash
    armed = kill_requested(key, "checkpoint")
    if armed:
        _armed_crash = "kill"
    try:
        yield
    finally:
        if armed:
            _armed_crash = None


def crash_during_save(stage: str) -> None:
    """Called by the checkpoint writer after ``stage`` (e.g. the model weights) is written."""
    mode = _armed_crash or os.environ.get(CRASH_ENV, "")
    if not mode or mode == "0":
        return
    if mode == "kill":
        os._exit(137)  # like SIGKILL: no cleanup runs
    raise RuntimeError(f"injected crash during save ({CRASH_ENV}={mode}, after {stage})")
