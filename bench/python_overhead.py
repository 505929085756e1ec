#!/usr/bin/env python3
"""stria.attention against torch SDPA, and what the Python package adds to a
call, side by side in one run.

Starts a coordinator and --workers workers on loopback (one kernel thread
each by default) and, for each shape (B x S x H x D, as many K/V heads as
heads, causal, striped) and ring size, times these arms, interleaved
within each round (the order reversed every other round), after one
warm-up call of each:

  stria   stria.attention(q, k, v, ring_size=R) in the default mode (a
          session of the client's; the backward sends Q, K, V, O and LSE)
  sdpa    torch.nn.functional.scaled_dot_product_attention, is_causal,
          torch with --sdpa-threads threads (independent of the ring)
  c       libstria's session calls made directly through ctypes
          (stria_session_forward, stria_session_backward) on preallocated
          buffers, on a session with the bounds the client's cache opens for
          the call; only those calls are timed
  keep    forward + backward through Client(keep_jobs=1): the job path,
          the job kept between forward and backward (fwd+bwd only)

each for the forward (no_grad) and forward + backward (o.backward(dO)).
The package's own cost is stria / c, the median of the rounds' ratios (the
two calls run next to each other in every round); beside it, inside every
stria call the time spent in libstria's calls is added up ("in C"), so
call / in C measures the package's cost on the same calls, out of reach of
the service's call-to-call variation. Workers get a runtime directory (as
under systemd), so session calls move tensors through a shared-memory arena;
--tcp leaves it out.

Then (unless --no-sharded) --ranks processes join a gloo group and time
stria.sharded_attention on their shards (one ring of the group's size; each
round starts at a barrier; a round's time is the slowest rank's).

Prints a table and, with --json, one JSON object a line (medians in ms, the
load average). The targets of the project's issue 34 are checked at the end.

    PYTHONPATH=python python3 bench/python_overhead.py            # the default run
    PYTHONPATH=python python3 bench/python_overhead.py --shapes 1x2048x8x64 --rings 4 --reps 15

Needs torch (the environment tests/run.sh makes has it) and a built tree.
"""

import argparse
import ctypes
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

try:
    import stria
except ImportError:  # the source tree's package
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__))), "python"))
    import stria
from stria import _lib  # noqa: E402
from stria.local import LocalService  # noqa: E402
from stria.session import make_call, rounded_bounds  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PASSES = ("fwd", "fwdbwd")

# (shape, ring, pass, arm, against): the largest ratio median(arm) /
# median(against) the project's issue 34 asks for.
TARGETS = [
    ("1x256x4x64", 1, "fwd", "stria", "sdpa", 3.0),
    ("1x256x4x64", 1, "fwdbwd", "stria", "sdpa", 3.0),
    ("1x256x4x64", 4, "fwd", "stria", "sdpa", 6.0),
    ("1x256x4x64", 4, "fwdbwd", "stria", "sdpa", 4.0),
    ("1x2048x8x64", 4, "fwd", "stria", "sdpa", 1.0),
    ("1x2048x8x64", 4, "fwdbwd", "stria", "sdpa", 1.0),
    ("1x8192x8x128", 4, "fwd", "stria", "sdpa", 0.45),
    ("1x8192x8x128", 4, "fwdbwd", "stria", "sdpa", 0.55),
    ("1x2048x8x64", 4, "fwdbwd", "stria", "keep", 1.05),
    ("1x2048x8x64", 1, "fwd", "stria", "c", 1.02),
    ("1x2048x8x64", 1, "fwdbwd", "stria", "c", 1.02),
    ("1x2048x8x64", 4, "fwd", "stria", "c", 1.02),
    ("1x2048x8x64", 4, "fwdbwd", "stria", "c", 1.02),
]


def parse_shape(s):
    B, S, H, D = (int(x) for x in s.lower().split("x"))
    return B, S, H, D


def default_reps(S):
    return 40 if S <= 512 else 11 if S <= 4096 else 3


