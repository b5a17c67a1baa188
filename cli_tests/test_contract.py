"""The stage contract (docs/architecture.md) for every stage command, as one table.

Each row of :data:`STAGES` is a command with minimal arguments (the scripted backend where it
generates) and one valid input record. Every row runs the baseline contract, in-process through
``CliRunner`` (errors are converted inside the typer app, so exit codes are real):

- ``--help`` works and describes the command;
- empty input: exit 0, no records;
- a line that is not JSON: exit 2, one line ``source:2: not valid JSON``, no output file;
- a line whose bytes are not UTF-8: exit 2, one line ``source:2: not valid UTF-8``;
- ``--skip-invalid --rejects``: the bad line is skipped, counted and written with its location;
- an unknown field in the input does not fail the command and passes through where the command
  enriches records (``passes_through``).

A few checks stay as real subprocesses: ``sptool --help`` imports no torch, ``python -m
sptool``, a pipe closed early, the exact stderr line of a bad byte.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import FIXTURES, REPO, SPTOOL, read_jsonl, write_jsonl

SOLVED = {"id": "s1", "question": "What is 1+1?", "answer": "2", "mine": {"keep": [1, 2]},
          "samples": [{"text": "so \\boxed{2}"}, {"text": "\\boxed{3}"}]}
EXTRA = {"x_unknown": {"keep": [1, "two"]}}


@dataclass
class Row:
    """One stage command: ``args`` (``{tmp}`` is the test's folder) and a valid input record."""

    name: str
    args: list[str]
    record: dict
    passes_through: bool = True   # output records keep the input's unknown fields
    skip_invalid: bool = True     # has --skip-invalid/--rejects
    output_flag: str | None = "-o"  # writes records to -o (None: a report or a checkpoint)
    slow: tuple[str, ...] = ()    # checks that load the real tiny model (marked slow)
    elsewhere: tuple[str, ...] = ()  # checks left to the stage's own test file (named in a comment)

    def command(self, tmp: Path) -> list[str]:
        return [part.replace("{tmp}", str(tmp)) for part in self.args]

    @property
    def path(self) -> list[str]:
        """The command's name: its leading arguments up to the first option."""
        words = []
        for part in self.args:
            if part.startswith("-"):
                break
            words.append(part)
        return words


def _tree(tmp: Path) -> None:
    from sptool.stages.tree import new_tree, save_tree

    if not (tmp / "tree.json").exists():
        save_tree(new_tree("mathematics", max_depth=2), tmp / "tree.json")


STAGES = [
    Row("solve", ["solve", "--backend", "scripted", "-k", "2"], {"question": "What is 1+1?", "answer": "2"}),
    Row("verify", ["verify", "--workers", "0"], SOLVED),
    Row("challenge documents", ["challenge", "--from", "documents", "--backend", "scripted", "--candidates", "2"],
        {"id": "d1", "title": "Addition", "text": "Adding 2 and 2 gives 4."}, passes_through=False),
    Row("challenge nothing", ["challenge", "--from", "nothing", "--backend", "scripted", "--candidates", "2"],
        {"topic": "arithmetic"}, passes_through=False),
    Row("challenge solutions", ["challenge", "--from", "solutions", "--backend", "scripted", "--candidates", "2"],
        {"question": "What is 1+1?", "answer": "2", "p_hat": 0.25,
         "samples": [{"text": "\\boxed{2}", "correct": True}, *[{"text": "3", "correct": False}] * 3]},
        passes_through=False),
    Row("novelty", ["novelty", "--backend", "scripted", "--partners", "1"], {"id": "c1", "question": "What is 2+2?"}),
    Row("filter", ["filter", "--recipe", "svs"], {**SOLVED, "p_hat": 0.5, "var": 0.25,
        "samples": [{"text": "\\boxed{2}", "correct": True}, {"text": "\\boxed{3}", "correct": False}]},
        passes_through=False),
    Row("posterior update", ["posterior", "update", "--tree", "{tmp}/tree.json"],
        {"id": "v1", "path_id": "not-in-this-tree", "var": 0.25, "valid": True}),
    Row("corpus fetch", ["corpus", "fetch", "--search", "local:package:web", "--encoder", "none",
                         "--min-chars", "1"], {"leaf": "Prime numbers"}, passes_through=False),
    Row("eval", ["eval", "--backend", "scripted", "-k", "1", "--pass-at", "1", "--no-greedy", "--workers", "0",
                 "--json"], {"question": "What is 1+1?", "answer": "2"},
        passes_through=False, skip_invalid=False, output_flag=None),
    Row("decontaminate", ["decontaminate", "-b", str(FIXTURES / "bench" / "basic_algebra.jsonl")],
        {"id": "q1", "question": "Name a prime number between 100 and 110."}),
    Row("train-step", ["train-step", "--output", "{tmp}/ckpt"],
        {"prompt": "Say yes.", "completions": ["yes", "no"], "rewards": [1.0, 0.0]},
        passes_through=False, output_flag=None, slow=("skip_invalid",),
        # empty input: test_train.py::test_empty_input_writes_unchanged_checkpoint (a small random
        # model); unknown fields: the skip_invalid check's valid record carries one and trains.
        elsewhere=("empty", "unknown_fields")),
]
IDS = [row.name for row in STAGES]


def rows(check: str, where=lambda row: True) -> list:
    """The table's rows for one check; a check that loads the real model is marked slow."""
    return [pytest.param(row, id=row.name, marks=[pytest.mark.slow] if check in row.slow else [])
            for row in STAGES if where(row) and check not in row.elsewhere]


def _run(cli, row: Row, tmp: Path, lines: list[bytes], *extra: str, name: str = "in.jsonl"):
    _tree(tmp)
    path = tmp / name
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return cli([*row.command(tmp), *extra, str(path)]), path


@pytest.fixture
def cli_bytes():
    """CliRunner that leaves stdin to the test (input may be bytes)."""
    from typer.testing import CliRunner

    from sptool.cli.main import app

    runner = CliRunner()
    return lambda args, input=None: runner.invoke(app, [str(a) for a in args], input=input,
                                                  catch_exceptions=False)


@pytest.mark.parametrize("row", STAGES, ids=IDS)
def test_help(cli, row):
    result = cli([*row.path, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.stdout and len(result.stdout.splitlines()) > 8
    if row.skip_invalid:
        assert "--skip-invalid" in result.stdout and "--rejects" in result.stdout


@pytest.mark.parametrize("row", rows("empty"))
def test_empty_input(cli_bytes, row, tmp_path):
    result, _ = _run(cli_bytes, row, tmp_path, [])
    assert result.exit_code == 0, result.output
    if row.output_flag:
        assert result.stdout == ""
    if row.name == "eval":
        assert json.loads(result.stdout)["benchmarks"][0]["problems"] == 0


@pytest.mark.parametrize("row", STAGES, ids=IDS)
def test_not_json_line_is_exit_2_at_its_line(cli_bytes, row, tmp_path):
    out = tmp_path / "out.jsonl"
    extra = [row.output_flag, str(out)] if row.output_flag else []
    result, path = _run(cli_bytes, row, tmp_path, [json.dumps(row.record).encode(), b"not json"], "-q", *extra)
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"sptool: error: {path}:2: not valid JSON (Expecting value at "
                                          "column 1) (each line must be one JSON object)"]
    assert not out.exists() and result.stdout == ""


@pytest.mark.parametrize("row", STAGES, ids=IDS)
def test_bytes_not_utf8_are_exit_2_at_their_line(cli_bytes, row, tmp_path):
    result, path = _run(cli_bytes, row, tmp_path, [json.dumps(row.record).encode(), b'{"question": "caf\xe9"}'], "-q")
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"sptool: error: {path}:2: not valid UTF-8 (byte 0xe9 at column 18)"]


@pytest.mark.parametrize("row", rows("skip_invalid", lambda row: row.skip_invalid))
def test_skip_invalid_writes_rejects(cli_bytes, row, tmp_path):
    rejects = tmp_path / "rejects.jsonl"
    lines = [b"not json", json.dumps({**row.record, **EXTRA}).encode(), b"\xff\xfe"]
    result, path = _run(cli_bytes, row, tmp_path, lines, "--skip-invalid", "--rejects", str(rejects))
    assert result.exit_code == 0, result.output
    rejected = [r for r in read_jsonl(rejects) if r["reject_reason"].startswith(str(path))]
    assert [r["reject_reason"].split(": ")[0] for r in rejected] == [f"{path}:1", f"{path}:3"]
    assert rejected[0]["line"] == "not json" and "not valid UTF-8" in rejected[1]["reject_reason"]
    assert "2 invalid input skipped" in result.stderr


@pytest.mark.parametrize("row", rows("unknown_fields"))
def test_unknown_fields_pass_through(cli_bytes, row, tmp_path):
    result, _ = _run(cli_bytes, row, tmp_path, [json.dumps({**row.record, **EXTRA}).encode()])
    assert result.exit_code == 0, result.output
    if row.passes_through:
        out = read_jsonl(result.stdout)
        assert out and all(record["x_unknown"] == EXTRA["x_unknown"] for record in out)


def test_stdin_is_named_in_errors(cli_bytes):
    result = cli_bytes(["verify", "--workers", "0"], input=json.dumps(SOLVED).encode() + b"\n{oops\n")
    assert result.exit_code == 2
    assert result.stderr.startswith("sptool: error: <stdin>:2: not valid JSON")


def test_every_command_and_group_has_help_text():
    """Walk the app (sqlite-utils' test): every command, group and option says what it does."""
    import typer

    from sptool.cli.main import app

    root = typer.main.get_command(app)
    missing = []

    def walk(command, path):
        if not (command.help or "").strip() and path:
            missing.append(" ".join(path))
        for param in command.params:
            if param.param_type_name == "option" and not (getattr(param, "help", None) or "").strip():
                missing.append(f"{' '.join(path)} {param.opts[0]}")
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, [*path, name])

    walk(root, [])
    assert len(getattr(root, "commands", {})) >= 13
    assert missing == []


