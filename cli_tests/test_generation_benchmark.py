"""``benchmarks/generation.py --profile``: the device's busy time per decoding step is the sum of the
device's own activities, not of every profiler row (an operator's row repeats its kernels' time)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import generation  # noqa: E402


def event(name: str, self_cpu_us: float, self_device_us: float) -> SimpleNamespace:
    return SimpleNamespace(key=name, self_cpu_time_total=self_cpu_us, self_device_time_total=self_device_us)


def test_device_busy_time_counts_each_kernel_once():
    # rows of the H200 step-decoder profile (microseconds): a compiled graph and aten::mm repeat their
    # kernels' device time, and CUPTI's "Command Buffer Full" claims 41 s of a 1.9 s run
    rows = [
        event("## Call CompiledFxGraph", 20_710, 1_555_000),
        event("Command Buffer Full", 696_437, 41_114_000),
        event("fmha_cutlassF_f32_aligned_64x64_rf_sm80", 0, 930_166),
        event("aten::mm", 3_492, 25_321),
        event("sm80_xmma_gemm_f32f32_f32f32_f32_tn_n", 0, 193_737),
        event("Memset (Device)", 0, 4_661),
        event("aten::empty", 150, 0),
    ]
    assert generation.device_busy_us(rows) == 930_166 + 193_737 + 4_661
    assert generation.device_busy_us([]) == 0


def test_the_target_line_names_each_arms_slowest_stage_against_its_shapes_target():
    def row(stage, x, shape="tiny", graph="capture"):
        return dict(stage=stage, shape=shape, decoder="step", attention="grouped", graph=graph,
                    sampler="bf16-split", x_bare=x)

    rows = [row("solve", 6.1), row("eval (greedy)", 4.92), row("solve", 7.0, graph="compile"),
            row("eval (greedy)", 5.0, graph="compile"), row("solve", 3.2, shape="0.6b"),
            {"stage": "loop-step memory", "shape": "tiny"}]
    assert generation.target_lines(rows) == [
        "tiny step/grouped/capture/bf16-split: slowest of 2 stages against bare generate: eval (greedy) at 4.92x; "
        "every stage >= 5x: no",
        "tiny step/grouped/compile/bf16-split: slowest of 2 stages against bare generate: eval (greedy) at 5.0x; "
        "every stage >= 5x: yes",
        "0.6b step/grouped/capture/bf16-split: slowest of 1 stage against bare generate: solve at 3.2x; "
        "every stage >= 3x: yes"]
    # the dynamic KV window's rows are an arm of their own
    rows = [row("solve", 6.1), dict(row("solve", 5.5), window="dynamic"), dict(row("solve", 6.0), window="static")]
    assert generation.target_lines(rows) == [
        "tiny step/grouped/capture/bf16-split: slowest of 2 stages against bare generate: solve at 6.0x; "
        "every stage >= 5x: yes",
        "tiny step/grouped/capture/dynamic-window/bf16-split: slowest of 1 stage against bare generate: solve at "
        "5.5x; every stage >= 5x: yes"]
    # a bf16-split arm is also held against bare generate on a bf16 copy: its own slowest stage and verdict
    rows = [dict(row("solve", 9.0), x_bare_bf16=4.1), dict(row("eval (greedy)", 5.2), x_bare_bf16=5.5)]
    assert generation.target_lines(rows) == [
        "tiny step/grouped/capture/bf16-split: slowest of 2 stages against bare generate: eval (greedy) at 5.2x; "
        "every stage >= 5x: yes; against bare generate on a bf16 copy: solve at 4.1x; every stage >= 5x: no"]


def test_the_bare_arm_runs_the_trainers_compiled_layers_eagerly(tiny_model_dir):
    """The bare arm replays over the trainer's model, whose decoder layers are regionally compiled
    on CUDA. It must run them plain: through the compiled forward, every layer_idx and cache
    length recompiled until dynamo's limit, so the "bare" arm was partly compiled."""
    import torch
    from torch._dynamo.testing import CompileCounter

    from sptool.models.base import SamplingParams
    from sptool.models.hf import HFBackend

    backend = HFBackend("tiny", device="cpu", batch_size=4)
    layers = backend.model.model.layers
    counter = CompileCounter()
    try:
        for layer in layers:
            layer.compile(backend=counter)
        compiled = [layer._compiled_call_impl for layer in layers]
        params = SamplingParams(temperature=0.0, max_new_tokens=3)
        calls = [dict(prompts=["What is 2 + 3?", "Name a colour."], n=1, params=params)]
        seconds, steps, tokens = generation.bare_replay(backend, calls)
        assert steps == 3 and 2 <= tokens <= 6 and seconds > 0
        assert counter.frame_count == 0  # no layer went through dynamo
        # timed from prompts to texts, as sptool's call: on a clock that only the chat template (1 s)
        # and the decoding (2 s) move, the replay takes 3 s
        import types

        clock = [0.0]
        render, decode, timer = backend.render_all, backend.tokenizer.batch_decode, generation.time
        backend.render_all = lambda prompts: clock.__setitem__(0, clock[0] + 1) or render(prompts)
        backend.tokenizer.batch_decode = lambda *a, **k: clock.__setitem__(0, clock[0] + 2) or decode(*a, **k)
        generation.time = types.SimpleNamespace(perf_counter=lambda: clock[0])
        try:
            assert generation.bare_replay(backend, calls)[0] == 3.0
        finally:
            backend.render_all, backend.tokenizer.batch_decode, generation.time = render, decode, timer
        assert [layer._compiled_call_impl for layer in layers] == compiled  # training keeps its compile
        with torch.inference_mode():  # and the layers are still compiled outside the replay
            layers[0](torch.zeros(1, 2, backend.model.config.hidden_size),
                      position_embeddings=backend.model.model.rotary_emb(torch.zeros(1, 2, 1), torch.arange(2)[None]))
        assert counter.frame_count == 1
    finally:
        for layer in layers:
            layer._compiled_call_impl = None
        backend.close()
        torch._dynamo.reset()


