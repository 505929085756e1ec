#!/usr/bin/env python3
"""Runs `stria-bench soak --json` for a few seconds with one worker killed
and started again, and checks its output: one JSON object with the
documented fields, counts that add up, one entry per daemon with its memory
and descriptors read, the killed worker restarted, no unexplained failure,
and the exit status. Then the usage errors (exit status 2)."""
import json
import subprocess
import sys

WORKERS = 3
TOP = ("name", "seconds", "workers", "clients", "kill_every_s", "kills", "load_start", "load_end",
       "jobs", "jobs_ok", "session_calls_ok", "jobs_per_s", "forward_retries", "jobs_retried", "slow_jobs", "longest_job_s", "failures",
       "failure_classes", "pool_in_use_bytes_start", "pool_in_use_bytes_end", "coordinator_end", "daemons",
       "unexplained")
FAILURES = ("total", "retryable", "not_retryable_after_kill", "unexplained", "bad_output",
            "retryable_without_kill", "other_classes")
COORD_END = ("jobs_submitted", "jobs_failed", "jobs_active", "jobs_pending", "workers_healthy",
             "workers_dead")
CLASS = ("status", "phase", "retryable", "after_kill", "count", "class", "example")
DAEMON = ("name", "pid", "restarts", "died", "samples", "fit_samples", "rss_kib_start",
          "rss_kib_after_warmup", "rss_kib_end", "rss_kib_max", "rss_slope_kib_per_min",
          "rss_slope_se", "rss_slope_last_half_kib_per_min", "rss_steady", "fds_start",
          "fds_after_warmup", "fds_end", "fds_slope_per_min")


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def need(obj, keys, what):
    for k in keys:
        if k not in obj:
            fail("%s: field %s missing in %s" % (what, k, json.dumps(obj)))


def check_run(bench):
    cmd = [bench, "soak", "--seconds", "6", "--workers", str(WORKERS), "--clients", "2",
           "--kill-every", "3", "--restart-after", "1", "--step-timeout", "5", "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        fail("%s exited with %d:\n%s\n%s" % (" ".join(cmd), run.returncode, run.stdout,
                                              run.stderr))
    lines = run.stdout.splitlines()
    if len(lines) != 1:
        fail("want one line of JSON, got %d: %r" % (len(lines), run.stdout))
    try:
        obj = json.loads(lines[0])
    except ValueError as e:
        fail("not JSON: %r (%s)" % (lines[0], e))
    need(obj, TOP, "soak")
    need(obj["failures"], FAILURES, "failures")
    need(obj["coordinator_end"], COORD_END, "coordinator_end")
    f = obj["failures"]
    ce = obj["coordinator_end"]
    # the jobs ok that ran as jobs (not as calls on a session the client
    # keeps) were each submitted at least once
    if ce["jobs_submitted"] < obj["jobs_ok"] - obj["session_calls_ok"] or \
            ce["workers_healthy"] != WORKERS:
        fail("the coordinator at the end: %s (jobs ok %d, %d of them session calls)"
             % (ce, obj["jobs_ok"], obj["session_calls_ok"]))
    if not 0 <= obj["session_calls_ok"] <= obj["jobs_ok"]:
        fail("session_calls_ok %d of %d jobs ok" % (obj["session_calls_ok"], obj["jobs_ok"]))
    if obj["name"] != "soak" or obj["workers"] != WORKERS or obj["clients"] != 2:
        fail("name/workers/clients: %s" % lines[0])
    if obj["seconds"] < 6 or obj["kills"] != 1:
        fail("ran %g s with %d kills, want >= 6 s and 1 kill" % (obj["seconds"], obj["kills"]))
    if obj["jobs"] < 1 or obj["jobs_ok"] < 1 or obj["jobs_ok"] > obj["jobs"]:
        fail("jobs %d, ok %d" % (obj["jobs"], obj["jobs_ok"]))
    if abs(obj["jobs_per_s"] - obj["jobs"] / obj["seconds"]) > 0.01 * obj["jobs_per_s"] + 0.01:
        fail("jobs_per_s %g != jobs / seconds" % obj["jobs_per_s"])
    if f["total"] != f["retryable"] + f["not_retryable_after_kill"] + f["unexplained"]:
        fail("failure causes do not add up: %s" % f)
    # every job not ok failed or gave a bad output (a failed connection is no job)
    if obj["jobs"] - obj["jobs_ok"] > f["total"] + f["bad_output"]:
        fail("jobs - ok = %d, failures %s" % (obj["jobs"] - obj["jobs_ok"], f))
    for c in obj["failure_classes"]:
        need(c, CLASS, "failure class")
        if c["count"] < 1 or (not c["after_kill"] and not c["retryable"]):
            fail("failure class %s (not retryable with no kill near: unexplained)" % c)
    no_kill = sum(c["count"] for c in obj["failure_classes"]
                  if c["retryable"] and not c["after_kill"])
    if f["other_classes"] == 0 and no_kill != f["retryable_without_kill"]:
        fail("retryable_without_kill %d, the classes say %d" % (f["retryable_without_kill"],
                                                                 no_kill))
    counted = sum(c["count"] for c in obj["failure_classes"]) + f["other_classes"]
    if counted != f["total"]:
        fail("failure classes count %d, total %d" % (counted, f["total"]))
    if f["unexplained"] != 0 or f["bad_output"] != 0 or obj["unexplained"] != 0:
        fail("unexplained failures: %s" % json.dumps(obj["failure_classes"]))
    if obj["forward_retries"] < obj["jobs_retried"]:
        fail("retries %d in %d jobs" % (obj["forward_retries"], obj["jobs_retried"]))
    ds = obj["daemons"]
    names = [d.get("name") for d in ds]
    if names != ["coordinator"] + ["worker%d" % i for i in range(WORKERS)]:
        fail("daemons %s" % names)
    for d in ds:
        need(d, DAEMON, "daemon")
        if d["died"] or d["pid"] <= 0 or d["samples"] < 2:
            fail("daemon %s" % d)
        for k in ("rss_kib_start", "rss_kib_end", "fds_start", "fds_end"):
            if d[k] <= 0:
                fail("daemon %s: %s %g" % (d["name"], k, d[k]))
        if d["rss_kib_max"] < max(d["rss_kib_start"], d["rss_kib_end"]):
            fail("daemon %s: max RSS below start or end" % d["name"])
    restarts = [d["restarts"] for d in ds]
    # the kill takes a worker of the upper half, which is then started again
    if restarts[0] != 0 or sum(restarts) != 1 or sum(restarts[1:1 + WORKERS // 2]) != 0:
        fail("restarts %s, want one of a worker of the upper half" % restarts)
    print("stria-bench soak --json: %d jobs (%d ok, %d retries), %d failures, %.1f s to end "
          "the last jobs, every field present and consistent" %
          (obj["jobs"], obj["jobs_ok"], obj["forward_retries"], f["total"], obj["drain_s"]))


def check_usage(bench):
    for args, what in ((["--seconds", "5", "--minutes", "1"], "--seconds and --minutes"),
                       (["--workers", "1", "--kill-every", "2"], "--kill-every"),
                       (["--seconds", "0"], "--seconds")):
        run = subprocess.run([bench, "soak"] + args + ["--json"], capture_output=True, text=True,
                             timeout=60)
        if run.returncode != 2 or what not in run.stderr or run.stdout:
            fail("soak %s: exit %d, stderr %r (want 2 and a message naming %s)" %
                 (" ".join(args), run.returncode, run.stderr, what))


def main():
    check_usage(sys.argv[1])
    check_run(sys.argv[1])


if __name__ == "__main__":
    main()
