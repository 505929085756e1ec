"""Shared by the stria-bench output checks: run a command that prints one
JSON object per line, and return the objects, each keyed by (layout, ranks,
seq, pass), failing on a bad exit, a line that is not JSON, a missing field
or a key seen twice."""
import json
import subprocess
import sys


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def run_json_lines(cmd, fields, timeout=300):
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if run.returncode != 0:
        fail("%s exited with %d: %s" % (" ".join(cmd), run.returncode, run.stderr))
    seen = {}
    for line in run.stdout.splitlines():
        try:
            obj = json.loads(line)
        except ValueError as e:
            fail("not a JSON object per line: %r (%s)" % (line, e))
        for f in fields:
            if f not in obj:
                fail("field %s missing in %s" % (f, line))
        key = (obj["layout"], obj["ranks"], obj["seq"], obj["pass"])
        if key in seen:
            fail("twice: %s" % (key,))
        seen[key] = obj
    return seen