class TimedLib:
    """libstria with the time spent in its stria_session_* and
    stria_client_* calls added up (the package gets its functions through
    _lib.lib(), so they all pass here while it is installed)."""

    def __init__(self, lib):
        self._lib = lib
        self.spent = 0.0
        self._cache = {}

    def __getattr__(self, name):
        fn = getattr(self._lib, name)
        if not name.startswith(("stria_session_", "stria_client_")):
            return fn
        timed = self._cache.get(name)
        if timed is None:
            def timed(*a):
                t0 = time.perf_counter()
                try:
                    return fn(*a)
                finally:
                    self.spent += time.perf_counter() - t0
            self._cache[name] = timed
        return timed


def inputs(shape, dtype, seed=0):
    B, S, H, D = shape
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, H, D, generator=g).to(dtype) for _ in range(4)]  # q k v dO


def stria_arms(client, ring, q, k, v, do):
    def fwd():
        with torch.no_grad():
            stria.attention(q, k, v, layout="striped", ring_size=ring, client=client)

    def fwdbwd():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        o = stria.attention(qq, kk, vv, layout="striped", ring_size=ring, client=client)
        o.backward(do)

    return {"fwd": fwd, "fwdbwd": fwdbwd}


def sdpa_arms(q, k, v, do):
    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)

    def fwdbwd():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        o = F.scaled_dot_product_attention(qq.transpose(1, 2), kk.transpose(1, 2),
                                           vv.transpose(1, 2), is_causal=True)
        o.transpose(1, 2).backward(do)

    return {"fwd": fwd, "fwdbwd": fwdbwd}


def c_arms(client, ring, q, k, v, do):
    """libstria's session calls on preallocated contiguous buffers; returns
    (arms, session): each arm returns the seconds spent in the calls."""
    B, S, H, D = q.shape
    mb, msl = rounded_bounds(B, S)
    sess = stria.Session(heads=H, kv_heads=k.shape[2], head_dim=D, max_seq_len=msl,
                         max_batch=mb, dtype=q.dtype, layout="striped", ring_size=ring,
                         client=client)
    L = _lib.lib()
    call, _ = make_call(B, S, True, None, None, None)
    o, dq = torch.empty_like(q), torch.empty_like(q)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    lse = torch.empty(B, H, S, dtype=torch.float32)
    P = ctypes.c_void_p
    p = {n: P(t.data_ptr()) for n, t in dict(q=q, k=k, v=v, o=o, lse=lse, do=do, dq=dq, dk=dk,
                                               dv=dv).items()}
    ref, cr = sess._ptr, ctypes.byref(call)

    def forward():
        return L.stria_session_forward(ref, cr, p["q"], p["k"], p["v"], p["o"], p["lse"])

    def backward():
        return L.stria_session_backward(ref, cr, p["q"], p["k"], p["v"], p["o"], p["lse"],
                                        p["do"], p["dq"], p["dk"], p["dv"])

    def fwd():
        t0 = time.perf_counter()
        rc = forward()
        t = time.perf_counter() - t0
        _lib.check(rc)
        return t

    def fwdbwd():
        t0 = time.perf_counter()
        rc = forward()
        t = time.perf_counter() - t0
        _lib.check(rc)
        t0 = time.perf_counter()
        rc = backward()
        t += time.perf_counter() - t0
        _lib.check(rc)
        return t

    return {"fwd": fwd, "fwdbwd": fwdbwd, "_keep": (call, o, lse, dq, dk, dv)}, sess


