"""The hf backend's step decoder (issue 33, ``model.decoder = "step"``): greedy tokens equal to
eager ``generate``'s, sampling log-probabilities equal to a forward pass's, the finish reasons,
update visibility, and the shared-prompt prefill. CPU, float32, the real tiny model (one loaded
model shared by the module)."""

from __future__ import annotations

import contextlib
import gc

import pytest

from conftest import assert_same_greedy

# prompts of different lengths: a left-padded batch
PROMPTS = ["What is 2 + 3?", [{"role": "user", "content": "Name a colour, any colour you like, and say why."}],
           "Hi"]
TIE = 1e-4  # float32 on both paths: only a genuine tie may be ordered differently


# -- fast checks (no model) ------------------------------------------------------------------

def test_decoder_and_decode_attention_are_typed_model_settings_off_by_default():
    from sptool.run.config import ModelConfig

    assert ModelConfig().decoder == "generate"
    assert ModelConfig().decode_attention == "model"
    assert ModelConfig().step_graph == "compile"


def test_rows_share_their_prompt_and_padding_rows_repeat_the_last():
    from sptool.models.step_decoder import row_map_of

    assert row_map_of(["a", "a", "b", "b", "c"], 8) == (["a", "b", "c"], [0, 0, 1, 1, 2, 2, 2, 2])
    assert row_map_of(["a", "a", "b"], 3, share=False) == (["a", "a", "b"], [0, 1, 2])


def test_a_common_prefix_goes_first_and_every_token_keeps_its_position():
    """``prefix_first``: left-padded prompts laid out as [common prefix | left-padded rest]. Each
    row's tokens in order and their positions (the mask's running count) are unchanged; the prefix
    leaves each row one token of its own; no prefix for one prompt, a too-short prompt, or fewer
    saved tokens than asked for."""
    import torch

    from sptool.models.step_decoder import prefix_first

    rows = [[5, 6, 7, 8, 9], [5, 6, 7, 1, 2, 3, 4], [5, 6, 7, 2, 3, 4], [5, 6, 7]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(row)) + row for row in rows])
    mask = (ids != 0).long()
    laid, laid_mask, prefix = prefix_first(ids, mask, 0, min_saved_tokens=1)
    assert prefix == 2  # "5 6 7" is common, but the 3-token prompt keeps its 7
    assert laid[:, :2].tolist() == [[5, 6]] * 4 and laid_mask[:, :2].tolist() == [[1, 1]] * 4

    def positions(m):
        return (m.cumsum(-1) - 1).masked_fill(m == 0, -1)

    for row, before, after, m_before, m_after in zip(rows, ids, laid, mask, laid_mask):
        assert after[m_after.bool()].tolist() == row == before[m_before.bool()].tolist()
        assert positions(m_after)[m_after.bool()].tolist() == positions(m_before)[m_before.bool()].tolist()
    assert laid[3].tolist() == [5, 6, 0, 0, 0, 0, 7]  # the padding moved between prefix and rest
    assert prefix_first(ids, mask, 0, min_saved_tokens=7)[2] == 0  # 2 tokens x 3 other rows = 6 saved
    assert prefix_first(ids[:1], mask[:1], 0, min_saved_tokens=0)[2] == 0
    short = torch.tensor([[0, 5], [5, 6]])
    assert prefix_first(short, (short != 0).long(), 0, min_saved_tokens=0)[2] == 0


def test_choose_samples_without_a_sync_and_records_raw_logprobs():
    """The sampling step: greedy is the argmax; the log-probability is under the raw logits
    (temperature and top-p only change the choice); finished rows emit pad and stop growing;
    EOS finishes a row; top-p never picks outside the nucleus."""
    import torch

    from sptool.models.step_decoder import choose

    torch.manual_seed(0)
    logits = torch.randn(4, 10)
    logits[:, 9] = torch.tensor([-9.0, 9.0, -9.0, -9.0])  # EOS (9): row 1's greedy token only
    finished = torch.tensor([False, False, False, True])
    lengths = torch.tensor([3, 3, 3, 2])
    eos = torch.tensor([9])
    one = torch.tensor(1.0)
    token, chosen, done, grown = choose(logits, finished, lengths, one, one, eos, 7, sample=False, nucleus=False)
    assert token[:3].tolist() == logits[:3].argmax(-1).tolist() and int(token[3]) == 7
    assert torch.allclose(chosen, torch.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1), atol=1e-6)
    assert done.tolist() == [False, True, False, True] and grown.tolist() == [4, 4, 4, 2]
    top = torch.tensor(0.3)
    for _ in range(20):
        token, chosen, _, _ = choose(logits, finished, lengths, torch.tensor(0.7), top, eos, 7, sample=True,
                                     nucleus=True)
        probs = torch.softmax(logits / 0.7, -1)
        for row in range(3):
            above = probs[row] > probs[row, token[row]]
            assert float(probs[row][above].sum()) < 0.3  # inside the nucleus
        assert torch.allclose(chosen, torch.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1), atol=1e-6)


def test_models_the_step_decoder_cannot_run_are_named():
    """A generation_config that changes the logits beyond temperature and top-p (a repetition
    penalty), a sliding-window cache layer, an encoder-decoder: each named, so the backend falls
    back to generate; a plain decoder-only model with full attention passes."""
    from types import SimpleNamespace

    from transformers import GenerationConfig
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    from sptool.models.step_decoder import unsupported

    def model(**generation):
        return SimpleNamespace(config=SimpleNamespace(is_encoder_decoder=False),
                               generation_config=GenerationConfig(**generation))

    full = SimpleNamespace(layers=[StaticLayer(64), StaticLayer(64)])
    assert unsupported(model(eos_token_id=2, pad_token_id=2, top_k=20, temperature=0.7), full) is None
    assert "repetition_penalty=1.05" in unsupported(model(repetition_penalty=1.05), full)
    sliding = SimpleNamespace(layers=[StaticLayer(64), StaticSlidingWindowLayer(64, 16)])
    assert "StaticSlidingWindowLayer" in unsupported(model(), sliding)
    encoder_decoder = SimpleNamespace(config=SimpleNamespace(is_encoder_decoder=True), generation_config=None)
    assert unsupported(encoder_decoder, full) == "an encoder-decoder model"


# -- the real tiny model ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def backends():
    """The eager ``generate`` backend and a step-decoder backend over one float32 CPU model."""
    from sptool.models.hf import HFBackend

    eager = HFBackend("tiny", device="cpu", dtype="fp32", batch_size=8)
    notes: list[str] = []
    step = HFBackend.from_model(eager.model, eager.tokenizer, model_id="tiny", batch_size=8, decoder="step",
                                log=notes.append)
    yield eager, step
    eager.close()


def tokens_of(results) -> list[list[list[int]]]:
    return [[sample.token_ids for sample in row] for row in results]


def check_same_greedy(eager, want, got) -> None:
    for prompt, rows_want, rows_got in zip(PROMPTS, want, got):
        for row_want, row_got in zip(rows_want, rows_got):
            assert_same_greedy(eager, prompt, row_got, row_want, TIE)


@pytest.mark.slow
def test_step_decoder_greedy_equals_generate_and_shared_prefill_changes_nothing(backends):
    """(a) a left-padded batch of prompts of different lengths, n = 3 (9 rows: a batch of 8, then
    one of 1): the step decoder's greedy tokens, texts and finish reasons are eager generate's;
    (e) prefilling every copy instead of each prompt once gives the same."""
    from sptool.models.base import SamplingParams

    eager, step = backends
    params = SamplingParams(temperature=0, max_new_tokens=20)
    want = eager.generate(PROMPTS, 3, params)  # 9 rows: two batches of up to 8
    steps = step.decode_steps
    got = step.generate(PROMPTS, 3, params)
    check_same_greedy(eager, tokens_of(want), tokens_of(got))
    assert [[(s.text, s.finish_reason, s.n_tokens) for s in row] for row in got] == \
        [[(s.text, s.finish_reason, s.n_tokens) for s in row] for row in want]
    assert step.decode_steps - steps == 40  # both batches ran all 20 columns (a row reached the limit)
    assert {s.finish_reason for row in got for s in row} == {"stop", "length"}  # EOS and max_tokens
    step.share_prefill = False
    try:
        unshared = step.generate(PROMPTS, 3, params)
    finally:
        step.share_prefill = True
    check_same_greedy(eager, tokens_of(got), tokens_of(unshared))


