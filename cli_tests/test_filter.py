"""`sptool filter --recipe wist|rzero|rquest|svs`: training groups, rewards, rejects, pipelines."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys

import pytest

from conftest import FIXTURES, REPO, read_jsonl, write_jsonl

approx = pytest.approx
SP = f"{shlex.quote(sys.executable)} -m sptool.cli.main"


def run_filter(cli, tmp_path, *args):
    rejects = tmp_path / "rejects.jsonl"
    result = cli(["filter", *args, "--rejects", rejects, "-q"])
    assert result.exit_code == 0, result.output
    groups = read_jsonl(result.stdout)
    rejected = {r["id"]: r["reject_reason"] for r in read_jsonl(rejects)}
    return groups, rejected


def by_role(groups, role):
    return [g for g in groups if g["role"] == role]


def pipeline(command: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env=env)


# ------------------------------------------------------------------ contract basics

def test_help_lists_recipes_and_options(cli):
    result = cli(["filter", "--help"])
    assert result.exit_code == 0
    for word in ("--recipe", "--advantage", "--replay", "--validity-init", "--synthesis-band",
                 "--uncertainty", "--rejects"):
        assert word in result.stdout


def test_empty_input_gives_no_groups(cli):
    result = cli(["filter", "--recipe", "rzero"], input="")
    assert result.exit_code == 0
    assert result.stdout == ""
    assert "0 in, 0 out" in result.stderr


def test_bad_line_is_exit_2_with_location(sptool):
    result = sptool("filter", "--recipe", "wist", input='{"id": 1}\nnot json\n')
    assert result.returncode == 2
    assert "<stdin>:2" in result.stderr and "Traceback" not in result.stderr


def test_usage_errors(sptool):
    result = sptool("filter", "--recipe", "wst", input="")
    assert result.returncode == 2 and "Did you mean 'wist'" in result.stderr
    result = sptool("filter", "--recipe", "wist", "--replay", str(FIXTURES / "verified_validity_init.jsonl"), input="")
    assert result.returncode == 2 and "rquest" in result.stderr
    result = sptool("filter", "--recipe", "rzero", "--solver-band", "0.8", input="")
    assert result.returncode == 2 and "--solver-band" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--recipe", "rquest", "--uncertainty", "reference"],
     "--uncertainty is not an option of --recipe rquest (it belongs to --recipe rzero)"),
    (["--recipe", "svs", "--sigma", "0.1"], "--sigma is not an option of --recipe svs (it belongs to --recipe wist)"),
    (["--recipe", "wist", "--format-weight", "0.1"], "--format-weight is not an option of --recipe wist"),
    (["--recipe", "rquest", "--validity-init", "--solver-band", "0.3,0.8"],
     "--solver-band is not an option of --validity-init"),
    (["--recipe", "wist", "--sigma", "0"], "--sigma must be"),
])
def test_options_of_another_recipe_are_refused(sptool, args, message):
    result = sptool("filter", *args, input="")
    assert result.returncode == 2 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_non_contiguous_groups_are_refused(sptool, tmp_path):
    records = read_jsonl(FIXTURES / "verified_wist.jsonl")
    shuffled = [records[0], records[3], records[1]]           # doc-a, doc-b, doc-a again
    path = write_jsonl(tmp_path / "in.jsonl", shuffled)
    result = sptool("filter", "--recipe", "wist", str(path))
    assert result.returncode == 2
    assert f"{path}:3: field 'group_id'" in result.stderr and "not contiguous" in result.stderr  # the line, not 'record wa2'


# ------------------------------------------------------------------ WIST

def test_wist_challenger_and_balanced_solver_groups(cli, tmp_path):
    groups, rejected = run_filter(cli, tmp_path, "--recipe", "wist", FIXTURES / "verified_wist.jsonl")
    challenger, = by_role(groups, "challenger")
    assert challenger["source_ids"] == ["wa1", "wa2", "wa3"]
    # wa1: p=0.5 -> Var 0.25 -> 1; wa2: all correct -> Var 0 -> exp(-3.125); wa3 invalid -> rho
    assert challenger["rewards"] == approx([1.0, math.exp(-3.125), -0.1])
    mean = (1.0 + math.exp(-3.125) - 0.1) / 3
    assert challenger["advantages"] == approx([r - mean for r in challenger["rewards"]])
    assert challenger["prompt"] == [{"role": "user", "content": "Write a question about document doc-a."}]
    assert challenger["completions"][0].startswith('{"question"')
    assert challenger["group_id"] == "doc-a" and challenger["doc_id"] == "doc-a"
    solver, = by_role(groups, "solver")            # role balancing: exactly one QA per document
    assert solver["source_ids"][0] in ("wa1", "wa2")
    assert len(solver["completions"]) == 4
    assert solver["prompt"][0]["content"].startswith("Solve the following")
    expected = {"wa1": [1.0, 0.0, 1.0, 0.0], "wa2": [1.0] * 4}[solver["source_ids"][0]]
    assert solver["rewards"] == expected
    # doc-b: every valid QA has Var = 0 -> whole document skipped, all three records rejected
    for rid in ("wb1", "wb2", "wb3"):
        assert rejected[rid] == "document skipped: every valid QA has Var = 0"
    other = ({"wa1", "wa2"} - {solver["source_ids"][0]}).pop()
    assert rejected[other].startswith("solver: not the QA drawn")


def test_wist_solver_draw_is_seeded(cli, tmp_path):
    picks = set()
    for seed in range(12):
        groups, _ = run_filter(cli, tmp_path, "--recipe", "wist", "--seed", seed,
                               FIXTURES / "verified_wist.jsonl")
        again, _ = run_filter(cli, tmp_path, "--recipe", "wist", "--seed", seed,
                              FIXTURES / "verified_wist.jsonl")
        assert groups == again
        picks.add(by_role(groups, "solver")[0]["source_ids"][0])
    assert picks == {"wa1", "wa2"}       # uniform draw: both valid QAs get drawn across seeds


def test_wist_sigma_and_penalty_options(cli, tmp_path):
    groups, _ = run_filter(cli, tmp_path, "--recipe", "wist", "--sigma", "0.5",
                           "--invalid-penalty", "-0.3", FIXTURES / "verified_wist.jsonl")
    assert by_role(groups, "challenger")[0]["rewards"] == approx([1.0, math.exp(-0.125), -0.3])


# ------------------------------------------------------------------ R-Zero

def test_rzero_questioner_and_solver_groups(cli, tmp_path):
    groups, rejected = run_filter(cli, tmp_path, "--recipe", "rzero", FIXTURES / "verified_rzero.jsonl")
    questioner, = by_role(groups, "questioner")
    assert questioner["source_ids"] == ["rz1", "rz2", "rz3", "rz4"]
    # p = 0.6, 0.8, 1.0; rz1/rz2 are BLEU near-duplicates (cluster of 2 of B = 3), rz3 alone;
    # rz4 unparsable -> -1
    assert questioner["rewards"] == approx([0.8 - 2 / 3, 0.4 - 2 / 3, 0.0 - 1 / 3, -1.0])
    assert questioner["completions"][3] == "I like numbers."
    assert questioner["prompt"][0]["content"] == "Write one new challenging math problem."
    solvers = by_role(groups, "solver")
    assert [g["source_ids"] for g in solvers] == [["rz1"], ["rz2"]]      # p in [0.3, 0.8]
    # answers 8,8,8,9,(no box) vs pseudo-label 8: 0.9*correct + 0.1*format
    assert solvers[0]["rewards"] == approx([1.0, 1.0, 1.0, 0.1, 0.0])
    assert solvers[0]["pseudo_label"] == "8"
    assert rejected["rz3"] == "solver: p outside [0.3, 0.8]"
    assert rejected["rz4"] == "solver: unparsable question"
    assert rejected["rz5"] == "verify_error"                 # verify_error records are dropped


def test_rzero_options(cli, tmp_path):
    groups, _ = run_filter(cli, tmp_path, "--recipe", "rzero", "--uncertainty", "reference",
                           "--advantage", "grpo", "--solver-band", "0.7,1.0",
                           FIXTURES / "verified_rzero.jsonl")
    questioner, = by_role(groups, "questioner")
    rewards = [0.4 - 2 / 3, 0.2 - 2 / 3, 0.0 - 1 / 3, -1.0]
    assert questioner["rewards"] == approx(rewards)
    mean = sum(rewards) / 4
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 3)
    assert questioner["advantages"] == approx([(r - mean) / (std + 1e-6) for r in rewards])
    assert questioner["advantage"] == "grpo"
    assert [g["source_ids"] for g in by_role(groups, "solver")] == [["rz2"], ["rz3"]]


# ------------------------------------------------------------------ R-Quest

def test_rquest_gates_and_solver_data(cli, tmp_path):
    groups, rejected = run_filter(cli, tmp_path, "--recipe", "rquest", FIXTURES / "verified_rquest.jsonl")
    questioner, = by_role(groups, "questioner")
    # rq1: u=0, s=0.6, novel -> min(.6,.4) = 0.4; rq2: u = 1 -> g_valid = -0.5;
    # rq3: not novel -> 0; rq4: format failure -> -1
    assert questioner["rewards"] == approx([0.4, -0.5, 0.0, -1.0])
    assert questioner["reward_terms"][1]["g_valid"] == -0.5
    assert [g["source_ids"] for g in by_role(groups, "solver")] == [["rq1"], ["rq3"]]
    assert by_role(groups, "solver")[0]["rewards"] == approx([1.0, 1.0, 1.0, 0.1, 0.1])
    assert rejected["rq2"] == "solver: invalid by the validity gate (u > 1/2)"
    assert rejected["rq4"] == "solver: unparsable question"
    assert not by_role(groups, "validity")


def test_rquest_replay_share(cli, tmp_path):
    groups, _ = run_filter(cli, tmp_path, "--recipe", "rquest", "--replay",
                           FIXTURES / "verified_validity_init.jsonl", "--replay-share", "0.5",
                           FIXTURES / "verified_rquest.jsonl")
    validity = by_role(groups, "validity")
    # 2 solver groups, share 0.5 -> k = round(2 * 0.5 / 0.5) = 2 replayed validity groups
    assert len(validity) == 2 and all(g["replay"] for g in validity)
    assert len({g["source_ids"][0] for g in validity}) == 2
    groups_default, _ = run_filter(cli, tmp_path, "--recipe", "rquest", "--replay",
                                   FIXTURES / "verified_validity_init.jsonl",
                                   FIXTURES / "verified_rquest.jsonl")
    assert len(by_role(groups_default, "validity")) == 0   # round(2 * 0.1 / 0.9) = 0


def test_rquest_validity_init_rewards(cli, tmp_path):
    groups, _ = run_filter(cli, tmp_path, "--recipe", "rquest", "--validity-init",
                           FIXTURES / "verified_validity_init.jsonl")
    rewards = {g["source_ids"][0]: g["rewards"][0] for g in groups}
    assert all(g["role"] == "validity" for g in groups)
    assert rewards == {"vi01": 1.0, "vi02": 1.0, "vi03": -0.5, "vi04": -0.1, "vi05": 1.0,
                       "vi06": 0.0, "vi07": 1.0, "vi08": 1.0, "vi09": 1.0, "vi10": 0.0,
                       "vi11": 1.0, "vi12": 1.0}


def test_validity_init_fixture_is_labelled():
    records = read_jsonl(FIXTURES / "validity_init.jsonl")
    assert len(records) == 12
    flawed = [r for r in records if r["answer"] == "INVALID"]
    assert len(flawed) == 6 and all(r["flaw"] for r in flawed)
    assert all(r["flaw"] is None for r in records if r["answer"] != "INVALID")


# ------------------------------------------------------------------ SvS

def test_svs_three_kinds_of_data(cli, tmp_path):
    groups, rejected = run_filter(cli, tmp_path, "--recipe", "svs", FIXTURES / "verified_svs.jsonl")
    roles = [g["role"] for g in groups]
    assert roles == ["solver", "synthesis", "solver"]
    original, synthesis, variant = groups
    assert original["source_ids"] == ["sv1"] and original["rewards"] == [1.0, 0.0, 1.0, 0.0]
    # variants: acc 0.5 (in band) -> 1; acc 1.0 -> 0; copy of the original (invalid) -> 0
    assert synthesis["rewards"] == [1.0, 0.0, 0.0]
    assert synthesis["accuracies"] == [0.5, 1.0, None]
    assert "Solution:" in synthesis["prompt"][0]["content"]
    assert synthesis["completions"][0].startswith("<problem>Seven bags")
    assert synthesis["parent_id"] == "sv1"
    assert variant["variant"] is True and variant["source_ids"] == [synthesis["source_ids"][0]]
    assert rejected["sv2"] == "solver: original Acc is 0 or 1"
    assert rejected[synthesis["source_ids"][1]] == "solver: variant Acc is 0 or 1"
    groups, _ = run_filter(cli, tmp_path, "--recipe", "svs", "--negative-synthesis-reward",
                           FIXTURES / "verified_svs.jsonl")
    assert by_role(groups, "synthesis")[0]["rewards"] == [1.0, -1.0, -1.0]
    groups, rejected = run_filter(cli, tmp_path, "--recipe", "svs", "--synthesis-band", "0.125,0.25",
                                  FIXTURES / "verified_svs.jsonl")
    assert not by_role(groups, "synthesis")                 # no variant in band: group dropped
    assert "synthesis: no variant of this solution in the band" in rejected.values()


def test_svs_format_weight_gives_a_weak_solver_a_signal(cli, tmp_path):
    """w > 0 (off by default, as in the paper): (1 − w)·correct + w·format, and a group trains when
    its rewards differ, so a problem nobody solves still teaches the \\boxed{} format."""
    original = read_jsonl(FIXTURES / "verified_svs.jsonl")[0]
    unsolved_some_boxed = {**original, "id": "boxed-some", "p_hat": 0.0, "samples": [
        {**sample, "answer": answer, "correct": False}
        for sample, answer in zip(original["samples"], ["41", None, "40", None])]}
    unsolved_all_boxed = {**original, "id": "boxed-all", "p_hat": 0.0, "samples": [
        {**sample, "answer": "41", "correct": False} for sample in original["samples"]]}
    data = tmp_path / "verified.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in (original, unsolved_some_boxed, unsolved_all_boxed)))
    groups, rejected = run_filter(cli, tmp_path, "--recipe", "svs", data)
    assert [g["source_ids"] for g in groups] == [["sv1"]]                  # the paper: binary, 0 < Acc < 1
    assert groups[0]["rewards"] == [1.0, 0.0, 1.0, 0.0]
    assert rejected["boxed-some"] == "solver: original Acc is 0 or 1"
    groups, rejected = run_filter(cli, tmp_path, "--recipe", "svs", "--format-weight", "0.1", data)
    rewards = {g["source_ids"][0]: g["rewards"] for g in groups}
    assert rewards == {"sv1": [1.0, 0.1, 1.0, 0.1], "boxed-some": [0.1, 0.0, 0.1, 0.0]}
    assert rejected["boxed-all"] == "solver: original rewards all equal (same correctness and format)"
    advantages = {g["source_ids"][0]: g["advantages"] for g in groups}
    assert advantages["boxed-some"] == pytest.approx([0.05, -0.05, 0.05, -0.05])   # Dr. GRPO: r − mean


def test_format_term_needs_a_boxed_answer_even_when_an_unboxed_one_is_graded(cli, tmp_path):
    """verify grades an answer found without \\boxed{} (``boxed: false``): it counts as correct,
    but the format term w·format stays 0 for it."""
    original = read_jsonl(FIXTURES / "verified_svs.jsonl")[0]
    unboxed = {**original, "id": "unboxed", "p_hat": 0.5, "samples": [
        {**sample, "answer": "42", "boxed": boxed, "correct": correct}
        for sample, boxed, correct in zip(original["samples"], [True, False, True, False],
                                          [True, True, False, False])]}
    data = tmp_path / "verified.jsonl"
    data.write_text(json.dumps(unboxed) + "\n")
    groups, _ = run_filter(cli, tmp_path, "--recipe", "svs", "--format-weight", "0.1", data)
    assert groups[0]["rewards"] == approx([1.0, 0.9, 0.1, 0.0])


def test_rlvr_solver_groups_drop_or_keep_equal_rewards(cli, tmp_path):
    """rlvr: one solver group per problem (no variants, no synthesis group); groups whose rewards
    are all equal are dropped unless --keep-equal-groups (then their advantages are all 0)."""
    original = read_jsonl(FIXTURES / "verified_svs.jsonl")[0]
    all_wrong_boxed = {**original, "id": "wrong-boxed", "p_hat": 0.0, "samples": [
        {**sample, "answer": "41", "boxed": True, "correct": False} for sample in original["samples"]]}
    data = tmp_path / "verified.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in (original, all_wrong_boxed)))
    groups, rejected = run_filter(cli, tmp_path, "--recipe", "rlvr", data)
    assert [(g["role"], g["source_ids"], g["rewards"]) for g in groups] == [("solver", ["sv1"], [1.0, 0.0, 1.0, 0.0])]
    assert groups[0]["recipe"] == "rlvr" and groups[0]["advantages"] == approx([0.5, -0.5, 0.5, -0.5])
    assert rejected["wrong-boxed"] == "solver: Acc is 0 or 1"
    groups, rejected = run_filter(cli, tmp_path, "--recipe", "rlvr", "--format-weight", "0.1",
                                  "--keep-equal-groups", data)
    rewards = {g["source_ids"][0]: (g["rewards"], g["advantages"]) for g in groups}
    assert rewards["wrong-boxed"] == ([0.1] * 4, approx([0.0] * 4)) and not rejected
    assert rewards["sv1"][0] == [1.0, 0.1, 1.0, 0.1]
    result = cli(["filter", "--recipe", "svs", "--keep-equal-groups", str(data)])
    assert result.exit_code == 2 and "keep-equal-groups" in result.stderr


# ------------------------------------------------------------------ shell pipelines (scripted backend)

def test_pipeline_wist_with_logprobs(tmp_path):
    out = tmp_path / "groups.jsonl"
    result = pipeline(
        f"{SP} solve -q --backend scripted -m fixtures/scripts/solve_wist.jsonl -k 4 --logprobs "
        f"fixtures/questions_wist.jsonl | {SP} verify -q --workers 1 | "
        f"{SP} filter --recipe wist -o {out}")
    assert result.returncode == 0, result.stderr
    groups = read_jsonl(out)
    assert [g["role"] for g in groups] == ["challenger", "solver"]
    solver = groups[1]
    assert len(solver["old_logprobs"]) == 4 and all(isinstance(lp, list) for lp in solver["old_logprobs"])
    assert "filter: 6 in, 2 out" in result.stderr


def test_pipeline_rzero(tmp_path):
    result = pipeline(
        f"{SP} solve -q --backend scripted -m fixtures/scripts/solve_rzero.jsonl -k 5 "
        f"fixtures/questions_rzero.jsonl | {SP} verify -q --workers 1 --pseudo-label | "
        f"{SP} filter -q --recipe rzero")
    assert result.returncode == 0, result.stderr
    groups = read_jsonl(result.stdout)
    assert [g["role"] for g in groups] == ["questioner", "solver", "solver"]
    assert groups[0]["rewards"] == approx([0.8 - 2 / 3, 0.4 - 2 / 3, -1 / 3])


def test_pipeline_rquest_with_novelty(tmp_path):
    judge = write_jsonl(tmp_path / "judge.jsonl", [
        {"match": "(?s)oranges.*apples|apples.*oranges", "output": "Yes, the same type."},
        "No, different."])
    rejects = tmp_path / "rejects.jsonl"
    result = pipeline(
        f"{SP} solve -q --backend scripted -m fixtures/scripts/solve_rquest.jsonl --mode validity -k 4 "
        f"fixtures/questions_rquest.jsonl | {SP} verify -q --workers 1 --pseudo-label | "
        f"{SP} solve -q --backend scripted -m fixtures/scripts/solve_rquest.jsonl --mode math -k 5 | "
        f"{SP} verify -q --workers 1 --pseudo-label | "
        f"{SP} novelty -q --backend scripted -m {judge} --partners 2 | "
        f"{SP} filter -q --recipe rquest --rejects {rejects}")
    assert result.returncode == 0, result.stderr
    groups = read_jsonl(result.stdout)
    questioner = by_role(groups, "questioner")[0]
    # apples vs oranges judged the same type -> both not novel -> 0; triangle invalid -> -0.5
    assert questioner["rewards"] == approx([0.0, -0.5, 0.0])
    assert len(by_role(groups, "solver")) == 2
    assert "invalid by the validity gate" in rejects.read_text()


def test_pipeline_svs_with_challenge(tmp_path):
    originals = tmp_path / "originals.jsonl"
    result = pipeline(
        f"{SP} solve -q --backend scripted -m fixtures/scripts/solve_svs.jsonl -k 4 "
        f"fixtures/questions_svs.jsonl | {SP} verify -q --workers 1 > {originals} && "
        f"{SP} challenge -q --from solutions --backend scripted -m fixtures/scripts/challenge_svs.jsonl "
        f"{originals} "
        f"--candidates 3 --max-solutions 1 | {SP} solve -q --backend scripted -m fixtures/scripts/solve_svs.jsonl -k 4 | "
        f"{SP} verify -q --workers 1 | cat {originals} - | {SP} filter -q --recipe svs")
    assert result.returncode == 0, result.stderr
    groups = read_jsonl(result.stdout)
    assert [g["role"] for g in groups] == ["solver", "synthesis", "solver"]
    assert groups[1]["rewards"] == [1.0, 0.0, 0.0]


def test_pipeline_validity_init(tmp_path):
    result = pipeline(
        f"{SP} solve -q --backend scripted -m fixtures/scripts/solve_validity_init.jsonl --mode validity "
        f"-k 2 fixtures/validity_init.jsonl | {SP} verify -q --workers 1 | "
        f"{SP} filter -q --recipe rquest --validity-init")
    assert result.returncode == 0, result.stderr
    groups = read_jsonl(result.stdout)
    assert len(groups) == 12
    assert sum(g["rewards"][0] == 1.0 for g in groups) == 8


# ------------------------------------------------------------------ the real tiny model

@pytest.mark.slow
def test_pipeline_rzero_with_tiny_model(tmp_path, tiny_model_dir):
    result = pipeline(
        f"{SP} solve -q -k 1 --max-tokens 24 --questions-per-call 4 fixtures/questions_rzero.jsonl | "
        f"{SP} verify -q --workers 1 --pseudo-label | {SP} filter --recipe rzero", timeout=600)
    assert result.returncode == 0, result.stderr
    groups = read_jsonl(result.stdout)
    questioner = by_role(groups, "questioner")
    assert len(questioner) == 1 and len(questioner[0]["rewards"]) == 3
    assert all(-1.0 <= r <= 1.0 for r in questioner[0]["rewards"])
    for group in groups:
        assert len(group["completions"]) == len(group["rewards"]) == len(group["advantages"])
        assert sum(group["advantages"]) == approx(0.0, abs=1e-9)
    assert "filter: 3 in" in result.stderr
