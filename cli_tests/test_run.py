"""`sptool run`, `sptool recipes`, `sptool report`: config merging, the four recipes end to end
(scripted generation + a tiny random-initialised policy for logic; the real tiny model for the
smoke runs), SIGKILL at several points then --resume, and the report's PNGs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from conftest import FIXTURES, REPO, read_jsonl, run_sptool, stable_metrics

SCRIPT = FIXTURES / "scripts" / "run_all.jsonl"
# Two cores shared by several processes: one BLAS thread per process avoids oversubscription
# (measured: a tiny-model solve took 91 s with the default threads under load, 7.5 s with one).
ENV = {"OMP_NUM_THREADS": "1"}
VOLATILE = {"wall_s", "fetched_at", "elapsed_s"}


# ------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="session")
def scripted_run(tmp_path_factory, random_policy):
    """``scripted_run(recipe)``: the uninterrupted scripted run of ``recipe`` (``scripted_args`` as
    they are), run once per session and read, never changed, by every test that needs it: the
    every-stage checks, the kill-and-resume references and the report (which works on a copy)."""
    runs: dict[str, Path] = {}

    def run(recipe: str) -> Path:
        if recipe not in runs:
            run_dir = tmp_path_factory.mktemp(f"scripted-{recipe}") / recipe
            # from a directory of its own: the recipe's shipped files (package:NAME) need no checkout
            result = run_sptool(*scripted_args(recipe, run_dir, random_policy), env=ENV, cwd=run_dir.parent)
            assert result.returncode == 0, result.stderr
            runs[recipe] = run_dir
        return runs[recipe]

    return run


def shares_run(recipe: str):
    """Tests reading ``scripted_run(recipe)`` go to one pytest-xdist worker, which runs it once."""
    return pytest.mark.xdist_group(f"scripted-{recipe}")


def scripted_args(recipe: str, run_dir: Path, policy: str, *extra: str) -> list[str]:
    args = ["run", "--recipe", recipe, "--tiny", "--run-dir", str(run_dir), "--backend", "scripted",
            "-m", policy, "--set", f'model.script="{SCRIPT}"', "--keep", "1", "-q"]
    if recipe in ("svs", "rlvr"):
        # all 16 problems: the scripted solver answers 42, right only for "What is 12 + 30?", which
        # a 3-problem sample may miss (then no problem is in band and nothing trains)
        args += ["--data", str(FIXTURES / "svs_train.jsonl"), "--set", f"{recipe}.problems=16"]
    return args + list(extra)


def stage_outputs(run_dir: Path) -> dict[str, list[dict]]:
    """Every stage's output records (volatile fields removed), by relative path."""
    out = {}
    for path in sorted(run_dir.glob("iter-*/*.jsonl")):
        records = read_jsonl(path)
        for record in records:
            for key in VOLATILE:
                record.pop(key, None)
            if "checkpoint" in record:  # train: timing metrics vary; the weights are compared apart
                record.pop("metrics", None)
        out[str(path.relative_to(run_dir))] = records
    return out


def checkpoint_weights(run_dir: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.glob("ckpt/*/*/model.safetensors"))}


# ------------------------------------------------------------------------------ recipes / config

def test_recipes_list_names_all_five(cli):
    result = cli(["recipes", "list"])
    assert result.exit_code == 0
    names = [line.split("\t")[0] for line in result.stdout.splitlines()]
    assert names == ["wist", "svs", "rzero", "rquest", "rlvr"]


def test_recipes_show_papers_defaults(cli):
    import tomllib

    wist = tomllib.loads(cli(["recipes", "show", "wist"]).stdout)
    assert wist["wist"]["paths"] == 128 and wist["wist"]["candidates"] == 8 and wist["wist"]["samples"] == 8
    assert wist["wist"]["tau_var"] == 0.2 and wist["wist"]["sigma"] == 0.02
    assert wist["train"]["learning_rate"] == 1e-6 and wist["train"]["beta"] == 0.0
    assert wist["train"]["loss"] == "dr_grpo" and wist["train"]["shared_policy"] is True
    svs = tomllib.loads(cli(["recipes", "show", "svs"]).stdout)
    assert svs["svs"]["band"] == [0.125, 0.5] and svs["svs"]["synthesis_band"] == [0.125, 0.625]
    assert svs["svs"]["problems"] == 256 and svs["svs"]["variants"] == 8
    rquest = json.loads(cli(["recipes", "show", "rquest", "--format", "json"]).stdout)
    assert rquest["rquest"]["validity_samples"] == 9 and rquest["rquest"]["samples"] == 10
    assert rquest["rquest"]["questioner_steps"] == 5 and rquest["rquest"]["solver_steps"] == 15
    assert rquest["rquest"]["novelty_k"] == 8 and rquest["train"]["beta"] == 0.01
    assert rquest["train"]["shared_policy"] is False