@pytest.mark.slow
def test_step_decoder_with_grouped_decode_attention_equals_generate(backends):
    """``model.decode_attention = "grouped"`` (``sptool.models.decode_attention``) over the step
    decoder's static cache: the same greedy tokens as eager ``generate`` with SDPA, the grouped
    function really ran for every decoding position, and the shared model is back on SDPA after
    the call (a trainer sharing it keeps its own attention)."""
    from unittest import mock

    from sptool.models import decode_attention
    from sptool.models.base import SamplingParams

    eager, step = backends
    params = SamplingParams(temperature=0, max_new_tokens=12)
    want = eager.generate(PROMPTS, 2, params)
    seen: list[int] = []
    real = decode_attention.grouped_decode_attention

    def spy(module, query, *args, **kwargs):
        seen.append(query.shape[2])
        return real(module, query, *args, **kwargs)

    step.decode_attention = "grouped"
    try:
        with mock.patch.object(decode_attention, "grouped_decode_attention", spy):
            decode_attention.register()  # the spy under the registered name
            got = step.generate(PROMPTS, 2, params)
    finally:
        step.decode_attention = "model"
        decode_attention.register()
    assert step.model.config._attn_implementation == "sdpa"
    layers = step.model.config.num_hidden_layers
    assert seen.count(1) == 11 * layers  # every decoding step after prefill's token, every layer
    check_same_greedy(eager, tokens_of(want), tokens_of(got))


@pytest.mark.slow
def test_choose_samples_the_tempered_nucleus_distribution_of_generate():
    """The sampled tokens' frequencies over many rows are transformers' distribution: softmax of
    logits / T, cut to the top-p nucleus by TopPLogitsWarper and renormalised (the step decoder's
    arms must learn as generate's; a sampler that drew from another distribution would not)."""
    import torch
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    from sptool.models.step_decoder import choose

    torch.manual_seed(1)
    rows = 200_000
    base = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -3.0, 0.9, 1.4])
    logits = base.expand(rows, -1).contiguous()
    finished = torch.zeros(rows, dtype=torch.bool)
    lengths = torch.zeros(rows, dtype=torch.long)
    eos = torch.tensor([5])
    for temperature, top_p in ((0.7, 0.8), (1.0, 1.0), (1.3, 0.95)):
        token, _, _, _ = choose(logits, finished, lengths, torch.tensor(temperature), torch.tensor(top_p), eos, 0,
                                sample=True, nucleus=top_p < 1.0)
        frequencies = torch.bincount(token, minlength=base.numel()).double() / rows
        warped = TemperatureLogitsWarper(temperature)(None, base[None].clone())
        if top_p < 1.0:
            warped = TopPLogitsWarper(top_p)(None, warped)
        expected = torch.softmax(warped[0], -1).double()
        assert (frequencies[expected == 0] == 0).all(), (temperature, top_p)  # nothing outside the nucleus
        assert torch.allclose(frequencies, expected, atol=0.004), (temperature, top_p, frequencies, expected)


def test_step_decoder_sampling_logprobs_are_the_models_and_seeds_repeat(backends):
    """(b) sampled rows (temperature and top-p): each recorded log-probability is the raw
    logits' log-softmax at that token in a forward pass over prompt + completion; a seed
    repeats its samples, another seed gives others; the progress listener hears every step."""
    import torch

    from sptool.models.base import SamplingParams, set_token_listener

    eager, step = backends
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=20, seed=5, logprobs=True)
    heard: list[int] = []
    set_token_listener(heard.append)
    try:
        first = step.generate(PROMPTS[:2], 2, params)
    finally:
        set_token_listener(None)
    assert sum(heard) > 0 and sum(heard) == 4 * 20  # 4 real rows x the columns decoded
    assert tokens_of(step.generate(PROMPTS[:2], 2, params)) == tokens_of(first)
    other = step.generate(PROMPTS[:2], 2, SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=20,
                                                         seed=6, logprobs=True))
    assert tokens_of(other) != tokens_of(first)
    for prompt, row in zip(PROMPTS, first):
        prompt_ids = eager.tokenizer(eager.render(prompt), add_special_tokens=False)["input_ids"]
        for sample in row:
            assert len(sample.logprobs) == sample.n_tokens == len(sample.token_ids) > 0
            ids = torch.tensor([prompt_ids + sample.token_ids])
            with torch.inference_mode():
                logits = eager.model(ids).logits[0, len(prompt_ids) - 1:-1].float()
            want = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt_ids):, None]).squeeze(-1)
            assert torch.allclose(torch.tensor(sample.logprobs), want, atol=1e-4), (sample.logprobs, want)


@pytest.mark.slow
def test_step_decoder_stops_at_eos_max_tokens_and_stop_strings(backends):
    """(c) EOS ends a row with "stop" (the EOS id its last token); max_tokens with "length";
    stop strings cut text and ids exactly as the generate path does, and the every-N-steps
    check ends the batch early once every row has stopped; a passed deadline decodes nothing."""
    from sptool.models.base import SamplingParams

    eager, step = backends
    short = step.generate(PROMPTS, 1, SamplingParams(temperature=0, max_new_tokens=3))
    eos = set(step._eos_ids())
    for row in short:
        sample = row[0]
        assert sample.finish_reason == ("stop" if sample.token_ids[-1] in eos else "length")
        assert sample.n_tokens == len(sample.token_ids) <= 3
        assert sample.finish_reason == "stop" or sample.n_tokens == 3
    stop = SamplingParams(temperature=0, max_new_tokens=48, stop=(" ", ".", "-"), logprobs=True)
    want, steps = eager.generate(PROMPTS, 1, stop), step.decode_steps
    got = step.generate(PROMPTS, 1, stop)
    assert any(row[0].stop_string for row in want)
    for row_want, row_got in zip(want, got):
        a, b = row_want[0], row_got[0]
        assert (b.text, b.token_ids, b.stop_string, b.finish_reason) == \
            (a.text, a.token_ids, a.stop_string, a.finish_reason)
        assert len(b.logprobs) == b.n_tokens
    assert step.decode_steps - steps == 16  # every row had stopped by the first check
    past = SamplingParams(temperature=0, max_new_tokens=8, deadline=0.0)
    assert step.generate(PROMPTS, 1, past) == [[], [], []]


@pytest.mark.slow
def test_compiled_step_decoder_is_one_graph_and_sees_in_place_weight_changes(backends):
    """(d) the step compiled through dynamo (``aot_eager`` on CPU: no CUDA graphs, no inductor
    build) is one graph; scaling a layer's weights in place (as an optimizer step writes them)
    changes its next greedy output to eager generate's on the new weights, without a new graph."""
    import torch
    from torch._dynamo.utils import counters

    from sptool.models.base import SamplingParams
    from sptool.models.hf import HFBackend
    from sptool.models.step_decoder import StepDecoder

    eager, _ = backends
    fast = HFBackend.from_model(eager.model, eager.tokenizer, model_id="tiny", batch_size=8, decoder="step")
    fast._step_decoder = StepDecoder(eager.model, compile=True, compile_prefill=False,
                                     compile_options=dict(backend="aot_eager", dynamic=False))
    params = SamplingParams(temperature=0, max_new_tokens=12)
    graphs = counters["stats"]["unique_graphs"]
    before = tokens_of(fast.generate(PROMPTS, 2, params))
    check_same_greedy(eager, tokens_of(eager.generate(PROMPTS, 2, params)), before)
    assert counters["stats"]["unique_graphs"] - graphs == 1  # the whole step: one graph, no breaks
    weight = eager.model.model.layers[2].mlp.down_proj.weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(4.0)
        want = tokens_of(eager.generate(PROMPTS, 2, params))
        after = tokens_of(fast.generate(PROMPTS, 2, params))
        assert after != before, "the change did not change the greedy output: the test proves nothing"
        check_same_greedy(eager, want, after)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert counters["stats"]["unique_graphs"] - graphs == 1 and fast._step_proven and fast.decoder == "step"


