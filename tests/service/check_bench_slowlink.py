#!/usr/bin/env python3
"""Runs `stria-bench slowlink` (the service across network namespaces joined
by rate-limited links) at a small shape and checks what it promises:

- the striped calls run, and the bytes that crossed the rate-limited
  interfaces are those of the ring's two links between hosts (3 K/V blocks
  each in a forward of 4 ranks): traffic inside a host and the client's
  tensors stay off them;
- the rate limit holds: the forward pass is no faster than its link's bytes
  at the rate allow, and slower than without the limit;
- --sharded: each layout and head groups (1 and 2) also runs as a sharded
  session, one thread and client per trainer rank, and its ring moves the
  same K/V as the whole-sequence session's: the ring bytes its ranks counted
  equal the whole row's, and as many bytes cross the host links; so does
  the G = 2 session called by one trainer rank per worker (--per-worker);
- nothing is left behind (namespaces, daemons), also after Ctrl-C.

Where namespaces or tc cannot be used (not root, no iproute2) the command
exits with 77, and so does this test (ctest: skipped), saying why."""
import json
import os
import signal
import subprocess
import sys
import time

SKIP = 77
SEQ, HEADS, HEAD_DIM, RANKS, RATE = 2048, 2, 32, 4, 20e6
GROUPS = (1, 2)
BURST = 131072  # the shaper's bucket: this much passes at once


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def namespaces(pid):
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [l.split()[0] for l in out.splitlines() if l.startswith("stria-sl%d-" % pid)]


