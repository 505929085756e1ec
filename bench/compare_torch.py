#!/usr/bin/env python3
"""Side-by-side comparison of stria's CPU attention kernels with PyTorch's
scaled_dot_product_attention on the same shapes, dtype (fp32 or bf16), masks
(causal or not), GQA (--kv-heads: torch's enable_gqa) and thread counts, in
one run. The CPU's model name heads the table: a comparison holds on that
CPU only (torch's bf16 runs on AMX tiles where the core has them).

Run by an interpreter that has torch it uses that one; otherwise the script
keeps its own virtual environment in bench/.venv and installs torch there with
pip on first use. If that is impossible (no network, no wheel for
this platform) it prints why and exits with status 0: the comparison is
skipped, not failed.

For every thread count it runs `stria-bench kernels --json` with the same
shapes, then times PyTorch's forward (no grad), forward+backward, and its
backward on its own (out.backward() after a forward with grad), and prints
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
        description="stria kernels vs torch.nn.functional.scaled_dot_product_attention, "
        "forward, backward and forward+backward, same shapes, dtype, masks and threads.")
    ap.add_argument("--seq", type=int, default=4096, help="tokens (default 4096)")
    ap.add_argument("--heads", type=int, default=8, help="heads (default 8)")
    ap.add_argument("--kv-heads", type=int, default=None,
                    help="K/V heads (GQA; default: --heads); torch runs with enable_gqa")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                    help="storage dtype of q, k, v and the gradients (default fp32)")
    ap.add_argument("--no-causal", dest="causal", action="store_false",
                    help="no mask (default: causal)")
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
    if args.kv_heads is None:
        args.kv_heads = args.heads
    if args.kv_heads < 1 or args.heads % args.kv_heads:
        ap.error("--kv-heads must divide --heads")
    return args


def cpu_model():
    """The CPU's model name (Linux), for the table's heading."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def skip(msg):
    print(f"compare_torch: SKIPPED: {msg}")
    sys.exit(0)


