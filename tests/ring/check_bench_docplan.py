#!/usr/bin/env python3
"""Runs `stria-bench docplan --json` (everything it prints is counted, no
timing but the plan's own) and checks what the document plan promises at the
benchmark's shape: the packed layout's rank work within 5% of the mean and
fewer bytes than striping with documents around 1,024 tokens; the same as
striping with documents longer than a shard and with no documents; the
counts of striping and contiguous shards as docs/BENCHMARKS.md states them
(896 and 256 MiB, 8 and 3 steps), and the critical paths counted in pairs."""
import json
import subprocess
import sys


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def run(bench, docs):
    cmd = [bench, "docplan", "--ranks", "8", "--seq", "65536", "--heads", "4", "--head-dim", "64",
           "--documents", docs, "--reps", "1", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        fail("%s exited with %d: %s" % (" ".join(cmd), out.returncode, out.stderr))
    rows, plan = {}, None
    for line in out.stdout.splitlines():
        obj = json.loads(line)
        if "plan" in obj:
            plan = obj["plan"]
        else:
            rows[obj["layout"]] = obj
    if set(rows) != {"packed", "striped", "contiguous"} or plan is None:
        fail("%s: layouts %s, plan %s" % (docs, sorted(rows), plan))
    return rows, plan


def main():
    bench = sys.argv[1]
    rows, plan = run(bench, "lognormal:1024")
    p, s, c = rows["packed"], rows["striped"], rows["contiguous"]
    print("documents around 1024: packed %.4f max/mean, %.3f of striped's bytes; plan %.2f ms"
          % (p["max_mean_rank_work_counted"], p["fwd_bytes_vs_striped"], plan["make_ms"]))
    if p["max_mean_rank_work_counted"] > 1.05:
        fail("packed max/mean %s > 1.05" % p["max_mean_rank_work_counted"])
    if not p["fwd_bytes_vs_striped"] < 0.5:
        fail("packed sends %s of striped's bytes" % p["fwd_bytes_vs_striped"])
    if (s["fwd_mib_sent"], s["steps"], c["fwd_mib_sent"], c["steps"]) != (896.0, 8, 256.0, 3):
        fail("striped/contiguous counts: %s %s" % (s, c))
    # the critical path in pairs, against striped's: striping is its own unit,
    # contiguous's causal imbalance shows, packed's is counted
    if s["critical_path_vs_striped"] != 1.0 or not c["critical_path_vs_striped"] > 2.0 or \
            not p["critical_path_pairs"] > 0:
        fail("critical paths: %s %s %s" % (p, s, c))
    if not (plan["kept"] > 0 and plan["cache_entries"] == 1 and plan["cache_bytes"] > 0):
        fail("plan: %s" % plan)
    for docs in ("lognormal:8192", "none"):
        rows, plan = run(bench, docs)
        if rows["packed"]["travel_rows"] != 65536 or rows["packed"]["steps"] != 8 or plan["kept"]:
            fail("%s: packed is not striping: %s %s" % (docs, rows["packed"], plan))
    print("ok")


if __name__ == "__main__":
    main()