def measured(bench):
    cmd = [bench, "slowlink", "--seq", str(SEQ), "--heads", str(HEADS), "--head-dim",
           str(HEAD_DIM), "--rate", "20mbit", "--layouts", "striped", "--reps", "1", "--json",
           "--head-groups", ",".join(map(str, GROUPS)), "--sharded", "--per-worker"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        fail("%s did not end within 120 s" % " ".join(cmd))
    if p.returncode == SKIP:
        print("SKIPPED: " + err.strip())
        sys.exit(SKIP)
    if p.returncode != 0:
        fail("%s exited with %d: %s" % (" ".join(cmd), p.returncode, err))
    left = namespaces(p.pid)
    if left:
        fail("namespaces left behind: %s" % left)
    rows = [json.loads(l) for l in out.splitlines()]
    striped = [r for r in rows if r.get("layout") == "striped"]
    base = [r for r in rows if "baseline" in r]
    keys = sorted((r["head_groups"], r["sharded"], r["per_worker"]) for r in striped)
    want = sorted([(g, sh, False) for g in GROUPS for sh in (False, True)] +
                  [(g, True, True) for g in GROUPS if g > 1])
    if keys != want or len(base) != 1:
        fail("expected a whole and a sharded striped row per head groups %s, a sharded one by "
             "one trainer rank per worker for each G > 1, and a baseline: %s" % (GROUPS, rows))
    bad = [r for r in striped if r["status"] != "ok"]
    if bad:
        fail("rows not ok: %s" % bad)
    row = [r for r in striped if r["head_groups"] == 1 and not r["sharded"]]
    return row[0], base[0], striped


def check_figures(row, base):
    block = SEQ // RANKS * HEADS * HEAD_DIM * 2 * 4  # K and V of one shard, fp32
    expect_mib = 2 * (RANKS - 1) * block / 1048576.0  # two links between the hosts
    mib = row["link_mib_fwd"]
    print("forward: %.3f MiB over the host links (ring: %.3f), pass %.3f s, call %.3f s; "
          "%.2fx its time without the limit" % (mib, expect_mib, row["pass_fwd_s"], row["fwd_s"],
                                               base["bound_fwd"]))
    if not 0.95 * expect_mib <= mib <= 1.5 * expect_mib:
        fail("%.3f MiB crossed the rate-limited interfaces in a forward, expected about %.3f"
             % (mib, expect_mib))
    if not row["link_mib_bwd"] > mib:
        fail("the backward sent %.3f MiB, no more than the forward" % row["link_mib_bwd"])
    floor = 0.9 * ((RANKS - 1) * block - BURST) * 8 / RATE
    if not row["pass_fwd_s"] >= floor:
        fail("the forward pass took %.3f s, less than its link's bytes take at the rate (%.3f s)"
             % (row["pass_fwd_s"], floor))
    if not (row["fwd_s"] >= row["pass_fwd_s"] > 0 and row["fwd_bwd_s"] > row["fwd_s"]):
        fail("times out of order: %s" % row)
    if not base["bound_fwd"] > 1.2:
        fail("the rate limit does not slow the pass: %s" % base)


def check_sharded(rows):
    for g, pw in [(g, False) for g in GROUPS] + [(g, True) for g in GROUPS if g > 1]:
        whole = [r for r in rows if r["head_groups"] == g and not r["sharded"]][0]
        sh = [r for r in rows
              if r["head_groups"] == g and r["sharded"] and r["per_worker"] == pw][0]
        if pw:
            print("G=%d, one trainer rank per worker:" % g)
        print("G=%d: ring %.3f/%.3f MiB (whole) and %.3f/%.3f MiB (sharded) fwd/bwd; host links "
              "%.3f/%.3f and %.3f/%.3f MiB; fwd+bwd %.3f and %.3f s"
              % (g, whole["ring_mib_fwd"], whole["ring_mib_bwd"], sh["ring_mib_fwd"],
                 sh["ring_mib_bwd"], whole["link_mib_fwd"], whole["link_mib_bwd"],
                 sh["link_mib_fwd"], sh["link_mib_bwd"], whole["fwd_bwd_s"], sh["fwd_bwd_s"]))
        for k in ("ring_mib_fwd", "ring_mib_bwd"):
            if not (whole[k] > 0 and abs(sh[k] - whole[k]) < 1e-5):
                fail("G=%d: the sharded session's ring counted %s %.6f MiB, the whole one's %.6f"
                     % (g, k, sh[k], whole[k]))
        for k in ("link_mib_fwd", "link_mib_bwd"):
            if not abs(sh[k] - whole[k]) <= 0.1 * whole[k] + 0.05:
                fail("G=%d: %.3f MiB crossed the host links in the sharded session's %s, %.3f in "
                     "the whole one's" % (g, sh[k], k, whole[k]))
        if not sh["fwd_bwd_s"] > sh["fwd_s"] >= sh["pass_fwd_s"] > 0:
            fail("G=%d: sharded times out of order: %s" % (g, sh))


def interrupted(bench):
    cmd = [bench, "slowlink", "--seq", str(SEQ), "--heads", str(HEADS), "--head-dim",
           str(HEAD_DIM), "--rate", "20mbit", "--layouts", "striped", "--reps", "50"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    until = time.time() + 60
    started = False
    while time.time() < until:
        line = p.stderr.readline()
        if not line:
            break
        if "open, warmed up" in line:
            started = True
            break
    if not started:
        p.kill()
        fail("the interrupted run did not get to its calls")
    made = namespaces(p.pid)
    pids = []
    for ns in made:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        pids += [int(x) for x in out.split() if int(x) != p.pid]  # the bench is in the head
    if len(made) != 1 + RANKS or len(pids) != 1 + RANKS:
        p.kill()
        fail("expected %d namespaces and daemons, found %s and %s" % (1 + RANKS, made, pids))
    # the daemons' logs: a temporary folder of the run's, removed with the rest
    logs = os.path.dirname(os.readlink("/proc/%d/fd/2" % pids[-1]))
    p.send_signal(signal.SIGINT)
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        fail("Ctrl-C did not end the run within 30 s")
    if p.returncode != -signal.SIGINT:
        fail("after Ctrl-C the run ended with %d" % p.returncode)
    left = namespaces(p.pid)
    alive = [pid for pid in pids if os.path.exists("/proc/%d" % pid)]
    if left or alive or os.path.exists(logs):
        fail("after Ctrl-C: namespaces %s, daemons %s, logs %s left behind"
             % (left, alive, logs if os.path.exists(logs) else None))
    print("Ctrl-C: %d namespaces and %d daemons removed" % (len(made), len(pids)))


def main():
    bench = sys.argv[1]
    row, base, rows = measured(bench)
    check_figures(row, base)
    check_sharded(rows)
    interrupted(bench)
    print("ok")


if __name__ == "__main__":
    main()