def test_the_phase_clock_splits_a_step_decoded_call_into_prefill_token_loop_and_host(tiny_model_dir):
    """``--stages`` rows of the step decoder carry where a call's time goes: the prefill, the token
    loop and the host's work around them add up to the call, and the decoder is unpatched after."""
    import time

    from sptool.models.base import SamplingParams
    from sptool.models.hf import HFBackend
    from sptool.models.hf_decoding import packed_split_weights
    from sptool.models.step_decoder import StepDecoder

    backend = HFBackend("tiny", device="cpu", batch_size=4, decoder="step")
    patched = (StepDecoder.prefill, StepDecoder.decode, HFBackend._encode, HFBackend.render_all,
               packed_split_weights.__enter__)
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=1)
        with generation.PhaseClock(backend) as phases:
            began = time.perf_counter()
            backend.generate(["What is 2 + 3?", "Name a colour."], 2, params)
            seconds = time.perf_counter() - began
        assert (StepDecoder.prefill, StepDecoder.decode, HFBackend._encode, HFBackend.render_all,
                packed_split_weights.__enter__) == patched
        split = phases.split(seconds, calls=1)
        assert split["prefill_ms"] > 0 and split["loop_ms"] > 0 and split["host_ms"] >= 0
        assert abs(split["prefill_ms"] + split["loop_ms"] + split["host_ms"] - seconds * 1000) < 0.5
        assert 0 < split["encode_ms"] <= split["host_ms"]  # the prompts' encoding is part of the host's time
        assert 0 < phases.render_s * 1000 <= split["host_ms"]  # so is rendering them
        assert split["pack_ms"] >= 0  # a float32 sampler packs nothing, but the entry is timed
        assert 0 < phases.prefill_s < phases.decode_s < seconds
        assert generation.PhaseClock(backend).split(1.0, calls=1) == {}  # no step-decoded call: no columns
    finally:
        backend.close()


def test_the_bf16_baseline_is_a_bf16_copy_of_the_split_trainers_live_weights(tiny_model_dir):
    """The bf16-split sampler's same-precision baseline: bare generate on a bf16 copy of the
    trainer's live float32 weights (the split rounding's routing adds no weights of its own)."""
    import torch
    from accelerate.state import AcceleratorState

    from sptool.models.base import SamplingParams
    from sptool.models.hf import HFBackend
    from sptool.train.step import PolicyTrainer, TrainConfig

    AcceleratorState._reset_state(True)  # one precision per process otherwise
    trainer = PolicyTrainer(TrainConfig(model=str(tiny_model_dir), device="cpu", mixed_precision="bf16",
                                        weight_rounding="split"))
    live = trainer.accelerator.unwrap_model(trainer.model)
    copy = generation.bare_copy(live, torch.bfloat16)
    weights = dict(copy.named_parameters())
    assert {p.dtype for p in weights.values()} == {torch.bfloat16}
    for name, parameter in live.named_parameters():
        assert name in weights and torch.equal(weights[name], parameter.detach().to(torch.bfloat16)), name
    assert {p.dtype for p in live.parameters()} == {torch.float32}  # the trainer's own are untouched
    backend = HFBackend.from_model(live, trainer.tokenizer, model_id=str(tiny_model_dir), batch_size=2)
    calls = [dict(prompts=["What is 2 + 3?", "Name a colour."], n=1,
                  params=SamplingParams(temperature=0.0, max_new_tokens=3))]
    try:
        seconds, steps, tokens = generation.bare_replay(backend, calls, copy)
        assert steps == 3 and 2 <= tokens <= 6 and seconds > 0
    finally:
        backend.close()
        AcceleratorState._reset_state(True)