@pytest.mark.slow
def test_a_model_the_step_decoder_cannot_run_falls_back_to_generate_with_one_line(backends, monkeypatch):
    """A model the step decoder can't run: one logged line, then transformers' generate."""
    from sptool.models import step_decoder
    from sptool.models.base import SamplingParams
    from sptool.models.hf import HFBackend

    eager, _ = backends
    notes: list[str] = []
    backend = HFBackend.from_model(eager.model, eager.tokenizer, model_id="tiny", batch_size=8, decoder="step",
                                   log=notes.append)
    monkeypatch.setattr(step_decoder, "unsupported", lambda model, cache: "a test's refusal")
    params = SamplingParams(temperature=0, max_new_tokens=6)
    got = backend.generate(PROMPTS[:1], 1, params)
    assert tokens_of(got) == tokens_of(eager.generate(PROMPTS[:1], 1, params))
    assert backend.decoder == "generate" and backend.decoding == "eager"
    backend.generate(PROMPTS[:1], 1, params)
    assert [note for note in notes if "step decoder" in note] == \
        ["note: the step decoder can't run this model (a test's refusal); decoding with transformers' "
         "generate (model.decoder=generate)"]


@pytest.mark.slow
def test_a_step_that_cannot_be_captured_falls_back_to_torch_compiles_graphs_with_one_line(backends):
    """``model.step_graph = capture`` on a model whose step can't be captured (here a captured step
    that raises as a CUDA capture does on an op it can't record): one logged line, then the step
    decoder with torch.compile's graphs, not ``generate``; the tokens are eager ``generate``'s."""
    from sptool.models.base import SamplingParams
    from sptool.models.hf import HFBackend
    from sptool.models.step_decoder import CapturedStep, StepDecoder

    class Uncapturable(CapturedStep):
        def capture(self):
            raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    eager, _ = backends
    notes: list[str] = []
    backend = HFBackend.from_model(eager.model, eager.tokenizer, model_id="tiny", batch_size=8, decoder="step",
                                   step_graph="capture", log=notes.append)
    backend._step_decoder = StepDecoder(eager.model, compile=True, graph="capture", captured_step=Uncapturable,
                                        compile_prefill=False, compile_options=dict(backend="aot_eager", dynamic=False))
    params = SamplingParams(temperature=0, max_new_tokens=6)
    got = tokens_of(backend.generate(PROMPTS, 1, params))
    check_same_greedy(eager, tokens_of(eager.generate(PROMPTS, 1, params)), got)
    assert backend.decoder == "step" and backend.step_graph == "compile" and backend._step_proven
    assert backend._step_decoder.graph == "compile"
    backend.generate(PROMPTS, 1, params)
    assert [note for note in notes if "note:" in note] == [
        "note: capturing the step decoder's CUDA graph failed on its first call (RuntimeError: operation not "
        "permitted when stream is capturing); its graphs come from torch.compile instead (model.step_graph=compile)"]


@pytest.mark.slow
def test_a_bf16_split_sampler_step_decodes_as_generate_and_compiles_to_one_graph(monkeypatch):
    """A bf16 sampler (bf16 autocast over split-rounded linears: ``--sampler bf16-split``, a run with
    ``train.weight_rounding = split``). A Llama layer's keys leave the rotary embedding in float32
    and its values leave ``v_proj`` in bf16; the static cache took one dtype and ``index_copy_``
    failed, so eager step decoding fell back to generate (and eager generate over a static cache
    failed). The cache layers cast what they store: greedy tokens equal generate's under the same
    autocast, with the model's attention and with grouped, and over generate's static cache; the
    compiled step with grouped attention (``aot_eager``) is one graph. A call of several batches
    packs the weights once, the first batch's prompts tokenised on another thread meanwhile."""
    import threading

    import torch
    from torch._dynamo.utils import counters

    from sptool.models import hf_decoding
    from sptool.models.base import SamplingParams
    from sptool.models.hf import HFBackend
    from sptool.models.step_decoder import StepDecoder, casting_static_layer
    from sptool.train.rounding import use_weight_rounding

    eager = HFBackend("tiny", device="cpu", dtype="fp32", batch_size=8)
    try:
        assert use_weight_rounding(eager.model, "split") > 0
        eager.autocast = torch.bfloat16
        notes: list[str] = []
        step = HFBackend.from_model(eager.model, eager.tokenizer, model_id="tiny", batch_size=8, decoder="step",
                                    log=notes.append, autocast=torch.bfloat16)
        params = SamplingParams(temperature=0, max_new_tokens=4)
        want = tokens_of(eager.generate(PROMPTS, 1, params))
        for attention in ("model", "grouped"):
            step.decode_attention = attention
            assert tokens_of(step.generate(PROMPTS, 1, params)) == want, attention
        static = HFBackend.from_model(eager.model, eager.tokenizer, model_id="tiny", batch_size=8,
                                      static_cache=True, autocast=torch.bfloat16)  # generate over a static cache
        assert tokens_of(static.generate(PROMPTS, 1, params)) == want
        assert step.decoder == "step" and step._step_proven, notes
        layers = next(iter(step._caches.values())).layers
        assert {type(layer) for layer in layers} == {casting_static_layer()}
        assert {layer.keys.dtype for layer in layers} | {layer.values.dtype for layer in layers} == {torch.bfloat16}
        (rows, length), = step._caches  # the room check's estimate: bf16 here, generate's static cache float32
        assert step.new_cache_bytes(rows, length) == step.cache_bytes()
        assert static.new_cache_bytes(*next(iter(static._caches))) == static.cache_bytes() > step.cache_bytes()
        step._step_decoder = StepDecoder(eager.model, compile=True, compile_prefill=False,
                                         compile_options=dict(backend="aot_eager", dynamic=False))
        graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
        assert tokens_of(step.generate(PROMPTS, 1, params)) == want
        assert counters["stats"]["unique_graphs"] - graphs == 1
        assert sum(counters["graph_break"].values()) == breaks
        packings, encoders = [], []
        enter, encode = hf_decoding.packed_split_weights.__enter__, HFBackend._encode
        monkeypatch.setattr(hf_decoding.packed_split_weights, "__enter__",
                            lambda self: packings.append(1) or enter(self))
        monkeypatch.setattr(HFBackend, "_encode",
                            lambda self, *args: encoders.append(threading.current_thread().name) or encode(self, *args))
        step._step_decoder, step.batch_size = None, 2  # eager again
        assert tokens_of(step.generate(PROMPTS, 1, params)) == want  # two batches
        assert packings == [1] and len(encoders) == 2
        assert encoders[0].startswith("sptool-prompts") and encoders[1] == threading.current_thread().name
    finally:
        eager.close()


@pytest.mark.slow
def test_a_runs_step_graph_setting_reaches_its_backend(tmp_path):
    """``--set model.step_graph=capture`` is the loaded hf backend's step graph; an unknown one is
    a usage error from the backend too (Python callers)."""
    from sptool.core.records import UsageError
    from sptool.models.hf import HFBackend
    from sptool.recipes import load_config
    from sptool.run.run_dir import RunDir
    from sptool.run.session import Session

    config = load_config("rlvr")
    config["model"].update(device="cpu", decoder="step", step_graph="capture")
    backend = Session(config, RunDir(tmp_path)).load_generator("tiny")
    try:
        assert (backend.decoder, backend.step_graph) == ("step", "capture")
        with pytest.raises(UsageError, match="unknown step graph 'trees'"):
            HFBackend.from_model(backend.model, backend.tokenizer, model_id="tiny", step_graph="trees")
    finally:
        backend.close()


