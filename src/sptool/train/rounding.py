"""How a bf16 or fp16 autocast forward rounds the float32 master weights (issue 32,
``train.weight_rounding``).

Why. Under autocast every matmul casts the float32 master weights to the low precision by
rounding to nearest. An RL-sized Adam step (lr 1e-5 moves a weight by about 1e-5) is far below half
a bf16 rounding step at the tiny model's typical |w| of 0.1 (about 2.4e-4), so the cast returns the
same bf16 weight until some twenty updates have added up: the forward does not see the updates
(``benchmarks/results/precision-h200/README.md``: after one update the bf16 forward's log-prob
change has cosine 0.098 with the float32 one). A bf16 trainer's gradient is then taken at a policy
that lags the one its sampler draws from: the likely source of the sampler–trainer gap that grew
from 0.026 to 0.22 nats a token over the H200 runs of a bf16 trainer with a float32 sampler. Activations are rounded too, but an activation varies from token to token,
so its rounding errors average out; a weight's rounding is the same for every token, every step.

The modes (``WEIGHT_ROUNDINGS``):

- ``nearest``: autocast's own cast (what every bf16 trainer does).
- ``split``: the weight as two low-precision parts, ``w ≈ hi + lo`` with ``hi = round(w)`` and
  ``lo = round(w − hi)``, and ``y = x·hiᵀ + x·loᵀ`` accumulated in float32, then rounded once to
  the autocast dtype: the forward sees the weights to about 16 mantissa bits (bf16), so every
  update. The sum must not be rounded between the two products: ``round(x·hiᵀ)`` is a grid point,
  and a remainder far below half a step added to a grid point rounds back to it. Rounding the whole
  sum once is an activation's rounding, which varies from token to token (on a small random Llama
  the trainer's log-prob change after one update had cosine 0.89 with float32's, against 0.92 with a
  float32 output and 0.19 for the nearest cast), and it keeps autocast's activation dtype, memory
  and KV cache. One more matmul per linear layer in the forward; the backward is autocast's
  (``∂L/∂x`` through ``hi`` alone, an error of one rounding step of the weights, as in any bf16
  backward).
- ``stochastic``: each forward uses a copy rounded stochastically, up with probability equal to the
  distance to the lower grid point over the grid step: ``E[round(w)] = w``, so an update is visible
  in expectation, at the cost of noise of up to one rounding step per weight and no extra matmul
  (bf16 only: 16 random low bits added, then truncated). The gradient reaches the master weight
  unchanged (straight through the rounding).

The trainer applies the mode to every linear layer of its model (:func:`use_weight_rounding`) and
to the LM head it applies itself in chunks (:func:`low_precision_parts`). A forward outside
autocast (the float32 sampler that shares the model) is plain ``F.linear``.
"""

from __future__ import annotations

from typing import Any

from sptool.train.config import WEIGHT_ROUNDINGS  # noqa: F401  (the modes, checked by TrainConfig)


def stochastic_round(weight, generator=None):
    """``weight`` (float32) rounded to a bf16 value stochastically, returned as float32 (exactly a
    bf16 value): the 16 low bits of the float32 pattern get uniform random bits added, then are
    cleared. A value a fraction f of the way from its bf16 neighbour nearer zero to the one farther
    from zero comes out as the farther one with probability f, so the expectation is ``weight``."""
    import torch

    bits = weight.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=generator)
    return ((bits + noise) & -65536).view(torch.float32)


def autocast_dtype(weight) -> Any:
    """The low-precision dtype a matmul of ``weight`` runs in here (bf16 or fp16 autocast on its
    device, a float32 weight); None: no rounding happens."""
    import torch

    if weight.dtype != torch.float32:
        return None
    device = weight.device.type
    if not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    return dtype if dtype in (torch.bfloat16, torch.float16) else None


def low_precision_parts(weight, dtype, rounding: str = "nearest"):
    """``(hi, lo)``: ``weight`` (detached) in ``dtype`` under ``rounding``; ``lo`` is the split
    mode's remainder ``round(w − hi)``, else None. A ``dtype`` that is the weight's own: no rounding."""
    import torch

    w = weight.detach()
    if dtype is None or dtype == w.dtype or rounding == "nearest" or w.dtype != torch.float32:
        return w.to(dtype or w.dtype), None
    if rounding == "split":
        hi = w.to(dtype)
        return hi, (w - hi.float()).to(dtype)
    if rounding == "stochastic" and dtype == torch.bfloat16:
        return stochastic_round(w).to(dtype), None
    raise ValueError(f"weight rounding {rounding!r} under {dtype}")


_OUT_DTYPE: dict = {}


