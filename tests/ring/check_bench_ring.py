#!/usr/bin/env python3
"""Runs `stria-bench ring --json` on a small problem and checks its output:
one JSON object per (layout, ranks, seq, pass) with the documented fields,
values that agree with each other, and the exit status."""
import sys

from bench_json import fail, run_json_lines

RANKS = (2, 3)
SEQ = 300
LAYOUTS = ("contiguous", "striped", "zigzag")
FIELDS = ("layout", "ranks", "seq", "pass", "critical_path_s", "speedup_vs_contiguous",
          "ideal_speedup", "fraction_of_ideal", "critical_path_best_s",
          "best_speedup_vs_contiguous", "total_compute_s", "balance")


def main():
    bench = sys.argv[1]
    cmd = [bench, "ring", "--ranks", ",".join(map(str, RANKS)), "--seq", str(SEQ), "--reps", "1",
           "--json"]
    seen = run_json_lines(cmd, FIELDS)
    for key, obj in seen.items():
        n = obj["ranks"]
        if abs(obj["ideal_speedup"] - (2 - 1 / n)) > 1e-3:
            fail("ideal speedup %g for N=%d (causal: 2 - 1/N)" % (obj["ideal_speedup"], n))
        if obj["critical_path_s"] <= 0 or obj["total_compute_s"] < obj["critical_path_s"] * 0.99:
            fail("critical path %g and total %g do not fit" % (obj["critical_path_s"],
                                                               obj["total_compute_s"]))
        ratio = obj["speedup_vs_contiguous"] / obj["ideal_speedup"]
        if abs(obj["fraction_of_ideal"] - ratio) > 1e-3:
            fail("fraction_of_ideal %g != speedup / ideal %g" % (obj["fraction_of_ideal"], ratio))
        if obj["layout"] == "contiguous" and abs(obj["speedup_vs_contiguous"] - 1) > 1e-9:
            fail("contiguous is the baseline: speedup %g" % obj["speedup_vs_contiguous"])
    want = {(l, n, SEQ, p) for l in LAYOUTS for n in RANKS for p in ("fwd", "bwd")}
    if set(seen) != want:
        fail("objects for %s, want %s" % (sorted(seen), sorted(want)))
    print("stria-bench ring --json: %d objects, every field present and consistent" % len(seen))


if __name__ == "__main__":
    main()
