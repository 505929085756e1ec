"""A stria service on this machine, started from Python: a coordinator and
workers on loopback, for tests, benchmarks and notebooks.

    with stria.local.LocalService(workers=4) as svc:
        client = stria.Client(svc.address)

The daemons come from `bin_dir` (default $STRIA_BIN_DIR, the build/bin of the
source checkout this package sits in, else PATH). They get SIGKILL if this
process dies (a parent-death signal), and SIGTERM from stop().
"""

import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time

_PR_SET_PDEATHSIG = 1


def _child_setup(parent):
    libc = ctypes.CDLL(None, use_errno=True)

    def setup():
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl
            os._exit(126)
    return setup


def find_bin_dir():
    env = os.environ.get("STRIA_BIN_DIR")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    build = os.path.join(os.path.dirname(os.path.dirname(here)), "build", "bin")
    if os.access(os.path.join(build, "stria-coordinator"), os.X_OK):
        return build
    found = shutil.which("stria-coordinator")
    return os.path.dirname(found) if found else build


class Daemon:
    """One daemon process: stdout read for its start line, stderr to a log."""

    def __init__(self, argv, log_path, env):
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log, env=env,
                                     preexec_fn=_child_setup(os.getpid()))

    def wait_line(self, prefix, timeout=30):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            line = self.proc.stdout.readline().decode(errors="replace")
            if not line:
                break
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        raise RuntimeError(f"{os.path.basename(self.proc.args[0])} did not print {prefix!r} "
                           f"(log: {self.log_path})")

    def stop(self, timeout=15):
        """SIGTERM, SIGKILL after `timeout`; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.proc.stdout.closed:
            self.proc.stdout.close()
        self.log.close()
        return self.proc.returncode


class LocalService:
    """A coordinator on 127.0.0.1 (a free port) and `workers` workers, each
    with `threads` kernel threads and `memory` to offer. `address` is the
    coordinator's HOST:PORT once the constructor returns (every worker
    healthy). token_file: the clients' credential (the workers and striactl
get fresh ones of their own in `dir`). heartbeat_period: the coordinator's (default its own, 1 s; a
    short one marks workers of a busy machine dead). Logs go to `log_dir`
    (default: a temporary folder, removed by a clean stop)."""

    def __init__(self, workers=4, *, bin_dir=None, token_file=None, threads=1, memory="2G",
                 step_timeout="60", heartbeat_period=None, log_dir=None, env=None):
        self.bin_dir = bin_dir or find_bin_dir()
        for prog in ("stria-coordinator", "stria-worker", "striactl"):
            if not os.access(os.path.join(self.bin_dir, prog), os.X_OK):
                raise FileNotFoundError(f"{self.bin_dir}/{prog} is missing: build stria "
                                        f"(cmake --build build) or set STRIA_BIN_DIR")
        self._own_dir = log_dir is None
        self.dir = log_dir or tempfile.mkdtemp(prefix="stria_local_")
        coord_auth, worker_auth, self.auth = [], [], []
        if token_file:  # clients prove token_file; workers and operators their own
            worker_tok = self._credential("worker.token")
            admin_tok = self._credential("admin.token")
            coord_auth = [f"--client-token-file={token_file}",
                          f"--worker-token-file={worker_tok}",
                          f"--admin-token-file={admin_tok}"]
            worker_auth = [f"--client-token-file={token_file}",
                           f"--worker-token-file={worker_tok}"]
            self.auth = [f"--token-file={admin_tok}"]  # striactl: an operator
        self.env = dict(os.environ, **{"UCX_HANDLE_ERRORS": "none",
                                       "STRIA_LOG_LEVEL": os.environ.get("STRIA_LOG_LEVEL",
                                                                         "error")})
        self.env.update(env or {})
        self.workers = []
        hb = ["--heartbeat-period", str(heartbeat_period)] if heartbeat_period else []
        self.coordinator = Daemon([os.path.join(self.bin_dir, "stria-coordinator"), "--listen",
                                   "127.0.0.1:0", *hb, *coord_auth],
                                  os.path.join(self.dir, "coordinator.log"), self.env)
        try:
            self.address = self.coordinator.wait_line("stria-coordinator listening on ")
            for i in range(workers):
                w = Daemon([os.path.join(self.bin_dir, "stria-worker"), "--coordinator",
                            self.address, "--threads", str(threads), "--step-timeout",
                            str(step_timeout), "--memory", str(memory), *worker_auth],
                           os.path.join(self.dir, f"worker{i}.log"), self.env)
                self.workers.append(w)
                w.wait_line("stria-worker listening rpc=")
            self.wait_healthy(workers)
        except BaseException:
            self.stop()
            raise

    def _credential(self, name):
        """A fresh random credential in `dir` (mode 0600); its path."""
        path = os.path.join(self.dir, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        return path

    def ctl(self, *args):
        """`striactl --json ARGS` against this service, parsed."""
        r = subprocess.run([os.path.join(self.bin_dir, "striactl"), "--coordinator",
                            self.address, *self.auth, "--json", *args], capture_output=True,
                           text=True, timeout=30, env=self.env)
        if r.returncode != 0:
            raise RuntimeError(f"striactl {' '.join(args)}: {r.stderr.strip()}")
        return json.loads(r.stdout)

    def wait_healthy(self, n, timeout=30):
        end = time.monotonic() + timeout
        got = None
        while time.monotonic() < end:
            got = self.ctl("status")["workers_healthy"]
            if got == n:
                return
            time.sleep(0.05)
        raise RuntimeError(f"{got} healthy workers, expected {n} (logs in {self.dir})")

    def active_jobs(self):
        """The jobs striactl lists (active or queued)."""
        return self.ctl("jobs")["jobs"]

    def stop(self):
        """Stops every daemon (SIGTERM); returns the names of those that did
        not exit cleanly (their logs stay in `dir`)."""
        bad = [f"worker {i}" for i, w in enumerate(self.workers) if w.stop() != 0]
        if self.coordinator.stop() != 0:
            bad.append("coordinator")
        if not bad and self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        return bad

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
