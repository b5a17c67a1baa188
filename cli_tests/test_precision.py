"""The precision a run trains and samples in must let it learn at the float32 rate.

The failure this guards against (measured on an H200, ``benchmarks/results/precision-h200/``): the
tiny model's weights sit exactly on the bf16 grid (the checkpoint is bf16), and an Adam step at
lr 1e-5 moves a weight by about 1e-5, far below half a bf16 step at the median |w| ≈ 0.11. A
forward under bf16 autocast rounds the float32 master weights back onto that grid, so the sampler
(and the trainer's own forward) kept seeing the start model for many updates: after one update the
bf16 sampler's log-prob change had a cosine of 0.10 with the float32 policy's change (0.66 after
five); RLVR's held-out accuracy stayed at 0.03–0.05 for 30 steps where float32 reached 0.67.

The CPU test applies the precisions a run chooses *on CUDA* (the defaults of
``shared_sampler_autocast`` and ``resolve_mixed_precision``) to the real tiny model on CPU, where
bf16 autocast rounds the same way, and requires that (a) the sampler's and the trainer's forwards
see a first Adam update at lr 1e-5 as the float32 policy does (cosine ≥ 0.9; bf16 measured 0.53 on
this batch on CPU), and (b) the trainer's gradient on a fixed batch stays close to float32's
(cosine ≥ 0.95; bf16 measured 0.9986).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys

import pytest

from conftest import FIXTURES, REPO

QUESTIONS = [("What is 47 + 38?", "\\boxed{85}"), ("What is 12 + 29?", "The answer is \\boxed{41}."),
             ("What is 63 + 18?", "63 + 18 = 81"), ("What is 55 + 27?", "\\boxed{72}")]
ADVANTAGES = [0.9, 0.45, -0.55, -0.8]


def _batch(tokenizer):
    """Prompt ids, completion ids (with EOS) per question, rendered as the trainer renders them."""
    from sptool.models.tokenizer import render_prompt

    rows = []
    for question, completion in QUESTIONS:
        prompt = tokenizer(render_prompt(tokenizer, [{"role": "user", "content": question}]),
                           add_special_tokens=False)["input_ids"]
        ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((prompt, ids))
    return rows


def _logprobs(model, rows, autocast_dtype, rounding: str = "nearest", draws: int = 1):
    """Log-probs of the batch's completion tokens under ``autocast_dtype`` (None: float32), the
    weights rounded by ``rounding`` (``train.weight_rounding``); the mean of ``draws`` forwards
    (a stochastic rounding differs from forward to forward)."""
    import torch

    from sptool.train.rounding import use_weight_rounding

    context = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    if rounding != "nearest":
        use_weight_rounding(model, rounding)
    try:
        total = 0
        for _ in range(draws):
            values = []
            with torch.no_grad(), context:
                for prompt, ids in rows:
                    full = torch.tensor([prompt + ids])
                    logits = model(input_ids=full).logits[0, len(prompt) - 1:-1].float()
                    values.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1))
            total = total + torch.cat(values)
    finally:
        if rounding != "nearest":
            use_weight_rounding(model, "nearest")
    return total / draws


def _gradient(model, rows, autocast_dtype):
    """Gradient of ``−Σ A · log π`` on the fixed batch, per parameter (autocast as given)."""
    import torch

    model.zero_grad(set_to_none=True)
    context = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    for (prompt, ids), advantage in zip(rows, ADVANTAGES):
        full = torch.tensor([prompt + ids])
        with context:
            logits = model(input_ids=full).logits[0, len(prompt) - 1:-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        (-advantage * logp.sum() / 64).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _cosine(a, b) -> float:
    import torch

    return torch.nn.functional.cosine_similarity(a.double().reshape(-1), b.double().reshape(-1), dim=0).item()


def _dtype(name: str):
    import torch

    return {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _visibility(model, rows, reference, dtypes, draws: int = 8):
    """Per view (an autocast dtype, or ``(dtype, rounding)``): (cosine, relative size) of its
    log-prob change after one first Adam step at lr 1e-5 (``lr · g / (|g| + eps)``, the float32
    gradient), against the float32 policy's change."""
    import torch

    def forward(view):
        dtype, rounding = view if isinstance(view, tuple) else (view, "nearest")
        return _logprobs(model, rows, dtype, rounding, draws if rounding == "stochastic" else 1)

    before = {view: forward(view) for view in {None, *dtypes}}  # None: float32
    saved = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        for name, param in model.named_parameters():
            g = reference.get(name)
            if g is not None:
                param -= 1e-5 * g / (g.abs() + 1e-8)
    moved = {view: forward(view) - before[view] for view in before}
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(saved[name])
    assert moved[None].abs().max().item() > 1e-4, "the update must move the float32 policy's log-probs"
    return {dtype: (_cosine(moved[dtype], moved[None]), (moved[dtype].norm() / moved[None].norm()).item())
            for dtype in dtypes}