def test_prompts_section_resolves_names_files_prefix_and_stop(cli, tmp_path):
    from sptool.recipes import load_config, to_toml

    config = load_config("rquest", tiny=True)
    p = config["prompts"]
    # the --tiny preset's shapes, with the packaged prompts' own prefix and stop strings recorded
    assert (p["questioner"], p["questioner_prefix"], p["questioner_stop"]) == ("arithmetic", "<question>",
                                                                           ["?", "</question>"])
    assert (p["solve"], p["solve_prefix"], p["solve_stop"]) == ("direct", "\\boxed{", ["}"])
    assert load_config("rquest")["prompts"]["questioner"] == "rzero"  # paper scale: R-Zero's prompt
    template = tmp_path / "solve.txt"
    template.write_text("Q: {question}")
    config = load_config("rzero", sets=[f"prompts.solve={template}", 'prompts.solve_stop=["\\n", "Q:"]'])
    assert config["prompts"]["solve"] == str(template) and config["prompts"]["solve_stop"] == ["\n", "Q:"]
    assert 'solve_stop = ["\\n", "Q:"]' in to_toml(config)
    result = cli(["recipes", "show", "rzero", "--set", "prompts.questioner=arithmetc"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "sptool: error: key 'prompts.questioner': unknown questioner prompt 'arithmetc'. Did you mean "
        "'arithmetic'? Packaged questioner prompts: rzero, arithmetic, sums; or give a template file path")


def test_merge_order_set_beats_config_beats_tiny_beats_recipe(cli, tmp_path):
    from sptool.recipes import load_config

    assert load_config("rzero")["rzero"]["questions"] == 2048
    assert load_config("rzero", tiny=True)["rzero"]["questions"] == 8
    override = tmp_path / "over.toml"
    override.write_text('[rzero]\nquestions = 6\nsamples = 7\n[generation]\ntemperature = 0.7\n')
    config = load_config("rzero", tiny=True, config_file=str(override), sets=["questions=9"])
    assert config["rzero"]["questions"] == 9          # --set wins
    assert config["rzero"]["samples"] == 7            # --config beats [tiny] (5)
    assert config["generation"]["temperature"] == 0.7
    assert config["generation"]["max_tokens"] == 48   # [tiny] beats the default 512
    assert config["train"]["learning_rate"] == 1e-6   # recipe file
    # show prints the same effective configuration, and it reads back as --config
    shown = cli(["recipes", "show", "rzero", "--tiny", "--config", override, "--set", "questions=9"]).stdout
    saved = tmp_path / "effective.toml"
    saved.write_text(shown)
    assert load_config("rzero", config_file=str(saved)) == {**config, "tiny": False}


@pytest.mark.parametrize("args, message", [
    (["--set", "wist.pathz=3"], "unknown key 'wist.pathz'. Did you mean 'wist.paths'?"),
    (["--set", "wist.paths=many"], "key 'wist.paths': expected an integer"),
    (["--set", "train.shared_policy=1"], "key 'train.shared_policy': expected a boolean"),
    (["--set", "generation.max_tokens=0"], "key 'generation.max_tokens': must be in [1, 1000000]"),
    (["--set", "nokey"], "--set expects KEY=VALUE"),
    (["--set", "train.start_optimizer=keep"], "key 'train.start_optimizer': unknown value 'keep'. Choose from: fresh, restore"),
    (["--set", "model.decode_attention=flash"],
     "key 'model.decode_attention': unknown value 'flash'. Choose from: grouped, model"),
    (["--set", "model.step_graph=trees"],
     "key 'model.step_graph': unknown value 'trees'. Choose from: capture, compile"),
])
def test_bad_overrides_are_one_line_usage_errors(args, message):
    result = run_sptool("recipes", "show", "wist", *args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_every_stage_setting_is_reachable_with_set(cli):
    """Settings that once lived only in a stage's options or as literals in the driver."""
    from sptool.recipes import load_config

    rzero = load_config("rzero", sets=["bleu_pairing=reference", "clip_questioner_reward=true", "batch_size=64"])
    assert rzero["rzero"]["bleu_pairing"] == "reference" and rzero["rzero"]["clip_questioner_reward"] is True
    wist = load_config("wist", sets=["min_votes=2", "proposals=5", "duplicate_threshold=0.9"])
    assert (wist["wist"]["min_votes"], wist["wist"]["proposals"], wist["wist"]["duplicate_threshold"]) == (2, 5, 0.9)
    svs = load_config("svs", sets=["strict_band=true", "generation.prompts_per_call=2",
                                   "negative_synthesis_value=-0.5"])
    assert svs["svs"]["strict_band"] is True and svs["generation"]["prompts_per_call"] == 2
    explained = cli(["recipes", "show", "svs", "--explain"]).stdout
    band = next(line for line in explained.splitlines() if line.startswith("band ="))
    assert "SvS §3.3" in band and "under-performing" in band


def test_bad_config_file_names_the_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[svs]\nband = [0.1]\n")
    result = run_sptool("recipes", "show", "svs", "--config", str(bad))
    assert result.returncode == 2 and "key 'svs.band': expected a list [LOW, HIGH]" in result.stderr
    bad.write_text("[model]\npolicyy = 'x'\n")
    result = run_sptool("recipes", "show", "svs", "--config", str(bad))
    assert result.returncode == 2 and "Did you mean 'model.policy'?" in result.stderr


def test_unknown_recipe_has_a_hint():
    result = run_sptool("run", "--recipe", "rzeor", "--tiny")
    assert result.returncode == 2 and "Did you mean 'rzero'?" in result.stderr


def test_stage_seed_depends_on_run_seed_iteration_and_stage():
    from sptool.run.steps import stage_seed

    seeds = {stage_seed(0, 1, "solve"), stage_seed(1, 1, "solve"), stage_seed(0, 2, "solve"),
             stage_seed(0, 1, "verify")}
    assert len(seeds) == 4 and stage_seed(0, 1, "solve") == stage_seed(0, 1, "solve")


# ------------------------------------------------------------------------------ scripted runs

@pytest.mark.slow
@pytest.mark.parametrize("recipe", [pytest.param("svs", marks=shares_run("svs")), "rzero",
                                    pytest.param("rquest", marks=shares_run("rquest")),
                                    pytest.param("wist", marks=shares_run("wist")), "rlvr"])
def test_scripted_recipe_runs_every_stage(recipe, scripted_run):
    run_dir = scripted_run(recipe)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    stages = [key.split("/")[1].split("-", 1)[1] for key in manifest["order"]]
    expected = {
        "svs": ["sample", "solve", "verify", "challenge", "solve-variants", "verify-variants", "filter", "train"],
        "rzero": ["q1-challenge", "q1-solve", "q1-verify", "q1-filter", "q1-train",
                  "s-challenge", "s-solve", "s-verify", "s-pool",
                  "s1-rollout", "s1-verify", "s1-filter", "s1-train"],
        "rquest": ["q1-challenge", "q1-solve-validity", "q1-verify-validity", "q1-solve", "q1-verify",
                   "q1-novelty", "q1-filter", "q1-train", "s-challenge", "s-solve-validity",
                   "s-verify-validity", "s-solve", "s-verify", "s-pool",
                   "s1-rollout", "s1-verify", "s1-filter", "s1-train"],
        "wist": ["tree-expand", "corpus-fetch", "challenge", "solve", "verify", "filter", "train",
                 "posterior-update"],
        "rlvr": ["sample", "solve", "verify", "filter", "train"],
    }[recipe]
    iterations = 2 if recipe in ("svs", "wist", "rlvr") else 1
    # R-Quest's validity initialisation is iteration 0 (no questions: no curriculum health)
    prelude = ["init1-solve", "init1-verify", "init1-filter", "init1-train"] if recipe == "rquest" else []
    assert stages == prelude + (expected + ["health"]) * iterations  # every iteration ends with its health
    for key, entry in manifest["stages"].items():
        path = run_dir / entry["output"]
        assert len(read_jsonl(path)) == entry["records"]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert len(metrics) == len(stages)
    # each stage's pauses for Python's garbage collector (CollectorClock), within its wall time
    assert all(isinstance(line["gc_s"], float) and 0 <= line["gc_s"] <= line["wall_s"] for line in metrics)
    groups = [g for path in run_dir.glob("iter-*/*filter.jsonl") for g in read_jsonl(path)]
    roles = {g["role"] for g in groups}
    trained = [r for path in run_dir.glob("iter-*/*train.jsonl") for r in read_jsonl(path)]
    assert any(r.get("checkpoint") for r in trained)
    # a train step's metrics line says how long it waited for its checkpoint; a deferred one's does not
    waited = {(line["iteration"], line["stage"]): line.get("checkpoint_s") for line in metrics
              if line["kind"] == "train"}
    for path in run_dir.glob("iter-*/*train.jsonl"):
        records = read_jsonl(path)
        step = (int(path.parent.name.split("-")[1]), path.stem.split("-", 1)[1])  # iter-0001/08-train
        if any(r.get("checkpoint") for r in records):
            assert waited[step] >= 0, (step, waited)
        elif all(r.get("deferred") for r in records):
            assert waited[step] is None, (step, waited)
        assert all("checkpoint_s" not in r for r in records)  # the records stay as a resume writes them
    if recipe == "svs":
        # the scripted solver gets 2 of 4 right on "12 + 30", variants share the answer 42
        assert {"solver", "synthesis"} <= roles
        variants = read_jsonl(run_dir / "iter-0001" / "06-verify-variants.jsonl")
        assert variants and all(v["answer"] == "42" for v in variants if v.get("valid"))
        assert (run_dir / "ckpt" / "policy").is_dir() and not (run_dir / "ckpt" / "solver").exists()
    elif recipe == "rlvr":
        # plain RLVR: solver groups only, each from a sampled labelled problem with 0 < Acc < 1
        assert roles == {"solver"} and all(g["recipe"] == "rlvr" for g in groups)
        assert all(min(g["rewards"]) < max(g["rewards"]) for g in groups)
        sampled = [r["id"] for r in read_jsonl(run_dir / "iter-0001" / "01-sample.jsonl")]
        assert {s for g in groups for s in g["source_ids"]} <= set(sampled) | {
            r["id"] for r in read_jsonl(run_dir / "iter-0002" / "01-sample.jsonl")}
        # graded against the reference: the majority vote is not taken (verify.vote = auto)
        verified = [v for v in read_jsonl(run_dir / "iter-0001" / "03-verify.jsonl") if v.get("samples")]
        assert verified and all(v["label_source"] == "reference" and v["majority_frac"] is None for v in verified)
    elif recipe in ("rzero", "rquest"):
        assert "questioner" in roles and "solver" in roles
        # questioner and solver train separate checkpoints
        assert {r["role"] for r in trained if r.get("checkpoint")} == {"questioner", "solver"}
        verified = read_jsonl(run_dir / "iter-0001" / ("03-q1-verify.jsonl" if recipe == "rzero"
                                                         else "05-q1-verify.jsonl"))
        assert all(v["majority"] == "42" for v in verified if v.get("samples"))
        # the --tiny prompts: the direct solver's reply starts at \boxed{ and ends at }, the
        # questioner writes in two steps; groups mark the stop-string ends (train-step adds no EOS)
        assert all(v["solve_prompt"][-1] == {"role": "assistant", "content": "\\boxed{"}
                   for v in verified if v.get("samples"))
        questions = read_jsonl(run_dir / "iter-0001" / "01-q1-challenge.jsonl")
        assert [q["raw"] for q in questions][:2] == ["<question>What is 40 + 2?</question>\n\\boxed{42}",
                                                     "<question>What is 6 * 7?</question>\n\\boxed{42}"]
        solver_groups = [g for g in groups if g["role"] == "solver"]
        assert solver_groups and all(g["stop_strings"] == ["}"] * len(g["completions"]) for g in solver_groups)
        if recipe == "rquest":
            assert "validity" in roles  # replay of the validity-initialisation set
            novelty = read_jsonl(run_dir / "iter-0001" / "06-q1-novelty.jsonl")
            assert any(isinstance(r.get("novelty"), dict) for r in novelty)
    else:
        tree = json.loads((run_dir / "tree.json").read_text())
        assert tree["applied"], "posterior update recorded observations in the tree"
        assert any(m.get("tree") for m in metrics if m["stage"] == "posterior-update")
        # each drawn leaf's round in the metrics (round_leaves): its graded questions and mean p̂
        for m in (m for m in metrics if m["stage"] == "posterior-update"):
            graded = [r for r in read_jsonl(run_dir / f"iter-{m['iteration']:04d}" / "05-verify.jsonl")
                      if r.get("p_hat") is not None]
            rows = [row for row in m["tree"] if "questions" in row]
            assert sum(row["questions"] for row in rows) == len(graded) > 0
            assert all(0.0 <= row["mean_p_hat"] <= 1.0 for row in rows)
            # and the g = 1 observations the posterior update made of them (g = 1(Var >= tau_var))
            update = read_jsonl(run_dir / f"iter-{m['iteration']:04d}" / "08-posterior-update.jsonl")
            assert sum(row["learnable"] for row in rows) == sum(r.get("g") == 1 for r in update)
            assert sum(row["learnable"] for row in rows) == sum(r["var"] >= 0.2 for r in graded if r.get("valid"))
        assert list((run_dir / "pools").glob("*.jsonl")), "per-leaf pools are kept in the run dir"
    # --keep 1: one checkpoint per role is left
    for role_dir in (run_dir / "ckpt").iterdir():
        assert len([p for p in role_dir.iterdir() if p.name.startswith("step-")]) == 1


def test_refuses_a_non_empty_run_dir_without_resume(tmp_path):
    run_dir = tmp_path / "busy"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    result = run_sptool("run", "--recipe", "rzero", "--tiny", "--run-dir", str(run_dir))
    assert result.returncode == 2
    assert "not empty" in result.stderr and "--resume" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert (run_dir / "notes.txt").read_text() == "mine"


def test_svs_without_data_is_a_usage_error(tmp_path, random_policy):
    args = scripted_args("svs", tmp_path / "r", random_policy)
    args = args[:args.index("--data")]
    result = run_sptool(*args, "--set", 'svs.data=""', env=ENV)
    assert result.returncode == 2 and "--data FILE" in result.stderr


# ------------------------------------------------------------------------------ kill and resume

KILL_POINTS = {
    # recipe: [(stage:point), …] — mid-generation, mid-verify, mid-save (stage output and checkpoint)
    "rquest": ["init1-train:checkpoint", "q1-solve-validity:mid", "q1-verify:mid", "q1-train:checkpoint",
               "s1-filter:save"],
    "svs": ["2/solve:mid", "2/train:checkpoint"],
}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [pytest.param("rquest", marks=shares_run("rquest")),
                                    pytest.param("svs", marks=shares_run("svs"))])
def test_sigkill_then_resume_equals_uninterrupted_run(recipe, tmp_path, random_policy, scripted_run):
    reference = scripted_run(recipe)
    killed = tmp_path / "killed"
    for point in KILL_POINTS[recipe]:
        args = scripted_args(recipe, killed, random_policy)
        if (killed / "manifest.json").exists():
            args.append("--resume")
        result = run_sptool(*args, env={**ENV, "SPTOOL_TEST_KILL_AT": point})
        # SIGKILL from the driver's hook, or exit 137 from the checkpoint writer's crash hook
        assert result.returncode in (-signal.SIGKILL, 137), (point, result.returncode, result.stderr)
    result = run_sptool(*scripted_args(recipe, killed, random_policy), "--resume", env=ENV)
    assert result.returncode == 0, result.stderr
    assert stage_outputs(killed) == stage_outputs(reference)
    assert checkpoint_weights(killed) == checkpoint_weights(reference)
    assert not [p for p in killed.rglob(".*") if ".part" in p.name or "sptool-tmp" in p.name]
    ref_metrics = stable_metrics(reference)
    got_metrics = stable_metrics(killed)
    assert got_metrics == ref_metrics  # no lost or duplicated lines


@pytest.mark.slow
def test_kill_between_checkpoints_replays_the_train_steps_since_the_last_one(tmp_path, random_policy):
    """run.checkpoint_every = 3 over 4 iterations: checkpoints after iterations 3 and 4 only. Killed
    in iteration 3 (iterations 1 and 2 trained, no checkpoint yet) and again in iteration 4 (after
    the background-written checkpoint of iteration 3), the resumed run trains 1 and 2 again from
    their recorded groups and ends with the uninterrupted run's outputs and weights."""
    extra = ("-n", "4", "--set", "run.checkpoint_every=3", "--keep", "0")
    reference = tmp_path / "reference"
    result = run_sptool(*scripted_args("svs", reference, random_policy, *extra), env=ENV)
    assert result.returncode == 0, result.stderr
    trained = {path.parent.name: read_jsonl(path)[0] for path in sorted(reference.glob("iter-*/*-train.jsonl"))}
    assert [bool(r["checkpoint"]) for r in trained.values()] == [False, False, True, True]
    assert [r.get("deferred", False) for r in trained.values()] == [True, True, False, False]
    assert sorted(p.name for p in (reference / "ckpt" / "policy").iterdir()) == ["step-0003", "step-0004"]
    killed = tmp_path / "killed"
    args = scripted_args("svs", killed, random_policy, *extra)
    args.remove("-q")
    result = run_sptool(*args, env={**ENV, "SPTOOL_TEST_KILL_AT": "3/solve:mid"})
    assert result.returncode == -signal.SIGKILL and not (killed / "ckpt").exists()
    result = run_sptool(*args, "--resume", env={**ENV, "SPTOOL_TEST_KILL_AT": "4/solve:mid"})
    assert result.returncode == -signal.SIGKILL
    assert "iter-0001/08-train: training again" in result.stderr
    assert "iter-0002/08-train: training again" in result.stderr
    # the kill may land before the background writer of iteration 3's checkpoint has finished
    written = (killed / "ckpt" / "policy" / "step-0003" / "sptool_state" / "state.json").is_file()
    result = run_sptool(*args, "--resume", env=ENV)
    assert result.returncode == 0, result.stderr
    assert ("iter-0001/08-train: training again" in result.stderr) is not written
    assert ("iter-0003/08-train: training again" in result.stderr) is not written
    assert stage_outputs(killed) == stage_outputs(reference)
    assert checkpoint_weights(killed) == checkpoint_weights(reference)


@pytest.mark.slow
@shares_run("svs")
def test_resume_trains_again_the_steps_after_the_newest_checkpoint(tmp_path, random_policy, scripted_run):
    """Killed in iteration 2 of 2 with no checkpoint written yet (iteration 1 deferred): resume
    replays iteration 1's train step, says so, and matches the uninterrupted run."""
    reference = scripted_run("svs")
    killed = tmp_path / "killed"
    result = run_sptool(*scripted_args("svs", killed, random_policy),
                        env={**ENV, "SPTOOL_TEST_KILL_AT": "2/train:train-done"})
    assert result.returncode == -signal.SIGKILL
    assert not (killed / "ckpt").exists()
    args = scripted_args("svs", killed, random_policy)
    args.remove("-q")
    result = run_sptool(*args, "--resume", env=ENV)
    assert result.returncode == 0, result.stderr
    assert "iter-0001/08-train: training again from the newest checkpoint (policy)" in result.stderr
    assert stage_outputs(killed) == stage_outputs(reference)
    assert checkpoint_weights(killed) == checkpoint_weights(reference)


def test_resume_refuses_changed_configuration(tmp_path, random_policy):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    from sptool.recipes import load_config
    from sptool.recipes import build_run

    config = load_config("rzero", tiny=True)
    driver = build_run(config, run_dir)
    driver._prepare_dir()
    changed = load_config("rzero", tiny=True, sets=["samples=6"])
    from sptool.core.records import UsageError

    with pytest.raises(UsageError, match="rzero.samples"):
        build_run(changed, run_dir, resume=True)._prepare_dir()
    more = load_config("rzero", tiny=True, sets=["run.iterations=3"])
    build_run(more, run_dir, resume=True)._prepare_dir()  # more iterations is fine


def test_resume_accepts_a_run_saved_before_a_key_existed(tmp_path):
    """A run directory written before the [eval] section existed resumes when the new keys keep
    their defaults, and is refused when one is set."""
    from sptool.recipes import load_config
    from sptool.recipes import build_run
    from sptool.run.driver import MANIFEST
    from sptool.core.records import UsageError

    run_dir = tmp_path / "r"
    build_run(load_config("svs", tiny=True), run_dir)._prepare_dir()
    manifest = json.loads((run_dir / MANIFEST).read_text())
    del manifest["config"]["eval"]
    del manifest["config"]["svs"]["format_weight"]
    (run_dir / MANIFEST).write_text(json.dumps(manifest))
    build_run(load_config("svs", tiny=True), run_dir, resume=True)._prepare_dir()
    (run_dir / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(UsageError, match="eval.every"):
        build_run(load_config("svs", tiny=True, sets=["eval.every=2"]), run_dir, resume=True)._prepare_dir()


# ------------------------------------------------------------------------------ report

@pytest.mark.slow
@shares_run("wist")
def test_report_writes_pngs_and_summary(tmp_path, scripted_run):
    run_dir = tmp_path / "wist"
    shutil.copytree(scripted_run("wist"), run_dir)  # the report writes into the run directory
    assert not (run_dir / "report").exists()
    result = run_sptool("report", str(run_dir))
    assert result.returncode == 0, result.stderr
    written = {p.name for p in (run_dir / "report").glob("*.png")}
    assert {"rewards.png", "accuracy.png", "validity_novelty.png", "diversity.png",
            "tree_posteriors.png"} <= written
    for name in written:
        assert (run_dir / "report" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "recipe wist, 2 iteration(s)" in result.stdout
    assert "rewards: solver:" in result.stdout and "tree posterior" in result.stdout


@pytest.mark.slow
def test_held_out_eval_before_during_and_after_the_run(tmp_path, random_policy):
    """``--eval``: greedy, mean@k and pass@k of the current weights before iteration 1 and after
    every ``--eval-every`` iterations, in metrics.jsonl and the report's heldout.png."""
    bench = tmp_path / "held_out.jsonl"
    bench.write_text('{"id": "h1", "question": "What is 12 + 30?", "answer": "42"}\n'
                     '{"id": "h2", "question": "What is 90 + 90?", "answer": "180"}\n')
    run_dir = tmp_path / "svs"
    result = run_sptool(*scripted_args("svs", run_dir, random_policy), "--eval", str(bench),
                        "--eval-every", "1", env=ENV)
    assert result.returncode == 0, result.stderr
    manifest = json.loads((run_dir / "manifest.json").read_text())
    stages = [key.split("/")[1].split("-", 1)[1] for key in manifest["order"]]
    assert stages[0] == "eval-before" and stages.count("eval") == 2 and stages[-2:] == ["eval", "health"]
    evals = [line for line in read_jsonl(run_dir / "metrics.jsonl") if line["kind"] == "eval"]
    assert [line["after_iteration"] for line in evals] == [0, 1, 2]
    # the scripted solver's samples cycle 42, 180, 42, 7 and its greedy answer is the first, 42:
    # h1 2/4 right, h2 1/4; mean@4 = pass@1 = (1/2 + 1/4)/2; pass@4 = 1; greedy 1 of 2
    for line in evals:
        assert line["benchmarks"]["held_out"] == pytest.approx(
            {"greedy": 0.5, "answered": 1.0, "mean@k": 0.375, "pass@1": 0.375, "pass@4": 1.0})
    result = run_sptool("report", str(run_dir))
    assert result.returncode == 0, result.stderr
    assert (run_dir / "report" / "heldout.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "heldout: held_out greedy: 0.500 (iter 0) -> 0.500 (iter 2)" in result.stdout


def test_collector_clock_times_the_garbage_collections_inside_it():
    import gc

    from sptool.run.driver import CollectorClock

    clock = CollectorClock()
    with clock:
        gc.collect()
    after = clock.seconds
    gc.collect()  # outside: not counted, and the callback is gone
    assert after > 0 and clock.seconds == after and clock not in gc.callbacks


def test_a_later_step_copies_an_output_from_the_lines_written_for_it(cli, tmp_path, random_policy, monkeypatch):
    """The driver keeps each step's JSONL lines as the run directory wrote them: a later step's copy
    of that output is parsed from them (what a resumed run reads back), fresh records each time,
    and the records are not serialised a second time for it."""
    from sptool.run import steps as steps_module

    serialised, copied = [], []
    monkeypatch.setattr(steps_module, "json_copy", lambda records: serialised.append(len(records)))
    copy = steps_module.WrittenOutput.copy

    def watched(self):
        records = copy(self)  # the stage that asked may change them: compared as they are now
        fresh = all(mine is not kept for mine, kept in zip(records, self.records))
        copied.append((json.dumps(records), json.dumps(self.records), fresh, self.lines))
        return records

    monkeypatch.setattr(steps_module.WrittenOutput, "copy", watched)
    run_dir = tmp_path / "rlvr"
    result = cli(scripted_args("rlvr", run_dir, random_policy))
    assert result.exit_code == 0, result.stderr
    assert serialised == [] and len(copied) >= 6  # solve, verify and filter copy their input, twice
    written = {path.read_text(encoding="utf-8") for path in run_dir.glob("iter-*/*.jsonl")}
    for records, kept, fresh, lines in copied:
        assert "".join(line + "\n" for line in lines) in written
        assert json.loads(records) == json.loads(kept) and fresh


def test_gc_freeze_after_the_first_iteration_by_default(cli, tmp_path, random_policy, monkeypatch):
    """``run.gc_freeze`` (on by default): once the first iteration has loaded everything, one
    collection and ``gc.freeze()``, and ``gc.unfreeze()`` when the run ends; off, neither."""
    import gc

    calls = []
    freeze, unfreeze = gc.freeze, gc.unfreeze
    monkeypatch.setattr(gc, "freeze", lambda: (calls.append(("freeze", sorted(p.name for p in run_dir.glob("iter-*")))),
                                               freeze()))
    monkeypatch.setattr(gc, "unfreeze", lambda: (calls.append(("unfreeze", gc.get_freeze_count() > 0)), unfreeze()))
    run_dir = tmp_path / "rlvr"
    result = cli(scripted_args("rlvr", run_dir, random_policy))
    assert result.exit_code == 0, result.stderr
    assert calls == [("freeze", ["iter-0001"]), ("unfreeze", True)] and gc.get_freeze_count() == 0
    assert {line["iteration"] for line in read_jsonl(run_dir / "metrics.jsonl")} == {1, 2}
    calls.clear()
    run_dir = tmp_path / "rlvr-unfrozen"
    result = cli(scripted_args("rlvr", run_dir, random_policy, "--set", "run.gc_freeze=false"))
    assert result.exit_code == 0, result.stderr
    assert calls == [] and (run_dir / "iter-0002").is_dir()


def test_bad_held_out_benchmark_fails_before_the_run_starts(tmp_path, random_policy):
    bench = tmp_path / "bench.jsonl"
    bench.write_text('{"question": "What is 1 + 1?", "answer": "2"}\n{"question": "What is 2 + 2?"}\n')
    run_dir = tmp_path / "svs"
    result = run_sptool(*scripted_args("svs", run_dir, random_policy), "--eval", str(bench), env=ENV)
    assert result.returncode == 2
    assert f"{bench}:2: field 'answer'" in result.stderr and "Traceback" not in result.stderr
    assert not run_dir.exists()


def test_report_on_a_non_run_dir_is_a_usage_error(tmp_path):
    result = run_sptool("report", str(tmp_path))
    assert result.returncode == 2 and "metrics.jsonl" in result.stderr


def test_report_series_average_per_iteration():
    from sptool.run.report import series

    lines = [{"iteration": 1, "stage": "q1-filter", "kind": "filter", "mean_reward": {"questioner": 0.2}},
             {"iteration": 1, "stage": "s-filter", "kind": "filter", "mean_reward": {"questioner": 0.4, "solver": 1.0}},
             {"iteration": 2, "stage": "s-verify", "kind": "verify", "accuracy": 0.5},
             {"iteration": 2, "stage": "novelty", "kind": "novelty", "novel_rate": 0.25}]
    result = series(lines)
    assert result["rewards"]["questioner"][1] == pytest.approx(0.3)
    assert result["rewards"]["solver"][1] == 1.0
    assert result["accuracy"]["verify"][2] == 0.5
    assert result["validity"]["novelty rate"][2] == 0.25


# ------------------------------------------------------------------------------ real tiny model

@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["rzero", "svs", "rquest", "wist", "rlvr"])
def test_tiny_recipe_completes_with_the_real_model(recipe, tmp_path):
    if os.environ.get("SPTOOL_SKIP_TINY_RUNS"):
        pytest.skip("SPTOOL_SKIP_TINY_RUNS set")
    run_dir = tmp_path / recipe
    extra = []
    if recipe == "rlvr":  # its problems from a `datasets` save_to_disk directory (a DatasetDict)
        from test_problemsets import save_to_disk

        data = str(save_to_disk(tmp_path / "hf-layout-dir", read_jsonl(FIXTURES / "addition_small_train.jsonl"),
                                split="train"))
        extra = ["--data", data]
    start = time.monotonic()
    # 1,024 tokens a micro-batch, not the default 4,096: on the CPU the tiny model's activations take
    # about 1.3 MB a token, and WIST's train stage peaked at 9.6 GB with the default (4.2 GB so, and
    # faster); twice in one session's CI, beside the parallel worker's tests, the OOM killer took it
    result = run_sptool("run", "--recipe", recipe, "--tiny", "--run-dir", str(run_dir), "--keep", "1",
                        "--set", "run.iterations=1", "--set", "train.max_tokens_per_micro_batch=1024", *extra,
                        env=ENV, timeout=900)
    wall = time.monotonic() - start
    assert result.returncode == 0, result.stderr
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["order"][-1].endswith("-health")
    assert manifest["order"][-2].endswith("train") or manifest["order"][-2].endswith("posterior-update")
    # the algorithm did its job, not just finished: every role trained on at least one group
    # with a learning signal (a non-zero advantage) in every iteration (R-Quest: also in the
    # validity initialisation, iteration 0)
    from sptool.run.report import load_metrics, outcome_counts, question_outcomes, training_signal

    lines, _ = load_metrics(run_dir)
    signal = training_signal(lines)
    roles = {"rzero": {"questioner", "solver"}, "rquest": {"questioner", "solver"}}.get(recipe, {"policy"})
    assert set(signal) == ({0, 1} if recipe == "rquest" else {1}), signal
    for iteration, counts in signal.items():
        assert set(counts) == ({"solver"} if iteration == 0 else roles), (iteration, counts)
        assert all(count >= 1 for count in counts.values()), (iteration, counts)
    report = run_sptool("report", str(run_dir), "-q", env=ENV, timeout=300)
    assert report.returncode == 0, report.stderr
    assert "training groups with a non-zero advantage, iteration 1" in report.stdout
    if recipe != "rlvr":
        # the questioner (challenger, synthesis) writes questions of the required shape, and
        # they reach the gates and the solver
        steps = question_outcomes(run_dir)
        page = (run_dir / "report" / "questions.md").read_text()
        assert all(" ".join(row["question"].split())[:40] in page for row in steps[0]["questions"][:6])
        totals = {}
        for step in steps:
            for name, value in outcome_counts(step).items():
                totals[name] = totals.get(name, 0) + value
        assert totals["kept"] > 0, totals
        if recipe in ("rzero", "rquest"):
            assert totals["well-formed"] >= totals["proposed"] / 2, totals
        if recipe == "rquest":  # the validity gate rejects some questions, and some pass both gates
            assert totals["validity gate: rejected"] > 0, totals
            assert sum(outcome_counts(step)["kept"] for step in steps if "-q" in step["step"]) > 0, totals
            assert "rejected: validity gate" in page
            # the novelty gate judged every well-formed question of the questioner's step, each against
            # min(K, n - 1) of the others. Whether 8 sampled word problems hold a near-copy is chance
            # (the lexical judge's rejection of a reused template: test_novelty.py)
            judged = read_jsonl(next((run_dir / "iter-0001").glob("*-q1-novelty.jsonl")))
            formed = [r for r in judged if r.get("valid", True) and r.get("question")]
            assert formed and all(isinstance(r.get("novelty"), dict) and r["novelty"]["judge"] == "lexical" and
                                  len(r["novelty"]["compared"]) == min(8, len(formed) - 1) for r in formed), judged
            if totals["novelty gate: rejected"]:
                assert "rejected: novelty gate" in page
            print(f"\nrquest --tiny gates: {totals}")
    if recipe == "rlvr":  # the finished run exported, then loaded by transformers and by `sptool solve`
        from test_problemsets import check_export

        exported = check_export(run_dir, tmp_path, data, curve=False)
        solved = run_sptool("solve", str(FIXTURES / "questions.jsonl"), "-m", str(exported), "-k", "1",
                            "--prompt", "direct", "--max-tokens", "4", "-q", env=ENV, timeout=300)
        assert solved.returncode == 0, solved.stderr
        records = read_jsonl(solved.stdout)
        assert records and all(len(r["samples"]) == 1 for r in records)
    print(f"\n{recipe} --tiny (1 iteration): {wall:.0f}s")


@pytest.mark.parametrize("iteration, unsaved, written", [
    (2, True, True),    # the last iteration trained nothing: the earlier deferred updates are written
    (1, True, False),   # not due yet (checkpoint_every 10): they wait for the last iteration
    (2, False, False),  # nothing new since the last checkpoint: no second copy
])
def test_last_iteration_without_groups_still_writes_the_deferred_updates(iteration, unsaved, written):
    from types import SimpleNamespace

    from sptool.run.session import Policy, Session

    session = object.__new__(Session)
    session.replaying = None
    session.config = {"model": {"backend": "hf"}, "run": {"checkpoint_every": 10, "iterations": 2}}
    session.settings = SimpleNamespace(model=SimpleNamespace(backend="hf"),
                                       run=SimpleNamespace(checkpoint_every=10, iterations=2))
    policy = object.__new__(Policy)
    policy._trainer = SimpleNamespace(step=3)
    policy.saved_step = 2 if unsaved else 3
    session.policies = {"policy": policy}
    calls = []
    session._checkpoint = lambda ctx, role, p, trainer, record: calls.append((role, trainer.step))
    out = session._train(SimpleNamespace(iteration=iteration), [], ["policy"], 1)
    assert out[0]["skipped"] == "no training groups"
    assert calls == ([("policy", 3)] if written else [])


def test_background_checkpoint_copy_keeps_tied_weights_tied(tmp_path):
    """The CPU copy behind background checkpoints keeps tied embeddings as one tensor, so the
    checkpoint has the same tensors as ``save_pretrained`` (it wrote a second, untied lm_head)."""
    import torch
    from safetensors import safe_open
    from transformers import LlamaConfig, LlamaForCausalLM

    from sptool.run.checkpoints import _cpu_copy

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    copy = _cpu_copy(model.state_dict())
    assert copy["lm_head.weight"] is copy["model.embed_tokens.weight"]
    model.save_pretrained(tmp_path / "copy", state_dict=copy, safe_serialization=True)
    model.save_pretrained(tmp_path / "plain")
    keys = {}
    for name in ("copy", "plain"):
        with safe_open(str(tmp_path / name / "model.safetensors"), "pt") as handle:
            keys[name] = set(handle.keys())
    assert keys["copy"] == keys["plain"]
    from sptool.run.checkpoints import _pin_snapshots

    assert not _pin_snapshots(model.state_dict(), {"state": {0: {"exp_avg": torch.zeros(2)}}})  # CPU: no CUDA call


@pytest.mark.gpu
def test_pinned_checkpoint_copy_equals_the_device_tensors():
    """On CUDA the background checkpoint's copy goes through page-locked memory without waiting
    per tensor: after the one synchronize the copies equal the device's tensors, tied ones stay tied."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from sptool.run.checkpoints import _cpu_copy, _pin_snapshots

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).cuda()
    state = model.state_dict()
    assert _pin_snapshots(state)
    copy = _cpu_copy(state, pinned=True)
    torch.cuda.synchronize()
    assert copy["lm_head.weight"] is copy["model.embed_tokens.weight"]
    for name, tensor in state.items():
        assert copy[name].is_pinned() and copy[name].device.type == "cpu"
        assert torch.equal(copy[name], tensor.cpu()), name


@pytest.mark.slow
@shares_run("svs")
def test_config_toml_records_each_stage_precision_and_reads_back(scripted_run):
    """config.toml ends with the precision of the sampler, trainer and reference on this machine
    (a comment: the file still loads as --config)."""
    run_dir = scripted_run("svs")
    text = (run_dir / "config.toml").read_text()
    comment = text[text.index("# precision on this machine"):].splitlines()
    assert comment[1:] == ["# sampler = none (the scripted backend replays its script)", "# trainer = float32, log π_old from the sampler (train.old_logprobs)",
                           "# reference = none (beta = 0)", "# device = cpu"]
    shown = run_sptool("recipes", "show", "svs", "--config", str(run_dir / "config.toml"), env=ENV)
    assert shown.returncode == 0, shown.stderr
    assert 'mixed_precision = "auto"' in shown.stdout


@pytest.mark.parametrize("setting, start, restores", [
    ("fresh", "elsewhere/ckpt/policy/step-0010", False),   # another run's checkpoint: new moments
    ("restore", "elsewhere/ckpt/policy/step-0010", True),
    ("fresh", "run/ckpt/solver/step-0003", True),           # this run's own (resume, R-Quest's restart)
    ("fresh", "tiny", False),
])
def test_a_run_from_another_runs_checkpoint_starts_a_fresh_optimizer(tmp_path, setting, start, restores):
    """A label-free arm that restored its rlvr start's AdamW moments went on along the labelled
    direction for some ten updates whatever its rewards: its random-label control gained +0.13 and
    +0.17. ``train.start_optimizer`` (default fresh) decides for another run's checkpoint; a run's
    own checkpoints are always restored."""
    from types import SimpleNamespace

    from sptool.run.session import Policy

    (tmp_path / "run").mkdir()
    session = SimpleNamespace(settings=SimpleNamespace(train=SimpleNamespace(start_optimizer=setting)),
                              run_dir=SimpleNamespace(path=tmp_path / "run"))
    where = str(tmp_path / start) if "/" in start else start
    assert Policy(session, "solver", where).restores_optimizer() is restores



@pytest.mark.slow
def test_a_given_wist_tree_keeps_its_own_cap_on_children(tmp_path, random_policy):
    """``wist.max_children`` at its default (0) takes a given tree's cap: a tree whose nodes are full
    at 3 draws no unk, so it grows no node. The old default (8) overrode the cap, and a round on
    the benchmark's arithmetic tree drew unks and grew "Adistance". A set value still overrides."""
    from sptool.stages.tree import load_tree
    from sptool.stages.tree.document import add_node, new_tree

    tree = new_tree("Arithmetic", max_depth=3, max_children=3, children=["Addition", "Subtraction", "Multiplication"])
    domain = tree["nodes"][tree["root"]]["children"][0]
    for operation in list(tree["nodes"][domain]["children"]):
        if not tree["nodes"][operation]["is_unk"]:
            for digits in ("One-digit", "Two-digit", "Three-digit"):
                add_node(tree, operation, f"{digits} {tree['nodes'][operation]['label'].lower()}")
    (tmp_path / "tree.json").write_text(json.dumps(tree))
    nodes = {i for i, node in tree["nodes"].items() if not node["is_unk"]}

    def grown(*extra: str) -> dict:
        run_dir = tmp_path / f"run{len(extra)}"
        result = run_sptool(*scripted_args("wist", run_dir, random_policy, "-n", "1", "--set",
                                           f'wist.tree="{tmp_path / "tree.json"}"', "--set", "wist.paths=6", *extra),
                            env=ENV, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        return load_tree(sorted(run_dir.glob("iter-0001/*tree-expand*.json"))[-1])

    kept = grown()
    assert kept["max_children"] == 3
    assert {i for i, node in kept["nodes"].items() if not node["is_unk"]} == nodes
    assert all(not kept["nodes"][p[-1]]["is_unk"] and kept["nodes"][p[-1]]["depth"] == 3
               for p in kept["paths"].values())
    assert grown("--set", "wist.max_children=5")["max_children"] == 5
