"""README.md's code blocks run as written, in order, in one working directory, so they cannot drift.

Every ```bash and ```console block is parsed; backslash-continued lines are joined and each command
runs with ``bash -o pipefail`` in one temporary directory that holds a link to the repository's
``fixtures/``, with ``sptool`` on PATH resolving to this checkout's CLI. Not run: the two setup
lines that start with ``scripts/setup.sh`` (setup, the tiny R-Quest run and the test suite: CI itself
runs those).

Models, chosen through the environment only, never by editing a line:

* stage commands get ``SPTOOL_BACKEND=scripted`` with ``fixtures/scripts/run_all.jsonl`` as the
  model (and novelty judge): real generation on 2 cores takes minutes per line. A line that names
  its own model (``-m DIR``, ``--model tiny``) runs with that model, the real one: ``train-step
  --model tiny`` trains the real tiny model and the next ``solve -m ckpt/step-1`` loads its
  checkpoint. A line the README marks ``# (your model)`` stands for the user's own model; it runs
  with the scripted one (its ``-m VALUE`` is left out, so the environment's model applies).
* ``sptool run`` gets ``SPTOOL_CONFIG``: a TOML that switches generation to the same script and the
  starting policy to a 1-layer random model with the tiny model's tokenizer (as in test_run.py),
  so every iteration trains and checkpoints in a second. Everything the line itself sets (``--tiny``,
  ``--set``, ``-n``, ``--data`` …) still applies: ``--set`` beats ``--config``, which beats ``--tiny``.

Each command must exit 0 (the console block: 2, with the error line it shows; a line whose comment
says ``exit N``, e.g. a run that may stop on collapse, may also end with N); a command whose
output goes to a file must leave that file non-empty, one that writes to the terminal must print
something, and the promises the README makes in words (groups, reports, plots, checkpoints) are
checked after the line that makes them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import FIXTURES, REPO

README = REPO / "README.md"
SCRIPT = FIXTURES / "scripts" / "run_all.jsonl"
YOUR_MODEL = "# (your model)"
# the two setup lines CI runs itself (scripts/setup.sh builds .venv; the second runs this suite)
SETUP_PREFIX = "scripts/setup.sh"


@dataclass
class Command:
    line: int                   # README line number of the command's first line
    text: str                   # the command as written (continuations joined)
    expect_rc: int = 0
    expect_stderr: list[str] = field(default_factory=list)  # console block: the lines it shows


def readme_commands(text: str | None = None) -> list[Command]:
    """The README's bash lines and console ``$`` lines, in order."""
    lines = (README.read_text() if text is None else text).splitlines()
    commands: list[Command] = []
    number = 0
    while number < len(lines):
        fence = re.match(r"^```(\w+)\s*$", lines[number])
        number += 1
        if not fence or fence.group(1) not in ("bash", "console"):
            continue
        language = fence.group(1)
        pending: Command | None = None
        while number < len(lines) and not lines[number].startswith("```"):
            raw, number = lines[number], number + 1
            if language == "console":
                if raw.startswith("$ "):
                    pending = Command(number, raw[2:], expect_rc=2)
                    commands.append(pending)
                elif pending is not None and raw.strip():
                    pending.expect_stderr.append(raw)
                continue
            if pending is not None:          # continuation of the previous line
                pending.text += "\n" + raw
            elif raw.strip() and not raw.lstrip().startswith("#"):
                pending = Command(number, raw)
                commands.append(pending)
            else:
                continue
            if not raw.rstrip().endswith("\\"):
                pending = None
        number += 1  # the closing fence
    return commands


def test_parser_joins_continuations_and_reads_console_blocks():
    text = ("```bash\n# a comment\nsptool a \\\n  --b c   # note\n\nsptool d\n```\n"
            "```python\nnot run\n```\n"
            "```console\n$ sptool e\nsptool: error: x\n$ sptool f\n```\n")
    commands = readme_commands(text)
    assert [c.text for c in commands] == ["sptool a \\\n  --b c   # note", "sptool d", "sptool e", "sptool f"]
    assert [c.line for c in commands] == [3, 6, 12, 14]
    assert commands[2].expect_rc == 2 and commands[2].expect_stderr == ["sptool: error: x"]


def without_model_option(text: str) -> str:
    """A ``# (your model)`` line with its ``-m VALUE``/``--model VALUE`` left out."""
    return re.sub(r"\s(?:-m|--model)\s+\S+", "", text)


def names_model(text: str) -> bool:
    return re.search(r"\s(?:-m|--model)\s+\S+", text) is not None


def redirect_target(text: str) -> str | None:
    """The file the command's stdout goes to (``> FILE`` or ``-o FILE`` of the last stage)."""
    code = text.split(" #", 1)[0]
    match = re.search(r">\s*(\S+)\s*$", code)
    if match:
        return match.group(1)
    last = code.split("|")[-1]
    match = re.search(r"(?:-o|--output)\s+(\S+)", last)
    return match.group(1) if match else None


def nonempty_jsonl(path: Path) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert records, f"{path} is empty"
    return records


