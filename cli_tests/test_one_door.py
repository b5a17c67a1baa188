"""Every input sptool reads goes through one door (issue 26): stage inputs, tree files, run
directory files, the local corpus, scripted scripts, TOML configs and policy files.

What the door refuses, as one ``source:line`` line and exit 2 (never a traceback): integers of
more than 308 digits (Python's own limit is a ValueError at 4,300), nesting deeper than 100
levels (RecursionError), lone surrogates (which crashed the writer), an endless line (read until
MemoryError), a closed standard input (AttributeError), non-UTF-8 text and TOML dates.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from conftest import FIXTURES, REPO, SPTOOL, write_jsonl

HUGE = "7" * 5000
HUGE_LINE = '{"question": "q", "x": ' + HUGE + '}'
SURROGATE_LINE = '{"question": "q", "x": "\\ud800", "samples": [{"text": "4"}]}'
DEEP_LINE = '{"question": "q", "x": ' + "[" * 5000 + "]" * 5000 + '}'


def one_line(result, code: int = 2) -> str:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("sptool: error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("line, expected", [
    (HUGE_LINE, "has 5000 digits (at most 308)"),
    (SURROGATE_LINE, "lone surrogate"),
    (DEEP_LINE, "nested too deeply"),
])
@pytest.mark.parametrize("args", [
    ["decontaminate", "-b", str(FIXTURES / "bench" / "leaked.jsonl")],
    ["verify"],
    ["solve", "--backend", "scripted"],
])
def test_stage_inputs_refuse_hostile_values_at_source_line(cli, args, line, expected):
    good = '{"question": "fine", "samples": [{"text": "1"}]}\n'
    result = cli(args, input=good + line + "\n")
    error = one_line(result)
    assert "<stdin>:2:" in error and expected in error, error


def test_tree_file_with_huge_integer_or_deep_nesting(cli, tmp_path):
    tree = json.loads((FIXTURES / "tree.json").read_text())
    text = json.dumps(tree, indent=2).replace('"revision": 0', '"revision": ' + HUGE)
    (tmp_path / "big.json").write_text(text)
    assert "has 5000 digits" in one_line(cli(["tree", "show", "--tree", tmp_path / "big.json"]))
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    error = one_line(cli(["tree", "show", "--tree", tmp_path / "deep.json"]))
    assert f"{tmp_path / 'deep.json'}:" in error and "nested too deeply" in error, error


def test_scripted_script_with_huge_integer_or_bad_regex(cli, tmp_path):
    script = tmp_path / "s.jsonl"
    script.write_text('"fine"\n{"match": "x", "output": "y", "n": ' + HUGE + '}\n')
    error = one_line(cli(["solve", "--backend", "scripted", "--model", script], input='{"question": "q"}\n'))
    assert f"{script}:2:" in error and "digits" in error, error
    script.write_text('{"match": "(unclosed", "output": "y"}\n')
    error = one_line(cli(["solve", "--backend", "scripted", "--model", script], input='{"question": "q"}\n'))
    assert f"{script}:1: field 'match': not a valid regular expression" in error, error


def test_report_on_a_run_dir_with_a_huge_integer(cli, tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 1, "stage": "solve"}\n{"iteration": ' + HUGE + '}\n')
    error = one_line(cli(["report", tmp_path]))
    assert f"{tmp_path / 'metrics.jsonl'}:2:" in error and "digits" in error, error


def test_local_corpus_with_huge_integer(cli, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "a page about primes", "n": ' + HUGE + '}\n')
    paths = write_jsonl(tmp_path / "paths.jsonl", [{"path_id": "p", "path": ["mathematics", "primes"]}])
    error = one_line(cli(["corpus", "fetch", paths, "--search", f"local:{corpus}", "--encoder", "none"]))
    assert f"{corpus}:1:" in error and "digits" in error, error


def test_toml_config_not_utf8_or_with_a_date_is_one_line(cli, tmp_path):
    config = tmp_path / "c.toml"
    config.write_bytes(b'recipe = "svs"\n[run]\nseed = 1\n# caf\xe9\n')
    error = one_line(cli(["recipes", "show", "svs", "--config", config]))
    assert f"{config}:4: not valid UTF-8" in error, error
    config.write_text('recipe = "svs"\n[run]\nseed = 1979-05-27\n')
    error = one_line(cli(["recipes", "show", "svs", "--config", config]))
    assert "key 'run.seed': expected an integer" in error and "1979-05-27" in error, error


def test_policy_file_not_utf8_is_one_line(cli, tmp_path):
    policy = tmp_path / "policy.txt"
    policy.write_bytes(b"deny example.com\n\xff\xfe\n")
    paths = write_jsonl(tmp_path / "paths.jsonl", [{"path_id": "p", "path": ["mathematics", "primes"]}])
    error = one_line(cli(["corpus", "fetch", paths, "--search", "local:package:web", "--encoder", "none",
                          "--policy", policy]))
    assert f"{policy}:2: not valid UTF-8" in error, error


def _shell(command: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(REPO / "src"), **(env or {})}
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=full, cwd=REPO,
                          timeout=120)


def _one_subprocess_line(result, code: int = 2) -> str:
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_closed_stdin_is_reported_as_such():
    sptool = " ".join(SPTOOL)
    error = _one_subprocess_line(_shell(f"{sptool} verify <&-"))
    assert error == "sptool: error: <stdin>: standard input is closed; give an input file or pipe JSONL in"


def test_an_endless_line_is_cut_at_the_size_limit():
    sptool = " ".join(SPTOOL)
    result = _shell(f"{sptool} verify /dev/zero", env={"SPTOOL_MAX_LINE_BYTES": str(1 << 20)})
    error = _one_subprocess_line(result)
    assert error.startswith("sptool: error: /dev/zero:1: line longer than 1048576 bytes"), error