@pytest.mark.slow
def test_grouped_attention_reads_a_kv_window_that_grows_with_the_written_positions(backends, monkeypatch):
    """The grouped decode attention reads only the cache's first ``decode_window`` positions, the
    next multiple of ``WINDOW`` above every written one, and the whole cache once that is no shorter.
    The greedy tokens are eager ``generate``'s and those of no window at all. With a captured step
    (the base class standing in for the CUDA graph, ``aot_eager``) each window has its own step and
    the loop's state moves on to the next one: a compiled graph each, or with ``dynamic_window``
    one for the windows shorter than the cache (the window a dynamic size) and one for the whole."""
    from unittest import mock

    import torch
    from torch._dynamo.utils import counters

    from sptool.models import decode_attention
    from sptool.models.base import SamplingParams
    from sptool.models.hf import HFBackend
    from sptool.models.hf_decoding import bucket_length
    from sptool.models.step_decoder import CapturedStep, StepDecoder

    eager, _ = backends
    monkeypatch.setattr(decode_attention, "WINDOW", 8)

    def backend(**decoder):
        made = HFBackend.from_model(eager.model, eager.tokenizer, model_id="tiny", batch_size=8, decoder="step",
                                    decode_attention="grouped")
        made._step_decoder = StepDecoder(eager.model, compile_prefill=False, **decoder)
        return made

    tokens = 20
    greedy = SamplingParams(temperature=0, max_new_tokens=tokens)
    prompt_length = eager._encode([eager.render(prompt) for prompt in PROMPTS])["input_ids"].shape[1]
    cache_length = bucket_length(prompt_length + tokens)
    windows: list[int | None] = []
    real = decode_attention.grouped_decode_attention

    def spy(module, query, key, *args, **kwargs):
        if query.shape[2] == 1:  # a decoding step (the prefill's prompts go to SDPA)
            windows.append(kwargs.get("decode_window"))
            assert key.shape[-2] == cache_length  # the whole cache is handed over; the function reads its window
        return real(module, query, key, *args, **kwargs)

    with mock.patch.object(decode_attention, "grouped_decode_attention", spy):
        decode_attention.register()
        try:
            windowed = tokens_of(backend().generate(PROMPTS, 2, greedy))
        finally:
            decode_attention.register()
    # 8-position windows: each the next multiple of 8 above the positions written so far
    expected = [-(-(prompt_length + column) // 8) * 8 for column in range(1, tokens)]
    expected = [window if window < cache_length else None for window in expected]
    assert len(set(expected) - {None}) >= 2 and None in expected, \
        f"the test's prompts should cross two windows and reach the whole cache: {sorted(set(expected), key=str)}"
    layers = eager.model.config.num_hidden_layers
    assert windows == [window for window in expected for _ in range(layers)]
    check_same_greedy(eager, tokens_of(eager.generate(PROMPTS, 2, greedy)), windowed)
    made: list[CapturedStep] = []

    class Recorded(CapturedStep):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    for dynamic_window, step_graphs in ((False, len(set(expected))), (True, 2)):
        made.clear()
        torch._dynamo.reset()  # dynamo keeps graphs per code object: the arm before would lend its own
        captured = backend(compile=True, compile_options=dict(backend="aot_eager", dynamic=False), graph="capture",
                           captured_step=Recorded, dynamic_window=dynamic_window)
        graphs = counters["stats"]["unique_graphs"]
        assert tokens_of(captured.generate(PROMPTS, 2, greedy)) == windowed
        assert len(made) == len(set(expected))  # a captured step per window, the loop's state carried over
        assert counters["stats"]["unique_graphs"] - graphs == step_graphs
    monkeypatch.setattr(decode_attention, "WINDOW", 1024)  # no window shorter than the cache
    check_same_greedy(eager, windowed, tokens_of(backend().generate(PROMPTS, 2, greedy)))


@pytest.mark.slow
def test_a_captured_step_keeps_its_buffers_per_cache_and_is_made_again_when_a_weight_moves(backends):
    """``graph="capture"``: the loop runs over the captured step's own buffers, one step per cache
    and sampling variant, reused by the next call on that cache (a CUDA graph is captured once),
    and made again when a weight is replaced rather than updated in place (a graph reads the
    addresses it was captured with). Here the base class stands in for the CUDA graph: it replays
    by calling the compiled step (``aot_eager``) over the same buffers. Tokens are eager
    ``generate``'s throughout, and the cache ends at the position the uncaptured decoder leaves."""
    import torch

    from sptool.models.base import SamplingParams
    from sptool.models.hf import HFBackend
    from sptool.models.step_decoder import CapturedStep, StepDecoder

    eager, _ = backends
    made: list[CapturedStep] = []

    class Recorded(CapturedStep):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

        @staticmethod
        def memory_pool():
            return object()  # a pool handle of its own, as torch.cuda.graph_pool_handle() gives

    options = dict(backend="aot_eager", dynamic=False)
    captured = HFBackend.from_model(eager.model, eager.tokenizer, model_id="tiny", batch_size=8, decoder="step")
    captured._step_decoder = StepDecoder(eager.model, compile=True, compile_options=options, graph="capture",
                                         captured_step=Recorded, compile_prefill=False)
    plain = HFBackend.from_model(eager.model, eager.tokenizer, model_id="tiny", batch_size=8, decoder="step")
    plain._step_decoder = StepDecoder(eager.model, compile=True, compile_options=options, compile_prefill=False)
    greedy = SamplingParams(temperature=0, max_new_tokens=12)
    first = tokens_of(captured.generate(PROMPTS, 2, greedy))
    check_same_greedy(eager, tokens_of(eager.generate(PROMPTS, 2, greedy)), first)
    assert len(made) == 1  # one batch of 6 rows: one cache, one step
    counters_captured = [int(layer.cumulative_length) for layer in next(iter(captured._caches.values())).layers]
    assert tokens_of(plain.generate(PROMPTS, 2, greedy)) == first
    counters_plain = [int(layer.cumulative_length) for layer in next(iter(plain._caches.values())).layers]
    assert counters_captured == counters_plain
    assert tokens_of(captured.generate(PROMPTS, 2, greedy)) == first
    assert len(made) == 1  # the same cache and variant: the kept step
    sampled = captured.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_new_tokens=8, seed=5))
    assert len(made) == 2 and all(len(row) == 2 for row in sampled)  # another variant: its own step
    assert made[1].pool is made[0].pool  # every graph of a decoder in one memory pool
    weight = eager.model.model.layers[2].mlp.down_proj.weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(4.0)  # in place, as an optimizer step: the kept step, the new weights
        scaled = tokens_of(captured.generate(PROMPTS, 2, greedy))
        assert scaled != first, "the change did not change the greedy output: the test proves nothing"
        check_same_greedy(eager, tokens_of(eager.generate(PROMPTS, 2, greedy)), scaled)
        assert len(made) == 2
        weight.data = weight.detach().clone()  # replaced: a captured graph would read the old memory
        assert tokens_of(captured.generate(PROMPTS, 2, greedy)) == scaled
        assert len(made) == 3 and made[2].outputs is not None
        assert made[2].pool is made[0].pool  # the sampled variant's graph still uses the pool
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    # every cache dropped (room for another stage's): their graphs go, and with the last graph a
    # CUDA pool: the next capture takes a new pool (torch asserts on a capture into the old handle)
    captured.release_caches()
    gc.collect()
    assert tokens_of(captured.generate(PROMPTS, 2, greedy)) == first
    assert len(made) == 4 and made[3].pool is not made[0].pool
    with pytest.raises(ValueError, match="unknown step graph"):
        StepDecoder(eager.model, graph="trees")


