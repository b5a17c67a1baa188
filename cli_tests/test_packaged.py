"""The files sptool reads by default ship inside the package (``package:NAME``, ``sptool/data/``), so
nothing it reads on its own depends on the current directory; and ``sptool doctor``, ``--version``.
The installed wheel, run from an empty directory: test_installed_wheel.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import FIXTURES, REPO, run_sptool

SRC = REPO / "src" / "sptool"
DATA = SRC / "data"


def test_no_source_file_names_a_relative_fixtures_path():
    """``fixtures/`` is the checkout's test folder: a default, a ``--tiny`` setting, a recipe file or a
    help text of the package never names it (the shipped copies are ``package:NAME``)."""
    offending = []
    for path in sorted(SRC.rglob("*")):
        if not path.is_file() or path.suffix in (".pyc", ".html") or DATA in path.parents:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if re.search(r"(?<![\w/])fixtures/", line):
                offending.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert offending == []


def test_every_shipped_file_equals_its_fixtures_twin():
    """The shipped sets are copies of the fixtures the tests read: a change to one is a change to both.
    The sample web pages have one copy, the shipped one: the corpus tests read ``package:web``."""
    shipped = sorted(p.relative_to(DATA) for p in DATA.rglob("*") if p.is_file())
    assert {str(p).split("/")[0] for p in shipped} == {"validity_init.jsonl", "addition_small_train.jsonl",
                                                      "tree.json", "titles.txt", "web"}
    for relative in shipped:
        if relative.parts[0] != "web":
            assert (DATA / relative).read_bytes() == (FIXTURES / relative).read_bytes(), relative
    assert not (FIXTURES / "web").exists()


def test_package_names_resolve_outside_the_checkout(tmp_path, monkeypatch):
    from sptool.core.packaged import local_path, packaged_names
    from sptool.stages.corpus.search import LocalSearch
    from sptool.stages.problemsets import read_labelled_problems
    from sptool.stages.problemsets.sources import source_name, source_sha256
    from sptool.stages.tree import load_tree
    from sptool.stages.tree.title_sources import load_titles

    monkeypatch.chdir(tmp_path)
    assert packaged_names() == ["addition_small_train.jsonl", "titles.txt", "tree.json", "validity_init.jsonl", "web"]
    assert Path(local_path("package:validity_init.jsonl")).parent == DATA
    assert local_path("fixtures/validity_init.jsonl") == "fixtures/validity_init.jsonl"  # the user's own path
    problems = read_labelled_problems("package:validity_init.jsonl", "R-Quest's validity initialisation")
    assert len(problems) == 12 and any(p["answer"] == "INVALID" for p in problems)
    assert source_name("package:validity_init.jsonl") == "validity_init"
    import hashlib

    assert source_sha256("package:addition_small_train.jsonl") == hashlib.sha256(
        (FIXTURES / "addition_small_train.jsonl").read_bytes()).hexdigest()
    assert source_sha256("package:nothing.jsonl") is None
    assert load_tree("package:tree.json")["nodes"]
    assert "Group theory" in load_titles("package:titles.txt")
    assert len(LocalSearch("package:web").entries) == 11


def test_an_unknown_package_name_is_one_line_listing_the_shipped_ones(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = cli(["run", "--recipe", "rlvr", "--tiny", "--run-dir", tmp_path / "r", "--backend", "scripted",
                  "--data", "package:nope.jsonl"])
    assert result.exit_code == 2, result.stderr
    line, = result.stderr.strip().splitlines()
    assert line.startswith("sptool: error: package:nope.jsonl: no such file shipped with sptool")
    assert "package:addition_small_train.jsonl" in line and "package:web" in line


def test_recipes_show_names_the_shipped_files(cli, tmp_path, monkeypatch):
    import tomllib

    monkeypatch.chdir(tmp_path)
    rquest = tomllib.loads(cli(["recipes", "show", "rquest", "--tiny"]).stdout)
    assert rquest["rquest"]["init_data"] == "package:validity_init.jsonl"
    wist = cli(["recipes", "show", "wist", "--tiny", "--explain"]).stdout
    assert 'search = "local:package:web"' in wist and 'tree = "package:tree.json"' in wist
    for recipe in ("svs", "rlvr"):
        shown = tomllib.loads(cli(["recipes", "show", recipe, "--tiny"]).stdout)
        assert shown[recipe]["data"] == "package:addition_small_train.jsonl"


def test_doctor_prints_one_line_per_check(tmp_path):
    result = run_sptool("doctor", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    names = [line.split()[1] for line in lines]
    assert names == ["python", "sptool", "packaged", "dependencies", "torch", "vllm", "trl", "peft", "datasets",
                     "trackers", "web", "gym", "cache", "tiny"]
    assert all(line.split()[0] in ("ok", "missing") for line in lines), lines
    status = {line.split()[1]: line for line in lines}
    assert status["torch"].startswith("ok") and "device " in status["torch"]
    assert str(SRC) in status["sptool"]
    assert "validity_init.jsonl" in status["packaged"]
    assert result.stderr == ""


def test_doctor_reports_a_broken_core_part_in_one_line(tmp_path):
    """torch that cannot import: its check says so, and the command ends in one error line, exit 1."""
    (tmp_path / "torch.py").write_text("raise ImportError('a broken build')\n")
    result = run_sptool("doctor", cwd=tmp_path, timeout=120, env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 1
    torch_line, = [line for line in result.stdout.splitlines() if line.split()[1] == "torch"]
    assert torch_line.startswith("error") and "a broken build" in torch_line
    assert result.stderr.strip().splitlines() == ["sptool: error: doctor: 1 core check(s) failed: torch"]


@pytest.mark.parametrize("args", [["--version"], ["doctor", "--help"]])
def test_version_and_doctor_help(cli, args):
    result = cli(args)
    assert result.exit_code == 0
    assert result.stdout.startswith("sptool 0.") if args == ["--version"] else "doctor" in result.stdout