def bench_shape(args, shape, svc_clients, reps):
    client, c_client, keep_client = svc_clients
    B, S, H, D = shape
    q, k, v, do = inputs(shape, DTYPES[args.dtype])
    name = "x".join(map(str, shape))
    with_c = name in args.c_shapes
    arms = {("sdpa", 0): sdpa_arms(q, k, v, do)}
    sessions = {}
    for ring in args.rings:
        arms[("stria", ring)] = stria_arms(client, ring, q, k, v, do)
        if with_c:
            a, s = c_arms(c_client, ring, q, k, v, do)
            arms[("c", ring)] = a
            sessions[ring] = s
            arms[("keep", ring)] = {"fwdbwd": stria_arms(keep_client, ring, q, k, v,
                                                         do)["fwdbwd"]}
    # stria, c and keep of one ring and pass next to each other: a round's
    # pair shares the machine's state of the moment (paired ratios below)
    items = [("sdpa", 0, ps) for ps in PASSES]
    items += [(arm, ring, ps) for ring in args.rings for ps in PASSES
              for arm in ("stria", "c", "keep") if ps in arms.get((arm, ring), {})]
    for arm, ring, ps in items:  # warm-up: sessions opened, caches filled
        arms[(arm, ring)][ps]()
    times = {it: [] for it in items}
    in_c = {it: [] for it in items if it[0] in ("stria", "keep")}
    timed = TimedLib(_lib.lib())
    load0 = os.getloadavg()
    for r in range(reps):
        order = items if r % 2 == 0 else items[::-1]
        for it in order:
            arm, ring, ps = it
            fn = arms[(arm, ring)][ps]
            if arm == "c":
                times[it].append(fn())
                continue
            if it in in_c:
                _lib._lib, timed.spent = timed, 0.0
            t0 = time.perf_counter()
            try:
                fn()
            finally:
                t = time.perf_counter() - t0
                _lib._lib = timed._lib
            times[it].append(t)
            if it in in_c:
                in_c[it].append(timed.spent)
    stats = {}
    for ring, s in sessions.items():
        stats[ring] = s.stats()
        s.close()
    load1 = os.getloadavg()
    rows = []
    for it in items:
        arm, ring, ps = it
        row = dict(bench="python_overhead", shape=name, dtype=args.dtype, arm=arm,
                   ring=ring if arm != "sdpa" else None, ps=ps, reps=reps,
                   median_ms=statistics.median(times[it]) * 1e3,
                   min_ms=min(times[it]) * 1e3, max_ms=max(times[it]) * 1e3,
                   loadavg_start=[round(x, 2) for x in load0],
                   loadavg_end=[round(x, 2) for x in load1])
        if arm == "sdpa":
            row["threads"] = args.sdpa_threads
        if arm == "c" and ps == "fwdbwd":  # over TCP, or next to nothing through the arena
            st = stats[ring]
            row["c_session_mib_moved_per_call"] = round(
                (st["bytes_up"] + st["bytes_down"]) / max(st["calls"], 1) / 2**20, 3)
        if it in in_c:
            row["in_c_ms"] = statistics.median(in_c[it]) * 1e3
            row["call_over_in_c"] = statistics.median(t / i for t, i in zip(times[it],
                                                                             in_c[it]))
            row["outside_c_ms"] = statistics.median(t - i for t, i in zip(times[it],
                                                                          in_c[it])) * 1e3
        if arm == "stria" and ("c", ring, ps) in times:  # median of the rounds' ratios
            row["paired_over_c"] = statistics.median(
                a / b for a, b in zip(times[it], times[("c", ring, ps)]))
        row["pass"] = row.pop("ps")
        rows.append(row)
    return rows


# ---- sharded_attention from a gloo group ------------------------------------

def _sharded_rank(rank, world, init, address, shapes, dtype, reps_list, out):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    client = stria.Client(address, step_timeout=120, arrival_timeout=120)
    res = []
    try:
        for shape, reps in zip(shapes, reps_list):
            S = shape[1]
            q, k, v, do = (stria.shard(t, 1, rank=rank, world_size=world, layout="striped")
                           for t in inputs(shape, DTYPES[dtype]))

            def fwd():
                with torch.no_grad():
                    stria.sharded_attention(q, k, v, seq_len=S, layout="striped",
                                            client=client)

            def fwdbwd():
                qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
                stria.sharded_attention(qq, kk, vv, seq_len=S, layout="striped",
                                        client=client).backward(do)

            fns = {"fwd": fwd, "fwdbwd": fwdbwd}
            for fn in fns.values():
                fn()
            times = {ps: [] for ps in PASSES}
            for r in range(reps):
                for ps in (PASSES if r % 2 == 0 else PASSES[::-1]):
                    dist.barrier()
                    t0 = time.perf_counter()
                    fns[ps]()
                    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    times[ps].append(float(t))
            res.append(times)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(res, f)
    finally:
        client.close()
        dist.destroy_process_group()


