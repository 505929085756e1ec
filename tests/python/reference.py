"""Reference attention for the Python suite: plain PyTorch, any dtype (the
tests run it in float64 as the truth, and in float32 for LSE's plain-fp32
error), with the service's masks (causal, window, documents)."""

import math

import torch


def visible(S, causal, window=None, cu_seqlens=None, device="cpu"):
    """[S, S] bool: may query i see key j (flash_attn's rules)."""
    i = torch.arange(S, device=device)[:, None]
    j = torch.arange(S, device=device)[None, :]
    ok = torch.ones(S, S, dtype=torch.bool, device=device)
    if causal:
        ok &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            ok &= j >= i - left
        if right >= 0 and not causal:
            ok &= j <= i + right
    if cu_seqlens is not None:
        doc = torch.zeros(S, dtype=torch.int64, device=device)
        for b in cu_seqlens[1:-1]:
            doc[b:] += 1
        ok &= doc[:, None] == doc[None, :]
    return ok


def attention(q, k, v, causal=True, scale=None, window=None, cu_seqlens=None):
    """O [B, S, H, D] and LSE [B, H, S] in q's dtype; differentiable."""
    B, S, H, D = q.shape
    g = H // k.shape[2]
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    kr = k.repeat_interleave(g, dim=2)
    vr = v.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    s = s.masked_fill(~visible(S, causal, window, cu_seqlens, q.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    return torch.einsum("bhqk,bkhd->bqhd", p, vr), lse


def sdpa(q, k, v, causal=True, scale=None):
    """torch's scaled_dot_product_attention in [B, S, H, D] terms."""
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=scale,
        enable_gqa=True)
    return o.transpose(1, 2)


def max_err(x, ref):
    return (x.double() - ref.double()).abs().max().item()
