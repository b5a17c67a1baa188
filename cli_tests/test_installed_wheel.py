"""The installed tool works anywhere: sptool built as a wheel (``pip wheel . --no-deps``), installed
non-editable into a fresh venv, and run from an empty directory, as a user who installed it runs it.

The fresh venv holds sptool alone; its dependencies (torch, transformers, …) are this environment's,
reached through a ``.pth`` line (added after the install, so pip sees an empty venv), which keeps
the test offline and fast. That line adds a plain directory to ``sys.path``: the checkout's editable
hook in it does not run, so ``import sptool`` finds the wheel's copy and nothing of ``src/``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from conftest import REPO, read_jsonl

# the README's main job on one core (OMP_NUM_THREADS=1 under xdist): smaller question batches than
# --tiny's, the same steps. Every recipe's packaged files are resolved by `sptool doctor` above it.
SMALL_RQUEST = ["--set", "rquest.questions=4", "--set", "rquest.questioner_group=2",
                "--set", "rquest.solver_questions=2", "--set", "rquest.solver_batch=2",
                "--set", "rquest.solver_rollouts=2"]


def _run(args, *, cwd: Path, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{' '.join(map(str, args))}: exit {result.returncode}\n{result.stderr[-3000:]}"
    return result


def build_wheel(tmp_path: Path) -> Path:
    """``pip wheel . --no-deps`` on a copy of the project's files (the checkout gets no build/ or
    egg-info); without build isolation where this environment's setuptools is recent enough, so
    nothing is downloaded."""
    from importlib import metadata

    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "src", source / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc"))
    try:
        recent = int(metadata.version("setuptools").split(".")[0]) >= 68  # pyproject's build requirement
    except metadata.PackageNotFoundError:
        recent = False
    isolation = ["--no-build-isolation", "--no-index"] if recent else []
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", source, "--no-deps", "-q", "-w", wheels, *isolation],
         cwd=tmp_path)
    wheel, = wheels.glob("sptool-*.whl")
    return wheel


def install_into_fresh_venv(wheel: Path, venv: Path) -> Path:
    """A venv holding the wheel's sptool (non-editable); returns its site-packages."""
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=venv.parent)
    _run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "--no-deps", "--no-index",
          "-q", wheel], cwd=venv.parent)
    site = Path(_run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=venv.parent).stdout.strip())
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "zz_sptool_test_dependencies.pth").write_text("".join(f"{path}\n" for path in sorted(ours)))
    return site


@pytest.mark.slow
@pytest.mark.xdist_group("installed-wheel")
def test_the_installed_wheel_runs_from_an_empty_directory(tmp_path):
    start = time.monotonic()
    wheel = build_wheel(tmp_path)
    site = install_into_fresh_venv(wheel, tmp_path / "venv")
    installed = time.monotonic() - start
    bin_dir = tmp_path / "venv" / "bin"
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(bin_dir.parent),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

    def sptool(*args, timeout: float = 300) -> subprocess.CompletedProcess:
        return _run([bin_dir / "sptool", *args], cwd=empty, env=env, timeout=timeout)

    imported = _run([bin_dir / "python", "-c", "import sptool; print(sptool.__file__)"],
                    cwd=empty, env=env).stdout.strip()
    assert Path(imported).parent == site / "sptool", imported
    assert not Path(imported).is_relative_to(REPO)
    assert sptool("--version").stdout.startswith("sptool 0.")
    doctor = sptool("doctor").stdout
    assert f"from {site / 'sptool'}" in doctor and "validity_init.jsonl" in doctor

    names = [line.split("\t")[0] for line in sptool("recipes", "list").stdout.splitlines()]
    assert names == ["wist", "svs", "rzero", "rquest", "rlvr"]
    assert 'init_data = "package:validity_init.jsonl"' in sptool("recipes", "show", "rquest", "--tiny").stdout

    runs = time.monotonic()
    # the README's main job (smaller batches) and its report, from `empty`
    sptool("run", "--recipe", "rquest", "--tiny", "-n", "1", "--run-dir", "rq", "--keep", "1", *SMALL_RQUEST,
           timeout=900)
    init = read_jsonl(next((empty / "rq" / "iter-0000").glob("*init1-solve.jsonl")))
    assert init and all(record["question"] for record in init)  # read from the shipped validity set
    report = sptool("report", "rq", "-q").stdout
    assert "training groups with a non-zero advantage" in report
    assert (empty / "rq" / "report" / "questions.md").is_file()
    assert sorted(p.name for p in empty.iterdir()) == ["rq"]  # nothing else written beside the run
    print(f"\ninstalled wheel: build and install {installed:.0f}s, runs {time.monotonic() - runs:.0f}s")
