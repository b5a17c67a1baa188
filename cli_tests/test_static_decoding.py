"""The hf backend's static-cache path (issue 23): bucketed batch shapes, step-by-step sampling
log-probabilities, and a decoder that sees every training update of the weights it shares.

On CPU the static path runs without compilation (``static_cache=True``); the compiled
(CUDA-graph) variant is the ``gpu`` test, run on the device machine.
"""

from __future__ import annotations

import pytest

from conftest import assert_same_greedy

PROMPTS = [[{"role": "user", "content": "What is 2 + 3?"}], [{"role": "user", "content": "Name a colour."}]]
GROUPS = [{"prompt": PROMPTS[0], "completions": ["The answer is 7, surely.", "5"], "rewards": [1.0, 0.0]},
          {"prompt": PROMPTS[1], "completions": ["Seven is a colour.", "Blue"], "rewards": [1.0, 0.0]}]


# -- fast checks (no model) ------------------------------------------------------------------

def test_batch_rows_and_cache_lengths_fall_into_few_buckets():
    from sptool.models.hf_decoding import bucket_length, bucket_rows

    assert [bucket_rows(rows, 64) for rows in (1, 7, 8, 9, 16, 17, 33, 63, 64)] == \
        [8, 8, 8, 16, 16, 32, 64, 64, 64]
    assert bucket_rows(300, 512) == 512 and bucket_rows(300, 500) == 500  # capped by the batch size
    assert bucket_rows(3, 2) == 3  # never fewer rows than asked for
    assert len({bucket_rows(rows, 512) for rows in range(1, 513)}) == 7  # 8 … 512
    assert [bucket_length(n) for n in (1, 64, 65, 200, 320)] == [64, 64, 128, 256, 320]
    # a run's solve calls (any prompt length up to 64 tokens, 64 new) share one cache length
    assert {bucket_length(prompt + 64) for prompt in range(1, 65)} == {128}


def test_compile_generation_is_a_typed_model_setting_on_by_default():
    from sptool.run.config import ModelConfig

    assert ModelConfig().compile_generation is True


def test_logprob_recorder_gathers_each_sampled_token_from_its_own_step():
    """Three steps of two rows (a padding row third): each token's log-probability comes from
    the raw logits of the step that sampled it (the next call's last input id), the last one
    from the generated sequence; the padding row is dropped."""
    import torch

    from sptool.models.hf_decoding import LogprobRecorder

    torch.manual_seed(0)
    steps = [torch.randn(3, 5) for _ in range(3)]
    tokens = torch.tensor([[1, 4, 0], [2, 2, 3], [0, 0, 0]])
    recorder = LogprobRecorder()
    input_ids = torch.zeros(3, 4, dtype=torch.long)  # the prompt
    for step, logits in enumerate(steps):
        assert recorder(input_ids, logits) is logits  # the scores pass through unchanged
        input_ids = torch.cat([input_ids, tokens[:, step:step + 1]], dim=1)
    got = torch.tensor(recorder.rows(tokens[:2]))
    want = torch.stack([torch.log_softmax(logits, -1)[:2].gather(-1, tokens[:2, s:s + 1]).squeeze(-1)
                        for s, logits in enumerate(steps)], dim=1)
    assert got.shape == (2, 3) and torch.allclose(got, want, atol=1e-6)


# -- the real tiny model ---------------------------------------------------------------------

def greedy(backend, params) -> list[list[int]]:
    return [row[0].token_ids for row in backend.generate(PROMPTS, 1, params)]


def check_update_visibility(tiny_model_dir: str, device: str, compile: bool, tie: float):
    """A trainer and two backends over its one live model: the eager one and the static (or
    compiled) one. The static decoder agrees with eager before and after a large-step update,
    and the update changes what both write (so a stale decoder would fail)."""
    from sptool.models.base import SamplingParams
    from sptool.models.hf import HFBackend
    from sptool.train.step import PolicyTrainer, TrainConfig

    trainer = PolicyTrainer(TrainConfig(model=tiny_model_dir, learning_rate=1e-3, device=device))
    model = trainer.accelerator.unwrap_model(trainer.model)
    eager = HFBackend.from_model(model, trainer.tokenizer, model_id=tiny_model_dir, batch_size=8)
    fast = HFBackend.from_model(model, trainer.tokenizer, model_id=tiny_model_dir, batch_size=8,
                                static_cache=True, compile=compile)
    assert eager.decoding == "eager" and fast.decoding == ("compiled" if compile else "static")
    params = SamplingParams(temperature=0, max_new_tokens=16)
    before = greedy(eager, params)
    fast_before = greedy(fast, params)
    for prompt, got, want in zip(PROMPTS, fast_before, before):
        assert_same_greedy(eager, prompt, got, want, tie)
    trainer.update(GROUPS)
    after = greedy(eager, params)
    assert after != before, "the update did not change the greedy output: the test proves nothing"
    fast_after = greedy(fast, params)
    for prompt, got, want in zip(PROMPTS, fast_after, after):
        assert_same_greedy(eager, prompt, got, want, tie)
    assert fast_after != fast_before
    # both calls: 2 prompts -> one 8-row bucket, one cache length: one cache, reset and reused
    assert len(fast.shapes_seen) == 1 and len(fast._caches) == 1 and fast.cache_bytes() > 0
    return trainer, eager, fast