def has_out_dtype_mm(device, dtype) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` works for ``dtype`` operands on
    ``device`` (CUDA, a recent torch), probed once against the float32 product. Called before any
    compiled forward (:func:`use_weight_rounding`), so the probe is never traced."""
    import torch

    device = torch.device(device)
    key = (device.type, dtype)
    if key not in _OUT_DTYPE:
        ok = False
        if device.type == "cuda":
            try:
                x, y = torch.randn(16, 8, device=device).to(dtype), torch.randn(8, 4, device=device).to(dtype)
                ok = bool(torch.allclose(torch.mm(x, y, out_dtype=torch.float32), x.float() @ y.float(),
                                         atol=1e-3, rtol=1e-3))
            except Exception:  # noqa: BLE001 - an older torch: no out_dtype
                ok = False
        _OUT_DTYPE[key] = ok
    return _OUT_DTYPE[key]


def mm_fp32(a, b):
    """``a @ b`` of two low-precision matrices, accumulated and returned in float32: one GEMM with
    ``out_dtype`` on CUDA where this torch has it, else the products of the low-precision values in
    float32 (the same numbers, slower). A bf16 output would round the sum, and a split weight's
    remainder added to a rounded output is rounded away again."""
    import torch

    if a.device.type == "cuda" and _OUT_DTYPE.get((a.device.type, a.dtype), False):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _split_linear_function():
    import torch

    class SplitLinear(torch.autograd.Function):
        """``y = x·hiᵀ + x·loᵀ (+ b)`` accumulated in float32 from ``dtype`` operands, then rounded
        once to ``dtype`` (autocast's output dtype); backward as autocast's linear: ``∂L/∂x = g·hi``
        in ``dtype``, ``∂L/∂w = gᵀ·x`` accumulated in float32."""

        @staticmethod
        def forward(ctx, x, weight, bias, dtype):
            with torch.autocast(x.device.type, enabled=False):
                shape = x.shape
                xb = x.reshape(-1, shape[-1]).to(dtype)
                hi = weight.detach().to(dtype)
                lo = (weight.detach() - hi.float()).to(dtype)
                y = mm_fp32(xb, hi.t()) + mm_fp32(xb, lo.t())
                if bias is not None:
                    y = y + bias.float()
                y = y.to(dtype)  # one rounding, of the whole sum
            ctx.save_for_backward(xb, hi)
            ctx.shape, ctx.x_dtype, ctx.has_bias = shape, x.dtype, bias is not None
            return y.reshape(*shape[:-1], y.shape[-1])

        @staticmethod
        def backward(ctx, grad):
            xb, hi = ctx.saved_tensors
            with torch.autocast(grad.device.type, enabled=False):
                g = grad.reshape(-1, grad.shape[-1])
                gl = g.to(hi.dtype)
                gx = (gl @ hi).reshape(ctx.shape).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
                gw = mm_fp32(gl.t(), xb) if ctx.needs_input_grad[1] else None
                gb = g.float().sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
            return gx, gw, gb, None

    return SplitLinear


_SPLIT = []


def rounded_linear(x, weight, bias, rounding: str):
    """``F.linear(x, weight, bias)`` whose weight, under bf16/fp16 autocast, is rounded by ``rounding``
    (see the module's docstring); outside autocast, or ``nearest``, exactly ``F.linear``. Every mode
    returns autocast's dtype."""
    import torch
    import torch.nn.functional as F

    dtype = autocast_dtype(weight) if rounding != "nearest" else None
    if dtype is None:
        return F.linear(x, weight, bias)
    if rounding == "split":
        if not _SPLIT:
            _SPLIT.append(_split_linear_function())
        return _SPLIT[0].apply(x, weight, bias, dtype)
    if dtype != torch.bfloat16:
        raise ValueError(f"stochastic weight rounding needs bf16 autocast, not {dtype}")
    with torch.no_grad():
        step = stochastic_round(weight) - weight
    return F.linear(x, weight + step, bias)  # straight through: the gradient is the weight's own


def packed_linear(x, packed, bias, dtype):
    """``y = [x, x]·packedᵀ (+ b)`` with ``packed = [hi | lo]`` (out x 2·in, ``dtype``): the split
    rounding's ``x·hiᵀ + x·loᵀ`` as one GEMM of twice the depth, accumulated in float32 and rounded
    once to ``dtype``. No gradient (a sampler's forward)."""
    import torch

    with torch.autocast(x.device.type, enabled=False):
        shape = x.shape
        xb = x.reshape(-1, shape[-1]).to(dtype)
        y = mm_fp32(torch.cat([xb, xb], dim=1), packed.t())
        if bias is not None:
            y = y + bias.float()
        return y.to(dtype).reshape(*shape[:-1], y.shape[-1])


def _rounded_forward(self, x):
    # a sampler's call under sptool.models.hf_decoding.packed_split_weights: [hi | lo] in one GEMM
    if getattr(self, "split_packed_on", False) and self.weight_rounding == "split":
        import torch

        if not torch.is_grad_enabled() and autocast_dtype(self.weight) == self.split_packed.dtype:
            dtype = self.split_packed.dtype
            group = getattr(self, "split_group", None)
            if group is not None:  # one GEMM with the layers beside it that read the same input
                return group[0].output(group[1], x, lambda x, packed, bias: packed_linear(x, packed, bias, dtype))
            return packed_linear(x, self.split_packed, self.bias, dtype)
    return rounded_linear(x, self.weight, self.bias, self.weight_rounding)


def use_weight_rounding(model, rounding: str, skip=(), device=None) -> int:
    """Route every ``nn.Linear`` of ``model`` but those in ``skip`` (the LM head the trainer applies
    itself, through :func:`low_precision_parts`) through :func:`rounded_linear` with ``rounding``;
    returns how many layers round so. ``nearest`` on a routed model sets them back to autocast's
    cast (their forward is ``F.linear`` again in effect). A layer reads its mode at each call.
    ``device``: where the model will run (default: where its parameters are now)."""
    import types

    import torch

    if rounding == "split":
        if not _SPLIT:
            _SPLIT.append(_split_linear_function())  # built here: torch.compile can't trace a class statement
        where = device if device is not None else next((p.device for p in model.parameters()), "cpu")
        for dtype in (torch.bfloat16, torch.float16):  # probed here, not inside a traced forward
            has_out_dtype_mm(where, dtype)
    count = 0
    for module in model.modules():
        # LoRA and quantised layers keep their own forward
        if type(module) is not torch.nn.Linear or any(module is other for other in skip):
            continue
        if "forward" not in vars(module):
            if rounding == "nearest":
                continue
            module.forward = types.MethodType(_rounded_forward, module)
        module.weight_rounding = rounding
        count += 1
    return count