def bench_sharded(args, address, shapes, reps_list):
    import torch.multiprocessing as mp

    tmp = tempfile.mkdtemp(prefix="stria_bench_sharded_")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tmp, "times.json")
    load0 = os.getloadavg()
    mp.start_processes(_sharded_rank, args=(args.ranks, f"tcp://127.0.0.1:{port}", address,
                                            shapes, args.dtype, reps_list, out),
                       nprocs=args.ranks, start_method="spawn")
    load1 = os.getloadavg()
    with open(out) as f:
        res = json.load(f)
    shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for shape, reps, times in zip(shapes, reps_list, res):
        for ps in PASSES:
            rows.append({"bench": "python_overhead", "shape": "x".join(map(str, shape)),
                         "dtype": args.dtype, "arm": "sharded", "ring": args.ranks,
                         "pass": ps, "reps": reps,
                         "median_ms": statistics.median(times[ps]) * 1e3,
                         "min_ms": min(times[ps]) * 1e3, "max_ms": max(times[ps]) * 1e3,
                         "loadavg_start": [round(x, 2) for x in load0],
                         "loadavg_end": [round(x, 2) for x in load1]})
    return rows


# ---- report -----------------------------------------------------------------

def find(rows, shape, arm, ring, ps):
    for r in rows:
        if (r["shape"], r["arm"], r["pass"]) == (shape, arm, ps) and \
                (arm == "sdpa" or r["ring"] == ring):
            return r
    return None


def table(rows, shapes, rings, ranks):
    lines = [f"{'shape':<13} {'pass':<7} {'ring':>4} {'stria ms':>9} {'sdpa ms':>8} "
             f"{'/sdpa':>6} {'C ms':>8} {'/C':>6} {'call/inC':>8} {'keep ms':>8} {'/keep':>6} "
             f"{'shard ms':>9} {'/sdpa':>6}"]

    def f(x, w, p):
        return f"{x:{w}.{p}f}" if x is not None else " " * (w - 1) + "-"

    for shape in shapes:
        for ps in PASSES:
            sd = find(rows, shape, "sdpa", None, ps)
            for ring in rings:
                st = find(rows, shape, "stria", ring, ps)
                if st is None:
                    continue
                c = find(rows, shape, "c", ring, ps)
                kp = find(rows, shape, "keep", ring, ps)
                sh = find(rows, shape, "sharded", ring, ps) if ring == ranks else None

                def ratio(a, b):
                    return a["median_ms"] / b["median_ms"] if a and b else None

                lines.append(
                    f"{shape:<13} {ps:<7} {ring:>4} {f(st['median_ms'], 9, 2)} "
                    f"{f(sd and sd['median_ms'], 8, 2)} {f(ratio(st, sd), 6, 2)} "
                    f"{f(c and c['median_ms'], 8, 2)} {f(st.get('paired_over_c'), 6, 3)} "
                    f"{f(st.get('call_over_in_c'), 8, 4)} {f(kp and kp['median_ms'], 8, 2)} "
                    f"{f(ratio(st, kp), 6, 3)} {f(sh and sh['median_ms'], 9, 2)} "
                    f"{f(ratio(sh, sd), 6, 2)}")
    return "\n".join(lines)


