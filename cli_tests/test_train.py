"""``sptool train-step``: objectives against their equations, update direction, optimizer state,
distributed equivalence, LoRA, atomic checkpoints, CLI contract, and a real-model reward rise."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import free_port, read_jsonl, write_jsonl

torch = pytest.importorskip("torch")

from sptool.train import losses  # noqa: E402

# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory, tiny_model_dir) -> str:
    """A small RANDOM-initialised Llama (hidden 64, 2 layers) with the tiny model's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    path = tmp_path_factory.mktemp("random-llama") / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def group(prompt="What is 2 + 2?", completions=("4", "5"), rewards=(1.0, 0.0), role="solver", **extra) -> dict:
    return {"prompt": [{"role": "user", "content": prompt}], "completions": list(completions),
            "rewards": list(rewards), "role": role, **extra}


GROUPS = [
    group("What is 2 + 2?", ["4", "The answer is 5.", "4, surely"], [1.0, 0.0, 1.0]),
    group("Name a prime.", ["7", "9 is prime", "2"], [1.0, 0.0, 0.5]),
    group("Write a hard problem.", ["What is 3 + 3?", "hello"], [0.6, -1.0], role="questioner"),
    group("Say yes.", ["yes", "no thanks, I will not"], [1.0, 0.0], finish_reasons=["stop", "length"]),
]


def weights_of(directory) -> dict:
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    assert files, f"no safetensors in {directory}"
    state = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def make_trainer(model_dir, **options):
    from sptool.train.step import PolicyTrainer, TrainConfig

    return PolicyTrainer(TrainConfig(model=model_dir, **options))


def sequence_logprob(trainer, prompt_messages, completion: str, temperature: float = 1.0) -> float:
    """log π(completion | prompt) under the trainer's current policy (EOS appended)."""
    from sptool.models.tokenizer import render_prompt

    tokenizer = trainer.tokenizer
    prompt_ids = tokenizer(render_prompt(tokenizer, prompt_messages), add_special_tokens=False)["input_ids"]
    ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    input_ids = torch.tensor([prompt_ids + ids])
    with torch.no_grad():
        logits = trainer.model(input_ids=input_ids).logits[0, len(prompt_ids) - 1:-1].float() / temperature
    return float(torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).sum())


# ------------------------------------------------------------------------------ pure formulas


def test_advantages_hand_computed():
    assert losses.group_advantages([1, 0, 1], "dr_grpo") == pytest.approx([1 / 3, -2 / 3, 1 / 3])
    # sample std of [1, 0] is sqrt(0.5) = 0.70711; (±0.5) / (0.70711 + 1e-6)
    assert losses.group_advantages([1, 0], "grpo") == pytest.approx([0.70710578, -0.70710578], rel=1e-6)
    assert losses.group_advantages([2, 2, 2], "grpo") == [0.0, 0.0, 0.0]
    assert losses.group_advantages([3, 1], "dr_grpo") == [1.0, -1.0]
    assert losses.group_advantages([3, 1], "dapo") == losses.group_advantages([3, 1], "grpo")


def test_token_weights_hand_computed():
    lengths = [2, 4]
    assert losses.sequence_token_weights(lengths, "sequence_mean") == pytest.approx([1 / 4, 1 / 8])
    assert losses.sequence_token_weights(lengths, "token_mean") == pytest.approx([1 / 6, 1 / 6])
    assert losses.sequence_token_weights(lengths, "global_constant") == pytest.approx([1 / 8, 1 / 8])
    assert losses.sequence_token_weights(lengths, "global_constant", normaliser_length=10) == pytest.approx([1 / 20] * 2)


def test_clipped_surrogate_and_k3_hand_computed():
    lp = torch.log(torch.tensor([0.6, 0.2, 0.55, 0.5]))
    old = torch.log(torch.tensor([0.4, 0.4, 0.5, 0.5]))   # ratios 1.5, 0.5, 1.1, 1.0
    adv = torch.tensor([1.0, -1.0, 1.0, -2.0])
    loss, clipped = losses.clipped_surrogate_loss(lp, old, adv, 0.2, 0.28)
    # -min(1.5·1, 1.28·1) = -1.28 ; -min(0.5·-1, 0.8·-1) = 0.8 ; -1.1 ; -(1·-2) = 2
    assert loss.tolist() == pytest.approx([-1.28, 0.8, -1.1, 2.0], rel=1e-5)
    assert clipped.tolist() == [True, True, False, False]
    kl = losses.k3_kl(torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25])))
    assert float(kl) == pytest.approx(0.5 - math.log(0.5) - 1, rel=1e-6)  # 0.193147