def draw_after_updates(sampler, reference, trainer, prompts, samples: int, tokens: int, updates: int):
    """The ``rlvr`` loop's set-up over one shared model: each round, ``reference`` and ``sampler``
    draw ``samples`` a prompt with one seed, then ``trainer`` updates the model on the reference's
    samples, rewarded for ending (EOS) within ``tokens``. Returns per round the two samplers' samples."""
    from sptool.models.base import SamplingParams

    rounds = []
    for round_ in range(updates + 1):
        params = SamplingParams(temperature=1.0, max_new_tokens=tokens, seed=100 + round_, logprobs=True)
        drawn = reference.generate(prompts, samples, params)
        rounds.append((drawn, sampler.generate(prompts, samples, params)))
        if round_ == updates:
            break
        trainer.update([{"prompt": prompt, "completions": [s.text for s in row],
                         "rewards": [1.0 if s.finish_reason == "stop" else 0.0 for s in row],
                         "completion_ids": [s.token_ids for s in row],
                         "finish_reasons": [s.finish_reason for s in row]} for prompt, row in zip(prompts, drawn)])
    return rounds


def cut_share(rows) -> float:
    flat = [sample for row in rows for sample in row]
    return sum(sample.finish_reason == "length" for sample in flat) / len(flat)


@pytest.mark.slow
@pytest.mark.alone  # a trainer beside two samplers: 3.3 GB at its peak, after the parallel tests
def test_a_captured_decoder_sharing_a_trainer_draws_generates_samples_after_each_update():
    """As in ``sptool run``: a real PolicyTrainer updates the model that eager ``generate`` and the
    captured step decoder (the base class standing in for the CUDA graph, over the compiled step and
    grouped attention, the prompts' common prefix prefilled once) sample from. For one seed the
    decoder draws exactly ``generate``'s samples, before any update and after each, while the policy
    learns to end within the limit: ``torch.multinomial``'s one draw is the same exponential race as
    the decoder's, so a sampler that missed an update would draw the old policy's tokens. (Over four
    seeds on an H100 the captured arm's cut share fell more slowly than ``generate``'s.)"""
    from sptool.models.hf import HFBackend
    from sptool.models.step_decoder import CapturedStep, StepDecoder
    from sptool.train.step import PolicyTrainer, TrainConfig

    trainer = PolicyTrainer(TrainConfig(model="tiny", device="cpu", loss="dr_grpo", learning_rate=1e-4,
                                        max_completion_tokens=24))
    model = trainer.accelerator.unwrap_model(trainer.model)
    reference = HFBackend.from_model(model, trainer.tokenizer, model_id="tiny", batch_size=16)
    captured = HFBackend.from_model(model, trainer.tokenizer, model_id="tiny", batch_size=16, decoder="step",
                                    decode_attention="grouped")
    captured.prefix_min_saved_tokens = 1  # the prompts' common prefix (the chat template's) prefilled once
    # dynamo's trace run eagerly (backend "eager"): the captured path's bookkeeping, without a compiler
    captured._step_decoder = StepDecoder(model, compile=True, compile_options=dict(backend="eager", dynamic=False),
                                         graph="capture", captured_step=CapturedStep, compile_prefill=False)
    prompts = [[{"role": "user", "content": f"What is {a} + {b}? Put the final answer in \\boxed{{}}."}]
               for a, b in ((60, 42), (20, 63), (7, 35), (81, 18))]
    rounds = draw_after_updates(captured, reference, trainer, prompts, samples=4, tokens=24, updates=1)
    for index, (want, got) in enumerate(rounds):
        assert tokens_of(got) == tokens_of(want), f"round {index}: the captured decoder drew other tokens"
    assert captured.decoding == "step" and captured._step_decoder.graph == "capture"
    first, last = cut_share(rounds[0][0]), cut_share(rounds[-1][0])
    assert last < first - 0.2, f"the policy did not learn to end ({first} -> {last}): the test proves nothing"


@pytest.mark.gpu
@pytest.mark.slow
def test_a_captured_decoder_sharing_a_trainer_follows_its_updates_on_gpu():
    """CUDA, as ``sptool run`` builds it: a PolicyTrainer with its CUDA defaults (bf16 autocast,
    stochastic weight rounding, regionally compiled layers) updates the model that ``generate`` and
    the captured step decoder sample from. Rewarded for ending within the limit, the policy's cut
    share falls, and the captured decoder's falls with it at each round (its tokens come from
    inductor's random stream, so the law is compared, not the draws: 512 samples a decoder, a
    round's two shares within 0.1). A sampler that kept the old policy's weights in its graph
    would keep cutting. (Over four seeds the captured arm's learning curve fell behind and its cut
    share fell more slowly, from the first update on.)"""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from sptool.models.hf import HFBackend
    from sptool.train.step import PolicyTrainer, TrainConfig

    trainer = PolicyTrainer(TrainConfig(model="tiny", device="cuda", loss="dr_grpo", learning_rate=1e-4,
                                        max_completion_tokens=32, max_tokens_per_micro_batch=8192))
    model = trainer.accelerator.unwrap_model(trainer.model)
    reference = HFBackend.from_model(model, trainer.tokenizer, model_id="tiny", batch_size=512)
    captured = HFBackend.from_model(model, trainer.tokenizer, model_id="tiny", batch_size=512, compile=True,
                                    decoder="step", decode_attention="grouped", step_graph="capture")
    captured.prefix_min_saved_tokens = 1  # the prompts' common prefix prefilled once, as at 64 prompts
    prompts = [[{"role": "user", "content": f"What is {a} + {b}? Put the final answer in \\boxed{{}}."}]
               for a, b in zip(range(10, 74), range(90, 26, -1))]
    rounds = draw_after_updates(captured, reference, trainer, prompts, samples=8, tokens=32, updates=2)
    shares = [(cut_share(want), cut_share(got)) for want, got in rounds]
    print(f"cut shares (generate, captured) by round: {shares}")
    assert captured.decoding == "step-compiled", shares
    assert shares[-1][0] < shares[0][0] - 0.2, f"the policy did not learn to end: {shares}"
    for index, (want, got) in enumerate(shares):
        assert abs(want - got) < 0.1, f"round {index}: cut share {got} against generate's {want}: {shares}"


@pytest.mark.gpu
@pytest.mark.slow
def test_compiled_step_decoder_on_gpu_follows_generate_and_weight_changes():
    """CUDA: the step compiled with CUDA graphs (reduce-overhead) writes eager generate's greedy
    tokens (bf16: a near-tie may be ordered differently), before and after an in-place change of
    a layer's weights, without falling back to generate."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from sptool.models.base import SamplingParams
    from sptool.models.hf import HFBackend

    eager = HFBackend("tiny", device="cuda", batch_size=8)
    notes: list[str] = []
    fast = HFBackend.from_model(eager.model, eager.tokenizer, model_id="tiny", batch_size=8, compile=True,
                                decoder="step", log=notes.append)
    grouped = HFBackend.from_model(eager.model, eager.tokenizer, model_id="tiny", batch_size=8, compile=True,
                                   decoder="step", decode_attention="grouped", log=notes.append)
    captured = HFBackend.from_model(eager.model, eager.tokenizer, model_id="tiny", batch_size=8, compile=True,
                                    decoder="step", decode_attention="grouped", log=notes.append,
                                    step_graph="capture")  # sptool's own CUDA graph per cache (CudaGraphStep)
    params = SamplingParams(temperature=0, max_new_tokens=24)

    def same(want, got):
        for prompt, rows_want, rows_got in zip(PROMPTS, want, got):
            for row_want, row_got in zip(rows_want, rows_got):
                # bf16 logits near 34 are 0.25 apart: two of them one or two steps apart are a tie
                # (seen on an H200: 33.75 against 33.5 at the third token of "What is 2 + 3?")
                assert_same_greedy(eager, prompt, row_got, row_want, 0.5)

    before = tokens_of(fast.generate(PROMPTS, 3, params))
    same(tokens_of(eager.generate(PROMPTS, 3, params)), before)
    assert fast.decoding == "step-compiled", notes
    same(before, tokens_of(grouped.generate(PROMPTS, 3, params)))  # the grouped decoding attention
    assert tokens_of(captured.generate(PROMPTS, 3, params)) == tokens_of(grouped.generate(PROMPTS, 3, params))
    assert grouped.decoding == "step-compiled" and eager.model.config._attn_implementation == "sdpa", notes
    with torch.no_grad():
        eager.model.model.layers[2].mlp.down_proj.weight.mul_(4.0)
    after = tokens_of(fast.generate(PROMPTS, 3, params))
    assert after != before
    same(tokens_of(eager.generate(PROMPTS, 3, params)), after)
    same(after, tokens_of(grouped.generate(PROMPTS, 3, params)))
    assert tokens_of(captured.generate(PROMPTS, 3, params)) == tokens_of(grouped.generate(PROMPTS, 3, params))
    drawn = captured.generate(PROMPTS, 3, SamplingParams(temperature=1.0, max_new_tokens=24, seed=3, logprobs=True))
    assert all(len(s.logprobs) == s.n_tokens for row in drawn for s in row)
    sampled = fast.generate(PROMPTS, 3, SamplingParams(temperature=1.0, max_new_tokens=24, seed=3, logprobs=True))
    assert all(len(s.logprobs) == s.n_tokens for row in sampled for s in row)
    # the one-line notes of a new shape's compile are expected; a fallback to generate is not
    fallbacks = [note for note in notes if "can't run" in note or "eagerly" in note]
    assert fast.decoding == grouped.decoding == captured.decoding == "step-compiled" and not fallbacks, notes
    eager.close()


def chi_square(counts, expected) -> float:
    return float(((counts - expected) ** 2 / expected).sum())


def two_sample_chi_square(first, second) -> float:
    """Pearson's statistic that two histograms (same bins) come from one law."""
    seen = (first + second) > 0
    first, second = first[seen], second[seen]
    pooled = (first + second) / (first.sum() + second.sum())
    return chi_square(first, pooled * first.sum()) + chi_square(second, pooled * second.sum())