def ensure_venv():
    """Re-executes this script inside bench/.venv with torch installed, unless
    the interpreter running it already has torch."""
    if os.path.realpath(sys.prefix) == os.path.realpath(VENV):
        return
    try:
        import torch  # noqa: F401
        return
    except ImportError:
        pass
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
    """Medians of torch's forward (no grad), forward+backward, and backward
    alone (out.backward() on a forward run with grad, the forward untimed)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    shape_q = (1, args.heads, args.seq, args.head_dim)
    shape_kv = (1, args.kv_heads, args.seq, args.head_dim)
    q = (torch.rand(shape_q) * 2 - 1).to(dtype)
    k = (torch.rand(shape_kv) * 2 - 1).to(dtype)
    v = (torch.rand(shape_kv) * 2 - 1).to(dtype)
    g = (torch.rand(shape_q) * 2 - 1).to(dtype)
    gqa = args.kv_heads != args.heads

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=args.causal, enable_gqa=gqa)

    def fwd():
        with torch.no_grad():
            sdpa(q, k, v)

    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

    def fwd_bwd():
        qg.grad = kg.grad = vg.grad = None
        sdpa(qg, kg, vg).backward(g)

    def bwd_only():
        bwd_only.times = getattr(bwd_only, "times", [])
        qg.grad = kg.grad = vg.grad = None
        out = sdpa(qg, kg, vg)
        t0 = time.perf_counter()
        out.backward(g)
        bwd_only.times.append(time.perf_counter() - t0)

    median_time(bwd_only, args.reps)
    bwd = statistics.median(bwd_only.times[1:])  # the first: warm-up
    return median_time(fwd, args.reps), median_time(fwd_bwd, args.reps), bwd, torch.__version__


def stria_times(args, threads):
    cmd = [args.stria_bench, "kernels", "--json", "--seq", str(args.seq), "--heads",
           str(args.heads), "--kv-heads", str(args.kv_heads), "--head-dim", str(args.head_dim),
           "--threads", str(threads), "--reps", str(args.reps), "--dtype", args.dtype,
           "--causal" if args.causal else "--no-causal"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"compare_torch: {' '.join(cmd)} failed ({r.returncode}):\n{r.stderr}")
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    by_pass = {row["pass"]: row for row in rows}
    # the peak the passes are judged against (peak_kind), from the pass rows
    peak = {"peak_gflops": by_pass["fwd"]["peak_gflops"], "peak_kind": by_pass["fwd"]["peak_kind"]}
    return by_pass["fwd"], by_pass["bwd"], peak


def main(argv):
    args = parse_args(argv)
    if not os.access(args.stria_bench, os.X_OK):
        sys.exit(f"compare_torch: {args.stria_bench} is not an executable; build the project "
                 "first or pass --stria-bench PATH")
    ensure_venv()
    flops_fwd = 4.0 * args.seq * args.seq * args.head_dim * args.heads
    if args.causal:
        flops_fwd *= 0.5
    flops_bwd = 2.5 * flops_fwd
    version = "?"
    variant = "?"
    kind = "?"
    got = {t: {"tf": [], "tb": [], "tfb": [], "sf": [], "sb": [], "sfb": [], "peak": []}
           for t in args.threads}
    for r in range(args.rounds):
        for t in args.threads:
            # stria first: torch's OpenMP workers spin for a moment after their
            # last parallel region and would slow the peak measurement down
            sf, sb, peak = stria_times(args, t)
            tf, tfb, tb, version = torch_times(args, t)
            time.sleep(1.0)
            variant, kind = sf["variant"], peak["peak_kind"]
            g = got[t]
            g["sf"].append(sf["seconds"])
            g["sb"].append(sb["seconds"])
            g["sfb"].append(sf["seconds"] + sb["seconds"])
            g["peak"].append(peak["peak_gflops"])
            g["tf"].append(tf)
            g["tb"].append(tb)
            g["tfb"].append(tfb)
            print(f"round {r + 1}/{args.rounds}, {t} thread(s): stria fwd {sf['seconds']:.4f} s "
                  f"bwd {sb['seconds']:.4f} s; torch fwd {tf:.4f} s bwd {tb:.4f} s "
                  f"fwd+bwd {tfb:.4f} s", flush=True)
    rows = []
    med = statistics.median
    for t in args.threads:
        g = got[t]
        peak = max(g["peak"])
        rows.append((t, "fwd", med(g["tf"]), med(g["sf"]), flops_fwd, peak))
        rows.append((t, "bwd", med(g["tb"]), med(g["sb"]), flops_bwd, peak))
        rows.append((t, "fwd+bwd", med(g["tfb"]), med(g["sfb"]), flops_fwd + flops_bwd, peak))
    gqa = f"/{args.kv_heads}" if args.kv_heads != args.heads else ""
    print(f"CPU: {cpu_model()}")
    print(f"S={args.seq} H={args.heads}{gqa} D={args.head_dim} "
          f"{'causal' if args.causal else 'non-causal'} {args.dtype}, median of {args.reps} "
          f"runs x {args.rounds} rounds; torch {version}, stria variant {variant}, "
          f"peak {kind}")
    hdr = (f"{'threads':>7} {'pass':>8} {'torch s':>9} {'stria s':>9} {'torch GF/s':>10} "
           f"{'stria GF/s':>10} {'stria %peak':>11} {'stria/torch':>11}")
    print(hdr)
    print("-" * len(hdr))
    for t, name, ts, ss, flops, peak in rows:
        print(f"{t:>7} {name:>8} {ts:>9.4f} {ss:>9.4f} {flops / ts * 1e-9:>10.1f} "
              f"{flops / ss * 1e-9:>10.1f} {100 * flops / ss * 1e-9 / peak:>10.1f}% "
              f"{ts / ss:>10.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