@pytest.mark.parametrize("name", ["dr_grpo", "grpo", "dapo"])
def test_objective_loss_equals_equation_on_random_inputs(name):
    """Padded 2-D batch, computed from the paper equations with explicit loops, vs the flat
    weighted sum the trainer uses (also split into two micro-batches)."""
    generator = torch.Generator().manual_seed(7)
    objective = losses.OBJECTIVES[name]
    lengths = [5, 2, 7, 3]
    width = max(lengths)
    n = len(lengths)
    lp = -torch.rand(n, width, generator=generator, dtype=torch.float64) * 3
    old = lp + 0.4 * torch.randn(n, width, generator=generator, dtype=torch.float64)
    ref = lp + 0.3 * torch.randn(n, width, generator=generator, dtype=torch.float64)
    rewards = torch.rand(n, generator=generator, dtype=torch.float64).tolist()
    adv = losses.group_advantages(rewards, name)
    beta = 0.05
    mask = torch.tensor([[t < length for t in range(width)] for length in lengths])

    lp_, old_, ref_ = lp.tolist(), old.tolist(), ref.tolist()

    def token_term(i, t):
        k = math.exp(lp_[i][t] - old_[i][t])
        low, high = objective.clip_low, objective.clip_high
        surrogate = min(k * adv[i], min(max(k, 1 - low), 1 + high) * adv[i])
        delta = ref_[i][t] - lp_[i][t]
        kl = math.exp(delta) - delta - 1
        return -(surrogate - beta * kl)  # loss = −objective

    if name == "grpo":      # (1/G) Σ_i (1/|y_i|) Σ_t
        expected = sum(sum(token_term(i, t) for t in range(lengths[i])) / lengths[i] for i in range(n)) / n
    elif name == "dapo":    # Σ_i Σ_t / Σ_i |y_i|
        expected = sum(token_term(i, t) for i in range(n) for t in range(lengths[i])) / sum(lengths)
    else:                   # Dr. GRPO: Σ_i Σ_t / (N · L_max)
        expected = sum(token_term(i, t) for i in range(n) for t in range(lengths[i])) / (n * max(lengths))

    weights = losses.sequence_token_weights(lengths, objective.aggregation)
    flat = lambda x: x[mask]  # noqa: E731
    token_adv = torch.tensor([[adv[i]] * width for i in range(n)], dtype=torch.float64)
    token_w = torch.tensor([[weights[i]] * width for i in range(n)], dtype=torch.float64)
    total, *_ = losses.objective_loss(flat(lp), flat(old), flat(ref), flat(token_adv), flat(token_w),
                                      clip_low=objective.clip_low, clip_high=objective.clip_high, beta=beta)
    assert float(total) == pytest.approx(expected, rel=1e-10)
    # micro-batches {0, 1} and {2, 3} sum to the same loss (gradient accumulation is exact)
    parts = 0.0
    for rows in ([0, 1], [2, 3]):
        sub = lambda x: x[rows][mask[rows]]  # noqa: E731
        part, *_ = losses.objective_loss(sub(lp), sub(old), sub(ref), sub(token_adv), sub(token_w),
                                         clip_low=objective.clip_low, clip_high=objective.clip_high, beta=beta)
        parts += float(part)
    assert parts == pytest.approx(expected, rel=1e-10)


def test_micro_batch_plan_respects_token_budget():
    from sptool.train.step import plan_micro_batches

    lengths = [10, 3, 7, 7, 2, 30]
    plan = plan_micro_batches(lengths, 16)
    assert sorted(i for batch in plan for i in batch) == list(range(6))
    for batch in plan:
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 16
    assert plan[0] == [5]  # longer than the budget: alone


# ------------------------------------------------------------------------------ chunked log-probs


def _full_softmax(hidden, weight, bias, targets, temperature=1.0):
    logits = (hidden.double() @ weight.double().t() + (bias.double() if bias is not None else 0.0)) / temperature
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_full_softmax(temperature):
    """Token-chunked log-probs (and entropies) equal log_softmax over the full logits: tight in
    float32, within bf16 rounding of the logits when the head runs in bf16."""
    from sptool.train.logprobs import chunked_selected_logprobs

    generator = torch.Generator().manual_seed(3)
    rows, width, vocab = 53, 24, 3001
    hidden = torch.randn(rows, width, generator=generator)
    weight = torch.randn(vocab, width, generator=generator) / width ** 0.5 * 3
    bias = torch.randn(vocab, generator=generator) * 0.1
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    expected, expected_entropy = _full_softmax(hidden, weight, bias, targets, temperature)
    for chunk_rows in (1, 7, 53, 1000):
        got, entropy = chunked_selected_logprobs(hidden, weight, bias, targets, temperature=temperature,
                                                 chunk_rows=chunk_rows, entropy=True)
        assert got.dtype == torch.float32 and got.shape == (rows,)
        assert float((got.double() - expected).abs().max()) < 2e-5
        assert float((entropy.double() - expected_entropy).abs().max()) < 2e-5
    bf16, _ = chunked_selected_logprobs(hidden, weight, bias, targets, temperature=temperature, chunk_rows=16,
                                        compute_dtype=torch.bfloat16)
    # the previous path under bf16 autocast: full bf16 logits, float32 log-softmax over them
    logits = (hidden.bfloat16() @ weight.bfloat16().t() + bias.bfloat16()).float() / temperature
    full_bf16 = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    assert float((bf16 - full_bf16).abs().max()) < 1e-3
    # against the exact values: within the rounding of logits to bf16 (8 significant bits)
    bound = 2 * 2.0 ** -8 * float(logits.abs().max())
    error = (bf16.double() - expected).abs()
    assert 1e-5 < float(error.max()) < bound