def test_bare_generate_out_of_memory_runs_the_batch_in_parts(tiny_model_dir):
    """When bare ``generate`` runs out of device memory on a batch, the batch runs in halves (the
    rows that fit are kept for the timed replay), and its decoding steps are its longest part's."""
    import torch

    from sptool.models.base import SamplingParams
    from sptool.models.hf import HFBackend

    backend = HFBackend("tiny", device="cpu", batch_size=4)
    generate, seen, said = backend.model.generate, [], []

    def short_of_memory(**kwargs):
        seen.append(kwargs["input_ids"].shape[0])
        if kwargs["input_ids"].shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.41 GiB.")
        return generate(**kwargs)

    backend.model.generate = short_of_memory
    calls = [dict(prompts=["What is 2 + 3?", "Name a colour.", "Say hi.", "Count to 3."], n=1,
                  params=SamplingParams(temperature=0.0, max_new_tokens=3))]
    try:
        fit: dict = {}
        seconds, steps, tokens = generation.bare_replay(backend, calls, fit=fit, log=said.append)
        assert fit == {"rows": 2} and seen == [4, 2, 2]
        assert said == ["bare generate ran out of memory at 4 rows; 2 at a time"]
        assert steps == 3 and 4 <= tokens <= 12 and seconds > 0  # 3 steps of the 4-row batch, not 6
        seen.clear()
        generation.bare_replay(backend, calls, fit=fit, log=said.append)
        assert seen == [2, 2] and len(said) == 1  # the timed replay starts at the rows that fit
    finally:
        backend.model.generate = generate
        backend.close()


def test_bare_generate_gets_room_by_dropping_the_kept_caches_only_when_short():
    dropped = []

    class Backend:
        device = "cuda:0"

        def __init__(self, room):
            self._caches = {(512, 448): object(), (512, 192): object()}
            self.room, self.asked = room, []

        def new_cache_bytes(self, rows, length, dtype=None):
            return rows * length * (4 if dtype == "fp32" else 2)

        def _room_for(self, need):
            self.asked.append(need)
            return self.room

        def cache_bytes(self):
            return 3 * 1024 ** 3

        def release_caches(self):
            self._caches.clear()

    roomy = Backend(room=True)
    assert generation.room_for_bare(roomy, "fp32", log=dropped.append) == 0.0
    assert roomy.asked == [512 * 448 * 4] and len(roomy._caches) == 2 and not dropped  # sized by the largest
    short = Backend(room=False)
    assert generation.room_for_bare(short, "fp32", log=dropped.append) == 3.0
    assert not short._caches and dropped == ["dropped sptool's kept KV caches (3.00 GiB) to give bare "
                                             "generate's 0.00 GiB cache room"]
    short.device = "cpu"  # a CPU keeps its caches
    short._caches = {(4, 64): object()}
    assert generation.room_for_bare(short, "fp32") == 0.0 and short._caches


def test_the_plain_bare_arm_generates_each_prompt(tiny_model_dir):
    """``generation.py`` without ``--stages``: bare ``generate`` over the backend's model (a stray
    edit once made it read a model it was never given)."""
    from sptool.models.base import SamplingParams
    from sptool.models.hf import HFBackend

    backend = HFBackend("tiny", device="cpu", batch_size=2)
    try:
        seconds, tokens = generation.bare_hf(backend, ["What is 2 + 3?", "Name a colour."],
                                             SamplingParams(temperature=0.0, max_new_tokens=3), same_options=False)
        assert seconds > 0 and 2 <= tokens <= 6
    finally:
        backend.close()
