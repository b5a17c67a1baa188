"""Attention for one decoding position that reads the KV cache once (issue 33).

The H200 profile of the solve stage (``benchmarks/results/generation-h200/step-decoder.md``) found
decoding device-bound, with 19 of 25 ms a step in attention: with a float32 sampler SDPA cannot use
flash attention and takes CUTLASS's memory-efficient kernel, which tiles 64 queries where a decoding
step has one per (row, head), after ``repeat_kv`` has copied every KV head out to its query heads.

For a single query position, grouped-query attention is two small batched matmuls. The G query
heads that share a KV head form a G-row query against that head's keys and values:

    scores = (q[B, Hkv, G, D] @ kᵀ[B, Hkv, D, S]) · scaling,  masked,
    out    = softmax(scores) @ v[B, Hkv, S, D]                → [B, 1, Hkv·G, D]

K and V are read once, never copied. Query lengths other than 1 (prefill, training) go to
transformers' own SDPA function unchanged.

A static cache holds every position a call may reach, and most of them are still empty early in
the call. The step decoder passes ``decode_window`` (a model keyword argument that transformers
hands to the attention function): the positions ``[0, window)`` hold every written one, so only
they are read (windows in :data:`WINDOW`-sized steps, one compiled and captured step each, or
one compiled step for all with the step decoder's ``dynamic_window``).

:func:`register` registers the function (with SDPA's
mask) under :data:`NAME`, and :func:`attention_implementation` switches a model to it inside a block;
``model.decode_attention = "grouped"`` switches the hf backend to it around each ``generate``
call; ``benchmarks/generation.py --stages --attention model,grouped`` measures it against SDPA.
"""

from __future__ import annotations

from contextlib import contextmanager

NAME = "sptool_grouped_decode"
#: the step decoder's KV windows are multiples of this many positions (a compiled step per window)
WINDOW = 64


def grouped_decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, is_causal: bool | None = None,
                             decode_window: int | None = None, **kwargs):
    """transformers' attention-function contract: ``query`` [B, H, Q, D], ``key``/``value``
    [B, Hkv, S, D], ``attention_mask`` SDPA's (bool, True = attend, or additive float, or None);
    returns ([B, Q, H, D], None). ``decode_window``: only the first that many positions of the
    cache are read (every position written so far lies below it; the rest are masked anyway)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    if length != 1 or heads % kv_heads or (dropout and module.training):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    if attention_mask is not None:
        attention_mask = attention_mask[..., -key.shape[-2]:]  # [B or 1, 1, 1, S]
    if decode_window is not None and decode_window < key.shape[-2]:
        key, value = key[:, :, :decode_window], value[:, :, :decode_window]
        attention_mask = attention_mask[..., :decode_window] if attention_mask is not None else None
    group = heads // kv_heads
    scale = dim ** -0.5 if scaling is None else scaling
    # repeat_kv gives query head h the KV head h // group, so heads [k·G, (k+1)·G) share KV head k
    grouped = query.reshape(batch, kv_heads, group, dim)
    scores = torch.matmul(grouped, key.transpose(-1, -2)) * scale  # [B, Hkv, G, S]
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs, value)  # [B, Hkv, G, D]
    return out.reshape(batch, heads, 1, dim).transpose(1, 2), None


def register() -> str:
    """Register the function and SDPA's mask under :data:`NAME` (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, grouped_decode_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


@contextmanager
def attention_implementation(model, name: str):
    """``model`` with attention ``name`` ("sdpa", "grouped", or any registered name) inside the block."""
    before = model.config._attn_implementation
    model.set_attn_implementation(register() if name == "grouped" else name)
    try:
        yield model
    finally:
        model.set_attn_implementation(before)