def test_fused_policy_loss_value_and_gradients_equal_autograd_over_full_logits():
    """The fused chunk loop (loss and ∂/∂hidden, ∂/∂W, ∂/∂b computed chunk by chunk in the forward
    pass) equals autograd through full logits → log_softmax → objective_loss, in float32."""
    from sptool.train.logprobs import fused_policy_loss

    generator = torch.Generator().manual_seed(5)
    rows, width, vocab, temperature = 29, 16, 997, 0.8
    hidden = torch.randn(rows, width, generator=generator, requires_grad=True)
    weight = (torch.randn(vocab, width, generator=generator) / 2).requires_grad_()
    bias = (torch.randn(vocab, generator=generator) * 0.1).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    advantages = torch.randn(rows, generator=generator)
    token_weights = torch.rand(rows, generator=generator) / rows
    old = torch.log(torch.rand(rows, generator=generator)) - 6
    ref = torch.log(torch.rand(rows, generator=generator)) - 6
    options = dict(clip_low=0.2, clip_high=0.28, beta=0.05)

    logits = (hidden @ weight.t() + bias) / temperature
    full = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    expected, *_ = losses.objective_loss(full, old, ref, advantages, token_weights, **options)
    expected_grads = torch.autograd.grad(2.5 * expected, (hidden, weight, bias))

    def token_loss(logprobs, start, end):
        loss, _, kl, clipped = losses.objective_loss(logprobs, old[start:end], ref[start:end],
                                                     advantages[start:end], token_weights[start:end], **options)
        return loss, torch.stack([clipped.sum().double(), kl.sum().double()])

    loss, logprobs, entropy, stats = fused_policy_loss(hidden, weight, bias, targets, token_loss,
                                                       temperature=temperature, chunk_rows=6, entropy=True)
    grads = torch.autograd.grad(2.5 * loss, (hidden, weight, bias))
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-5)
    assert float((logprobs - full.detach()).abs().max()) < 1e-5
    assert float(stats[0]) > 0  # some tokens clipped: the comparison covers the clipped branch
    for got, want in zip(grads, expected_grads):
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    expected_entropy = -(torch.log_softmax(logits, -1).exp() * torch.log_softmax(logits, -1)).sum(-1)
    assert float((entropy - expected_entropy.detach()).abs().max()) < 1e-4


def test_trainer_chunked_path_equals_full_logits_path(random_model_dir):
    """One update through the default (chunked) path and through --full-logits: same metrics,
    same new weights (float32, CPU), with a KL reference, a temperature and off-policy log-probs;
    the trainer's behaviour log-probs equal a full-softmax forward."""
    prompt = GROUPS[0]["prompt"]
    # Adam with ε = 1 moves each weight by ≈ lr·g: the weights compare the gradients (with the
    # default ε a weight with a 1e-12 gradient moves by ±lr, its sign set by rounding)
    trainers = [make_trainer(random_model_dir, learning_rate=1.0, adam_epsilon=1.0, beta=0.1, temperature=0.9,
                             loss="dapo", max_tokens_per_micro_batch=40, full_logits=full,
                             logit_chunk_elements=20_000) for full in (True, False)]
    start = [p.detach().clone() for p in trainers[0].model.parameters()]
    assert trainers[0].head is None and trainers[1].head is not None
    sequences = trainers[1].encode_group(GROUPS[0])
    behaviour = trainers[1].logprobs(sequences)
    full = trainers[0].logprobs(sequences)
    assert [len(row) for row in behaviour] == [len(seq.completion_ids) for seq in sequences]
    assert sum(behaviour, []) == pytest.approx(sum(full, []), abs=1e-5)
    assert [sum(row) for row in behaviour] == pytest.approx(
        [sequence_logprob(trainers[1], prompt, text, 0.9) for text in GROUPS[0]["completions"]], abs=1e-4)
    shifted = [[x - 0.5 for x in row] for row in behaviour]
    metrics = [t.update([{**GROUPS[0], "old_logprobs": shifted}, GROUPS[1]]) for t in trainers]
    for key in ("loss", "grad_norm", "clip_fraction", "ratio_mean", "entropy"):
        assert metrics[1][key] == pytest.approx(metrics[0][key], rel=1e-5, abs=1e-7), key
    assert metrics[1]["kl"] == pytest.approx(0.0, abs=1e-6) and metrics[1]["clip_fraction"] > 0
    assert metrics[1]["completion_tokens"] == metrics[0]["completion_tokens"]
    second = [t.update(GROUPS[:2]) for t in trainers]
    assert second[1]["kl"] == pytest.approx(second[0]["kl"], rel=1e-4) and second[1]["kl"] > 0
    moved = max(float((a.detach() - b).abs().max()) for a, b in zip(trainers[0].model.parameters(), start))
    diff = max(float((a - b).detach().abs().max())
               for a, b in zip(trainers[0].model.parameters(), trainers[1].model.parameters()))
    assert moved > 1e-3 and diff < 5e-5 * moved, (moved, diff)  # float32 rounding: ≈ 7e-6


@pytest.mark.parametrize("loss, budget, expected", [
    ("dr_grpo", 16, 1.5 / (2 * 16)),   # Liu et al.: Σ_i Σ_t −A_i / (N · budget)
    ("dr_grpo", None, 1.5 / (2 * 5)),  # no budget given: the longest completion (5) stands in
    ("dapo", 16, 1.5 / 7),             # token mean: Σ_i Σ_t −A_i / Σ_i |y_i|, budget ignored
    ("grpo", 16, 0.0),                 # (1/N) Σ_i (1/|y_i|) Σ_t −A_i = (−0.5 + 0.5) / 2
])
def test_dr_grpo_normaliser_is_the_generation_budget(random_model_dir, loss, budget, expected):
    """Hand-computed: completions of 2 and 5 tokens with advantages +0.5 and −0.5, ratio 1, so each
    token's loss is −A_i; the loss is Σ_i |y_i| (−A_i) w_i = (−0.5·2 + 0.5·5) w = 1.5 w for a
    constant weight."""
    from sptool.train.step import TrainSequence

    trainer = make_trainer(random_model_dir, loss=loss, max_completion_tokens=budget)
    prompt = [11, 12, 13]
    sequences = [TrainSequence(prompt, [21, 22], 0.5), TrainSequence(prompt, [31, 32, 33, 34, 35], -0.5)]
    metrics = trainer.update_sequences(sequences)
    assert metrics["loss"] == pytest.approx(expected, abs=1e-7)
    assert metrics["completion_tokens"] == 7


