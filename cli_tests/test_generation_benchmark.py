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
        "tiny step/grouped/capture/bf16-split: slowest of 2 stages: eval (greedy) at 4.92x bare; every stage >= 5x: no",
        "tiny step/grouped/compile/bf16-split: slowest of 2 stages: eval (greedy) at 5.0x bare; every stage >= 5x: yes",
        "0.6b step/grouped/capture/bf16-split: slowest of 1 stage: solve at 3.2x bare; every stage >= 3x: yes"]


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
    from sptool.models.step_decoder import StepDecoder

    backend = HFBackend("tiny", device="cpu", batch_size=4, decoder="step")
    prefill, decode = StepDecoder.prefill, StepDecoder.decode
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=1)
        with generation.PhaseClock(backend) as phases:
            began = time.perf_counter()
            backend.generate(["What is 2 + 3?", "Name a colour."], 2, params)
            seconds = time.perf_counter() - began
        assert (StepDecoder.prefill, StepDecoder.decode) == (prefill, decode)
        split = phases.split(seconds, calls=1)
        assert split["prefill_ms"] > 0 and split["loop_ms"] > 0 and split["host_ms"] >= 0
        assert abs(sum(split.values()) - seconds * 1000) < 0.5
        assert 0 < phases.prefill_s < phases.decode_s < seconds
        assert generation.PhaseClock(backend).split(1.0, calls=1) == {}  # no step-decoded call: no columns
    finally:
        backend.close()