def check_promises(command: Command, cwd: Path, stdout: str, stderr: str) -> None:
    """What the README says a line leaves behind, beyond exit 0."""
    text = command.text
    if "groups.jsonl" in text and "filter" in text:
        groups = nonempty_jsonl(cwd / "groups.jsonl")
        assert all({"role", "prompt", "completions", "rewards", "advantages"} <= set(g) for g in groups)
    if "sptool train-step" in text:
        assert (cwd / "ckpt" / "step-1" / "config.json").is_file()
        assert "1 update(s)" in " ".join(stderr.split()), stderr
    if text.startswith("sptool report"):
        report = cwd / text.split()[2] / "report"
        assert list(report.glob("*.png")), f"no plots in {report}"
    if text.startswith("sptool run"):
        run_dir = re.search(r"--run-dir\s+(\S+)", text)
        if run_dir:
            manifest = json.loads((cwd / run_dir.group(1) / "manifest.json").read_text())
            assert manifest, "empty manifest"
        if "--resume" in text.split(" #", 1)[0]:  # continues from the last finished stage: the finished run is read back
            assert re.search(r"\b[1-9]\d* read back", stderr), stderr
        if "--log-with tensorboard" in text:
            assert list((cwd / run_dir.group(1)).rglob("events.out.tfevents.*")), "no tensorboard events"
    if text.startswith("sptool export"):  # a plain HF model directory with its model card
        exported = cwd / re.search(r"--output\s+(\S+)", text).group(1)
        assert (exported / "config.json").is_file() and "huggingface-cli upload" in (exported / "README.md").read_text()
    if text.startswith("sptool recipes list"):
        assert {"wist", "svs", "rzero", "rquest", "rlvr"} <= set(stdout.split())
    if text.startswith("sptool tree show"):
        # the categories from `tree init`, with the outcomes `posterior update` recorded
        assert "Geometry" in stdout and re.search(r"n=[1-9]", stdout), stdout


@pytest.mark.slow  # about 4 minutes on 2 busy cores: the real tiny model trains and solves once
def test_readme_code_blocks_run_in_order(tmp_path, random_policy):
    commands = readme_commands()
    assert len(commands) > 30 and any(c.expect_rc == 2 for c in commands)
    work = tmp_path / "work"
    work.mkdir()
    (work / "fixtures").symlink_to(FIXTURES)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "sptool"
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m sptool.cli.main "$@"\n')
    shim.chmod(0o755)
    run_config = tmp_path / "scripted-run.toml"
    run_config.write_text(f'[model]\nbackend = "scripted"\nscript = {json.dumps(str(SCRIPT))}\n'
                          f'policy = {json.dumps(random_policy)}\n')
    base_env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])),
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                "SPTOOL_CONFIG": str(run_config)}
    scripted = {"SPTOOL_BACKEND": "scripted", "SPTOOL_MODEL": str(SCRIPT), "SPTOOL_JUDGE_MODEL": str(SCRIPT)}

    ran, timings = 0, []
    for command in commands:
        if command.text.startswith(SETUP_PREFIX):
            continue
        text = command.text
        env = dict(base_env)
        if YOUR_MODEL in text:
            text = without_model_option(text)
        if not names_model(text):
            env.update(scripted)
        started = time.monotonic()
        result = subprocess.run(["bash", "-o", "pipefail", "-c", text], cwd=work, env=env,
                                capture_output=True, text=True, timeout=300)
        timings.append((time.monotonic() - started, command.line))
        where = f"README.md:{command.line}: {command.text}\n--- stdout\n{result.stdout[-2000:]}\n" \
                f"--- stderr\n{result.stderr[-3000:]}"
        # a line whose comment says "exit N" may also end with N (e.g. run.stop_on_collapse: 3)
        documented = re.search(r"#.*\bexit (\d+)\b", text)
        allowed = {command.expect_rc} | ({int(documented.group(1))} if documented else set())
        assert result.returncode in allowed, where
        if result.returncode == 3:
            assert "run.stop_on_collapse" in result.stderr and "--resume" in result.stderr, where
        assert "Traceback" not in result.stderr, where
        if command.expect_stderr:
            assert result.stderr.strip().splitlines() == command.expect_stderr, where
            ran += 1
            continue
        target = redirect_target(text)
        if target and target != "/dev/null":
            assert (work / target).stat().st_size > 0, f"{target} is empty\n{where}"
        elif not target:
            assert result.stdout.strip() or result.stderr.strip(), f"printed nothing\n{where}"
        check_promises(command, work, result.stdout, result.stderr)
        ran += 1
    slowest = sorted(timings, reverse=True)[:5]
    print("slowest README lines:", ", ".join(f"README.md:{line} {s:.1f}s" for s, line in slowest))
    assert ran == len([c for c in commands if not c.text.startswith(SETUP_PREFIX)])


# ------------------------------------------------------------------------------ what the README run found

def test_scripted_backend_without_a_matching_rule_is_one_line(tmp_path):
    """A prompt that no rule of a script matches (and no plain output queued) was a ZeroDivisionError."""
    from conftest import run_sptool

    script = tmp_path / "script.jsonl"
    script.write_text('{"match": "never matches", "output": "x"}\n')
    result = run_sptool("solve", "--backend", "scripted", "-m", str(script), input='{"question": "1 + 1?"}\n')
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"sptool: error: {script}: no rule matches the prompt and no plain output is queued "
        "(prompt starts 'Solve the following math problem. Reason step by step, then ')"]


def test_a_missing_checkpoint_directory_is_named_as_such(tmp_path):
    """`solve -m ckpt/step-1` before the checkpoint exists: say that no such directory exists, not
    only that the hub could not be reached (HF_HUB_OFFLINE=1)."""
    from conftest import run_sptool

    result = run_sptool("solve", "-m", "ckpt/step-1", input='{"question": "1 + 1?"}\n', cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.startswith("sptool: error: cannot load model 'ckpt/step-1': no such local directory"), \
        result.stderr
    assert "Traceback" not in result.stderr