def test_compiled_layers_that_fail_on_the_first_step_fall_back_to_eager(random_model_dir):
    """A compiled decoder layer that raises on its first call (no compiler, unsupported op) is
    undone with a note and the step runs eagerly: the same update as an eager trainer."""
    notes = []
    eager = make_trainer(random_model_dir, learning_rate=1e-3)
    trainer = make_logged_trainer(random_model_dir, notes.append, learning_rate=1e-3)
    layers = [m for m in trainer.model.modules() if m.__class__.__name__.endswith("DecoderLayer")]
    assert layers and not trainer.compiled_layers  # CPU: not compiled by default

    def broken(*args, **kwargs):
        raise RuntimeError("inductor: no C++ compiler")

    for layer in layers:
        layer._compiled_call_impl = broken
    trainer.compiled_layers, trainer.compile_proven = layers, False
    metrics = trainer.update(GROUPS[:2])
    assert any("compiled decoder layers failed" in note and "no C++ compiler" in note for note in notes)
    assert all(layer._compiled_call_impl is None for layer in layers)
    assert metrics["loss"] == pytest.approx(eager.update(GROUPS[:2])["loss"], rel=1e-6)
    diff = max(float((a - b).detach().abs().max()) for a, b in zip(trainer.model.parameters(), eager.model.parameters()))
    assert diff < 1e-6


def make_logged_trainer(model_dir, log, **options):
    from sptool.train.step import PolicyTrainer, TrainConfig

    return PolicyTrainer(TrainConfig(model=model_dir, **options), log=log)


def test_cli_budget_scales_the_dr_grpo_loss_and_no_entropy_drops_the_metric(cli, random_model_dir, tmp_path):
    """Through the CLI: at ratio 1 the Dr. GRPO loss is Σ −A_i |y_i| / (N · L), so halving
    --max-completion-tokens doubles it exactly; --no-entropy reports no entropy."""
    groups = write_jsonl(tmp_path / "groups.jsonl", GROUPS[:2])
    losses_by_budget = {}
    for budget in (64, 32):
        metrics = tmp_path / f"m{budget}.jsonl"
        result = cli(["train-step", groups, "-m", random_model_dir, "-o", tmp_path / f"out{budget}", "-q",
                      "--max-completion-tokens", budget, "--no-entropy", "--no-compile", "--metrics", metrics])
        assert result.exit_code == 0, result.output
        record = read_jsonl(metrics)[0]
        assert record["entropy"] is None
        losses_by_budget[budget] = record["loss"]
    assert losses_by_budget[64] != 0 and losses_by_budget[32] == pytest.approx(2 * losses_by_budget[64], rel=1e-5)


def test_train_step_help_lists_the_speed_and_normaliser_options(sptool):
    result = sptool("train-step", "--help", env={"COLUMNS": "200"})
    for option in ("--max-completion-tokens", "--full-logits", "--no-entropy", "--compile"):
        assert option in result.stdout


# ------------------------------------------------------------------------------ the update


def test_direction_rewarded_up_penalised_down_and_zero_advantage_noop(random_model_dir, monkeypatch):
    import sys

    from sptool.train import step as step_module

    trainer = make_trainer(random_model_dir, learning_rate=1e-3, loss="dr_grpo", weight_decay=0.1)
    prompt = [{"role": "user", "content": "Answer yes or no."}]
    before_good = sequence_logprob(trainer, prompt, "yes indeed")
    before_bad = sequence_logprob(trainer, prompt, "no way")
    trims = []  # a CPU update gives the heap's freed pages back once, after its optimizer step
    release = step_module.release_freed_host_memory
    monkeypatch.setattr(step_module, "release_freed_host_memory", lambda: trims.append(trainer.step) or release())
    metrics = trainer.update([{"prompt": prompt, "completions": ["yes indeed", "no way"], "rewards": [1.0, 0.0]}])
    assert trims == [1] and release() == sys.platform.startswith("linux")
    after_good = sequence_logprob(trainer, prompt, "yes indeed")
    after_bad = sequence_logprob(trainer, prompt, "no way")
    assert after_good > before_good + 1e-3
    assert after_bad < before_bad - 1e-3
    assert metrics["step"] == 1 and not metrics["skipped"] and metrics["clip_fraction"] == 0.0
    assert metrics["ratio_mean"] == pytest.approx(1.0)

    # a group whose rewards are all equal has zero advantage: nothing changes (not even weight decay)
    snapshot = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    metrics = trainer.update([{"prompt": prompt, "completions": ["yes", "no"], "rewards": [0.5, 0.5]}])
    assert metrics["skipped"] is True and metrics["step"] == 2
    assert all(torch.equal(snapshot[k], v) for k, v in trainer.model.state_dict().items())


