#!/usr/bin/env python3
"""Runs `stria-bench simulate --calibrate --calibrate-each --measure --json`
on a small problem: the path that calibrates this machine's kernels, predicts
every pass and runs it in process beside the prediction. Checks the output's
shape and the quantities that do not depend on timing (steps, bytes, the
baseline, the measured and predicted rows present for every layout and
pass); of the times only that they are positive and that prediction and
measurement are of the same order (the 10% figures are benchmarks, measured
on a quiet machine, not a test)."""
import sys

from bench_json import fail, run_json_lines

RANKS = (2, 3)
SEQ = 384
LAYOUTS = ("contiguous", "striped", "zigzag")
FIELDS = ("layout", "ranks", "seq", "pass", "predicted_pass_s", "predicted_critical_s",
          "speedup_vs_contiguous", "steps", "bytes_sent_per_rank", "measured_critical_s",
          "predicted_over_measured", "measured_speedup_vs_contiguous", "predicted_total_s",
          "measured_total_s", "total_predicted_over_measured")


def main():
    bench = sys.argv[1]
    cmd = [bench, "simulate", "--calibrate", "--calibrate-each", "--calibrate-reps", "1",
           "--measure", "--reps", "1", "--ranks", ",".join(map(str, RANKS)), "--seq", str(SEQ),
           "--heads", "1", "--head-dim", "64", "--pass", "both", "--json"]
    seen = run_json_lines(cmd, FIELDS)
    for key, obj in seen.items():
        n = obj["ranks"]
        if obj["steps"] != n:
            fail("%s: %d steps, a ring of %d ranks has %d" % (key, obj["steps"], n, n))
        for f in ("predicted_critical_s", "measured_critical_s", "predicted_total_s",
                  "measured_total_s"):
            if not obj[f] > 0:
                fail("%s: %s = %r, want a positive time" % (key, f, obj[f]))
        if obj["predicted_pass_s"] < obj["predicted_critical_s"]:
            fail("%s: the predicted pass is shorter than its compute critical path" % (key,))
        want = obj["predicted_critical_s"] / obj["measured_critical_s"]
        if abs(obj["predicted_over_measured"] - want) > 1e-3 * want:
            fail("%s: predicted_over_measured %g != predicted / measured %g"
                 % (key, obj["predicted_over_measured"], want))
        for f in ("predicted_over_measured", "total_predicted_over_measured"):
            if not 0.2 < obj[f] < 5:
                fail("%s: %s = %g: the calibration does not describe the kernels it measured"
                     % (key, f, obj[f]))
        if obj["layout"] == "contiguous" and (abs(obj["speedup_vs_contiguous"] - 1) > 1e-9 or
                                              abs(obj["measured_speedup_vs_contiguous"] - 1) > 1e-9):
            fail("%s: contiguous is the baseline of both speedups" % (key,))
    want = {(l, n, SEQ, p) for l in LAYOUTS for n in RANKS for p in ("fwd", "bwd")}
    if set(seen) != want:
        fail("objects for %s, want %s" % (sorted(seen), sorted(want)))
    for n in RANKS:  # every layout moves the same blocks of the same size
        for p in ("fwd", "bwd"):
            sent = {seen[(l, n, SEQ, p)]["bytes_sent_per_rank"] for l in LAYOUTS}
            if len(sent) != 1:
                fail("N=%d %s: bytes sent per rank differ between layouts: %s" % (n, p, sent))
    print("stria-bench simulate --calibrate --measure --json: %d objects, every field present "
          "and consistent" % len(seen))


if __name__ == "__main__":
    main()