def test_stage_table_covers_every_stage_command():
    """A new stage command must join STAGES (or be listed here as not a stage, with why)."""
    import typer

    from sptool.cli.main import app

    root = typer.main.get_command(app)
    commands = set()
    for name, command in root.commands.items():
        subs = getattr(command, "commands", None)
        commands |= {f"{name} {sub}" for sub in subs} if subs else {name}
    not_stages = {"run",                 # the driver; tested in test_run.py
                  "recipes list", "recipes show",  # print packaged recipes, read no records
                  "report",              # reads a run directory
                  "export",              # reads a run directory, writes a model directory
                  "data gym",            # makes records from generators, reads none
                  "serve",               # starts a vLLM server, reads no records
                  "doctor",              # checks the installation, reads no records
                  "tree init", "tree show", "tree expand"}  # the tree file, not JSONL records
    table = {" ".join(row.path) for row in STAGES}
    assert table <= commands and commands - not_stages == table, sorted(commands - not_stages - table)


# ---------------------------------------------------------------------------- subprocess checks

def test_top_level_help_does_not_import_torch():
    code = ("import sys; sys.argv=['sptool','--help']\n"
            "from sptool.cli.main import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "heavy=[m for m in ('torch','transformers','vllm','sentence_transformers') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert "HEAVY []" in result.stdout, result.stdout + result.stderr


def test_python_dash_m_sptool_runs_the_cli():
    result = subprocess.run([sys.executable, "-m", "sptool", "--version"], capture_output=True, text=True,
                            cwd=REPO)
    assert result.returncode == 0 and result.stdout.startswith("sptool ")
    bad = subprocess.run([sys.executable, "-m", "sptool", "verify", "--workers", "0"], input="not json\n",
                         capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and bad.stderr.startswith("sptool: error: <stdin>:1: not valid JSON")
    assert "Traceback" not in bad.stderr


def test_bytes_that_are_not_utf8_name_their_line_and_exit_2(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(SOLVED).encode() + b'\n{"question": "caf\xe9", "answer": "1"}\n')
    result = subprocess.run([*SPTOOL, "verify", "--workers", "1", str(path)], capture_output=True,
                            cwd=REPO)
    assert result.returncode == 2
    assert result.stderr.decode().strip() == f"sptool: error: {path}:2: not valid UTF-8 (byte 0xe9 at column 18)"


def test_sigpipe_ends_quietly(tmp_path):
    path = write_jsonl(tmp_path / "many.jsonl", [SOLVED] * 300)
    pipeline = (f"{' '.join(SPTOOL)} verify --workers 1 -q {path} | head -n 1")
    result = subprocess.run(["bash", "-o", "pipefail", "-c", pipeline], capture_output=True,
                            text=True, cwd=REPO)
    assert len(result.stdout.splitlines()) == 1
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr


def test_tree_expand_without_titles_and_no_network_names_titles(tmp_path):
    """No --titles, no network (a proxy that refuses every connection): one line naming --titles."""
    from sptool.stages.tree import new_tree, save_tree

    save_tree(new_tree("mathematics", max_depth=3), tmp_path / "tree.json")  # "Algebra" is not a leaf
    script = write_jsonl(tmp_path / "script.jsonl", ["Algebra"])
    env = {"HTTPS_PROXY": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "NO_PROXY": "",
           "no_proxy": "", "SPTOOL_TITLES": "", "SPTOOL_WIKI_URL": ""}
    result = subprocess.run([*SPTOOL, "tree", "expand", "--tree", str(tmp_path / "tree.json"), "--paths", "1",
                             "--backend", "scripted", "-m", str(script), "--wiki-timeout", "2"],
                            capture_output=True, text=True, cwd=REPO, env={**os.environ, **env})
    assert result.returncode == 1 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "title search at https://en.wikipedia.org" in lines[0] and "--titles FILE" in lines[0]


# ---------------------------------------------------------------------------- in-process details

def test_version(cli):
    result = cli(["--version"])
    assert result.exit_code == 0 and result.stdout.startswith("sptool ")


def test_missing_field_names_the_field_and_line(cli, tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "ok?"}, {"prompt": "no question here"}])
    result = cli(["solve", "--backend", "scripted", str(path)])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [f"sptool: error: {path}:2: field 'question': missing, expected a string"]


def test_wrong_type_is_reported(cli, tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [{**SOLVED, "samples": "oops"}])
    result = cli(["verify", "--workers", "0", str(path)])
    assert result.exit_code == 2
    assert ":1: field 'samples': expected a list, got the string \"oops\"" in result.stderr


def test_failed_run_leaves_no_output_file_and_keeps_old_one(cli, tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [SOLVED, SOLVED, {"bad": True}])
    out = tmp_path / "out.jsonl"
    result = cli(["verify", "--workers", "0", str(path), "-o", str(out)])
    assert result.exit_code == 2
    assert not out.exists()
    assert not list(tmp_path.glob(".sptool-*"))  # no temp file left behind
    out.write_text("previous\n")
    cli(["verify", "--workers", "0", str(path), "-o", str(out)])
    assert out.read_text() == "previous\n"


def test_skip_invalid_counts_and_writes_rejects(cli, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(SOLVED) + "\nnot json\n" + json.dumps({"x": 1}) + "\n")
    rejects = tmp_path / "rejects.jsonl"
    result = cli(["verify", "--workers", "0", "--skip-invalid", "--rejects", str(rejects), str(path)])
    assert result.exit_code == 0, result.output
    assert len(read_jsonl(result.stdout)) == 1
    rejected = read_jsonl(rejects)
    assert len(rejected) == 2
    assert ":2:" in rejected[0]["reject_reason"] and rejected[0]["line"] == "not json"
    assert "field 'question'" in rejected[1]["reject_reason"]
    assert "2 invalid input skipped" in result.stderr


def test_gz_both_ways(cli, tmp_path):
    source = tmp_path / "in.jsonl.gz"
    with gzip.open(source, "wt") as handle:
        handle.write(json.dumps(SOLVED) + "\n")
    out = tmp_path / "out.jsonl.gz"
    result = cli(["verify", "--workers", "0", "-q", str(source), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stderr == ""  # --quiet
    with gzip.open(out, "rt") as handle:
        record = json.loads(handle.readline())
    assert record["mine"] == {"keep": [1, 2]}
    assert record["p_hat"] == 0.5


def test_corrupt_gz_is_one_line(cli, tmp_path):
    path = tmp_path / "in.jsonl.gz"
    path.write_bytes(b"not gzip at all")
    result = cli(["verify", "--workers", "0", str(path)])
    assert result.exit_code == 2 and result.stderr.startswith(f"sptool: error: {path}: cannot read")


def test_unknown_backend_suggests_the_closest(cli):
    result = cli(["solve", "--backend", "hff"], input="")
    assert result.exit_code == 2
    assert "unknown backend 'hff'. Did you mean 'hf'?" in result.stderr


def test_missing_input_file(cli):
    result = cli(["verify", "does/not/exist.jsonl"])
    assert result.exit_code == 2
    assert "does/not/exist.jsonl: no such file" in result.stderr


def test_backend_option_group_is_the_same_everywhere(cli):
    """One option group: every generating command takes the same backend options."""
    group = ("--model", "--backend", "--device", "--dtype", "--gen-batch-size", "--no-chat-template",
             "--base-url", "--tensor-parallel-size")
    for command in (["solve"], ["challenge"], ["novelty"], ["eval"], ["tree", "expand"]):
        result = cli([*command, "--help"])
        assert all(flag in result.stdout for flag in group), command


def test_fixture_questions_are_valid_question_records():
    from sptool.core.jsonl import read_records
    from sptool.core.records import QUESTION

    records = list(read_records(FIXTURES / "questions.jsonl", QUESTION))
    assert len(records) >= 5



@pytest.mark.parametrize("fmt", ["parquet", "csv"])
@pytest.mark.parametrize("command", [["eval", "--backend", "scripted", "--preset", "math", "-q"],
                                     ["decontaminate", "--preset", "math", "-q", "-b"]])
def test_a_bad_row_of_a_parquet_or_csv_problem_set_is_one_line_exit_2(cli_bytes, tmp_path, fmt, command):
    """Problem sets in the field's formats (sptool.stages.problemsets) fail like a bad JSONL line:
    ``source:row: field 'x': expected ...``, exit 2, nothing on stdout."""
    rows = [{"problem": "What is the value of three plus four, written out?", "solution": "\\boxed{7}"},
            {"problem": "What is the value of two plus two, written out?", "solution": "four"}]
    if command[0] == "decontaminate":  # only the problem text is read: a missing one is the bad row
        rows[1]["problem"] = ""
        got = "null" if fmt == "csv" else 'the string ""'
        expected = f"field 'problem': expected the problem text (a non-empty string), got {got}"
    else:
        expected = "field 'solution': expected a worked solution with a \\boxed{...} answer, got the string \"four\""
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "bench.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        import csv

        path = tmp_path / "bench.csv"
        with open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, ["problem", "solution"])
            writer.writeheader()
            writer.writerows(rows)
    result = cli_bytes([*command, str(path)], input=b"")
    assert result.exit_code == 2 and result.stdout == ""
    row = 3 if fmt == "csv" else 2  # CSV: the file's line (the header is line 1); parquet: the row
    assert result.stderr.strip().splitlines() == [f"sptool: error: {path}:{row}: {expected}"]