def test_an_update_counts_the_graphs_torch_compile_made_for_it(random_model_dir, monkeypatch):
    """``graphs_compiled``: what an update's compiles were (a new micro-batch shape, a recompile), so
    that a slow GPU step can be told from one that compiled. Here the layers are compiled by
    dynamo's ``eager`` backend (no inductor on the CPU): the first update makes graphs, the same
    update again none; a trainer that compiles nothing says 0."""
    import torch

    from sptool.train import step as step_module

    def compile_eagerly(model, log):
        layers = list(model.model.layers)
        for layer in layers:
            layer.compile(backend="eager")
        return layers

    groups = [{"prompt": [{"role": "user", "content": "Answer yes or no."}],
               "completions": ["yes indeed", "no way"], "rewards": [1.0, 0.0]}]
    plain = make_trainer(random_model_dir, learning_rate=1e-4)
    assert plain.update(groups)["graphs_compiled"] == 0
    monkeypatch.setattr(step_module, "_compile_decoder_layers", compile_eagerly)
    torch._dynamo.reset()
    compiled = make_trainer(random_model_dir, learning_rate=1e-4, compile=True)
    assert compiled.compiled_layers and compiled.update(groups)["graphs_compiled"] >= 1
    assert compiled.update(groups)["graphs_compiled"] == 0


def test_an_update_reports_what_the_cuda_allocator_did_during_it(random_model_dir, monkeypatch):
    """``alloc_retries``, ``device_mallocs``, ``device_frees``: the change of torch's caching-allocator
    counters over one update (a slow GPU step that paid for ``cudaMalloc``/``cudaFree`` shows it);
    None on a CPU. The counters are read from ``torch.cuda.memory_stats`` by name."""
    import torch

    from sptool.train import model as model_module
    from sptool.train import step as step_module

    groups = [{"prompt": [{"role": "user", "content": "Answer yes or no."}],
               "completions": ["yes indeed", "no way"], "rewards": [1.0, 0.0]}]
    trainer = make_trainer(random_model_dir, learning_rate=1e-4)
    metrics = trainer.update(groups)
    assert {key: metrics[key] for key in ("alloc_retries", "device_mallocs", "device_frees")} == dict.fromkeys(
        ("alloc_retries", "device_mallocs", "device_frees"))

    # on CUDA: torch's counters by name, read without touching the device
    asked = []
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: asked.append(device) or {
        "num_alloc_retries": 2, "num_device_alloc": 7, "num_device_free": 5, "allocated_bytes.all.peak": 1})
    cuda = torch.device("cuda", 0)
    assert model_module.cuda_allocator_counts(cuda) == {"alloc_retries": 2, "device_mallocs": 7, "device_frees": 5}
    assert asked == [cuda] and model_module.cuda_allocator_counts(torch.device("cpu")) is None

    # an update's figures are the change between its start and its end
    readings = iter([{"alloc_retries": 1, "device_mallocs": 40, "device_frees": 3},
                     {"alloc_retries": 2, "device_mallocs": 46, "device_frees": 3}])
    monkeypatch.setattr(step_module, "cuda_allocator_counts", lambda device: next(readings))
    metrics = trainer.update(groups)
    assert (metrics["alloc_retries"], metrics["device_mallocs"], metrics["device_frees"]) == (1, 6, 0)


def test_old_logprobs_equal_to_current_give_the_ratio_one_update(random_model_dir):
    """Clipped surrogate with π_old = π_θ is the plain policy gradient; an off-policy π_old changes it."""
    base = make_trainer(random_model_dir, learning_rate=1e-3, loss="grpo")
    sequences = base.encode_group(GROUPS[0])
    current = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq.prompt_ids + seq.completion_ids])
            logits = base.model(input_ids=ids).logits[0, len(seq.prompt_ids) - 1:-1].float()
            current.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq.completion_ids)[:, None])
                           .squeeze(-1).tolist())
    base.update([GROUPS[0]])
    same = make_trainer(random_model_dir, learning_rate=1e-3, loss="grpo")
    metrics = same.update([{**GROUPS[0], "old_logprobs": current}])
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["old_logprob_mismatches"] == 0
    diff = max(float((a - b).detach().abs().max()) for a, b in zip(base.model.parameters(), same.model.parameters()))
    assert diff < 1e-5  # 1% of the learning rate (Adam's first step moves each weight by ≈ lr)
    shifted = make_trainer(random_model_dir, learning_rate=1e-3, loss="grpo")
    far = [[x - 1.0 for x in row] for row in current]  # ratio e ≈ 2.7: clipped for positive advantages
    metrics = shifted.update([{**GROUPS[0], "old_logprobs": far}])
    assert metrics["clip_fraction"] > 0.2 and metrics["ratio_mean"] == pytest.approx(math.e, rel=1e-3)


