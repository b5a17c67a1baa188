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

# Under pytest-xdist (CI: `-n 2` on 2 cores, one worker per core) each worker and everything it
# starts (tiny-model runs, vLLM engines, training ranks) computes on one thread, so the two workers
# never oversubscribe the cores. A value set in the environment wins.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", … under xdist
if XDIST_WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def read_jsonl(path_or_text) -> list[dict]:
    text = Path(path_or_text).read_text() if isinstance(path_or_text, Path) else path_or_text
    return [json.loads(line) for line in text.splitlines() if line.strip()]


#: metrics keys that differ between two runs of the same work (clocks, the collector's pauses,
#: per-role timings): left out where a resumed run's metrics are compared with an uninterrupted one's
VOLATILE_METRICS = ("wall_s", "checkpoint_s", "gc_s", "roles")


def stable_metrics(run_dir: Path) -> list[dict]:
    """The lines of ``run_dir``'s ``metrics.jsonl`` without :data:`VOLATILE_METRICS`."""
    return [{k: v for k, v in line.items() if k not in VOLATILE_METRICS} for line in read_jsonl(run_dir / "metrics.jsonl")]


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a server or an `accelerate launch` rendezvous: two
    pytest-xdist workers must not both take accelerate's default 29500)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


@pytest.fixture(scope="session")
def random_policy(tmp_path_factory, tiny_model_dir) -> str:
    """A 1-layer, 16-wide random model with the tiny model's tokenizer: fast to train and save.
    Defined here, not imported into test modules (an imported fixture is one more per module)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("random-policy")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


# The heaviest work units first (by their durations on 2 CPU cores), then the other slow tests, then the
# fast ones, so that under `-n 2 --dist loadgroup` the last units to start are short and neither
# worker idles at the end. A unit is an xdist_group (tests sharing a loaded engine, server or run)
# or one test. Without xdist only the order changes: every group stays contiguous, so a module or
# session fixture is still set up once.
HEAVY_FIRST = [
    "served-vllm",                      # test_scale_out: two-process parity, then the server's runs
    "test_scale_out.py::test_vllm_run_builds_one_engine_and_updates_it_after_each_step",
    "vllm-engines",                                                  # test_backends
    "test_run.py::test_tiny_recipe_completes_with_the_real_model[wist]",
    "test_readme.py::test_readme_code_blocks_run_in_order",
    "installed-wheel",                  # test_installed_wheel: build, install, two runs from an empty folder
    "test_run.py::test_tiny_recipe_completes_with_the_real_model[rquest]",
    "test_run.py::test_tiny_recipe_completes_with_the_real_model[rzero]",
    "test_run.py::test_tiny_recipe_completes_with_the_real_model[svs]",
    "test_run.py::test_tiny_recipe_completes_with_the_real_model[rlvr]",
    "scripted-rquest", "scripted-svs", "scripted-wist",              # test_run: shared scripted runs
    "test_precision.py::test_the_first_update_from_a_rollout_has_ratio_one_and_the_gap_is_measured",  # ≈ 2.5 min
]


def _unit(item) -> str:
    """The item's pytest-xdist work unit under ``--dist loadgroup``: its group, or itself."""
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", ""))
    return item.nodeid


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    rank = {name: index for index, name in enumerate(HEAVY_FIRST)}

    def key(item) -> int:
        unit = _unit(item)
        if unit in rank:
            return rank[unit]
        for name, index in rank.items():
            if unit.endswith("/" + name):
                return index
        return len(rank) if item.get_closest_marker("slow") else len(rank) + 1

    items.sort(key=key)
    units_dir = os.environ.get(UNITS_ENV)
    if units_dir and hasattr(config, "workerinput"):  # a pytest-xdist worker tells the controller
        units = {item.nodeid: _unit(item) for item in items if _unit(item) != item.nodeid}
        path = Path(units_dir) / f"{config.workerinput['workerid']}.json"
        path.with_suffix(".part").write_text(json.dumps(units))
        os.replace(path.with_suffix(".part"), path)


# `--dist loadgroup` sends the tests of one xdist_group to one worker by appending "@group" to
# their node ids in the worker; since pytest 9.2 (structured node ids) that no longer takes
# (pytest-xdist issue 1386) and the groups are silently split. So the workers write each grouped
# test's unit to a file (above) before they report their collection, and the controller's
# scheduler reads the units from there.
UNITS_ENV = "SPTOOL_TEST_XDIST_UNITS"


def pytest_configure(config):
    if not hasattr(config, "workerinput") and config.getoption("dist", "no") == "loadgroup":
        import tempfile

        os.environ[UNITS_ENV] = tempfile.mkdtemp(prefix="sptool-xdist-units-")  # the workers inherit it


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput") and os.environ.get(UNITS_ENV):
        import shutil

        shutil.rmtree(os.environ.pop(UNITS_ENV), ignore_errors=True)


def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class MarkedGroupScheduling(LoadGroupScheduling):
        units: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.units is None:
                self.units = {}
                for path in Path(os.environ[UNITS_ENV]).glob("*.json"):
                    self.units.update(json.loads(path.read_text()))
            return self.units.get(nodeid) or super()._split_scope(nodeid)

    return MarkedGroupScheduling(config, log)


def assert_same_greedy(reference, prompt, got: list[int], want: list[int], tie: float = 1e-3) -> None:
    """``got`` equals ``want`` (greedy tokens of ``reference``, an hf backend) token for token,
    except for a divergence at a genuine tie: ``reference``'s two best logits there within
    ``tie`` (other kernels may order it differently). Stale weights diverge with real margins
    and fail."""
    if got == want:
        return
    at = next(i for i, (a, b) in enumerate(zip(got + [None], want + [None])) if a != b)
    torch = reference._torch
    ids = reference.tokenizer(reference.render(prompt), add_special_tokens=False)["input_ids"] + want[:at]
    with torch.inference_mode():
        logits = reference.model(torch.tensor([ids], device=reference.device)).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    assert float(top[0] - top[1]) < tie, f"greedy tokens differ at {at} without a tie: {got} vs {want}"
