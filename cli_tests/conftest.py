"""Shared test helpers: run the CLI in-process (CliRunner) or as a real subprocess.

Tests never reach the internet (HF_HUB_OFFLINE=1) and share one converted tiny model under
``$SPTOOL_CACHE`` (default ``.cache/sptool`` in the repository), converted on first use.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "fixtures"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("SPTOOL_CACHE", str(REPO / ".cache" / "sptool"))
SPTOOL = [sys.executable, "-m", "sptool.cli.main"]


def read_jsonl(path_or_text) -> list[dict]:
    text = Path(path_or_text).read_text() if isinstance(path_or_text, Path) else path_or_text
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run_sptool(*args: str, input: str | None = None, timeout: float = 600, env: dict | None = None,
               cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``sptool ARGS`` as a real subprocess (text mode)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([*SPTOOL, *args], input=input, capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd or REPO)


@pytest.fixture
def sptool():
    return run_sptool


@pytest.fixture
def cli():
    """In-process CLI runner: ``cli(["verify", path])`` → click Result (stdout and stderr apart)."""
    from typer.testing import CliRunner

    from sptool.cli.main import app

    runner = CliRunner()

    def invoke(args, input: str | None = None):
        return runner.invoke(app, [str(a) for a in args], input=input, catch_exceptions=False)

    return invoke


@pytest.fixture(scope="session")
def tiny_model_dir() -> str:
    """The real tiny model as an HF directory (converted once per cache)."""
    from sptool.models.resolve import resolve_model

    return resolve_model("tiny")