def test_response_prefix_is_prompt_and_a_stop_string_gets_no_eos(random_model_dir):
    """A prompt ending in an assistant message (response prefix) renders with it, so the prefix
    that begins each completion is scored as prompt, not trained; a stop-string end adds no EOS."""
    from sptool.models.tokenizer import render_prompt

    trainer = make_trainer(random_model_dir)
    tokenizer = trainer.tokenizer
    prompt = [{"role": "user", "content": "Write a problem."}, {"role": "assistant", "content": "<question>"}]
    sequences = trainer.encode_group(group(completions=["<question>How many?", "<question>Two cats"],
                                           rewards=[1.0, 0.0], stop_strings=["?", None],
                                           finish_reasons=["stop", "stop"]) | {"prompt": prompt})
    expected_prompt = render_prompt(tokenizer, prompt[:1]) + "<question>"
    assert expected_prompt.endswith("<|im_start|>assistant\n<question>")
    assert sequences[0].prompt_ids == tokenizer(expected_prompt, add_special_tokens=False)["input_ids"]
    assert sequences[0].completion_ids == tokenizer("How many?", add_special_tokens=False)["input_ids"]
    assert sequences[1].completion_ids == tokenizer("Two cats", add_special_tokens=False)["input_ids"] + [
        tokenizer.eos_token_id]


def test_kl_to_reference_is_zero_at_start_then_positive(random_model_dir):
    trainer = make_trainer(random_model_dir, learning_rate=1e-2, beta=0.1)
    first = trainer.update(GROUPS[:2])
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first update
    second = trainer.update(GROUPS[:2])
    assert second["kl"] > 1e-6
    assert trainer.checkpoint_state()["reference_model"] == os.path.abspath(random_model_dir)


def test_two_invocations_equal_one_invocation_with_two_updates(cli, random_model_dir, tmp_path):
    g1, g2 = write_jsonl(tmp_path / "g1.jsonl", GROUPS[:2]), write_jsonl(tmp_path / "g2.jsonl", GROUPS[2:])
    both = write_jsonl(tmp_path / "both.jsonl", GROUPS)
    common = ["--lr", "1e-3", "--loss", "dapo", "-q"]
    # two invocations: G1 then G2
    assert cli(["train-step", g1, "-m", random_model_dir, "-o", tmp_path / "s1", *common]).exit_code == 0
    assert cli(["train-step", g2, "-m", tmp_path / "s1", "-o", tmp_path / "s2", *common]).exit_code == 0
    # one invocation, two updates (2 groups each)
    result = cli(["train-step", both, "-m", random_model_dir, "-o", tmp_path / "one", "--groups-per-update", "2",
                  "--metrics", tmp_path / "m.jsonl", *common])
    assert result.exit_code == 0, result.output
    assert [m["step"] for m in read_jsonl(tmp_path / "m.jsonl")] == [1, 2]
    assert max_abs_diff(weights_of(tmp_path / "s2"), weights_of(tmp_path / "one")) < 1e-6
    state = json.loads((tmp_path / "s2" / "sptool_state" / "state.json").read_text())
    assert state["step"] == 2 and state["roles"] == ["questioner", "solver"] and state["config"]["loss"] == "dapo"
    # the optimizer state really matters: without it the second step differs
    shutil.copytree(tmp_path / "s1", tmp_path / "s1-fresh")
    (tmp_path / "s1-fresh" / "sptool_state" / "optimizer.pt").unlink()
    assert cli(["train-step", g2, "-m", tmp_path / "s1-fresh", "-o", tmp_path / "s2-fresh", *common]).exit_code == 0
    assert max_abs_diff(weights_of(tmp_path / "s2"), weights_of(tmp_path / "s2-fresh")) > 1e-4
    # restore_optimizer=False (sptool run's train.start_optimizer = "fresh"): the saved moments are not read
    updated = {}
    for name, start, restore in (("fresh", tmp_path / "s1", False), ("deleted", tmp_path / "s1-fresh", True),
                                 ("restored", tmp_path / "s1", True)):
        trainer = make_trainer(str(start), learning_rate=1e-3, loss="dapo", restore_optimizer=restore)
        trainer.update(GROUPS[2:])
        updated[name] = {key: value.detach().clone() for key, value in trainer.model.state_dict().items()}
    assert max_abs_diff(updated["fresh"], updated["deleted"]) < 1e-6
    assert max_abs_diff(updated["fresh"], updated["restored"]) > 1e-4


