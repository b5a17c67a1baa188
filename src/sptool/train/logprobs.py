"""Selected-token log-probabilities from the last hidden states, without ``[tokens × vocabulary]`` logits.

A policy-gradient loss needs one number per completion token, ``log π(y_t) = z_{y_t}/τ − logsumexp(z/τ)``
with ``z = W h_t (+ b)`` the language-model head's logits. Materialising ``z`` for every token (and
its float32 copy, its log-softmax and their gradients) is what made the update slow and large: at
a 151,936-token vocabulary one 16k-token micro-batch holds ≈ 25 GB of logits. Here the head is
applied to **chunks of tokens** (``chunk_rows`` rows at a time, so memory grows with
``chunk_rows × vocabulary``, never with ``tokens × vocabulary``), in the compute dtype (bf16
matmuls with float32 accumulation under bf16 mixed precision) and reductions in float32.

- :func:`chunked_selected_logprobs`: no-grad log-probs (and optionally entropies), for the
  reference model's KL and for behaviour log-probs.
- :func:`fused_policy_loss`: the training path. A policy-gradient loss is a sum of per-token terms
  ``L = Σ_t ℓ_t(log π(y_t))``, so ``∂L/∂z_t = ℓ'_t · (onehot(y_t) − softmax(z_t/τ)) / τ`` is known
  as soon as a chunk's log-probs are: each chunk's logits are used once, for the forward value and
  the gradients of the hidden states and of the head together (the same trick as Liger-Kernel's
  fused linear cross-entropy, Hsu et al. 2024, in portable torch). No logits are kept for the
  backward pass and the head's matmuls are not repeated.

The per-chunk arithmetic is two small functions in two versions: eager (:func:`chunk_forward`,
:func:`chunk_grad`: in-place float32 passes) and for ``torch.compile`` (:func:`fused_chunk_forward`,
:func:`fused_chunk_grad`: on CUDA Inductor fuses each into one or two kernels that read the bf16
logits and write only ``[rows]`` vectors and the bf16 gradient).
"""

from __future__ import annotations

from typing import Callable

# Elements (rows × vocabulary) of one chunk of logits: 2^28 ≈ 268M on CUDA (0.5 GB in bf16; at
# Qwen2.5's 151,936-token vocabulary ≈ 1,766 rows), 2^22 on CPU (cache-friendly, 16 MB).
CHUNK_ELEMENTS = {"cuda": 2**28, "cpu": 2**22}


def chunk_rows_for(vocab: int, device_type: str, chunk_elements: int | None = None) -> int:
    elements = chunk_elements or CHUNK_ELEMENTS.get(device_type, CHUNK_ELEMENTS["cuda"])
    return max(1, elements // max(vocab, 1))


def chunk_forward(z, targets, temperature: float, want_entropy: bool):
    """One chunk of logits ``z`` ``[rows, V]`` → ``(state, log π(y), logsumexp(z/τ), entropy or None)``.

    Eager version: ``state`` is ``z/τ`` in float32, which :func:`chunk_grad` overwrites in place
    (``z`` belongs to the caller's chunk loop: float32 logits are used in place, not copied); the
    entropy is left to :func:`chunk_grad`, which has the softmax."""
    import torch

    zf = z.float()
    if temperature != 1.0:
        zf.div_(temperature)
    lse = torch.logsumexp(zf, dim=-1)
    return zf, zf.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse, lse, None


def chunk_grad(state, targets, lse, token_grad, temperature: float, out_dtype, want_entropy: bool):
    """``∂(Σ_t g_t log π(y_t))/∂z = g/τ · (onehot(y) − softmax(z/τ))`` in ``out_dtype``, and the
    rows' entropies ``H = −Σ_v p_v log p_v`` when ``want_entropy`` and :func:`chunk_forward` did
    not give them. Eager version: in place on ``state``."""
    import torch

    logp = state.sub_(lse.unsqueeze(-1))
    p = logp.exp()
    entropy = None
    if want_entropy:  # −Σ p log p as a batched dot product (no [rows, V] temporary)
        entropy = -torch.bmm(p.unsqueeze(1), logp.unsqueeze(2)).view(-1)
    scale = (token_grad / temperature).unsqueeze(-1)
    p.mul_(-scale)
    p.scatter_add_(-1, targets.unsqueeze(-1), scale)
    return p.to(out_dtype), entropy


def fused_chunk_forward(z, targets, temperature: float, want_entropy: bool):
    """As :func:`chunk_forward`, written for ``torch.compile`` (no in-place ops, no
    ``[rows, V]`` float32 result: the reductions read ``z`` and write ``[rows]`` vectors);
    ``state`` is ``z`` itself and the entropy comes from here."""
    import torch

    zf = z.float() / temperature
    m = zf.amax(-1, keepdim=True)
    e = torch.exp(zf - m)
    s = e.sum(-1)
    lse = m.squeeze(-1) + torch.log(s)
    logp = zf.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = lse - (e * zf).sum(-1) / s if want_entropy else None
    return z, logp, lse, entropy


def fused_chunk_grad(z, targets, lse, token_grad, temperature: float, out_dtype, want_entropy: bool):
    """As :func:`chunk_grad`, written for ``torch.compile``: one pointwise pass over ``z``."""
    import torch

    zf = z.float() / temperature
    p = torch.exp(zf - lse.unsqueeze(-1))
    onehot = torch.arange(z.shape[-1], device=z.device).unsqueeze(0) == targets.unsqueeze(-1)
    return ((onehot.to(zf.dtype) - p) * (token_grad / temperature).unsqueeze(-1)).to(out_dtype), None


class _Kernels:
    """The per-chunk pair (forward, grad): eager, or compiled by ``torch.compile`` with dynamic
    shapes. A compiled pair that fails (no Triton, an unsupported backend) falls back to eager
    for the rest of the process, with a note on stderr."""

    def __init__(self, compiled: bool):
        self.compiled = compiled
        self.broken = False
        if compiled:
            import torch

            self._forward = torch.compile(fused_chunk_forward, dynamic=True)
            self._grad = torch.compile(fused_chunk_grad, dynamic=True)

    def _fail(self, exc: Exception) -> None:
        import sys

        self.broken = True
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        print(f"note: torch.compile of the log-prob kernels failed ({type(exc).__name__}: {first}); "
              "running them eagerly", file=sys.stderr)

    def forward(self, z, targets, temperature: float, want_entropy: bool):
        """``((state, logp, lse, entropy or None), fused)``: pass ``state`` and ``fused`` to :meth:`grad`."""
        if self.compiled and not self.broken:
            try:
                return self._forward(z, targets, temperature, want_entropy), True
            except Exception as exc:  # noqa: BLE001 - any compiler failure: run eagerly instead
                self._fail(exc)
        return chunk_forward(z, targets, temperature, want_entropy), False

    def grad(self, state, targets, lse, token_grad, temperature: float, out_dtype, want_entropy: bool,
             fused: bool):
        if fused and not self.broken:
            try:
                return self._grad(state, targets, lse, token_grad, temperature, out_dtype, want_entropy)
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)
        if fused:  # ``state`` is the raw logits: make the eager state
            state = chunk_forward(state, targets, temperature, False)[0]
        return chunk_grad(state, targets, lse, token_grad, temperature, out_dtype, want_entropy)