@pytest.mark.gpu
@pytest.mark.slow
def test_captured_sampling_draws_the_softmax_law_afresh_at_each_step_on_gpu():
    """CUDA: the captured sampler's tokens follow the softmax at every replay, independently of the
    replay before (a graph whose noise repeated or shifted between steps would tie a row's tokens
    together: a row that drew a slow EOS once would draw it at every step), and over the real tiny
    model a captured decoder's finish lengths and first tokens follow eager ``generate``'s law.
    (A 2-seed learning curve had the captured decoder's truncated share fall more slowly.)
    Thresholds: the statistics' 1e-4 tails (χ² with 7, 63, 5 and 6 degrees of freedom)."""
    import collections

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from sptool.models.base import SamplingParams
    from sptool.models.hf import HFBackend
    from sptool.models.step_decoder import CudaGraphStep, choose

    probs = torch.tensor([0.3, 0.2, 0.15, 0.12, 0.1, 0.07, 0.04, 0.02], dtype=torch.float64)
    rows = 1 << 16

    def sample(cache, logits, finished, lengths, temperature, top_p, eos):  # the decoder's sampling step
        token, chosen, _, _ = choose(logits, finished, lengths, temperature, top_p, eos, 0, True, False)
        return token, chosen

    class Cache:
        pass

    cache, device = Cache(), "cuda"
    inputs = [probs.log().float().repeat(rows, 1).to(device), torch.zeros(rows, dtype=torch.bool, device=device),
              torch.zeros(rows, dtype=torch.long, device=device), torch.tensor(1.0, device=device),
              torch.tensor(1.0, device=device), torch.tensor([len(probs)], device=device)]
    torch.manual_seed(5)
    step = CudaGraphStep(torch.compile(sample), cache, inputs, (), [], pool=CudaGraphStep.memory_pool())
    draws = []
    for _ in range(3):
        token, chosen = step.replay()
        draws.append(token.cpu().clone())
        assert torch.allclose(chosen.cpu().double(), probs.log()[draws[-1]], atol=1e-5)
    for draw in draws:
        assert chi_square(torch.bincount(draw, minlength=8).double(), probs * rows) < 30, "not the softmax's law"
    for before, after in zip(draws, draws[1:]):
        pairs = torch.bincount(before * 8 + after, minlength=64).double()
        assert chi_square(pairs, (probs[:, None] * probs[None, :]).flatten() * rows) < 115, \
            "a replay's token depends on the replay before"

    eager = HFBackend("tiny", device="cuda", dtype="fp32", batch_size=512)  # the learning runs' sampler
    captured = HFBackend.from_model(eager.model, eager.tokenizer, model_id="tiny", batch_size=512, compile=True,
                                    decoder="step", decode_attention="grouped", step_graph="capture")
    prompts = [f"Solve the following math problem. Give only the final answer inside \\boxed{{}}, with no "
               f"explanation.\n\nProblem: What is {a} + {b}?" for a, b in ((60, 42), (20, 63))]
    params = SamplingParams(temperature=1.0, max_new_tokens=32, seed=9, logprobs=True)
    laws = []
    for backend in (eager, captured):
        samples = [s for row in backend.generate(prompts, 256, params) for s in row]
        lengths = torch.tensor([s.n_tokens if s.finish_reason == "stop" else 33 for s in samples])
        finish = torch.bucketize(lengths, torch.tensor([2, 4, 8, 16, 32])).bincount(minlength=6).double()
        laws.append((finish, collections.Counter(s.token_ids[0] for s in samples)))
    assert captured.decoding == "step-compiled"
    assert two_sample_chi_square(laws[0][0], laws[1][0]) < 26, f"finish lengths: {laws}"
    common = [token for token, _ in (laws[0][1] + laws[1][1]).most_common(6)]
    firsts = [torch.tensor([law[token] for token in common] + [sum(law.values()) - sum(law[t] for t in common)],
                           dtype=torch.float64) for _, law in laws]
    assert two_sample_chi_square(*firsts) < 28, f"first tokens: {firsts}"
    eager.close()


