"""Self-play as the papers run it: R-Quest's validity initialisation (iteration 0), per-role start
checkpoints, fresh solver rollouts per step from the round's pool (with their sampling
log-probabilities), the replay share inside every solver update, WIST's updates per rollout, and
the importance ratio on a second update from the same rollout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import FIXTURES, read_jsonl, run_sptool
from test_run import ENV, scripted_args


def state_of(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "sptool_state" / "state.json").read_text())


def only_checkpoint(run_dir: Path, name: str) -> Path:
    (directory,) = [p for p in (run_dir / "ckpt" / name).iterdir() if p.name.startswith("step-")]
    return directory


# ------------------------------------------------------------------------------ pure parts

def test_walk_draws_successive_batches_through_seeded_permutations():
    from sptool.recipes.rzero import walk

    items = list(range(10))
    seed_of = lambda epoch: 100 + epoch  # noqa: E731
    first, second = walk(items, 4, 0, seed_of), walk(items, 4, 1, seed_of)
    assert len(set(first)) == 4 and len(set(second)) == 4 and set(first).isdisjoint(second)
    epoch = walk(items, 5, 0, seed_of) + walk(items, 5, 1, seed_of)
    assert sorted(epoch) == items                      # every item once per epoch
    assert walk(items, 4, 0, seed_of) == first         # deterministic
    assert walk(items, 4, 0, lambda e: 7 + e) != first  # another seed, another order


def test_replay_count_is_the_share_of_each_update():
    from sptool.filter.pseudo_label import interleave
    from sptool.recipes.rzero import replay_count

    share = 0.1
    for batch, pool_draws, replayed in ((512, 461, 51), (10, 9, 1), (4, 3, 1)):
        n = batch - replay_count(batch, share)
        assert (n, replay_count(n, share / (1 - share))) == (pool_draws, replayed)
    assert replay_count(100, 0.0) == 0
    mixed = interleave(list("abcdefghi"), ["R"])
    assert mixed.index("R") not in (0, len(mixed) - 1) and sorted(mixed) == sorted("abcdefghiR")


def test_validity_init_phase_is_planned_unless_skipped(tmp_path):
    from sptool.recipes import load_config
    from sptool.recipes.rzero import RQuest
    from sptool.run.run_dir import RunDir
    from sptool.run.session import Session

    def prelude(*sets):
        config = load_config("rquest", tiny=True, sets=sets)
        return [step.name for step in RQuest(config, Session(config, RunDir(tmp_path))).prelude()]

    assert prelude() == ["init1-solve", "init1-verify", "init1-filter", "init1-train"]
    assert len(prelude("init_steps=3")) == 12
    assert prelude("rquest.validity_init=false") == []
    assert prelude("model.solver=ckpt/my-solver") == []   # a user's initialised solver


def test_per_role_start_needs_two_roles():
    result = run_sptool("recipes", "show", "svs", "--set", "model.solver=x")
    assert result.returncode == 2 and "model.solver" in result.stderr and "shared_policy" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_recipes_show_explain_cites_the_paper_scale_defaults(cli):
    """The paper-scale defaults, each with its source (the setting's own ``source``)."""
    def sections(text: str) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        section = ""
        for line in text.splitlines():
            if line.startswith("["):
                section = line.strip("[]")
            elif "=" in line and section:
                out.setdefault(section, {})[line.split("=", 1)[0].strip()] = line
        return out

    shown = sections(cli(["recipes", "show", "rquest", "--explain"]).stdout)
    rquest = shown["rquest"]
    assert rquest["solver_questions"].startswith("solver_questions = 10000") and "10,000" in rquest["solver_questions"]
    assert rquest["questions"].startswith("questions = 2048") and "2,048" in rquest["questions"]
    assert rquest["solver_rollouts"].startswith("solver_rollouts = 5") and "solver 5 条" in rquest["solver_rollouts"]
    assert rquest["solver_batch"].startswith("solver_batch = 512") and "rollout 批 512" in rquest["solver_batch"]
    assert rquest["init_steps"].startswith("init_steps = 15") and "15 步" in rquest["init_steps"]
    assert rquest["init_batch"].startswith("init_batch = 512") and "批内 512 题" in rquest["init_batch"]
    assert rquest["init_samples"].startswith("init_samples = 8") and "每题 8 条回答" in rquest["init_samples"]
    assert "0.99" in rquest["init_top_p"] and "top-p 0.99" in rquest["init_top_p"]
    assert "10%" in rquest["replay_share"] and rquest["validity_init"].startswith("validity_init = true")
    assert "R-Quest" in shown["model"]["solver"] and "R-Quest" in shown["model"]["questioner"]
    rzero = sections(cli(["recipes", "show", "rzero", "--explain"]).stdout)["rzero"]
    assert rzero["solver_questions"].startswith("solver_questions = 10000") and "10,000" in rzero["solver_questions"]
    wist = sections(cli(["recipes", "show", "wist", "--explain"]).stdout)
    assert wist["wist"]["train_batch"].startswith("train_batch = 512") and "B_train" in wist["wist"]["train_batch"]
    assert wist["generation"]["max_tokens"].startswith("max_tokens = 8192")
    svs = sections(cli(["recipes", "show", "svs"]).stdout)
    assert svs["generation"]["max_tokens"].startswith("max_tokens = 8192")
    # the recipe file says where the values of shared sections come from (recipes show --source)
    assert "8,192" in cli(["recipes", "show", "svs", "--source"]).stdout
    tiny = sections(cli(["recipes", "show", "rquest", "--tiny"]).stdout)["rquest"]
    assert tiny["solver_questions"] == "solver_questions = 8" and tiny["init_steps"] == "init_steps = 1"


# ------------------------------------------------------------------------------ behaviour policy

def test_second_update_from_one_rollout_has_ratio_off_one_and_clips(random_policy):  # noqa: F811
    """The backend's sampling log-probabilities are the trainer's log π_old: the first update from
    a rollout has ratio 1; after it the weights moved, so a second update from the same rollout
    has ratio ≠ 1 and the clipped branch engages."""
    import torch

    from sptool.models.base import SamplingParams
    from sptool.models.hf import HFBackend
    from sptool.train.losses import selected_logprobs
    from sptool.train.step import PolicyTrainer, TrainConfig

    trainer = PolicyTrainer(TrainConfig(model=random_policy, loss="grpo", learning_rate=0.05))
    model = trainer.accelerator.unwrap_model(trainer.model)
    backend = HFBackend.from_model(model, trainer.tokenizer, model_id=random_policy, batch_size=8)
    prompt = [{"role": "user", "content": "What is 2 + 3?"}]
    texts = ["The answer is 5.", "It is 6.", "5", "I think the answer is 7."]
    # a rollout whose sampling log-probs come from the backend (greedy-free sampling, logprobs on)
    samples = backend.generate([prompt], 4, SamplingParams(max_new_tokens=12, logprobs=True, seed=3))[0]
    rendered = trainer.tokenizer(backend.render(prompt), add_special_tokens=False)["input_ids"]
    for sample in samples:  # the backend's log-probs are the model's own, token by token
        ids = torch.tensor([rendered + sample.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(rendered) - 1:-1]
        expected = selected_logprobs(logits, torch.tensor(sample.token_ids))
        assert torch.allclose(torch.tensor(sample.logprobs), expected, atol=1e-4)
    # texts that re-tokenise exactly, scored by the same weights, as the rollout to train on
    old = []
    for text in texts:
        ids = trainer.tokenizer(text, add_special_tokens=False)["input_ids"] + [trainer.eos_id()]
        full = torch.tensor([rendered + ids])
        with torch.no_grad():
            logits = model(input_ids=full).logits[0, len(rendered) - 1:-1]
        old.append(selected_logprobs(logits, torch.tensor(ids)).tolist())
    group = {"role": "solver", "prompt": prompt, "completions": texts, "rewards": [1.0, 0.0, 1.0, 0.0],
             "old_logprobs": old, "finish_reasons": ["stop"] * 4}
    first = trainer.update([group])
    assert first["old_logprob_mismatches"] == 0
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and first["clip_fraction"] == 0.0
    second = trainer.update([group])
    assert abs(second["ratio_mean"] - 1.0) > 1e-3
    assert second["clip_fraction"] > 0


def test_completions_without_sampling_logprobs_get_a_behaviour_ratio(random_policy):  # noqa: F811
    """A rollout whose completions carry no sampling log-probs (the two-phase questioner's
    replies, a backend that returns none) is scored by the policy before its first update, so the
    second update from it has ratio ≠ 1 and clips; without that it fell back to ratio 1."""
    from sptool.train.step import PolicyTrainer, TrainConfig

    texts = ["The answer is 5.", "It is 6.", "5", "I think the answer is 7."]
    prompt = [{"role": "user", "content": "What is 2 + 3?"}]
    group = {"role": "solver", "prompt": prompt, "completions": texts, "rewards": [1.0, 0.0, 1.0, 0.0],
             "finish_reasons": ["stop"] * 4}
    # one completion keeps its recorded log-probs: only the missing ones are scored
    trainer = PolicyTrainer(TrainConfig(model=random_policy, loss="grpo", learning_rate=0.05))
    recorded = trainer.logprobs(trainer.encode_group(group))[0]
    scored = {**group, "old_logprobs": [[x - 0.5 for x in recorded], None, None, None]}
    assert trainer.fill_old_logprobs([scored]) == 3
    assert scored["old_logprobs"][0] == [x - 0.5 for x in recorded]
    first = trainer.update([scored])
    assert first["old_logprob_mismatches"] == 0 and first["clip_fraction"] > 0  # the recorded one is off
    second = trainer.update([scored])
    assert abs(second["ratio_mean"] - 1.0) > 1e-3 and second["clip_fraction"] > 0
    # without scoring, the same two updates have ratio 1 throughout
    plain = PolicyTrainer(TrainConfig(model=random_policy, loss="grpo", learning_rate=0.05))
    plain.update([dict(group)])
    assert plain.update([dict(group)])["ratio_mean"] == pytest.approx(1.0, abs=1e-6)


# ------------------------------------------------------------------------------ scripted runs

@pytest.mark.slow
def test_rquest_validity_init_fresh_rollouts_and_replay(tmp_path, random_policy):  # noqa: F811
    run_dir = tmp_path / "rquest"
    result = run_sptool(*scripted_args("rquest", run_dir, random_policy), "--set", "init_steps=2",
                        "--set", "solver_questions=15", "--set", "solver_batch=10", "--set", "solver_steps=2",
                        "--set", "solver_rollouts=4", env=ENV)
    assert result.returncode == 0, result.stderr
    init = run_dir / "iter-0000"
    assert sorted(p.name for p in init.glob("*.jsonl")) == [
        "01-init1-solve.jsonl", "02-init1-verify.jsonl", "03-init1-filter.jsonl", "04-init1-train.jsonl",
        "05-init2-solve.jsonl", "06-init2-verify.jsonl", "07-init2-filter.jsonl", "08-init2-train.jsonl"]
    init_groups = read_jsonl(init / "03-init1-filter.jsonl")
    assert init_groups and {g["role"] for g in init_groups} == {"validity"}
    assert all(len(g["completions"]) == 2 for g in init_groups)          # tiny init_samples
    assert all(len(g["old_logprobs"]) == 2 for g in init_groups)
    solved = read_jsonl(init / "01-init1-solve.jsonl")
    assert {r["mode"] for r in solved} == {"validity"} and len(solved) == 4   # tiny init_batch
    (last_init,) = read_jsonl(init / "08-init2-train.jsonl")
    assert last_init["restart"] is True and last_init["checkpoint"].startswith("ckpt/solver-init/")
    # the self-play solver starts from the initialised solver, which is its KL reference; the
    # questioner starts from the base model
    init_ckpt = only_checkpoint(run_dir, "solver-init")
    solver_state = state_of(only_checkpoint(run_dir, "solver"))
    assert Path(solver_state["reference_model"]) == init_ckpt.resolve()
    assert solver_state["step"] == 4                                   # 2 init + 2 self-play updates
    questioner_state = state_of(only_checkpoint(run_dir, "questioner"))
    assert questioner_state["base_model"] == str(Path(random_policy).resolve()) and questioner_state["step"] == 1

    it = run_dir / "iter-0001"
    pool = read_jsonl(next(it.glob("*-s-pool.jsonl")))
    voting = {r["id"]: r for r in read_jsonl(next(it.glob("*-s-verify.jsonl")))}
    # the questions past the validity gate with a majority (of 15 candidates), labelled with it
    assert 9 < len(pool) <= 15 and all(r["answer"] == voting[r["id"]]["majority"] for r in pool)
    assert all(voting[r["id"]]["verdicts"]["validity"]["invalid_frac"] <= 0.5 for r in pool)
    batches = []
    for step in (1, 2):
        rollouts = read_jsonl(next(it.glob(f"*-s{step}-rollout.jsonl")))
        math = [r for r in rollouts if r["mode"] == "math"]
        replay = [r for r in rollouts if r["mode"] == "validity"]
        assert len(math) == 9 and len(replay) == 1 and replay[0]["replay"] is True
        assert {r["id"] for r in math} <= {r["id"] for r in pool}
        # fresh rollouts: solver_rollouts (4) samples each, not the 5 voting samples
        assert all(len(r["samples"]) == 4 and len(voting[r["id"]]["samples"]) == 5 for r in math)
        batches.append(({r["id"] for r in math}, replay[0]["id"]))
        groups = read_jsonl(next(it.glob(f"*-s{step}-filter.jsonl")))
        assert len(groups) == 10
        replayed = [i for i, g in enumerate(groups) if g.get("replay")]
        assert len(replayed) == 1 and groups[replayed[0]]["role"] == "validity"   # 10 % of the update
        assert replayed[0] != len(groups) - 1                                   # mixed in, not appended
        for group in groups:
            assert len(group["completions"]) == 4 == len(group["old_logprobs"])
            assert all(isinstance(lp, list) and lp for lp in group["old_logprobs"])
        for group in (g for g in groups if g["role"] == "solver"):
            assert group["pseudo_label"] == voting[group["source_ids"][0]]["majority"]
        (trained,) = read_jsonl(next(it.glob(f"*-s{step}-train.jsonl")))
        assert trained["role"] == "solver" and trained["groups"] == 10 and trained["updates"] == 1
    assert batches[0][0] != batches[1][0]   # each step draws its own batch from the pool
    assert batches[0][1] != batches[1][1]   # and its own replay problem from the whole set


@pytest.mark.slow
def test_per_role_start_checkpoints_skip_the_validity_init(tmp_path, random_policy):  # noqa: F811
    questioner, solver = tmp_path / "questioner-start", tmp_path / "solver-start"
    shutil.copytree(random_policy, questioner)
    shutil.copytree(random_policy, solver)
    run_dir = tmp_path / "run"
    result = run_sptool(*scripted_args("rquest", run_dir, random_policy), "--set", f'model.questioner="{questioner}"',
                        "--set", f'model.solver="{solver}"', env=ENV)
    assert result.returncode == 0, result.stderr
    assert not (run_dir / "iter-0000").exists() and not (run_dir / "ckpt" / "solver-init").exists()
    assert state_of(only_checkpoint(run_dir, "questioner"))["base_model"] == str(questioner.resolve())
    assert state_of(only_checkpoint(run_dir, "solver"))["base_model"] == str(solver.resolve())


@pytest.mark.slow
def test_wist_takes_as_many_updates_as_its_training_batch_fills(tmp_path, random_policy):  # noqa: F811
    run_dir = tmp_path / "wist"
    result = run_sptool(*scripted_args("wist", run_dir, random_policy), "--set", "run.iterations=1",
                        "--set", "wist.train_batch=8", "--set", "train.learning_rate=0.05", env=ENV)
    assert result.returncode == 0, result.stderr
    groups = read_jsonl(run_dir / "iter-0001" / "06-filter.jsonl")
    completions = sum(len(g["completions"]) for g in groups)
    (trained,) = read_jsonl(run_dir / "iter-0001" / "07-train.jsonl")
    assert all(len(g["completions"]) == 8 for g in groups)   # tiny: G = K = 8, one group an update
    assert trained["updates"] == -(-completions // 8) > 1
    assert len(trained["per_update"]) == trained["updates"]
    # the later updates are off-policy: completions the backend gave no log-probs for were scored
    # by the policy before the first update, so they have a behaviour ratio, not ratio 1
    missing = sum(1 for g in groups for lp in (g.get("old_logprobs") or [None] * 8) if lp is None)
    assert trained.get("old_logprobs_filled", 0) == missing
    assert any(abs(update["ratio_mean"] - 1.0) > 1e-3 for update in trained["per_update"][1:])
    assert state_of(only_checkpoint(run_dir, "policy"))["step"] == trained["updates"]