@pytest.mark.slow
def test_static_cache_decoder_sees_every_update_and_keeps_stops_and_logprobs(tiny_model_dir):
    """CPU: the static-cache path (no compile on CPU) after a real train-step update writes the
    eager backend's greedy tokens from the same new weights; stop strings cut its text and ids
    as on the eager path; log-probabilities come per generated token (one prompt: padded rows)."""
    from sptool.models.base import SamplingParams

    _, eager, fast = check_update_visibility(tiny_model_dir, "cpu", compile=False, tie=1e-3)
    stop = SamplingParams(temperature=0, max_new_tokens=16, stop=(" ", "."), logprobs=True)
    got, want = fast.generate(PROMPTS[:1], 1, stop)[0][0], eager.generate(PROMPTS[:1], 1, stop)[0][0]
    assert want.stop_string is not None and want.finish_reason == "stop"  # the stop really ended it
    assert (got.text, got.token_ids, got.stop_string, got.finish_reason) == \
        (want.text, want.token_ids, want.stop_string, want.finish_reason)
    assert len(got.logprobs) == got.n_tokens == len(want.logprobs)
    assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < 1e-3


@pytest.mark.gpu
@pytest.mark.slow
def test_compiled_decoder_sees_every_update_on_gpu(tiny_model_dir):
    """CUDA: the compiled (static cache, CUDA graphs) decoder after a train-step update writes
    the eager backend's greedy tokens from the same new weights, through a compiled graph."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from torch._dynamo.utils import counters

    # bf16 kernels (inductor's vs eager) may order a near-tie differently; staleness is caught by
    # the changed output and by the margin check at any other divergence
    trainer, eager, fast = check_update_visibility(tiny_model_dir, "cuda", compile=True, tie=0.25)
    assert fast.decoding == "compiled"  # no fallback to eager on the way
    assert counters["stats"]["unique_graphs"] >= 1  # the decoding step really went through dynamo


@pytest.mark.slow
def test_compiled_decoding_step_traces_once_and_reads_weights_in_place_on_cpu(hf_backend_cpu):
    """The compiled path on CPU through dynamo (``aot_eager``: no CUDA graphs, no inductor
    build): the decoding step is one graph, the model's regionally compiled layers (as the
    trainer compiles them on CUDA) do not recompile per cache layer, and after an in-place
    change of every weight the compiled step writes the eager greedy tokens, without a new graph."""
    import torch
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    from sptool.models.base import SamplingParams
    from sptool.models.hf import HFBackend

    eager = hf_backend_cpu
    for layer in eager.model.model.layers:
        layer.compile()
    fast = HFBackend.from_model(eager.model, eager.tokenizer, model_id="tiny", batch_size=8, static_cache=True)
    config = CompileConfig(backend="aot_eager", mode=None)
    config._compile_all_devices = True  # transformers' switch for compiling off CUDA
    fast.compile, fast._compile_config = True, config
    params = SamplingParams(temperature=0, max_new_tokens=6)
    prompts = ["What is 2 + 3?", "Name a colour."]
    graphs = counters["stats"]["unique_graphs"]
    before = greedy_of(fast, prompts, params)
    assert before == greedy_of(eager, prompts, params)
    assert counters["stats"]["unique_graphs"] - graphs == 1  # one decoding graph, no layer recompiles
    with torch.no_grad():
        torch.manual_seed(0)
        for parameter in eager.model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)  # in place, as an optimizer step
    after = greedy_of(fast, prompts, params)
    assert after != before and after == greedy_of(eager, prompts, params)
    assert counters["stats"]["unique_graphs"] - graphs == 1 and fast._compile_proven


def greedy_of(backend, prompts, params) -> list[list[int]]:
    return [row[0].token_ids for row in backend.generate(prompts, 1, params)]


@pytest.fixture
def hf_backend_cpu():
    """A private tiny model on CPU (this test changes its weights and compiles its layers)."""
    from sptool.models.hf import HFBackend

    backend = HFBackend("tiny", device="cpu", batch_size=8)
    yield backend
    for layer in backend.model.model.layers:
        layer._compiled_call_impl = None
    backend.close()