@pytest.mark.gpu
@pytest.mark.slow
def test_a_captured_step_draws_new_noise_each_replay_and_a_seed_repeats_on_gpu():
    """CUDA: sptool's own CUDA graph of a step (``graph="capture"``) samples as a seeded sampler
    should. Each replay draws new noise: a graph that replayed its capture's draw would give every
    step of a row one fixed exponential race. A seed draws the same in the call that captures (its
    warm-up calls draw too) as in a call that replays; another seed draws otherwise, and again
    after every cache (and with them every graph) was dropped."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from sptool.models.base import SamplingParams
    from sptool.models.hf import HFBackend
    from sptool.models.step_decoder import CudaGraphStep

    def race(cache, x):  # the sampler's noise, compiled without torch's CUDA graphs as the decoder's step
        return x + torch.empty_like(x).exponential_(1)

    class Cache:  # a stand-in the step refers to weakly; no layers to put back
        pass

    cache = Cache()
    pool = CudaGraphStep.memory_pool()
    torch.manual_seed(11)
    step = CudaGraphStep(torch.compile(race), cache, [torch.zeros(4096, device="cuda")], (), [], pool=pool)
    first = step.replay().clone()
    second = step.replay().clone()
    assert not torch.equal(first, second), "a replay drew its capture's noise again"
    assert abs(first.mean().item() - 1.0) < 0.1 and abs(second.mean().item() - 1.0) < 0.1  # Exp(1)
    torch.manual_seed(11)
    assert torch.equal(step.replay(), first), "the capturing call's warm-ups moved the seed's draws"

    eager = HFBackend("tiny", device="cuda", batch_size=8)
    captured = HFBackend.from_model(eager.model, eager.tokenizer, model_id="tiny", batch_size=8, compile=True,
                                    decoder="step", decode_attention="grouped", step_graph="capture")
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=3, logprobs=True)
    drawn = tokens_of(captured.generate(PROMPTS, 3, params))  # captures
    assert tokens_of(captured.generate(PROMPTS, 3, params)) == drawn  # replays
    other = SamplingParams(temperature=1.0, max_new_tokens=24, seed=4, logprobs=True)
    assert tokens_of(captured.generate(PROMPTS, 3, other)) != drawn
    assert captured.decoding == "step-compiled"
    # every cache dropped (room for another stage's) takes the graphs and their memory pool with
    # it: the next call captures into a new pool (into the old one's handle torch's allocator
    # asserts: the 0.6B stages' benchmark run of 2026-12-07), and draws as before
    captured.release_caches()
    gc.collect()
    assert tokens_of(captured.generate(PROMPTS, 3, params)) == drawn
    assert captured.decoding == "step-compiled"
    eager.close()


@pytest.mark.gpu
@pytest.mark.slow
def test_a_bf16_split_sampler_compiles_to_one_graph_on_gpu():
    """CUDA: a bf16-split sampler (the split linears take ``torch.mm(out_dtype=float32)`` there) step
    decodes through the compiled step with grouped attention without a graph break, its prefill
    compiled (dynamic shapes) and its linears' ``[hi | lo]`` packed, as eager ``generate`` with the
    two-GEMM split linears decodes greedily. On an H100 it
    hit torch.compile's recompile limit instead, the decoder layer recompiled per ``layer_idx``,
    which a break inside the layer makes (CPU, where the split linears multiply in float32, has
    none: ``test_a_bf16_split_sampler_step_decodes_as_generate_and_compiles_to_one_graph``)."""
    import torch
    from torch._dynamo.utils import counters

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from sptool.models.base import SamplingParams
    from sptool.models.hf import HFBackend
    from sptool.train.rounding import use_weight_rounding

    eager = HFBackend("tiny", device="cuda", dtype="fp32", batch_size=8)
    assert use_weight_rounding(eager.model, "split") > 0
    eager.autocast = torch.bfloat16
    notes: list[str] = []
    fast = HFBackend.from_model(eager.model, eager.tokenizer, model_id="tiny", batch_size=8, compile=True,
                                decoder="step", decode_attention="grouped", log=notes.append,
                                autocast=torch.bfloat16)
    params = SamplingParams(temperature=0, max_new_tokens=24)
    breaks = sum(counters["graph_break"].values())
    got = tokens_of(fast.generate(PROMPTS, 3, params))
    assert sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])
    assert fast.decoding == "step-compiled" and not [n for n in notes if "note:" in n], notes  # no fallback
    assert fast._step_decoder._prefill_proven  # the compiled prefill ran (inductor, dynamic shapes)
    packed = [module for module in eager.model.modules() if hasattr(module, "split_packed")]
    assert packed and {module.split_packed.dtype for module in packed} == {torch.bfloat16}  # [hi | lo] packed
    assert {layer.keys.dtype for layer in next(iter(fast._caches.values())).layers} == {torch.bfloat16}
    want = tokens_of(eager.generate(PROMPTS, 3, params))
    for prompt, rows_want, rows_got in zip(PROMPTS, want, got):
        for row_want, row_got in zip(rows_want, rows_got):
            assert_same_greedy(eager, prompt, row_got, row_want, 0.5)
    eager.close()


# -- other model families ------------------------------------------------------------------------

FAMILIES = {  # small random models: Qwen3 (q/k norms), its MoE, Phi-3 (fused qkv), Gemma (scaled
    # embeddings), GPT-2 (learned positions, one KV head per query head), Gemma-2 (sliding window)
    "qwen3": dict(head_dim=16), "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                  moe_intermediate_size=32),
    "phi3": {}, "gemma": dict(head_dim=16), "gpt2": None, "gemma2": dict(head_dim=16),
}


def small_model(family: str, tokenizer):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    extra = FAMILIES[family]
    if extra is None:
        config = AutoConfig.for_model(family, n_embd=64, n_layer=2, n_head=4, **ids)
    else:
        config = AutoConfig.for_model(family, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      pad_token_id=tokenizer.pad_token_id, **ids, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float().eval()


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_other_model_families_step_decode_as_generate_in_one_graph_or_fall_back(backends, family):
    """Issue 33: the step decoder works for every model family the hf backend loads, or says in
    one line that it can't. Each family's greedy tokens equal eager generate's, with the model's
    attention, with grouped and with grouped over 16-position KV windows. The compiled step
    (``aot_eager``) is one graph, the compiled prefill another. Gemma-2's sliding window layers fall
    back to generate, with its note."""
    from torch._dynamo.utils import counters

    from sptool.models.base import SamplingParams
    from sptool.models.hf import HFBackend
    from sptool.models.step_decoder import StepDecoder

    tokenizer = backends[0].tokenizer
    model = small_model(family, tokenizer)
    params = SamplingParams(temperature=0, max_new_tokens=8)
    want = tokens_of(HFBackend.from_model(model, tokenizer, model_id=family, batch_size=8).generate(PROMPTS, 2, params))
    for attention in ("model", "grouped"):
        notes: list[str] = []
        fast = HFBackend.from_model(model, tokenizer, model_id=family, batch_size=8, decoder="step",
                                    decode_attention=attention, log=notes.append)
        if family != "gemma2":  # a preset decoder skips the backend's check of the model
            fast._step_decoder = StepDecoder(model, compile=True,
                                             compile_options=dict(backend="aot_eager", dynamic=False))
        graphs = counters["stats"]["unique_graphs"]
        assert tokens_of(fast.generate(PROMPTS, 2, params)) == want
        if family == "gemma2":
            assert fast.decoder == "generate"
            assert [note for note in notes if "step decoder" in note] == [
                "note: the step decoder can't run this model (cache layers of type StaticSlidingWindowLayer (only "
                "full attention is step-decoded)); decoding with transformers' generate (model.decoder=generate)"]
        else:
            assert fast.decoder == "step" and fast._step_proven and fast._step_decoder._prefill_proven
            assert counters["stats"]["unique_graphs"] - graphs == 2  # the whole step and the prefill, no break
    if family != "gemma2":  # grouped attention over 16-position KV windows (the kwarg reaches it)
        from sptool.models import decode_attention

        windowed = HFBackend.from_model(model, tokenizer, model_id=family, batch_size=8, decoder="step",
                                        decode_attention="grouped")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(decode_attention, "WINDOW", 16)
            assert tokens_of(windowed.generate(PROMPTS, 2, params)) == want and windowed.decoder == "step"


@pytest.mark.slow
def test_the_compiled_prefill_is_one_graph_for_any_batch_of_prompts_and_falls_back_with_one_line(backends):
    """The step decoder's prefill compiled with dynamic shapes (``aot_eager`` here): a batch of other
    rows and length reuses its one graph, and the logits, positions and cached keys and values
    equal the eager prefill's. A compiled prefill whose first call fails is said in one line, then
    runs eagerly (not the whole decoder falling back)."""
    import torch
    from torch._dynamo.utils import counters
    from transformers import StaticCache

    from sptool.models.step_decoder import StepDecoder

    tokenizer = backends[0].tokenizer
    model = small_model("qwen3", tokenizer)
    options = dict(backend="aot_eager")
    notes: list[str] = []
    eager = StepDecoder(model)
    fast = StepDecoder(model, compile=True, compile_options=options, log=notes.append)

    def prefilled(decoder, texts, row_map):
        encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        assert encoded["attention_mask"][:, 0].min() == 0  # left padded: the positions matter
        cache = StaticCache(config=model.config, max_cache_len=64)
        with torch.inference_mode():
            logits, positions = decoder.prefill(cache, encoded["input_ids"], encoded["attention_mask"],
                                                torch.tensor(row_map))
        return logits, positions, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]

    def assert_same(got, want):
        torch.testing.assert_close(got[0], want[0])
        assert torch.equal(got[1], want[1])
        for (keys, values), (want_keys, want_values) in zip(got[2], want[2]):
            torch.testing.assert_close(keys, want_keys)
            torch.testing.assert_close(values, want_values)

    batches = (([PROMPTS[0], "Name a colour, any colour you like, and say why.", "Hi"], [0, 0, 1, 2]),
               (["Say, in a few plain words, what colour the sea is on a clear day.", PROMPTS[0]], [1, 0, 0]))
    graphs = [counters["stats"]["unique_graphs"]]
    for texts, row_map in batches:
        assert_same(prefilled(fast, texts, row_map), prefilled(eager, texts, row_map))
        graphs.append(counters["stats"]["unique_graphs"])
    # one graph at most (dynamo may reuse one an earlier test made for a model of this structure);
    # the second batch, of other rows and length, made none
    assert graphs[1] - graphs[0] <= 1 and graphs[2] == graphs[1]
    assert fast._prefill_proven and notes == []

    broken = StepDecoder(model, compile=True, compile_options=options, log=notes.append)

    def fails(*args):
        raise RuntimeError("dynamo could not trace this\nmore detail")

    broken._prefill_forward = fails
    for texts, row_map in batches:
        assert_same(prefilled(broken, texts, row_map), prefilled(eager, texts, row_map))
    assert notes == ["note: the step decoder's compiled prefill failed on its first call (RuntimeError: dynamo "
                     "could not trace this); prefilling eagerly"]


@pytest.mark.slow
def test_a_common_prefix_prefilled_once_decodes_as_generate(backends, monkeypatch):
    """Chat prompts share the template's system message and the task's words: the step decoder
    prefills that prefix once and the rests on top of it. The last positions' logits
    and positions equal a plain prefill's (a small Qwen3, eager and compiled with ``aot_eager``:
    no fallback note), and the tiny model's greedy tokens, texts and finish reasons equal eager
    ``generate``'s."""
    import torch
    from transformers import StaticCache

    from sptool.models import step_decoder
    from sptool.models.base import SamplingParams
    from sptool.models.step_decoder import StepDecoder, prefix_first

    eager, step = backends
    task = "Answer with one number. What is {}?"
    prompts = [[{"role": "user", "content": task.format(question)}]
               for question in ("2 + 3", "the sum of 17 and 25, written out", "9 - 4 + 1")]
    texts = [eager.render(prompt) for prompt in prompts]
    encoded = eager.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    laid, laid_mask, prefix = prefix_first(encoded["input_ids"], encoded["attention_mask"],
                                           eager.tokenizer.pad_token_id, min_saved_tokens=0)
    assert prefix > 20  # the system message, "Answer with one number. What is"
    row_map = torch.tensor([0, 0, 1, 2])
    notes: list[str] = []
    model = small_model("qwen3", eager.tokenizer)
    decoders = (StepDecoder(model), StepDecoder(model, compile=True, log=notes.append,
                                                compile_options=dict(backend="aot_eager")))

    def prefilled(decoder, ids, mask, length):
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 8)
        with torch.inference_mode():
            return decoder.prefill(cache, ids, mask, row_map, length)

    want_logits, want_positions = prefilled(decoders[0], encoded["input_ids"], encoded["attention_mask"], 0)
    for decoder in decoders:
        logits, positions = prefilled(decoder, laid, laid_mask, prefix)
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(positions, want_positions)
    assert notes == [] and decoders[1]._prefill_proven == {"", " on a prefix"}

    used = []

    def spied(*args, **kwargs):
        out = prefix_first(*args, **kwargs)
        used.append(out[2])
        return out

    monkeypatch.setattr(step_decoder, "prefix_first", spied)
    monkeypatch.setattr(step, "prefix_min_saved_tokens", 0)
    params = SamplingParams(temperature=0, max_new_tokens=12)
    want = eager.generate(prompts, 2, params)
    got = step.generate(prompts, 2, params)
    assert used and used[0] == prefix
    for prompt, rows_want, rows_got in zip(prompts, tokens_of(want), tokens_of(got)):
        for row_want, row_got in zip(rows_want, rows_got):
            assert_same_greedy(eager, prompt, row_got, row_want, TIE)
    assert [[(s.text, s.finish_reason) for s in row] for row in got] == \
        [[(s.text, s.finish_reason) for s in row] for row in want]


