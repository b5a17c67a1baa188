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