@pytest.mark.slow
def test_the_cuda_default_precisions_see_an_update_and_keep_the_gradient(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from sptool.models.hf import shared_sampler_autocast
    from sptool.models.tokenizer import load_tokenizer
    from sptool.train.step import TrainConfig, resolve_precision

    torch.manual_seed(0)
    tokenizer = load_tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    rows = _batch(tokenizer)
    sampler = shared_sampler_autocast(None, "cuda")             # what a CUDA run samples in by default
    default = resolve_precision(TrainConfig(), cuda=True)       # what a CUDA run trains in by default
    trainer = _dtype(default.mixed_precision)
    assert torch.float16 not in (sampler, trainer), "fp16 autocast does not run on CPU: extend this test"
    trainer_view = (trainer, default.weight_rounding)           # its forward rounds the weights so

    reference = _gradient(model, rows, None)
    chosen = _gradient(model, rows, trainer) if trainer is not None else reference
    flat_ref = torch.cat([g.reshape(-1) for g in reference.values()])
    gradient_cosine = _cosine(torch.cat([chosen[name].reshape(-1) for name in reference]), flat_ref)
    seen = _visibility(model, rows, reference, [sampler, trainer_view, torch.bfloat16])
    print(json.dumps({"sampler": str(sampler), "trainer": str(trainer_view), "gradient_cosine": gradient_cosine,
                      "visibility": {str(k): v for k, v in seen.items()}}))
    cosine, size = seen[sampler]
    assert cosine >= 0.9 and 0.5 <= size <= 2.0, (
        f"the default sampler ({sampler}) does not see a first update as the float32 policy does: cosine "
        f"{cosine:.3f}, relative size {size:.3f} (a bf16 sampler rounds the update away)")
    assert gradient_cosine >= 0.95, f"the default trainer precision's gradient is off: cosine {gradient_cosine:.3f}"
    cosine, size = seen[trainer_view]  # the trainer's forward computes at the weights its autocast sees
    assert cosine >= 0.9 and 0.5 <= size <= 2.0, (
        f"the default trainer precision ({trainer_view}) hides a first update from its own forward: cosine "
        f"{cosine:.3f}, relative size {size:.3f}")
    # the guard catches the old default: under bf16 autocast the same update is mostly invisible
    cosine16, size16 = seen[torch.bfloat16]
    assert cosine16 < 0.9 or not 0.5 <= size16 <= 2.0, seen


@pytest.mark.gpu
def test_rlvr_on_two_digit_sums_learns_at_the_float32_rate_on_a_gpu(tmp_path):
    """The precision issue's settings with the defaults: held-out greedy ≥ 0.2 within 15 steps.

    Measured on one H200 (benchmarks/results/precision-h200/): the float32 default 0.157, 0.297,
    0.310 after 5, 10, 15 steps; the old bf16 default 0.050, 0.030, 0.037. (The issue's 0.8 came
    from a grader that took "\\boxed{47+38}" as the answer 85; under one that wants the number
    no arm gets near it in 15 steps: the bare loop 0.627, TRL 0.000.)"""
    run_dir = tmp_path / "run"
    sets = {"rlvr.data": str(FIXTURES / "addition_train.jsonl"), "rlvr.problems": 64, "rlvr.samples": 8,
            "rlvr.format_weight": 0.1, "rlvr.keep_equal_groups": True, "generation.max_tokens": 64,
            "generation.temperature": 1.0, "train.loss": "dr_grpo", "train.learning_rate": 1e-5,
            "train.max_tokens_per_micro_batch": 16384, "model.gen_batch_size": 512, "verify.workers": 8,
            "verify.require_boxed": True, "prompts.solve": str(REPO / "benchmarks/prompt_zero_shot.txt"),
            "prompts.solve_prefix": "", "prompts.solve_stop": [], "model.device": "cuda",
            "eval.benchmarks": str(FIXTURES / "bench/addition_heldout_300.jsonl"), "eval.every": 5,
            "eval.samples": 0, "eval.max_tokens": 64}
    command = [sys.executable, "-m", "sptool.cli.main", "run", "--recipe", "rlvr", "--run-dir", str(run_dir),
               "-n", "15", "-q"]
    for key, value in sets.items():
        command += ["--set", f"{key}={json.dumps(value) if isinstance(value, (str, bool, list)) else value}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    curve = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "eval":
            curve[record["after_iteration"]] = next(iter(record["benchmarks"].values()))["greedy"]
    print("held-out greedy:", curve)
    assert max(curve.values()) >= 0.2 and not math.isnan(max(curve.values())), curve


def test_a_training_group_is_trained_on_the_tokens_it_sampled(random_policy):
    """Re-tokenising a sampled completion can split it differently ("ans","wer" sampled, "answer"
    re-tokenised): then the trainer scored tokens the sampler never produced, against log-probs of
    other tokens. Samples that keep their token ids beside their log-probs are trained as sampled."""
    from sptool.filter.groups import sample_token_ids
    from sptool.models.base import SamplingParams
    from sptool.models.hf import HFBackend
    from sptool.train.step import PolicyTrainer, TrainConfig

    backend = HFBackend(random_policy, device="cpu", batch_size=4)
    [[sample]] = backend.generate([[{"role": "user", "content": "What is 4 + 7?"}]], 1,
                                  SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, logprobs=True))
    record = sample.to_record()
    assert record["token_ids"] == sample.token_ids and len(record["token_ids"]) == len(record["logprobs"])
    assert "token_ids" not in type(sample)(text="x", n_tokens=1, token_ids=[5]).to_record()  # no log-probs: no ids

    trainer = PolicyTrainer(TrainConfig(model=random_policy, device="cpu", loss="dr_grpo", max_completion_tokens=8))
    tokenizer = trainer.tokenizer
    split = tokenizer("ans", add_special_tokens=False)["input_ids"] + tokenizer("wer", add_special_tokens=False)["input_ids"]
    assert tokenizer("answer", add_special_tokens=False)["input_ids"] != split  # the text re-tokenises otherwise
    samples = [{"text": "answer", "token_ids": split, "logprobs": [-1.0] * len(split)},
               {"text": "12", "token_ids": tokenizer("12", add_special_tokens=False)["input_ids"],
                "logprobs": [-0.5] * len(tokenizer("12", add_special_tokens=False)["input_ids"])}]
    group = {"prompt": [{"role": "user", "content": "What is 40 + 7?"}], "completions": ["answer", "12"],
             "rewards": [1.0, 0.0], "old_logprobs": [s["logprobs"] for s in samples],
             "finish_reasons": ["length", "length"], "completion_ids": sample_token_ids(samples)}
    first = trainer.encode_group(group)[0]
    assert first.completion_ids == split and first.old_logprobs == [-1.0] * len(split)
    without = trainer.encode_group({k: v for k, v in group.items() if k != "completion_ids"})[0]
    assert without.completion_ids != split and without.old_logprobs is None  # the old way lost the ratio


# ------------------------------------------------------------------------------ sampler–trainer mismatch

def _sequences(tokenizer, model, sampler_dtype):
    """The fixed batch as training sequences, each with the log-probs a sampler in ``sampler_dtype``
    (None: float32) gives its tokens."""
    import torch

    from sptool.train.step import TrainSequence

    rows = _batch(tokenizer)
    flat = _logprobs(model, rows, sampler_dtype).tolist()
    sequences = []
    for (prompt, ids), advantage in zip(rows, ADVANTAGES):
        sampled, flat = flat[:len(ids)], flat[len(ids):]
        sequences.append(TrainSequence(prompt, ids, advantage, 1.0 if advantage > 0 else 0.0, "solver", sampled))
    assert not flat and torch.is_grad_enabled()
    return sequences


def _first_update(model, tokenizer, sequences, **options) -> dict:
    """The metrics of a fresh trainer's first update on ``sequences`` (a copy of ``model``; CPU)."""
    import copy
    import gc

    from accelerate.state import AcceleratorState

    from sptool.train.step import PolicyTrainer, TrainConfig

    AcceleratorState._reset_state(True)  # one precision per process otherwise
    trainer = PolicyTrainer(TrainConfig(model="<test>", device="cpu", learning_rate=1e-5, max_completion_tokens=64,
                                        compile=False, compile_kernels=False, **options),
                            model=copy.deepcopy(model), tokenizer=tokenizer)
    metrics = trainer.update_sequences([copy.copy(seq) for seq in sequences])
    del trainer
    gc.collect()
    AcceleratorState._reset_state(True)
    return metrics


@pytest.mark.slow
def test_the_first_update_from_a_rollout_has_ratio_one_and_the_gap_is_measured(tiny_model_dir):
    """Issue 32's suspect: a bf16 trainer that takes log π_old from a float32 sampler starts every
    rollout with ratio ≠ 1, so clipping and the ratio's noise land on every token. On the real
    tiny model and a fixed batch, with the precisions a CUDA run uses by default (applied on CPU):
    the first update's ratio is 1 (mean, max and min within 2e-3). The same check fails for a bf16
    trainer with the float32 sampler's log-probs (it must: the guard catches a mismatched source)
    and passes again with ``old_logprobs="trainer"``; the sampler–trainer gap is ~0 when the
    sampler is the same float32 model, and not when the trainer computes in bf16."""
    import torch
    from transformers import AutoModelForCausalLM

    from sptool.models.hf import shared_sampler_autocast
    from sptool.models.tokenizer import load_tokenizer
    from sptool.train.config import TrainConfig
    from sptool.train.step import resolve_precision

    tokenizer = load_tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    float32 = _sequences(tokenizer, model, None)

    def ratio_is_one(metrics: dict, tolerance: float = 2e-3) -> bool:
        return all(abs(metrics[key] - 1.0) <= tolerance for key in ("ratio_mean", "ratio_max", "ratio_min"))

    # the CUDA defaults: the sampler's precision, the trainer's and where log π_old comes from
    sampler = shared_sampler_autocast(None, "cuda")
    cuda_default = resolve_precision(TrainConfig(), cuda=True)
    mixed = cuda_default.mixed_precision
    assert mixed != "fp16", "fp16 autocast does not run on CPU: extend this test"
    same = _first_update(model, tokenizer, float32, mixed_precision="no")  # float32 sampler and trainer
    resolved = {k: getattr(cuda_default, k) for k in ("mixed_precision", "old_logprobs", "weight_rounding")}
    default = same if (sampler, mixed, cuda_default.old_logprobs) == (None, "no", "sampler") else _first_update(
        model, tokenizer, float32 if sampler is None else _sequences(tokenizer, model, sampler), **resolved)
    print(json.dumps({"sampler": str(sampler), **resolved,
                      **{k: default[k] for k in ("ratio_mean", "ratio_max", "ratio_min", "logprob_gap")}}))
    assert ratio_is_one(default), f"the default precisions start a rollout off ratio 1: {default}"
    assert default["clip_fraction"] == 0.0

    assert same["logprob_gap"] < 1e-4 and same["logprob_gap_max"] < 1e-3, same
    assert ratio_is_one(same, 1e-4) and same["ratio_std"] < 1e-4

    mismatched = _first_update(model, tokenizer, float32, mixed_precision="bf16", old_logprobs="sampler",
                               weight_rounding="nearest")
    assert not ratio_is_one(mismatched), f"a bf16 trainer against float32 log π_old should be off 1: {mismatched}"
    assert mismatched["logprob_gap"] > 1e-3 and mismatched["ratio_std"] > 1e-3

    own = _first_update(model, tokenizer, float32, mixed_precision="bf16", old_logprobs="trainer",
                        weight_rounding="nearest")
    assert own["ratio_mean"] == own["ratio_max"] == own["ratio_min"] == 1.0 and own["clip_fraction"] == 0.0
    assert own["logprob_gap"] == pytest.approx(mismatched["logprob_gap"], rel=1e-3)  # the gap is still seen


def test_truncated_importance_weights_are_capped():
    import torch

    from sptool.train.losses import objective_loss, truncated_importance_weights

    trainer = torch.tensor([-1.0, -1.0, -2.0])
    sampler = torch.tensor([-1.5, -1.0, -1.0])
    weights = truncated_importance_weights(trainer, sampler, cap=1.5)
    assert torch.allclose(weights, torch.tensor([1.5, 1.0, math.exp(-1.0)]))  # exp(0.5) = 1.65 capped
    logprobs = torch.tensor([-1.0, -1.0, -2.0], requires_grad=True)
    loss, *_ = objective_loss(logprobs, logprobs.detach(), None, torch.ones(3), torch.ones(3), clip_low=0.2,
                              clip_high=0.2, importance_weights=weights)
    loss.backward()
    assert torch.allclose(logprobs.grad, -weights)  # ρ_t multiplies each token's policy gradient


def test_trainer_old_logprobs_keep_the_sampler_for_the_gap_and_tis(random_policy):
    """``old_logprobs="trainer"``: a rollout's first update has ratio 1 even when the sampler's
    log-probs are off by 0.5 nats (they show as the gap, and TIS caps their weight); scored before
    the first update (a rollout of several updates), the sampler's log-probs stay and the second
    update's ratio moves off 1."""
    from sptool.train.step import PolicyTrainer, TrainConfig

    prompt = [{"role": "user", "content": "What is 2 + 3?"}]
    group = {"role": "solver", "prompt": prompt, "completions": ["The answer is 5.", "It is 6.", "5", "7"],
             "rewards": [1.0, 0.0, 1.0, 0.0], "finish_reasons": ["stop"] * 4}
    options = dict(model=random_policy, loss="grpo", learning_rate=0.05, old_logprobs="trainer", tis_cap=1.2)
    trainer = PolicyTrainer(TrainConfig(**options))
    current = trainer.logprobs(trainer.encode_group(group))
    off = {**group, "old_logprobs": [[x - 0.5 for x in row] for row in current]}
    assert trainer.fill_old_logprobs([off]) == 4 and off["old_logprobs"][0] == [x - 0.5 for x in current[0]]
    first = trainer.update([off])
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and first["clip_fraction"] == 0.0
    assert first["logprob_gap"] == pytest.approx(0.5, abs=1e-3) and first["logprob_gap_max"] == pytest.approx(0.5, abs=1e-3)
    assert first["tis_weight_mean"] == pytest.approx(1.2) and first["tis_capped_fraction"] == 1.0
    second = trainer.update([off])
    assert abs(second["ratio_mean"] - 1.0) > 1e-3
    with pytest.raises(Exception, match="--tis-cap"):
        TrainConfig(model=random_policy, tis_cap=2.0, old_logprobs="sampler")  # TIS corrects the trainer's log π_old
    with pytest.raises(Exception, match="--old-logprobs"):
        TrainConfig(model=random_policy, old_logprobs="both")


@pytest.mark.gpu
def test_tf32_turns_on_tensor_core_float32_matmuls_on_cuda_only(random_policy):
    """``tf32``: on CUDA the process's float32 matmuls go to TF32 (an fp32 GEMM's result moves off
    the float64 one by TF32's rounding, about 1e-3 relative); a trainer without it leaves them alone."""
    import torch

    from sptool.train.step import PolicyTrainer, TrainConfig

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    PolicyTrainer(TrainConfig(model=random_policy, device="cuda"))
    assert torch.backends.cuda.matmul.allow_tf32 is False
    a, b = torch.randn(512, 512, device="cuda"), torch.randn(512, 512, device="cuda")
    exact = (a.double() @ b.double()).float()
    full = (a @ b - exact).abs().max().item()
    PolicyTrainer(TrainConfig(model=random_policy, device="cuda", tf32=True))
    assert torch.backends.cuda.matmul.allow_tf32 is True
    assert (a @ b - exact).abs().max().item() > 10 * full
    torch.backends.cuda.matmul.allow_tf32 = False


def test_report_shows_the_ratio_and_a_drifting_gap(tmp_path):
    """``sptool report``: the train steps' ratio, clip share and sampler–trainer gap per iteration
    (``precision.png`` and the text summary, with the gap's largest value)."""
    from sptool.run.report import series, summary_text, write_plots

    gaps = [0.02, 0.03, 0.4, 0.05]
    lines = [{"iteration": it, "stage": "train", "kind": "train", "records": 1, "wall_s": 1.0,
              "roles": {"solver": {"ratio_mean": 1.0, "ratio_max": 1.0 + gap, "clip_fraction": gap / 10,
                                   "logprob_gap": gap, "loss": 0.1}}} for it, gap in enumerate(gaps, 1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    precision = series(lines)["precision"]
    assert precision["solver sampler-trainer log-prob gap (mean, nats)"] == dict(enumerate(gaps, 1))
    assert precision["solver ratio max"][3] == pytest.approx(1.4)
    text = summary_text(tmp_path)
    assert "precision: solver sampler-trainer log-prob gap (mean, nats): 0.020 (iter 1) -> 0.050 (iter 4)" in text
    assert "precision: solver sampler-trainer log-prob gap (mean, nats): largest 0.400 (iter 3)" in text
    assert "precision.png" in {path.name for path in write_plots(tmp_path)}


def test_auto_precision_is_bf16_stochastic_trainer_on_cuda_and_float32_on_cpu():
    """The CUDA default is the path that learnt at the float32 rate on an H200 (bf16 autocast,
    stochastic weight rounding, the trainer's own log π_old); CPU stays float32 with the sampler's
    log-probs; an explicit setting is kept; config.toml's precision comment says the same."""
    from sptool.run.driver import stage_precisions
    from sptool.train.step import TrainConfig, resolve_precision

    def resolved(cuda: bool, **options):
        config = resolve_precision(TrainConfig(**options), cuda=cuda)
        return config.mixed_precision, config.weight_rounding, config.old_logprobs

    assert resolved(True) == ("bf16", "stochastic", "trainer")
    assert resolved(False) == ("no", "nearest", "sampler")
    assert resolved(False, tis_cap=2.0) == ("no", "nearest", "trainer")  # TIS needs the trainer's log π_old
    assert resolved(True, mixed_precision="no") == ("no", "nearest", "sampler")
    assert resolved(True, mixed_precision="fp16") == ("fp16", "nearest", "trainer")
    assert resolved(True, weight_rounding="nearest", old_logprobs="sampler") == ("bf16", "nearest", "sampler")
    assert resolved(False, mixed_precision="bf16", weight_rounding="split") == ("bf16", "split", "trainer")

    found = stage_precisions({"model": {"device": "cuda", "backend": "hf"},
                              "train": {"mixed_precision": "auto", "old_logprobs": "auto",
                                        "weight_rounding": "auto", "beta": 0.04}})
    assert found["trainer"] == ("bf16 autocast (float32 master weights, optimizer and reductions), weights "
                                "rounded by stochastic (train.weight_rounding), log π_old from the trainer "
                                "(train.old_logprobs)")
    assert found["reference"] == "bf16 autocast (float32 master weights, optimizer and reductions)"
    assert found["sampler"] == "float32 (the trainer's policy)"
    on_cpu = stage_precisions({"model": {"device": "cpu"}, "train": {"weight_rounding": "stochastic"}})
    assert on_cpu["trainer"] == "float32, log π_old from the sampler (train.old_logprobs)"


def test_auto_rounding_leaves_lora_layers_alone_without_a_note(random_policy):
    """LoRA layers keep their own forward, so "auto" rounds nothing there and says nothing; an
    explicit --weight-rounding stochastic still gets the note that it does not apply."""
    from accelerate.state import AcceleratorState

    from sptool.train.step import PolicyTrainer, TrainConfig

    for asked, noted in (("auto", False), ("stochastic", True)):
        AcceleratorState._reset_state(True)
        notes: list[str] = []
        trainer = PolicyTrainer(TrainConfig(model=random_policy, device="cpu", lora_r=4, mixed_precision="bf16",
                                            weight_rounding=asked, compile=False, compile_kernels=False),
                                log=notes.append)
        assert trainer.is_lora and trainer.config.old_logprobs == "trainer"
        assert trainer.config.weight_rounding == ("nearest" if asked == "auto" else "stochastic")
        assert any("--weight-rounding" in note for note in notes) == noted, notes
        del trainer
    AcceleratorState._reset_state(True)


@pytest.mark.gpu
def test_a_cuda_update_syncs_the_host_only_at_its_end(random_policy):
    """Issue 32: a host sync inside the micro-batch loop (a copy from pageable memory, a scalar made
    on the host) makes each micro-batch wait for the previous backward, and the GPU idles while the
    host packs and launches the next (79 syncs a step cost the 0.5B step 1.52x -> 1.37x bare on an
    H100). Nothing inside the loop syncs (transformers' packed-sequence check did, once per
    micro-batch, until the trainer answered it: see the CPU test below); the step's end syncs for
    the gradient norm and the metrics."""
    import warnings
    from pathlib import Path

    import torch
    from accelerate.state import AcceleratorState

    from sptool.train.step import PolicyTrainer, TrainConfig

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    AcceleratorState._reset_state(True)
    trainer = PolicyTrainer(TrainConfig(model=random_policy, device="cuda", learning_rate=1e-5,
                                        max_tokens_per_micro_batch=64))
    groups = [{"prompt": [{"role": "user", "content": f"What is {a} + {a}?"}],
               "completions": [f"The answer is {2 * a}.", "I do not know the answer to that one.", str(a)],
               "rewards": [1.0, 0.0, 0.0], "role": "solver"} for a in range(11, 15)]
    trainer.update(groups)  # warm-up: compilation and first allocations
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            metrics = trainer.update(groups)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    assert metrics["micro_batches"] >= 2, metrics
    assert not [place for place in syncs if place.startswith("masking_utils.py")], syncs
    assert len(syncs) <= 4, syncs
    # the allocator's counts (read inside the watched update, so without a sync of their own)
    assert all(isinstance(metrics[key], int) and metrics[key] >= 0
               for key in ("alloc_retries", "device_mallocs", "device_frees")), metrics
    AcceleratorState._reset_state(True)


def test_the_trainer_forward_skips_transformers_packed_sequence_check(random_policy, monkeypatch):
    """Issue 32: given no attention mask, transformers looks for sequences packed into one row, with
    a ``.all()`` that waits for the GPU before every forward (4 of the 7 host syncs left in a 0.5B
    step). The trainer puts one sequence in a row, so it answers the check itself: an update with
    a reference model (``beta``) and the trainer's own old log-probs never calls it, a plain
    forward of the same model does, and the check is transformers' own again after the update."""
    import torch
    from accelerate.state import AcceleratorState
    from transformers import masking_utils

    from sptool.train.step import PolicyTrainer, TrainConfig

    calls: list[tuple] = []
    real = masking_utils.find_packed_sequence_indices

    def spy(position_ids):
        calls.append(tuple(position_ids.shape))
        return real(position_ids)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", spy)
    AcceleratorState._reset_state(True)
    trainer = PolicyTrainer(TrainConfig(model=random_policy, device="cpu", learning_rate=1e-5, beta=0.04,
                                        old_logprobs="trainer", max_tokens_per_micro_batch=64))
    groups = [{"prompt": [{"role": "user", "content": f"What is {a} + {a}?"}],
               "completions": [f"The answer is {2 * a}.", "I do not know.", str(a)],
               "rewards": [1.0, 0.0, 0.0], "role": "solver"} for a in range(11, 14)]
    metrics = trainer.update(groups)
    assert metrics["micro_batches"] >= 2 and calls == [], (metrics, calls)
    with torch.no_grad():
        trainer.model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
    assert calls == [(1, 3)]
    assert masking_utils.find_packed_sequence_indices is spy
    del trainer
    AcceleratorState._reset_state(True)