@pytest.mark.slow
def test_a_bf16_split_sampler_decodes_with_packed_parts_as_with_two_gemms_in_one_graph(backends, monkeypatch):
    """A bf16-split sampler (a trainer's split-rounded model under bf16 autocast): the step decoder's
    call packs each layer's ``[hi | lo]`` once (``packed_split_weights``) and its greedy tokens and
    log-probabilities are those of the unpacked split layers' two GEMMs; compiled (``aot_eager``),
    the step and the prefill trace with no graph break."""
    import torch
    from torch._dynamo.utils import counters

    from sptool.models import hf
    from sptool.models.base import SamplingParams
    from sptool.models.hf import HFBackend
    from sptool.models.step_decoder import StepDecoder
    from sptool.train.rounding import use_weight_rounding

    tokenizer = backends[0].tokenizer
    model = small_model("qwen3", tokenizer)
    assert use_weight_rounding(model, "split") > 0
    params = SamplingParams(temperature=0, max_new_tokens=8, logprobs=True)

    def decoded(compile_step: bool):
        backend = HFBackend.from_model(model, tokenizer, model_id="small", batch_size=8, decoder="step",
                                       autocast=torch.bfloat16)
        if compile_step:
            backend._step_decoder = StepDecoder(model, compile=True, compile_options=dict(backend="aot_eager"))
        return backend.generate(PROMPTS, 2, params)

    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    packed = decoded(compile_step=True)
    assert counters["stats"]["unique_graphs"] - graphs <= 2 and sum(counters["graph_break"].values()) == breaks
    layers = [module for module in model.modules() if hasattr(module, "split_packed")]
    assert layers and not any(layer.split_packed_on for layer in layers)
    # q/k/v and gate/up multiplied as one GEMM each (SiblingGEMM): 5 of a layer's 7 linears are in a set
    assert sum(bool(layer.split_group) for layer in layers) == 5 * model.config.num_hidden_layers
    monkeypatch.setattr(hf, "packed_split_weights", lambda model, dtype: contextlib.nullcontext())
    for layer in layers:
        del layer.split_packed, layer.split_packed_on, layer.split_group
    two_gemms = decoded(compile_step=False)
    assert not any(hasattr(module, "split_packed") for module in model.modules())
    assert tokens_of(packed) == tokens_of(two_gemms)
    for rows_packed, rows_two in zip(packed, two_gemms):
        for a, b in zip(rows_packed, rows_two):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 0.05


@pytest.mark.slow
def test_a_new_cache_that_does_not_fit_drops_the_kept_ones_first(backends, monkeypatch):
    """Issue 33's memory: each (rows, length) bucket keeps its static cache, and at the 0.6B shape
    two 448-position caches of 512 rows did not fit beside the trainer. A new cache first drops the
    least recently used kept ones while the device lacks the room, with one line each. The
    estimate of a new cache's bytes is what it then holds."""
    from sptool.models.base import SamplingParams
    from sptool.models.hf import HFBackend

    eager, _ = backends
    notes: list[str] = []
    step = HFBackend.from_model(eager.model, eager.tokenizer, model_id="tiny", batch_size=8, decoder="step",
                                log=notes.append)
    params = SamplingParams(temperature=0, max_new_tokens=4)
    assert tokens_of(step.generate(PROMPTS[:2], 1, params)) == tokens_of(eager.generate(PROMPTS[:2], 1, params))
    (rows, length), = step._caches
    assert step.cache_bytes() == step.new_cache_bytes(rows, length) > 0
    one = step.cache_bytes()
    # a device with room for two of these caches, not for one beside one of twice the rows
    monkeypatch.setattr(step, "_room_for", lambda need: step.cache_bytes() + need <= 2 * one)
    want = tokens_of(eager.generate(PROMPTS[:2], 2, params))
    assert tokens_of(step.generate(PROMPTS[:2], 2, params)) == want
    assert list(step._caches) == [(2 * rows, length)]
    assert step.cache_bytes() == step.new_cache_bytes(2 * rows, length) == 2 * one
    assert [note for note in notes if "dropped" in note] == [
        f"hf: dropped the KV cache of {rows} rows x {length} positions to make room for {2 * rows} x {length} "
        f"({2 * one / 1024 ** 3:.2f} GiB)"]
    monkeypatch.setattr(step, "_room_for", lambda need: step.cache_bytes() + need <= 3 * one)
    step.generate(PROMPTS[:2], 1, params)  # room for the small one beside the large one: both kept
    assert list(step._caches) == [(2 * rows, length), (rows, length)]