def test_accelerate_two_processes_equal_one_process(cli, random_model_dir, tmp_path):
    launcher = shutil.which("accelerate") or str(Path(sys.executable).parent / "accelerate")
    if not os.path.exists(launcher):
        pytest.skip("accelerate launch is not installed")
    groups = write_jsonl(tmp_path / "groups.jsonl", GROUPS)
    options = ["--lr", "1e-3", "--max-tokens-per-micro-batch", "48", "-q"]
    result = cli(["train-step", groups, "-m", random_model_dir, "-o", tmp_path / "single",
                  "--metrics", tmp_path / "single.jsonl", *options])
    assert result.exit_code == 0, result.output
    # `accelerate launch --cpu` ignores --num_processes (one process, no MPI): --multi_gpu starts
    # torchrun-style workers, and sptool's Accelerator(cpu=True) picks gloo on this CPU machine.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                          "--main_process_port", str(free_port()),
                          "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "sptool.cli.main",
                          "train-step", str(groups), "-m", random_model_dir, "-o", str(tmp_path / "dual"),
                          "--metrics", str(tmp_path / "dual.jsonl"), *options],
                         capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    single, dual = read_jsonl(tmp_path / "single.jsonl")[0], read_jsonl(tmp_path / "dual.jsonl")
    assert len(dual) == 1 and dual[0]["world_size"] == 2 and single["world_size"] == 1
    assert dual[0]["loss"] == pytest.approx(single["loss"], rel=1e-5)
    assert dual[0]["completion_tokens"] == single["completion_tokens"]
    assert dual[0]["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-4)
    base = weights_of(random_model_dir)
    delta = max_abs_diff(weights_of(tmp_path / "single"), base)
    assert delta > 1e-4  # the update did something
    assert max_abs_diff(weights_of(tmp_path / "dual"), weights_of(tmp_path / "single")) < 2e-5


def test_lora_adapter_is_written_resumed_and_loadable_by_solve(cli, random_model_dir, tmp_path):
    groups = write_jsonl(tmp_path / "groups.jsonl", GROUPS[:2])
    result = cli(["train-step", groups, "-m", random_model_dir, "-o", tmp_path / "lora1", "--lora-r", "4",
                  "--lora-target-modules", "q_proj,v_proj", "--lr", "1e-2", "-q"])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "lora1" / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    assert config["base_model_name_or_path"] == os.path.abspath(random_model_dir)
    assert not (tmp_path / "lora1" / "model.safetensors").exists()
    assert cli(["train-step", groups, "-m", tmp_path / "lora1", "-o", tmp_path / "lora2", "--lr", "1e-2", "-q",
                "--beta", "0.05"]).exit_code == 0
    state = json.loads((tmp_path / "lora2" / "sptool_state" / "state.json").read_text())
    assert state["step"] == 2 and state["trainable"] == "lora"
    adapter1, adapter2 = weights_of(tmp_path / "lora1"), weights_of(tmp_path / "lora2")
    assert max_abs_diff(adapter1, adapter2) > 1e-4
    # the hf backend (solve) loads the adapter directory and generates
    from sptool.models.base import SamplingParams, load_backend

    backend = load_backend("hf", str(tmp_path / "lora2"), device="cpu")
    out = backend.generate(["Hello"], 1, SamplingParams(temperature=0, max_new_tokens=4))
    assert out[0][0].n_tokens >= 1


def test_crash_during_save_leaves_input_intact_and_no_output(cli, sptool, random_model_dir, tmp_path):
    groups = write_jsonl(tmp_path / "groups.jsonl", GROUPS[:2])
    assert cli(["train-step", groups, "-m", random_model_dir, "-o", tmp_path / "in", "-q", "--lr", "1e-3"]).exit_code == 0
    before = weights_of(tmp_path / "in")
    state_before = (tmp_path / "in" / "sptool_state" / "state.json").read_text()
    # in-process: an exception after the weights were staged
    os.environ["SPTOOL_TEST_CRASH_DURING_SAVE"] = "1"
    try:
        with pytest.raises(RuntimeError, match="injected crash"):
            cli(["train-step", groups, "-m", tmp_path / "in", "-o", tmp_path / "out", "-q", "--lr", "1e-3"])
        with pytest.raises(RuntimeError, match="injected crash"):  # --output == --model: swapped only at the end
            cli(["train-step", groups, "-m", tmp_path / "in", "-o", tmp_path / "in", "-q", "--lr", "1e-3"])
    finally:
        del os.environ["SPTOOL_TEST_CRASH_DURING_SAVE"]
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # staging cleaned up
    # a hard kill (no cleanup runs) mid-save, as a real process
    killed = sptool("train-step", str(groups), "-m", str(tmp_path / "in"), "-o", str(tmp_path / "in"), "-q",
                    env={"SPTOOL_TEST_CRASH_DURING_SAVE": "kill"})
    assert killed.returncode == 137
    assert not (tmp_path / "out").exists()
    assert max_abs_diff(weights_of(tmp_path / "in"), before) == 0.0
    assert (tmp_path / "in" / "sptool_state" / "state.json").read_text() == state_before
    trainer = make_trainer(str(tmp_path / "in"))  # still loadable, optimizer state included
    assert trainer.step == 1


# ------------------------------------------------------------------------------ CLI contract


def test_help_lists_the_options(sptool):
    result = sptool("train-step", "--help", env={"COLUMNS": "200"})
    assert result.returncode == 0
    assert "torch" not in result.stderr
    for option in ("--model", "--output", "--loss", "--beta", "--learning-rate", "--lora-r", "--roles",
                   "--max-tokens-per-micro-batch", "--groups-per-update", "--metrics"):
        assert option in result.stdout


def test_empty_input_writes_unchanged_checkpoint(cli, random_model_dir, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = cli(["train-step", empty, "-m", random_model_dir, "-o", tmp_path / "out"])
    assert result.exit_code == 0
    assert "no training groups" in result.stderr
    assert max_abs_diff(weights_of(tmp_path / "out"), weights_of(random_model_dir)) == 0.0


def test_bad_line_exits_2_with_location(sptool, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(GROUPS[0]) + "\n" + json.dumps({**GROUPS[1], "rewards": [1.0]}) + "\n")
    result = sptool("train-step", str(bad), "-m", "tiny", "-o", str(tmp_path / "out"))
    assert result.returncode == 2
    assert f"{bad}:2: field 'rewards': expected 3 entries" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_roles_select_groups_and_output_must_not_clobber_user_dirs(cli, random_model_dir, tmp_path):
    groups = write_jsonl(tmp_path / "groups.jsonl", GROUPS)
    result = cli(["train-step", groups, "-m", random_model_dir, "-o", tmp_path / "out", "--roles", "questioner",
                  "--metrics", tmp_path / "m.jsonl", "--lr", "1e-3"])
    assert result.exit_code == 0, result.output
    metrics = read_jsonl(tmp_path / "m.jsonl")[0]
    assert list(metrics["reward_mean"]) == ["questioner"] and metrics["completions"] == 2
    assert "3 skipped (role)" in result.stderr
    assert json.loads((tmp_path / "out" / "sptool_state" / "state.json").read_text())["roles"] == ["questioner"]
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep")
    result = cli(["train-step", groups, "-m", random_model_dir, "-o", precious])  # errors are exit codes in-process
    assert result.exit_code == 2 and "exists and is not a model checkpoint" in result.stderr
    assert (precious / "notes.txt").read_text() == "keep"


# ------------------------------------------------------------------------------ real tiny model


@pytest.mark.slow
def test_real_tiny_model_reward_rises(tiny_model_dir, tmp_path):
    """Sample with the hf backend, reward completions that contain an exclamation mark, train a
    LoRA adapter for a few updates on those groups, re-sample: the mean reward goes up."""
    from sptool.models.base import SamplingParams, load_backend
    from sptool.train.step import PolicyTrainer, TrainConfig

    prompts = [[{"role": "user", "content": text}] for text in
               ("Say hello to me.", "Greet a friend.", "Tell me about the sea.")]
    k = 4
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=1, logprobs=True)

    def reward(text: str) -> float:
        return 1.0 if "!" in text else 0.0

    def sample(model_dir: str):
        backend = load_backend("hf", model_dir, device="cpu", batch_size=32)
        outputs = backend.generate(prompts, k, params)
        backend.close()
        return outputs

    before = sample(tiny_model_dir)
    mean_before = sum(reward(s.text) for row in before for s in row) / (k * len(prompts))
    groups = [{"prompt": p, "role": "solver", "completions": [s.text for s in row],
               "rewards": [reward(s.text) for s in row], "old_logprobs": [s.logprobs for s in row],
               "finish_reasons": [s.finish_reason for s in row]} for p, row in zip(prompts, before)]
    trainer = PolicyTrainer(TrainConfig(model=tiny_model_dir, lora_r=8, learning_rate=5e-3, loss="dr_grpo"))
    history = [trainer.update(groups) for _ in range(3)]
    # the sampler's log-probs line up with the trainer's tokens (same prompt rendering): ratio ≈ 1;
    # a decode/re-encode round trip may differ for a rare completion (that one falls back to ratio 1)
    assert history[0]["old_logprob_mismatches"] <= 1
    assert history[0]["ratio_mean"] == pytest.approx(1.0, abs=0.02)
    trainer.save(tmp_path / "trained")
    after = sample(str(tmp_path / "trained"))
    mean_after = sum(reward(s.text) for row in after for s in row) / (k * len(prompts))
    print(f"\nreal tiny model: mean reward {mean_before:.3f} -> {mean_after:.3f}; "
          f"losses {[round(m['loss'], 4) for m in history]}, ratio {history[0]['ratio_mean']:.4f}, "
          f"seconds/update {[round(m['seconds'], 1) for m in history]}")
    assert mean_after > mean_before + 0.1


def test_restored_moments_carry_the_last_update_into_a_faint_one(random_model_dir, tmp_path):
    """Why ``sptool run`` starts a fresh optimizer from another run's checkpoint: Adam's step is about
    lr per weight whatever the gradient's size, so restored moments turn an update with almost no
    signal into a step along the previous run's last update. A label-free arm that restored its
    labelled start's moments kept learning from the labels for some ten updates."""
    def flat(trainer):
        return torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters()])

    labelled = make_trainer(random_model_dir, learning_rate=1e-3)
    before = flat(labelled)
    labelled.update(GROUPS[:2])
    labelled_step = flat(labelled) - before
    labelled.save(str(tmp_path / "s1"))
    faint = [group("Say yes.", ["yes", "no"], [1e-6, 0.0])]  # Dr. GRPO advantages ±5e-7
    cosine = {}
    for restore in (True, False):
        trainer = make_trainer(str(tmp_path / "s1"), learning_rate=1e-3, restore_optimizer=restore)
        start = flat(trainer)
        trainer.update(faint)
        step = flat(trainer) - start
        cosine[restore] = float(torch.nn.functional.cosine_similarity(step, labelled_step, dim=0))
    assert cosine[True] > 0.9, cosine
    assert cosine[False] < 0.5, cosine


def test_a_non_finite_gradient_norm_names_its_parameters_and_writes_no_update(random_model_dir):
    """The error line says whether the loss was finite and which gradients were not (the first
    GPU loop step at the 0.6B shape raised "non-finite gradient norm (nan)" with nothing more)."""
    import torch

    from sptool.core.records import RuntimeFailure

    trainer = make_trainer(random_model_dir, device="cpu")
    model = trainer.accelerator.unwrap_model(trainer.model)
    name = "model.layers.0.mlp.down_proj.weight"
    poisoned = dict(model.named_parameters())[name]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    handle = poisoned.register_hook(lambda grad: grad * float("nan"))
    with pytest.raises(RuntimeFailure) as failure:
        trainer.update(GROUPS)
    message = str(failure.value)
    assert "non-finite gradient norm (nan) at step 1" in message
    assert f"the loss was finite; non-finite gradients in {name}" in message and "no update written" in message
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # nothing applied
    handle.remove()
    assert math.isfinite(trainer.update(GROUPS)["loss"])  # and the next step trains
