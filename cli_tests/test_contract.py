"""The stage contract (DESIGN §2) for every stage command: help, empty input, bad lines, atomic
output, .gz, pass-through of unknown fields, rejects, SIGPIPE."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest

from conftest import FIXTURES, REPO, SPTOOL, read_jsonl, run_sptool, write_jsonl

SOLVED = {"id": "s1", "question": "What is 1+1?", "answer": "2", "mine": {"keep": [1, 2]},
          "samples": [{"text": "so \\boxed{2}"}, {"text": "\\boxed{3}"}]}


def test_top_level_help_does_not_import_torch():
    code = ("import sys; sys.argv=['sptool','--help']\n"
            "from sptool.cli.main import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "heavy=[m for m in ('torch','transformers','vllm','sentence_transformers') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert "HEAVY []" in result.stdout, result.stdout + result.stderr


def test_version(sptool):
    result = sptool("--version")
    assert result.returncode == 0 and result.stdout.startswith("sptool ")


@pytest.mark.parametrize("command", ["solve", "verify"])
def test_help(cli, command):
    result = cli([command, "--help"])
    assert result.exit_code == 0
    assert "--output" in result.output and "--quiet" in result.output


@pytest.mark.parametrize("command", [["verify", "--workers", "1"], ["solve", "--backend", "scripted"]])
def test_empty_input_gives_empty_output_and_summary(sptool, command):
    result = sptool(*command, input="")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert "0 in, 0 out" in result.stderr


@pytest.mark.parametrize("command", [["verify", "--workers", "1"], ["solve", "--backend", "scripted"]])
def test_not_json_names_stdin_line_and_exits_2(sptool, command):
    result = sptool(*command, input="not json\n")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "<stdin>:1" in lines[0] and "not valid JSON" in lines[0]
    assert "Traceback" not in result.stderr


def test_bytes_that_are_not_utf8_name_their_line_and_exit_2(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(SOLVED).encode() + b'\n{"question": "caf\xe9", "answer": "1"}\n')
    result = subprocess.run([*SPTOOL, "verify", "--workers", "1", str(path)], capture_output=True,
                            cwd=REPO)
    assert result.returncode == 2
    assert result.stderr.decode().strip() == f"sptool: error: {path}:2: not valid UTF-8 (byte 0xe9 at column 18)"


def test_missing_field_names_the_field_and_line(sptool, tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "ok?"}, {"prompt": "no question here"}])
    result = sptool("solve", "--backend", "scripted", str(path))
    assert result.returncode == 2
    assert f"{path}:2: field 'question': missing, expected a string" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_wrong_type_is_reported(sptool, tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [{**SOLVED, "samples": "oops"}])
    result = sptool("verify", "--workers", "1", str(path))
    assert result.returncode == 2
    assert ":1: field 'samples': expected a list, got the string \"oops\"" in result.stderr


def test_failed_run_leaves_no_output_file_and_keeps_old_one(sptool, tmp_path):
    good = dict(SOLVED)
    path = write_jsonl(tmp_path / "in.jsonl", [good, good, {"bad": True}])
    out = tmp_path / "out.jsonl"
    result = sptool("verify", "--workers", "1", str(path), "-o", str(out))
    assert result.returncode == 2
    assert not out.exists()
    assert not list(tmp_path.glob(".sptool-*"))  # no temp file left behind
    out.write_text("previous\n")
    sptool("verify", "--workers", "1", str(path), "-o", str(out))
    assert out.read_text() == "previous\n"


def test_skip_invalid_counts_and_writes_rejects(sptool, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(SOLVED) + "\nnot json\n" + json.dumps({"x": 1}) + "\n")
    rejects = tmp_path / "rejects.jsonl"
    result = sptool("verify", "--workers", "1", "--skip-invalid", "--rejects", str(rejects),
                    str(path))
    assert result.returncode == 0, result.stderr
    assert len(read_jsonl(result.stdout)) == 1
    rejected = read_jsonl(rejects)
    assert len(rejected) == 2
    assert ":2:" in rejected[0]["reject_reason"] and rejected[0]["line"] == "not json"
    assert "field 'question'" in rejected[1]["reject_reason"]
    assert "2 invalid input skipped" in result.stderr


def test_unknown_fields_pass_through_and_gz_both_ways(sptool, tmp_path):
    source = tmp_path / "in.jsonl.gz"
    with gzip.open(source, "wt") as handle:
        handle.write(json.dumps(SOLVED) + "\n")
    out = tmp_path / "out.jsonl.gz"
    result = sptool("verify", "--workers", "1", "-q", str(source), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # --quiet
    with gzip.open(out, "rt") as handle:
        record = json.loads(handle.readline())
    assert record["mine"] == {"keep": [1, 2]}
    assert record["p_hat"] == 0.5


def test_sigpipe_ends_quietly(tmp_path):
    path = write_jsonl(tmp_path / "many.jsonl", [SOLVED] * 300)
    pipeline = (f"{' '.join(SPTOOL)} verify --workers 1 -q {path} | head -n 1")
    result = subprocess.run(["bash", "-o", "pipefail", "-c", pipeline], capture_output=True,
                            text=True, cwd=REPO)
    assert len(result.stdout.splitlines()) == 1
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr


def test_unknown_backend_suggests_the_closest(sptool):
    result = sptool("solve", "--backend", "hff", input="")
    assert result.returncode == 2
    assert "unknown backend 'hff'. Did you mean 'hf'?" in result.stderr


def test_missing_input_file(sptool):
    result = sptool("verify", "does/not/exist.jsonl")
    assert result.returncode == 2
    assert "does/not/exist.jsonl: no such file" in result.stderr


def test_fixture_questions_are_valid_question_records():
    from sptool.jsonl import read_records
    from sptool.records import QUESTION

    records = list(read_records(FIXTURES / "questions.jsonl", QUESTION))
    assert len(records) >= 5
