#!/usr/bin/env python3
"""Side-by-side comparison of stria's CPU attention kernels with PyTorch's
scaled_dot_product_attention (causal, fp32) on the same shapes and thread
counts, in one run.

The script keeps its own virtual environment in bench/.venv and installs torch
there with pip on first use. If that is impossible (no network, no wheel for
this platform) it prints why and exits with status 0: the comparison is
skipped, not failed.

For every thread count it runs `stria-bench kernels --json` with the same
shapes, then times PyTorch forward (no grad) and forward+backward, and prints
the medians and the speed ratio stria/torch (> 1: stria is faster). On a
machine shared with other work the two alternate for --rounds rounds and each
figure is the median of the per-round medians, so that a burst of foreign load
does not fall on one side only.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import venv

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VENV = os.path.join(HERE, ".venv")
VENV_PY = os.path.join(VENV, "bin", "python")


def parse_args(argv):
    ap = argparse.ArgumentParser(
        description="stria kernels vs torch.nn.functional.scaled_dot_product_attention "
        "(causal, fp32), forward and forward+backward, same shapes and threads.")
    ap.add_argument("--seq", type=int, default=4096, help="tokens (default 4096)")
    ap.add_argument("--heads", type=int, default=8, help="heads (default 8)")
    ap.add_argument("--head-dim", type=int, default=128, help="head dimension (default 128)")
    ap.add_argument("--threads", nargs="+", default=["1", "2"],
                    help="thread counts to compare, e.g. 1 2 or 1,2 (default: 1 2)")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per figure, median (default 5)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternating stria/torch rounds; each figure is the median over the "
                    "rounds of the per-round medians (default 3)")
    ap.add_argument("--stria-bench", default=os.path.join(ROOT, "build", "bin", "stria-bench"),
                    help="path of the stria-bench executable (default: build/bin/stria-bench)")
    args = ap.parse_args(argv)
    try:
        args.threads = [int(t) for arg in args.threads for t in arg.split(",") if t]
    except ValueError:
        ap.error("--threads takes integers, e.g. --threads 1 2")
    if args.seq < 1 or args.heads < 1 or args.reps < 1 or args.rounds < 1:
        ap.error("--seq, --heads, --reps and --rounds must be >= 1")
    if args.head_dim < 16 or args.head_dim > 256 or args.head_dim % 8:
        ap.error("--head-dim must be a multiple of 8 in 16..256")
    if any(t < 1 for t in args.threads):
        ap.error("--threads must be >= 1")
    return args


def skip(msg):
    print(f"compare_torch: SKIPPED: {msg}")
    sys.exit(0)


def ensure_venv():
    """Re-executes this script inside bench/.venv with torch installed."""
    if os.path.realpath(sys.prefix) == os.path.realpath(VENV):
        return
    if not os.path.exists(VENV_PY):
        print(f"compare_torch: creating {VENV}", flush=True)
        try:
            venv.EnvBuilder(with_pip=True).create(VENV)
        except Exception as e:  # venv or ensurepip missing
            skip(f"cannot create a virtual environment in {VENV}: {e}")
    have = subprocess.run([VENV_PY, "-c", "import torch"], capture_output=True).returncode == 0
    if not have:
        print("compare_torch: installing torch into bench/.venv (large download, once)",
              flush=True)
        r = subprocess.run([VENV_PY, "-m", "pip", "install", "--quiet", "torch", "numpy"])
        if r.returncode != 0:
            skip("pip could not install torch (no network or no wheel for this platform)")
        if subprocess.run([VENV_PY, "-c", "import torch"]).returncode != 0:
            skip("torch installed but does not import")
    os.execv(VENV_PY, [VENV_PY, os.path.abspath(__file__)] + sys.argv[1:])


def median_time(fn, reps):
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def torch_times(args, threads):
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    shape = (1, args.heads, args.seq, args.head_dim)
    q = torch.rand(shape) * 2 - 1
    k = torch.rand(shape) * 2 - 1
    v = torch.rand(shape) * 2 - 1
    g = torch.rand(shape) * 2 - 1

    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

    def fwd_bwd():
        qg.grad = kg.grad = vg.grad = None
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
        out.backward(g)

    return median_time(fwd, args.reps), median_time(fwd_bwd, args.reps), torch.__version__


def stria_times(args, threads):
    cmd = [args.stria_bench, "kernels", "--json", "--seq", str(args.seq), "--heads",
           str(args.heads), "--head-dim", str(args.head_dim), "--threads", str(threads),
           "--reps", str(args.reps), "--dtype", "fp32", "--causal"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"compare_torch: {' '.join(cmd)} failed ({r.returncode}):\n{r.stderr}")
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    by_pass = {row["pass"]: row for row in rows}
    return by_pass["fwd"], by_pass["bwd"], by_pass["peak"]


def main(argv):
    args = parse_args(argv)
    if not os.access(args.stria_bench, os.X_OK):
        sys.exit(f"compare_torch: {args.stria_bench} is not an executable; build the project "
                 "first or pass --stria-bench PATH")
    ensure_venv()
    flops_fwd = 2.0 * args.seq * args.seq * args.head_dim * args.heads  # causal half
    flops_bwd = 2.5 * flops_fwd
    version = "?"
    variant = "?"
    got = {t: {"tf": [], "tfb": [], "sf": [], "sfb": [], "peak": []} for t in args.threads}
    for r in range(args.rounds):
        for t in args.threads:
            # stria first: torch's OpenMP workers spin for a moment after their
            # last parallel region and would slow the FMA peak measurement down
            sf, sb, peak = stria_times(args, t)
            tf, tfb, version = torch_times(args, t)
            time.sleep(1.0)
            variant = sf["variant"]
            g = got[t]
            g["sf"].append(sf["seconds"])
            g["sfb"].append(sf["seconds"] + sb["seconds"])
            g["peak"].append(peak["peak_gflops"])
            g["tf"].append(tf)
            g["tfb"].append(tfb)
            print(f"round {r + 1}/{args.rounds}, {t} thread(s): stria fwd {sf['seconds']:.4f} s "
                  f"fwd+bwd {g['sfb'][-1]:.4f} s; torch fwd {tf:.4f} s fwd+bwd {tfb:.4f} s",
                  flush=True)
    rows = []
    med = statistics.median
    for t in args.threads:
        g = got[t]
        peak = {"peak_gflops": max(g["peak"])}
        rows.append((t, "fwd", med(g["tf"]), med(g["sf"]), flops_fwd, peak, variant))
        rows.append((t, "fwd+bwd", med(g["tfb"]), med(g["sfb"]), flops_fwd + flops_bwd, peak,
                     variant))
    print(f"S={args.seq} H={args.heads} D={args.head_dim} causal fp32, median of {args.reps} "
          f"runs x {args.rounds} rounds; torch {version}, stria variant {variant}")
    hdr = (f"{'threads':>7} {'pass':>8} {'torch s':>9} {'stria s':>9} {'torch GF/s':>10} "
           f"{'stria GF/s':>10} {'stria %peak':>11} {'stria/torch':>11}")
    print(hdr)
    print("-" * len(hdr))
    for t, name, ts, ss, flops, peak, _ in rows:
        print(f"{t:>7} {name:>8} {ts:>9.4f} {ss:>9.4f} {flops / ts * 1e-9:>10.1f} "
              f"{flops / ss * 1e-9:>10.1f} {100 * flops / ss * 1e-9 / peak['peak_gflops']:>10.1f}% "
              f"{ts / ss:>10.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
