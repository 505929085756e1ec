#!/usr/bin/env python3
"""What the Python package adds to a call: the same job through
stria.attention (torch tensors, autograd) and through libstria's C calls
directly (stria_client_forward/backward/release on preallocated buffers, the
same client connection), alternating within each round, in one run.
Prints the medians and the ratios Python / C (target <= 1.05).

On a busy machine the service's own time varies from call to call far more
than the package's cost, so the script also times, inside every Python call,
the time spent in libstria's calls: "in C" below, and the ratio
call / in C on the same calls, which the service's noise does not reach.

Three pairs, each doing the same service work on both sides:
  forward      no_grad stria.attention     vs  forward + release
  keep         fwd+bwd, Client(keep_jobs)  vs  forward, backward, release
  recompute    fwd+bwd, the default mode   vs  forward + release, then
                                                forward, backward, release

Needs torch (the test environment tests/run.sh makes has it) and a built
tree; starts its own coordinator and workers on loopback unless given
--coordinator:

    PYTHONPATH=python python3 bench/python_overhead.py --shape 1,4096,8,8,64 --reps 7
"""

import argparse
import ctypes
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

import torch  # noqa: E402

import stria  # noqa: E402
from stria import _lib  # noqa: E402
from stria.attention import _Config  # noqa: E402
from stria.local import LocalService  # noqa: E402


def c_calls(client, cfg, q, k, v, do):
    """The C side: libstria called directly on contiguous buffers."""
    L = _lib.lib()
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    spec, _ = cfg.spec(q, k)
    P = ctypes.c_void_p

    def forward():
        job = P()
        _lib.check(L.stria_client_forward(client._ptr, ctypes.byref(spec), P(q.data_ptr()),
                                          P(k.data_ptr()), P(v.data_ptr()), P(o.data_ptr()),
                                          P(lse.data_ptr()), None, None, None, ctypes.byref(job)))
        return job

    def backward(job):
        _lib.check(L.stria_client_backward(job, P(do.data_ptr()), P(dq.data_ptr()),
                                           P(dk.data_ptr()), P(dv.data_ptr()), None, None,
                                           None))

    def fwd_only():
        L.stria_client_release(forward())

    def keep():
        job = forward()
        backward(job)
        L.stria_client_release(job)

    def recompute():
        fwd_only()
        keep()

    return {"forward": fwd_only, "keep": keep, "recompute": recompute}


class _TimedLib:
    """libstria with the time spent in its calls added up (the package gets
    its functions through _lib.lib(), so they all pass here)."""

    def __init__(self, lib):
        self._lib = lib
        self.spent = 0.0

    def __getattr__(self, name):
        fn = getattr(self._lib, name)
        if not name.startswith("stria_client_"):
            return fn

        def timed(*a):
            t0 = time.perf_counter()
            try:
                return fn(*a)
            finally:
                self.spent += time.perf_counter() - t0
        return timed


def py_calls(client, keep_client, args, q, k, v, do):
    def run(c):
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        o = stria.attention(qq, kk, vv, causal=args.causal, layout=args.layout, client=c)
        o.backward(do)

    def fwd_only():
        with torch.no_grad():
            stria.attention(q, k, v, causal=args.causal, layout=args.layout, client=client)

    return {"forward": fwd_only, "keep": lambda: run(keep_client),
            "recompute": lambda: run(client)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1,4096,8,8,64", help="B,S,H,Hkv,D")
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--layout", default="striped")
    ap.add_argument("--no-causal", dest="causal", action="store_false")
    ap.add_argument("--reps", type=int, default=7, help="rounds; medians over them")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="kernel threads per worker")
    ap.add_argument("--coordinator", help="a running service (else one is started)")
    ap.add_argument("--heartbeat-period", type=float, default=5.0,
                    help="of the service started here (long: a busy machine's stalls must "
                         "not mark workers dead mid-benchmark)")
    args = ap.parse_args()
    B, S, H, Hkv, D = (int(x) for x in args.shape.split(","))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    g = torch.Generator().manual_seed(0)
    q, do = (torch.randn(B, S, H, D, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(B, S, Hkv, D, generator=g).to(dtype) for _ in range(2))

    svc = None
    if not args.coordinator:
        import tempfile

        logs = tempfile.mkdtemp(prefix="stria_bench_python_")
        print(f"python_overhead: daemons' logs in {logs}", flush=True)
        svc = LocalService(args.workers, threads=args.threads, log_dir=logs,
                           heartbeat_period=args.heartbeat_period)
    address = args.coordinator or svc.address
    try:
        client = stria.Client(address)
        keep_client = stria.Client(address, keep_jobs=1)
        cfg = _Config(client, args.causal, None, None, None, _lib.LAYOUTS[args.layout], 0)
        sides = {"C": c_calls(client, cfg, q, k, v, do),
                 "Python": py_calls(client, keep_client, args, q, k, v, do)}
        times = {(s, m): [] for s in sides for m in sides[s]}
        timed = _TimedLib(_lib.lib())
        in_c = {m: [] for m in sides["Python"]}
        for fns in sides.values():  # warm-up: one of each
            for fn in fns.values():
                fn()
        for r in range(args.reps):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for mode in ("forward", "keep", "recompute"):
                for side in order:
                    if side == "Python":
                        _lib._lib, timed.spent = timed, 0.0
                    t0 = time.perf_counter()
                    try:
                        sides[side][mode]()
                    finally:
                        _lib._lib = timed._lib
                    times[(side, mode)].append(time.perf_counter() - t0)
                    if side == "Python":
                        in_c[mode].append(timed.spent)
        print(f"python_overhead: {args.shape} {args.dtype} {'causal' if args.causal else 'full'} "
              f"{args.layout}, {args.workers} workers, {args.reps} rounds (medians, seconds)")
        print(f"{'mode':<10} {'C':>9} {'Python':>9} {'Python/C':>9} {'in C':>9} "
              f"{'call/in C':>9} {'outside C':>10}")
        for mode in ("forward", "keep", "recompute"):
            c = statistics.median(times[("C", mode)])
            p = statistics.median(times[("Python", mode)])
            ic = statistics.median(in_c[mode])
            same = statistics.median(t / i for t, i in zip(times[("Python", mode)], in_c[mode]))
            outside = statistics.median(t - i for t, i in zip(times[("Python", mode)],
                                                              in_c[mode]))
            print(f"{mode:<10} {c:9.4f} {p:9.4f} {p / c:9.3f} {ic:9.4f} {same:9.4f} "
                  f"{outside * 1e3:8.2f}ms")
        rk = statistics.median(times[("Python", "recompute")]) / \
            statistics.median(times[("Python", "keep")])
        for mode in ("forward", "keep", "recompute"):
            for side in ("C", "Python"):
                print(f"  {mode} {side} per round: "
                      + " ".join(f"{t:.3f}" for t in times[(side, mode)]))
        print(f"recompute / keep (Python): {rk:.3f}  (the price of holding no worker memory "
              f"between forward and backward)")
        client.close()
        keep_client.close()
    finally:
        if svc is not None:
            svc.stop()


if __name__ == "__main__":
    main()
