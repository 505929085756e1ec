"""Non-finite inputs through the service are never hidden: a NaN or an
infinity in q, k, v or the output's gradient, given to stria.attention (4
workers, every layout, float32 and bfloat16, with and without documents and
a window). Every output that depends on it through the positions the mask
lets it see is non-finite, as with SDPA (a NaN or +inf score poisons its
query's row, a -inf score is a zero weight); the other batch row and kv
head group keep the outputs of a run without it."""

import math

import pytest
import torch

import stria
from reference import visible

B, S, H, HKV, D = 2, 128, 4, 2, 64
LAYOUTS = ["striped", "contiguous", "zigzag"]
DTYPES = [torch.float32, torch.bfloat16]
MASKS = {"causal": {}, "documents-window": dict(cu_seqlens=[0, 37, 37, 90, 128],
                                                window_size=(20, 0))}


def _inputs(dtype):
    g = torch.Generator().manual_seed(42)
    return [torch.randn(B, S, h, D, generator=g).to(dtype) for h in (H, HKV, HKV, H)]


def _run(q, k, v, do, layout, masks):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = stria.attention(q, k, v, causal=True, layout=layout, return_lse=True, **masks)
    o.backward(do)
    return {"o": o.detach().float(), "lse": lse.float(), "dq": q.grad.float(),
            "dk": k.grad.float(), "dv": v.grad.float()}


def _reference(q, k, v, do, masks):
    """float64 over the keys the mask lets each row see (a masked score is
    -inf whatever it was, and no zero weight multiplies anything, so no 0 x
    NaN): the outputs that depend on a non-finite input come out non-finite,
    the others finite."""
    q, k, v, do = (t.double() for t in (q, k, v, do))
    window = masks.get("window_size")
    vis = visible(S, True, window=list(window) if window else None,
                  cu_seqlens=masks.get("cu_seqlens"))
    scale = 1.0 / math.sqrt(D)
    out = {"o": torch.zeros(B, S, H, D, dtype=torch.float64),
           "lse": torch.zeros(B, H, S, dtype=torch.float64),
           "dq": torch.zeros(B, S, H, D, dtype=torch.float64),
           "dk": torch.zeros(B, S, HKV, D, dtype=torch.float64),
           "dv": torch.zeros(B, S, HKV, D, dtype=torch.float64)}
    zero = torch.zeros((), dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            hk = h // (H // HKV)
            qh, kh, vh, gh = q[b, :, h], k[b, :, hk], v[b, :, hk], do[b, :, h]
            s = ((qh @ kh.T) * scale).masked_fill(~vis, -math.inf)
            m = s.amax(-1)  # NaN when a visible score is NaN
            empty = m == -math.inf  # nothing visible, or only -inf scores
            p = torch.where(vis & ~empty[:, None], torch.exp(s - m.masked_fill(empty, 0)[:, None]),
                            zero)
            w = p != 0  # -inf scores are zero weights; NaN is not zero
            l = p.sum(-1)
            pn = torch.where(w, p / l[:, None], zero)
            o = torch.where(w[..., None], pn[..., None] * vh[None], zero).sum(1)
            delta = (gh * o).sum(-1)
            ds = torch.where(w, pn * (gh @ vh.T - delta[:, None]) * scale, zero)
            out["o"][b, :, h] = o
            out["lse"][b, h] = torch.where(empty, -math.inf, m + torch.log(l))
            out["dq"][b, :, h] = torch.where(w[..., None], ds[..., None] * kh[None], zero).sum(1)
            out["dk"][b, :, hk] += torch.where(w[..., None], ds[..., None] * qh[:, None],
                                               zero).sum(0)
            out["dv"][b, :, hk] += torch.where(w[..., None], pn[..., None] * gh[:, None],
                                               zero).sum(0)
    return out


def _group_mask(name, b, g):
    """The elements of output `name` in batch row b and kv head group g."""
    if name == "lse":
        m = torch.zeros(B, H, S, dtype=torch.bool)
        m[b, g * (H // HKV):(g + 1) * (H // HKV)] = True
    elif name in ("dk", "dv"):
        m = torch.zeros(B, S, HKV, D, dtype=torch.bool)
        m[b, :, g] = True
    else:
        m = torch.zeros(B, S, H, D, dtype=torch.bool)
        m[b, :, g * (H // HKV):(g + 1) * (H // HKV)] = True
    return m


SPOTS = [  # tensor (0 q, 1 k, 2 v, 3 dO), token, value
    (0, 70, math.nan), (0, 70, math.inf), (1, 20, math.nan), (1, 20, math.inf),
    (1, 20, -math.inf), (2, 20, math.nan), (2, 20, math.inf), (3, 60, math.nan),
]


@pytest.mark.parametrize("masks", list(MASKS), ids=list(MASKS))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_nonfinite_inputs_are_never_hidden(client, dtype, layout, masks):
    opts = MASKS[masks]
    inputs = _inputs(dtype)
    clean = _run(*inputs, layout, opts)
    for t, tok, value in SPOTS:
        x = [a.clone() for a in inputs]
        head = 1  # a query head of kv group 0, or kv head 1
        x[t][1, tok, head, 5] = value
        group = head // (H // HKV) if t in (0, 3) else head
        got = _run(*x, layout, opts)
        ref = _reference(*x, opts)
        what = f"{['q', 'k', 'v', 'dO'][t]}[1, {tok}, {head}, 5] = {value}"
        reached = 0
        for name, r in ref.items():
            g = got[name]
            must = torch.isnan(r) | (r == math.inf) if name == "lse" else ~torch.isfinite(r)
            hidden = must & (torch.isfinite(g) | (g == -math.inf))
            assert not hidden.any(), (
                f"{what}: {int(hidden.sum())} of the {int(must.sum())} {name} outputs that "
                f"depend on it are finite")
            reached += int(must.sum())
            out = ~_group_mask(name, 1, group)
            c = clean[name]
            same = (g == c) | ((g - c).abs() <= 1e-3 * c[torch.isfinite(c)].abs().max())
            assert (same | ~out).all(), f"{what}: {name} outside its batch row and group changed"
        assert reached > 0, f"{what}: reaches no output"
