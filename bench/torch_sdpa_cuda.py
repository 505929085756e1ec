#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention on a CUDA GPU, the yardstick of
`stria-bench kernels --device cuda`: forward (no grad) and forward+backward on
the same shapes ([1, H, S, D], one dtype, causal by default), timed with
torch.cuda.Event, median of --reps after one warm-up run. FLOPs are counted
as by stria-bench: forward 4*S^2*D*H (half when causal), backward 2.5x
forward, so forward+backward is 3.5x.

Prints one JSON object per line (--json) or a small table. Exits 3 when torch
or a CUDA GPU is not available (nothing measured)."""

import argparse
import json
import statistics
import sys


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=0, help="K/V heads (default: --heads)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-causal", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    kv_heads = args.kv_heads or args.heads
    if args.seq < 1 or args.heads < 1 or args.reps < 1 or args.heads % kv_heads:
        ap.error("--seq, --heads, --reps must be >= 1 and --kv-heads must divide --heads")
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        print(f"torch_sdpa_cuda: torch is not importable ({e})", file=sys.stderr)
        return 3
    if not torch.cuda.is_available():
        print("torch_sdpa_cuda: no CUDA GPU visible to torch", file=sys.stderr)
        return 3

    dev = torch.device("cuda")
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    causal = not args.no_causal
    S, H, D = args.seq, args.heads, args.head_dim
    gen = torch.Generator(device=dev).manual_seed(1)

    def rnd(h):
        return (torch.rand(1, h, S, D, device=dev, dtype=torch.float32, generator=gen) * 2 - 1).to(dt)

    q = rnd(H).requires_grad_(True)
    k = rnd(kv_heads).requires_grad_(True)
    v = rnd(kv_heads).requires_grad_(True)
    g = rnd(H)
    extra = {}
    if kv_heads != H:
        extra["enable_gqa"] = True

    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=causal, **extra)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, **extra)
        out.backward(g)

    def timed(fn):
        fn()  # warm-up
        torch.cuda.synchronize()
        ms = []
        for _ in range(args.reps):
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            ms.append(e0.elapsed_time(e1))
        return statistics.median(ms)

    fwd_flops = 4.0 * S * S * D * H * (0.5 if causal else 1.0)
    gpu = torch.cuda.get_device_name(dev)
    rows = []
    for name, fn, flops in (("fwd", fwd, fwd_flops), ("fwd+bwd", fwd_bwd, 3.5 * fwd_flops)):
        ms = timed(fn)
        rows.append({"name": "torch_sdpa", "pass": name, "gpu": gpu, "torch": torch.__version__,
                     "seq": S, "heads": H, "kv_heads": kv_heads, "head_dim": D,
                     "dtype": args.dtype, "causal": causal, "reps": args.reps,
                     "seconds": ms * 1e-3, "tflops": flops / (ms * 1e-3) * 1e-12})
    for r in rows:
        if args.json:
            print(json.dumps(r))
        else:
            print(f"  torch sdpa {r['pass']:8s} {r['seconds'] * 1e3:10.3f} ms "
                  f"{r['tflops']:8.1f} TFLOP/s  ({gpu}, torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
