"""stria.attention against float64 PyTorch autograd, 4 workers, every layout:
O, LSE, dQ, dK, dV. float32 must be within 2x the error of float32 SDPA (LSE:
of a plain float32 logsumexp) plus a small floor; bfloat16 and float16 O
within 2x and gradients within 3x of same-dtype SDPA's error."""

import functools

import pytest
import torch

import stria
from reference import attention as ref_attention, max_err, sdpa

SHAPES = [  # B, S, H, Hkv, D, causal
    (2, 509, 4, 2, 64, True),
    (1, 1024, 8, 8, 128, True),
    (2, 300, 4, 1, 32, False),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LAYOUTS = ["striped", "contiguous", "zigzag", "auto"]


def _id(shape):
    return "B{}_S{}_H{}_Hkv{}_D{}_{}".format(*shape[:5], "causal" if shape[5] else "full")


@functools.lru_cache(maxsize=2)
def case(shape, dtype):
    """Inputs in `dtype`, and the errors a plain same-dtype implementation
    makes against float64: the bar stria is held to."""
    B, S, H, Hkv, D, causal = shape
    g = torch.Generator().manual_seed(hash(shape) % 2**31)
    q, k, v = (torch.randn(B, S, h, D, generator=g).to(dtype) for h in (H, Hkv, Hkv))
    do = torch.randn(B, S, H, D, generator=g).to(dtype)
    # float64 truth from the same (rounded) values
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    o64, lse64 = ref_attention(q64, k64, v64, causal)
    o64.backward(do.double())
    truth = {"o": o64.detach(), "lse": lse64.detach(), "dq": q64.grad, "dk": k64.grad,
             "dv": v64.grad}
    # same-dtype SDPA, and a plain float32 LSE
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    os_ = sdpa(qs, ks, vs, causal)
    os_.backward(do)
    _, lse32 = ref_attention(q.float(), k.float(), v.float(), causal)
    bar = {"o": max_err(os_, truth["o"]), "lse": max_err(lse32, truth["lse"]),
           "dq": max_err(qs.grad, truth["dq"]), "dk": max_err(ks.grad, truth["dk"]),
           "dv": max_err(vs.grad, truth["dv"])}
    return (q, k, v, do), truth, bar


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_against_float64(client, shape, dtype, layout):
    (q, k, v, do), truth, bar = case(shape, dtype)
    causal = shape[5]
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = stria.attention(qs, ks, vs, causal=causal, layout=layout, return_lse=True)
    o.backward(do)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert lse.shape == (shape[0], shape[2], shape[1])
    got = {"o": o, "lse": lse, "dq": qs.grad, "dk": ks.grad, "dv": vs.grad}
    factor = {"o": 2.0, "lse": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0}
    if dtype == torch.float32:
        factor = dict.fromkeys(factor, 2.0)
    report = []
    for name, x in got.items():
        assert x.shape == truth[name].shape, name
        err = max_err(x, truth[name])
        floor = 2.0**-20 * truth[name].abs().max().item()
        allowed = factor[name] * bar[name] + floor
        report.append(f"{name}: {err:.3g} (allowed {allowed:.3g}, plain {bar[name]:.3g})")
        assert err <= allowed, "; ".join(report)


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_bfloat16_within_twice_math_sdpa(client, shape):
    """FlashAttention's bar for bf16 kernels that round P and dS to bf16: O,
    dQ, dK, dV within 2x the error of PyTorch's math SDPA computing in bf16 on
    the same tensors, plus the floor. (Since torch 2.5 the math backend
    computes bf16 in fp32 unless bf16 reductions are allowed: that would be a
    plain fp32 implementation, the yardstick of test_against_float64.)"""
    (q, k, v, do), truth, _ = case(shape, torch.bfloat16)
    causal = shape[5]
    qm, km, vm = (t.clone().requires_grad_() for t in (q, k, v))
    allowed_before = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            om = sdpa(qm, km, vm, causal)
        om.backward(do)
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(allowed_before)
    bar = {"o": om, "dq": qm.grad, "dk": km.grad, "dv": vm.grad}
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    o = stria.attention(qs, ks, vs, causal=causal, layout="striped")
    o.backward(do)
    got = {"o": o, "dq": qs.grad, "dk": ks.grad, "dv": vs.grad}
    for name, x in got.items():
        err, plain = max_err(x, truth[name]), max_err(bar[name], truth[name])
        allowed = 2.0 * plain + 2.0**-20 * truth[name].abs().max().item()
        assert err <= allowed, f"{name}: {err:.3g} > {allowed:.3g} (math SDPA bf16 {plain:.3g})"
