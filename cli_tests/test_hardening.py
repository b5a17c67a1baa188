"""Hardening (issue 18): no input destroyed, no silent corruption, real deadlines, one line for
every failure. Each test reproduces one defect found by a reliability review and checks the fix
with the real CLI in a subprocess (real files, FIFOs, devices, servers on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import FIXTURES, REPO, SPTOOL, read_jsonl, run_sptool, write_jsonl

SOLVED = {"id": "s1", "question": "What is 1+1?", "answer": "2",
          "samples": [{"text": "so \\boxed{2}"}, {"text": "\\boxed{3}"}]}


def one_error_line(result, code: int = 2) -> str:
    """The run failed with ``code`` and exactly one line on stderr (no traceback); that line."""
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


# ---------------------------------------------------------------- 1. data loss

@pytest.fixture
def verified_wist(tmp_path):
    source = tmp_path / "in.jsonl"
    shutil.copy(FIXTURES / "verified_wist.jsonl", source)
    return source


def test_rejects_naming_the_input_is_refused_and_the_input_survives(verified_wist, tmp_path):
    before = verified_wist.read_bytes()
    result = run_sptool("filter", "--recipe", "wist", str(verified_wist), "--rejects", str(verified_wist),
                        "-o", str(tmp_path / "g.jsonl"))
    line = one_error_line(result)
    assert "--rejects" in line and "same file as the input" in line
    assert verified_wist.read_bytes() == before
    assert not (tmp_path / "g.jsonl").exists()


@pytest.mark.parametrize("how", ["same", "symlink", "hardlink"])
def test_output_that_is_the_input_is_refused(verified_wist, tmp_path, how):
    before = verified_wist.read_bytes()
    target = verified_wist
    if how == "symlink":
        target = tmp_path / "link.jsonl"
        target.symlink_to(verified_wist)
    elif how == "hardlink":
        target = tmp_path / "hard.jsonl"
        os.link(verified_wist, target)
    result = run_sptool("filter", "--recipe", "wist", str(verified_wist), "-o", str(target))
    assert "same file as the input" in one_error_line(result)
    assert verified_wist.read_bytes() == before


def test_output_that_is_another_input_is_refused(tmp_path):
    """--replay, --prompt, --tree …: any file a command reads is protected, not only INPUT."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Solve: {question}\n")
    source = write_jsonl(tmp_path / "q.jsonl", [{"question": "1+1?"}])
    result = run_sptool("solve", "--backend", "scripted", str(source), "--prompt", str(prompt),
                        "-o", str(prompt))
    assert "--output" in (line := one_error_line(result)) and f"same file as the input {prompt}" in line
    assert prompt.read_text() == "Solve: {question}\n"


def test_output_from_stdin_input_file_is_refused(verified_wist):
    before = verified_wist.read_bytes()
    with open(verified_wist) as stdin:
        result = subprocess.run([*SPTOOL, "filter", "--recipe", "wist", "-o", str(verified_wist)],
                                stdin=stdin, capture_output=True, text=True, cwd=REPO)
    assert "same file as standard input" in one_error_line(result)
    assert verified_wist.read_bytes() == before


def test_challenge_and_corpus_fetch_refuse_their_input_as_output(tmp_path):
    documents = tmp_path / "docs.jsonl"
    shutil.copy(FIXTURES / "documents.jsonl", documents)
    before = documents.read_bytes()
    result = run_sptool("challenge", "--from", "documents", str(documents), "--backend", "scripted",
                        "-o", str(documents))
    assert "same file as the input" in one_error_line(result)
    paths = tmp_path / "paths.jsonl"
    shutil.copy(FIXTURES / "paths.jsonl", paths)
    result = run_sptool("corpus", "fetch", str(paths), "--search", f"local:{FIXTURES / 'web'}",
                        "--encoder", "none", "-o", str(paths))
    assert "same file as the input" in one_error_line(result)
    assert documents.read_bytes() == before and paths.read_bytes() == (FIXTURES / "paths.jsonl").read_bytes()


def test_output_onto_a_fifo_or_a_device_is_refused_and_left_as_it_was(verified_wist, tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for target in (fifo, "/dev/full", tmp_path):
        result = run_sptool("filter", "--recipe", "wist", str(verified_wist), "-o", str(target))
        line = one_error_line(result)
        assert "refusing to replace it" in line, line
    assert os.path.exists(fifo) and not os.path.isfile(fifo)  # still a FIFO
    import stat
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_output_through_a_symlink_replaces_the_file_and_keeps_the_link(verified_wist, tmp_path):
    real = tmp_path / "real.jsonl"
    real.write_text("old\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    result = run_sptool("filter", "--recipe", "wist", "-q", str(verified_wist), "-o", str(link))
    assert result.returncode == 0, result.stderr
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert read_jsonl(real) and read_jsonl(real)[0]["role"] in ("challenger", "solver")


def test_dev_null_and_dev_stdout_are_written_through(verified_wist):
    result = run_sptool("filter", "--recipe", "wist", "-q", str(verified_wist), "-o", "/dev/null")
    assert result.returncode == 0 and result.stdout == "", result.stderr
    result = run_sptool("filter", "--recipe", "wist", "-q", str(verified_wist), "-o", "/dev/stdout")
    assert result.returncode == 0, result.stderr
    assert read_jsonl(result.stdout)


def test_a_failure_before_commit_leaves_no_output(tmp_path):
    """posterior update saves the tree in run_stage's before_commit: when that fails, -o and
    --rejects keep their old content (the old order wrote -o, then failed saving the tree)."""
    from sptool.cli.common import run_stage
    from sptool.records import RuntimeFailure
    from sptool.stage import Stage

    class Echo(Stage):
        name = "echo"

        def process(self, records):
            yield from records

    source = write_jsonl(tmp_path / "in.jsonl", [{"a": 1}, {"a": 2}])
    out = tmp_path / "out.jsonl"
    out.write_text("previous\n")

    def fail():
        raise RuntimeFailure("cannot save the tree")

    with pytest.raises(RuntimeFailure):
        run_stage(Echo(), input_path=str(source), output=str(out), quiet=True, before_commit=fail)
    assert out.read_text() == "previous\n"
    assert not list(tmp_path.glob(".sptool-*"))
    run_stage(Echo(), input_path=str(source), output=str(out), quiet=True, before_commit=lambda: None)
    assert read_jsonl(out) == [{"a": 1}, {"a": 2}]