_KERNELS: dict = {}


def kernels(compiled: bool) -> _Kernels:
    if compiled not in _KERNELS:
        _KERNELS[compiled] = _Kernels(compiled)
    return _KERNELS[compiled]


def _logits(hidden, weight, bias, weight_lo=None):
    if weight_lo is not None:  # the split weight rounding (sptool.train.rounding): summed in float32
        from sptool.train.rounding import mm_fp32

        z = mm_fp32(hidden, weight.t()) + mm_fp32(hidden, weight_lo.t())
        return z + bias.float() if bias is not None else z
    z = hidden @ weight.t()
    return z + bias if bias is not None else z


def chunked_selected_logprobs(hidden, weight, bias, targets, *, temperature: float = 1.0, chunk_rows: int = 1024,
                              compute_dtype=None, entropy: bool = False, compiled: bool = False,
                              rounding: str = "nearest"):
    """``log softmax(W h_t / τ)[y_t]`` for every row ``t`` of ``hidden`` ``[T, d]`` (no gradient),
    ``chunk_rows`` rows at a time; with ``entropy`` also the entropy of each row's distribution.
    ``rounding``: how ``W`` is rounded to ``compute_dtype`` (:mod:`sptool.train.rounding`).
    Returns float32 ``(logprobs [T], entropy [T] or None)``."""
    import torch

    from sptool.train.rounding import low_precision_parts

    pair = kernels(compiled)
    dtype = compute_dtype or weight.dtype
    with torch.no_grad():
        w, w_lo = low_precision_parts(weight, dtype, rounding)
        b = bias.detach().to(dtype) if bias is not None else None
        h = hidden.detach().to(dtype)
        out = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        ent = torch.empty_like(out) if entropy else None
        for start in range(0, h.shape[0], chunk_rows):
            end = min(start + chunk_rows, h.shape[0])
            z = _logits(h[start:end], w, b, w_lo)
            (state, out[start:end], lse, chunk_ent), fused = pair.forward(z, targets[start:end], temperature, entropy)
            if entropy:
                if chunk_ent is None:  # the eager forward leaves the entropy to the softmax pass
                    logp = state.sub_(lse.unsqueeze(-1))
                    chunk_ent = -torch.bmm(logp.exp().unsqueeze(1), logp.unsqueeze(2)).view(-1)
                ent[start:end] = chunk_ent
        return out, ent


_ADDMM_FP32: dict = {}


