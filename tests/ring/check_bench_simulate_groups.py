#!/usr/bin/env python3
"""The simulator's head groups (`stria-bench simulate --head-groups G,...`):
counts only, no timing. At --device-tflops (a prediction from counts alone):

1. The 1-D ring's rows are the same with and without --head-groups, and
   its G = 1 row (the 1-D table through the head groups' model) equals them.
2. Every G > 1 row is G rings of R = N / G ranks over kv_heads / G: per rank
   the K/V messages of R - 1 blocks of S / R tokens (bf16), the backward's
   dK/dV sums of R such blocks (fp32), the agreement beside, adding up to
   its bytes; their ratios to the 1-D ring's are (R - 1) / (N - 1) and
   R / N; R steps each way.
3. A G that does not divide N is skipped for that N; one that does not
   divide the K/V heads is refused, naming it."""
import json
import subprocess
import sys

from bench_json import fail

S, HEADS, KV, D = 12288, 8, 4, 64
RANKS, GROUPS = (6, 8, 16), (1, 2, 4)
LAYOUTS, PASSES = ("contiguous", "striped", "zigzag"), ("fwd", "bwd")
# the 1-D rows' fields that are timings of the simulator itself
WALL = ("simulate_s", "simulate_cpu_s", "plan_s")


def run(bench, extra):
    cmd = [bench, "simulate", "--device-tflops", "400", "--ranks", ",".join(map(str, RANKS)),
           "--seq", str(S), "--heads", str(HEADS), "--kv-heads", str(KV), "--head-dim", str(D),
           "--dtype", "bf16", "--devices-per-host", "4", "--pass", "both", "--json"] + extra
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        fail("%s exited with %d: %s" % (" ".join(cmd), out.returncode, out.stderr))
    plain, grouped = {}, {}
    for line in out.stdout.splitlines():
        try:
            obj = json.loads(line)
        except ValueError as e:
            fail("not a JSON object per line: %r (%s)" % (line, e))
        key = (obj["layout"], obj["ranks"], obj["pass"])
        into = plain
        if "head_groups" in obj:
            key += (obj["head_groups"],)
            into = grouped
        if key in into:
            fail("twice: %s" % (key,))
        into[key] = obj
    return plain, grouped


def strip(obj):
    return {k: v for k, v in obj.items() if k not in WALL}


def check_plain(plain, alone, grouped):
    if set(plain) != set(alone) or any(strip(plain[k]) != strip(alone[k]) for k in plain):
        fail("the 1-D rows change with --head-groups")
    for (layout, n, p), obj in plain.items():
        g1 = grouped.get((layout, n, p, 1))
        if g1 is None:
            fail("no G = 1 row for %s" % ((layout, n, p),))
        for f in ("predicted_pass_s", "predicted_critical_s", "steps", "bytes_sent_per_rank"):
            if g1[f] != obj[f]:
                fail("%s G = 1: %s %r, the 1-D table's %r" % ((layout, n, p), f, g1[f], obj[f]))


def check_group(key, obj):
    layout, n, p, G = key
    R = n // G
    block = (S // R) * (KV // G) * D * 2  # K and V of one shard's tokens
    kv, dkv = (R - 1) * block * 2, (R * block * 4 if p == "bwd" else 0)  # bf16; fp32 sums
    got = (obj["ring_ranks"], obj["steps"], obj["kv_bytes_per_rank"], obj["dkv_bytes_per_rank"])
    if got != (R, R, kv, dkv):
        fail("%s: ring of %d, %d steps, K/V %d and dK/dV %d bytes a rank; want %s"
             % (key, got[0], got[1], got[2], got[3], (R, R, kv, dkv)))
    if obj["kv_bytes_per_rank"] + obj["dkv_bytes_per_rank"] + obj["agree_bytes_per_rank"] != \
            obj["bytes_sent_per_rank"]:
        fail("%s: the parts do not add up to the %d bytes sent" % (key, obj["bytes_sent_per_rank"]))
    want = ((R - 1) / (n - 1), R / n if p == "bwd" else 0.0)
    if abs(obj["kv_expected"] - want[0]) > 1e-6 or abs(obj["dkv_expected"] - want[1]) > 1e-6:
        fail("%s: expected ratios %g and %g, want %g and %g"
             % (key, obj["kv_expected"], obj["dkv_expected"], want[0], want[1]))
    if abs(obj["kv_vs_1d"] - want[0]) > 1e-6 or abs(obj["dkv_vs_1d"] - want[1]) > 1e-6:
        fail("%s: K/V %.6f and dK/dV %.6f of the 1-D ring's, want %.6f and %.6f"
             % (key, obj["kv_vs_1d"], obj["dkv_vs_1d"], want[0], want[1]))
    if not obj["predicted_pass_s"] > 0:
        fail("%s: no pass predicted" % (key,))


def check_refused(bench):
    cmd = [bench, "simulate", "--device-tflops", "400", "--ranks", "8", "--seq", "4096",
           "--heads", "8", "--kv-heads", "4", "--head-groups", "3"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if out.returncode != 2 or "--head-groups 3" not in out.stderr:
        fail("--head-groups 3 with 4 K/V heads: exit %d, %r" % (out.returncode, out.stderr))


def main():
    bench = sys.argv[1]
    plain, grouped = run(bench, ["--head-groups", ",".join(map(str, GROUPS))])
    alone, none = run(bench, [])
    if none:
        fail("head-group rows without --head-groups: %s" % sorted(none))
    check_plain(plain, alone, grouped)
    want = {(l, n, p, G) for l in LAYOUTS for n in RANKS for p in PASSES for G in GROUPS
            if n % G == 0}
    if set(grouped) != want:
        fail("head-group rows for %s, want %s" % (sorted(grouped), sorted(want)))
    for key, obj in grouped.items():
        check_group(key, obj)
    check_refused(bench)
    print("stria-bench simulate --head-groups: %d grouped rows send (R-1)/(N-1) of the 1-D "
          "ring's K/V and R/N of its dK/dV; G = 1 is the 1-D table" % len(grouped))


if __name__ == "__main__":
    main()