def check_targets(rows):
    out = []
    for shape, ring, ps, arm, against, limit in TARGETS:
        a = find(rows, shape, arm, ring, ps)
        b = find(rows, shape, against, ring, ps)
        if a is None or b is None:
            continue
        val = a["median_ms"] / b["median_ms"]
        t = {"bench": "python_overhead", "target": f"{shape} ring {ring} {ps} {arm}/{against}",
             "value": round(val, 4), "limit": limit, "met": val <= limit}
        if against == "c":  # the paired ratio decides; the others beside it
            t["ratio_of_medians"] = t["value"]
            t["value"] = round(a["paired_over_c"], 4)
            t["met"] = a["paired_over_c"] <= limit
            t["call_over_in_c"] = round(a["call_over_in_c"], 4)
        out.append(t)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1x256x4x64,1x2048x8x64,1x8192x8x128",
                    help="BxSxHxD, comma-separated (K/V heads = H)")
    ap.add_argument("--rings", default="1,4", help="ring sizes, comma-separated")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--reps", type=int, default=0,
                    help="rounds per shape (default: 40 up to S=512, 11 up to S=4096, else 3)")
    ap.add_argument("--c-shapes", default="1x256x4x64,1x2048x8x64",
                    help="shapes that also run the direct C and keep arms")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="kernel threads per worker")
    ap.add_argument("--sdpa-threads", type=int, default=2, help="torch threads (SDPA's)")
    ap.add_argument("--ranks", type=int, default=4, help="gloo ranks of the sharded arm")
    ap.add_argument("--no-sharded", action="store_true")
    ap.add_argument("--json", action="store_true", help="JSON lines besides the table")
    ap.add_argument("--tcp", action="store_true",
                    help="workers without a runtime directory: tensors over TCP (default: "
                         "each worker gets one, as under systemd, and session calls move "
                         "tensors through a shared-memory arena)")
    ap.add_argument("--heartbeat-period", type=float, default=5.0,
                    help="of the service started here (long: a busy machine's stalls must "
                         "not mark workers dead mid-benchmark)")
    args = ap.parse_args()
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    names = ["x".join(map(str, s)) for s in shapes]
    args.rings = [int(x) for x in args.rings.split(",")]
    args.c_shapes = set(args.c_shapes.split(",")) if args.c_shapes else set()
    reps_list = [args.reps or default_reps(s[1]) for s in shapes]
    torch.set_num_threads(args.sdpa_threads)

    logs = tempfile.mkdtemp(prefix="stria_bench_python_")
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    print(f"python_overhead: {started}, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; {args.workers} workers x "
          f"{args.threads} kernel threads, data path {'tcp' if args.tcp else 'arena'}, "
          f"SDPA on {args.sdpa_threads} threads; daemons' "
          f"logs in {logs}", flush=True)
    env = None
    if not args.tcp:  # the workers' sockets are named by pid: one folder serves them all
        env = {"RUNTIME_DIRECTORY": os.path.join(logs, "run")}
        os.mkdir(env["RUNTIME_DIRECTORY"], 0o700)
    svc = LocalService(args.workers, threads=args.threads, log_dir=logs,
                       heartbeat_period=args.heartbeat_period, step_timeout="120", env=env)
    rows = []
    try:
        clients = (stria.Client(svc.address, max_sessions=8),
                   stria.Client(svc.address, max_sessions=8),
                   stria.Client(svc.address, keep_jobs=1))
        try:
            for shape, reps in zip(shapes, reps_list):
                got = bench_shape(args, shape, clients, reps)
                for r in got:
                    r["data_path"] = "tcp" if args.tcp else "arena"
                rows += got
                if args.json:
                    for r in got:
                        print(json.dumps(r), flush=True)
        finally:
            for c in clients:
                c.close()
        if not args.no_sharded and args.ranks in args.rings:
            got = bench_sharded(args, svc.address, shapes, reps_list)
            for r in got:
                r["data_path"] = "tcp" if args.tcp else "arena"
            rows += got
            if args.json:
                for r in got:
                    print(json.dumps(r), flush=True)
    finally:
        bad = svc.stop()
        if bad:
            print(f"python_overhead: {', '.join(bad)} did not stop cleanly (logs in {logs})")
    targets = check_targets(rows)
    if args.json:
        for t in targets:
            print(json.dumps(t), flush=True)
    print(f"\npython_overhead: {args.dtype}, causal, striped; medians of "
          f"{'/'.join(map(str, reps_list))} rounds; load average at the end "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(table(rows, names, args.rings, args.ranks))
    print("\ntargets (ratios of medians; stria/c: the median of the rounds' ratios, beside "
          "it the ratio of medians and call / in C on the same calls):")
    for t in targets:
        extra = (f"  (medians {t['ratio_of_medians']:.3f}, call/inC {t['call_over_in_c']:.4f})"
                 if "call_over_in_c" in t else "")
        print(f"  {t['target']:<40} {t['value']:7.3f} <= {t['limit']:<5g} "
              f"{'met' if t['met'] else 'MISSED'}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