def _accumulate_fp32(acc, a, b) -> None:
    """``acc += a @ b`` with ``acc`` float32 and ``a``, ``b`` in a lower precision: on CUDA one
    GEMM accumulating into float32 (``out_dtype``) when this torch has it, else a product then add."""
    import torch

    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    key = (acc.device.type, a.dtype)
    if key not in _ADDMM_FP32:
        ok = False
        if acc.device.type == "cuda":
            try:  # probe once against the plain product
                x = torch.randn(16, 8, device=acc.device).to(a.dtype)
                y = torch.randn(8, 4, device=acc.device).to(a.dtype)
                c = torch.ones(16, 4, device=acc.device)
                torch.addmm(c, x, y, out_dtype=torch.float32, out=c)
                ok = bool(torch.allclose(c, 1 + x.float() @ y.float(), atol=1e-2, rtol=1e-2))
            except Exception:  # noqa: BLE001 - an older torch or a backend without it
                ok = False
        _ADDMM_FP32[key] = ok
    if _ADDMM_FP32[key]:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.add_(a @ b)


def _fused_forward(hidden, weight, bias, targets, token_loss, temperature, chunk_rows, dtype, want_entropy,
                   compiled, need_hidden_grad, need_weight_grad, need_bias_grad, rounding="nearest"):
    import torch

    from sptool.train.rounding import low_precision_parts

    pair = kernels(compiled)
    rows = hidden.shape[0]
    device = hidden.device
    # the split rounding's remainder enters the logits only; ∂L/∂h goes through hi, as in its linears
    w, w_lo = low_precision_parts(weight, dtype, rounding)
    b = bias.detach().to(dtype) if bias is not None else None
    h = hidden.detach().to(dtype)
    grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=device) if need_hidden_grad else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=device) if need_weight_grad else None
    grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=device) if need_bias_grad else None
    logprobs = torch.empty(rows, dtype=torch.float32, device=device)
    entropy = torch.empty(rows, dtype=torch.float32, device=device) if want_entropy else None
    loss = torch.zeros((), dtype=torch.float32, device=device)
    stats = None
    for start in range(0, rows, chunk_rows):
        end = min(start + chunk_rows, rows)
        hc = h[start:end]
        z = _logits(hc, w, b, w_lo)
        (state, logp, lse, ent), fused = pair.forward(z, targets[start:end], temperature, want_entropy)
        del z  # the eager state is a float32 copy; the fused one is z itself
        logprobs[start:end] = logp
        with torch.enable_grad():
            leaf = logp.detach().requires_grad_(True)
            chunk_loss, chunk_stats = token_loss(leaf, start, end)
            (token_grad,) = torch.autograd.grad(chunk_loss, leaf, allow_unused=True)
        if token_grad is None:
            token_grad = torch.zeros_like(logp)
        loss += chunk_loss.detach()
        stats = chunk_stats if stats is None else stats + chunk_stats
        g, grad_ent = pair.grad(state, targets[start:end], lse, token_grad, temperature, dtype,
                                want_entropy and ent is None, fused)
        del state
        if want_entropy:
            entropy[start:end] = ent if ent is not None else grad_ent
        if grad_hidden is not None:
            grad_hidden[start:end] = g @ w
        if grad_weight is not None:
            _accumulate_fp32(grad_weight, g.t(), hc)
        if grad_bias is not None:
            grad_bias += g.float().sum(0)
    return loss, logprobs, entropy, stats, grad_hidden, grad_weight, grad_bias


def fused_policy_loss(hidden, weight, bias, targets, token_loss: Callable, *, temperature: float = 1.0,
                      chunk_rows: int = 1024, compute_dtype=None, entropy: bool = False, compiled: bool = False,
                      rounding: str = "nearest"):
    """The loss ``Σ_chunks token_loss(log π(y[chunk]))`` and its gradients w.r.t. ``hidden``
    ``[T, d]``, the head ``weight`` ``[V, d]`` (and ``bias``), computed chunk by chunk.

    ``token_loss(logprobs, start, end)`` gets the float32 log-probs of rows ``start:end`` (a leaf
    that requires grad) and returns ``(loss, stats)``: a scalar that is a sum of per-row terms
    (each term may depend on its own row's log-prob only) and a tensor of statistics that are
    summed over chunks. Returns ``(loss, logprobs, entropy or None, stats)``; only ``loss``
    carries a gradient. Backward multiplies the saved gradients by the incoming scalar.
    ``rounding``: how the head is rounded to ``compute_dtype`` (:mod:`sptool.train.rounding`).
    """
    import torch

    box: dict = {}

    class _FusedPolicyLoss(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden_, weight_, bias_):
            loss, logprobs, ent, stats, gh, gw, gb = _fused_forward(
                hidden_, weight_, bias_, targets, token_loss, temperature, chunk_rows,
                compute_dtype or weight_.dtype, entropy, compiled, ctx.needs_input_grad[0],
                ctx.needs_input_grad[1], bias_ is not None and ctx.needs_input_grad[2], rounding)
            box["grads"] = [gh, gw.to(weight_.dtype) if gw is not None else None,
                            gb.to(bias_.dtype) if gb is not None else None]
            box["outputs"] = (logprobs, ent, stats)
            return loss

        @staticmethod
        def backward(ctx, grad_loss):
            grads = box.pop("grads")
            # the gradients are ours alone: scale them in place (no host sync, no copy)
            return tuple(None if g is None else g.mul_(grad_loss) for g in grads)

    loss = _FusedPolicyLoss.apply(hidden, weight, bias)
    logprobs, ent, stats = box.pop("outputs")
    return loss, logprobs, ent, stats
