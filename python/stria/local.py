"""A stria service on this machine, started from Python: a coordinator and
workers on loopback, for tests, benchmarks and notebooks.

    with stria.local.LocalService(workers=4) as svc:
        client = stria.Client(svc.address)

The daemons come from `bin_dir` (default $STRIA_BIN_DIR, the package's own
_bin (a wheel carries them there), the build/bin of the source checkout this
package sits in, else PATH). They get SIGKILL if this process dies (a
parent-death signal), and SIGTERM from stop(). From a shell,

    python -m stria.local --workers 4

starts the same service, prints its address and the STRIA_COORDINATOR= line,
and stops it on Ctrl-C or SIGTERM.
"""

import argparse
import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import IO, Any, Callable, Dict, List, Mapping, Optional, Sequence, cast

from ._lib import PACKAGE_BIN, PACKAGE_LIB, missing_library_hint

_PR_SET_PDEATHSIG = 1


def _child_setup(parent: int) -> Callable[[], None]:
    libc = ctypes.CDLL(None, use_errno=True)

    def setup() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl
            os._exit(126)
    return setup


def find_bin_dir() -> str:
    """Where the daemons are: $STRIA_BIN_DIR, the package's _bin (a wheel),
    the source checkout's build/bin, else the folder of stria-coordinator on
    PATH (the build tree's path when none has it, for the error)."""
    env = os.environ.get("STRIA_BIN_DIR")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    build = os.path.join(os.path.dirname(os.path.dirname(here)), "build", "bin")
    for d in (PACKAGE_BIN, build):
        if os.access(os.path.join(d, "stria-coordinator"), os.X_OK):
            return d
    found = shutil.which("stria-coordinator")
    return os.path.dirname(found) if found else build


class Daemon:
    """One daemon process: stdout read for its start line, stderr to a log."""

    def __init__(self, argv: Sequence[str], log_path: str, env: Mapping[str, str]) -> None:
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log, env=env,
                                     preexec_fn=_child_setup(os.getpid()))

    def wait_line(self, prefix: str, timeout: float = 30) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            line = cast(IO[bytes], self.proc.stdout).readline().decode(errors="replace")
            if not line:
                break
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        prog = os.path.basename(cast(Sequence[str], self.proc.args)[0])
        try:
            self.proc.wait(1)
            self.log.flush()
            with open(self.log_path, errors="replace") as f:
                hint = missing_library_hint(f.read())
        except (OSError, subprocess.TimeoutExpired):
            hint = None
        if hint:  # the dynamic loader could not start it
            raise RuntimeError(f"{prog} cannot start: {hint} (log: {self.log_path})")
        raise RuntimeError(f"{prog} did not print {prefix!r} (log: {self.log_path})")

    def stop(self, timeout: float = 15) -> int:
        """SIGTERM, SIGKILL after `timeout`; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        stdout = cast(IO[bytes], self.proc.stdout)
        if not stdout.closed:
            stdout.close()
        self.log.close()
        return self.proc.returncode


class LocalService:
    """A coordinator on 127.0.0.1 (`port`, default 0: a free one) and `workers` workers, each
    with `threads` kernel threads and `memory` to offer. `address` is the
    coordinator's HOST:PORT once the constructor returns (every worker
    healthy). token_file: the clients' credential (the workers and striactl
get fresh ones of their own in `dir`). heartbeat_period: the coordinator's (default its own, 1 s; a
    short one marks workers of a busy machine dead). Logs go to `log_dir`
    (default: a temporary folder, removed by a clean stop)."""

    def __init__(self, workers: int = 4, *, bin_dir: Optional[str] = None,
                 token_file: Optional[str] = None, threads: int = 1, memory: str = "2G",
                 step_timeout: str = "60", heartbeat_period: Optional[float] = None,
                 log_dir: Optional[str] = None, env: Optional[Mapping[str, str]] = None,
                 port: int = 0) -> None:
        self.bin_dir = bin_dir or find_bin_dir()
        for prog in ("stria-coordinator", "stria-worker", "striactl"):
            if not os.access(os.path.join(self.bin_dir, prog), os.X_OK):
                raise FileNotFoundError(f"{self.bin_dir}/{prog} is missing: build stria "
                                        f"(cmake --build build) or set STRIA_BIN_DIR")
        self._own_dir = log_dir is None
        self.dir = log_dir or tempfile.mkdtemp(prefix="stria_local_")
        coord_auth: List[str] = []
        worker_auth: List[str] = []
        self.auth: List[str] = []
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
        if os.path.abspath(self.bin_dir) == PACKAGE_BIN and os.path.isdir(PACKAGE_LIB):
            # a wheel's daemons: what it carries beside libstria (a CUDA runtime)
            path = self.env.get("LD_LIBRARY_PATH")
            self.env["LD_LIBRARY_PATH"] = PACKAGE_LIB + (os.pathsep + path if path else "")
        self.env.update(env or {})
        self.workers: List[Daemon] = []
        hb = ["--heartbeat-period", str(heartbeat_period)] if heartbeat_period else []
        self.coordinator = Daemon([os.path.join(self.bin_dir, "stria-coordinator"), "--listen",
                                   f"127.0.0.1:{int(port)}", *hb, *coord_auth],
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

    def _credential(self, name: str) -> str:
        """A fresh random credential in `dir` (mode 0600); its path."""
        path = os.path.join(self.dir, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        return path

    def ctl(self, *args: str) -> Any:
        """`striactl --json ARGS` against this service, parsed."""
        r = subprocess.run([os.path.join(self.bin_dir, "striactl"), "--coordinator",
                            self.address, *self.auth, "--json", *args], capture_output=True,
                           text=True, timeout=30, env=self.env)
        if r.returncode != 0:
            raise RuntimeError(f"striactl {' '.join(args)}: {r.stderr.strip()}")
        return json.loads(r.stdout)

    def wait_healthy(self, n: int, timeout: float = 30) -> None:
        end = time.monotonic() + timeout
        got = None
        while time.monotonic() < end:
            got = self.ctl("status")["workers_healthy"]
            if got == n:
                return
            time.sleep(0.05)
        raise RuntimeError(f"{got} healthy workers, expected {n} (logs in {self.dir})")

    def active_jobs(self) -> List[Dict[str, Any]]:
        """The jobs striactl lists (active or queued)."""
        return cast(List[Dict[str, Any]], self.ctl("jobs")["jobs"])

    def stop(self) -> List[str]:
        """Stops every daemon (SIGTERM); returns the names of those that did
        not exit cleanly (their logs stay in `dir`)."""
        bad = [f"worker {i}" for i, w in enumerate(self.workers) if w.stop() != 0]
        if self.coordinator.stop() != 0:
            bad.append("coordinator")
        if not bad and self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        return bad

    def __enter__(self) -> "LocalService":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """python -m stria.local: a coordinator and workers on loopback until
    Ctrl-C or SIGTERM; stops every daemon it started."""
    ap = argparse.ArgumentParser(
        prog="python -m stria.local",
        description="Start a stria coordinator and workers on loopback (127.0.0.1), print the "
                    "address, and stop them on Ctrl-C or SIGTERM.")
    ap.add_argument("--workers", type=int, default=4, help="workers to start (default 4)")
    ap.add_argument("--threads", type=int, default=1, help="kernel threads a worker (default 1)")
    ap.add_argument("--memory", default="2G", help="memory a worker offers (default 2G)")
    ap.add_argument("--port", type=int, default=0,
                    help="the coordinator's port on 127.0.0.1 (default 0: a free one)")
    ap.add_argument("--heartbeat-period", type=float,
                    help="the coordinator's heartbeat period in seconds (default its own, 1; "
                    "a longer one keeps a busy machine's workers from being marked dead)")
    ap.add_argument("--token-file", help="the clients' credential (default: no authentication)")
    ap.add_argument("--bin-dir", help="the daemons' folder (default: $STRIA_BIN_DIR, the "
                    "package's, the build tree's, PATH)")
    ap.add_argument("--log-dir", help="the daemons' logs (default: a temporary folder, removed "
                    "by a clean stop)")
    args = ap.parse_args(argv)
    if args.workers < 1:
        ap.error("--workers must be at least 1")

    def terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = {s: signal.signal(s, terminate) for s in (signal.SIGTERM, signal.SIGHUP)}
    svc = None
    try:
        svc = LocalService(args.workers, bin_dir=args.bin_dir, token_file=args.token_file,
                           threads=args.threads, memory=args.memory, port=args.port,
                           heartbeat_period=args.heartbeat_period, log_dir=args.log_dir)
        print(f"stria: coordinator on {svc.address}, {args.workers} workers "
              f"(daemons in {svc.bin_dir}, logs in {svc.dir})")
        print(f"STRIA_COORDINATOR={svc.address}")
        if args.token_file:
            print(f"STRIA_TOKEN_FILE={os.path.abspath(args.token_file)}")
        print("stria: Ctrl-C or SIGTERM stops them", flush=True)
        while True:
            dead = [name for name, d in [("coordinator", svc.coordinator)] +
                    [(f"worker {i}", w) for i, w in enumerate(svc.workers)]
                    if d.proc.poll() is not None]
            if dead:
                print(f"stria: {', '.join(dead)} exited (logs in {svc.dir}); stopping",
                      file=sys.stderr)
                return 1
            time.sleep(1)
    except KeyboardInterrupt:
        return 0
    except (FileNotFoundError, RuntimeError) as e:
        print(f"stria: {e}", file=sys.stderr)
        return 1
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if svc is not None:
            # a second Ctrl-C while stopping must not leave daemons behind
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            bad = svc.stop()
            print("stria: stopped" + (f" ({', '.join(bad)} not cleanly; logs in {svc.dir})"
                                      if bad else ""), flush=True)


if __name__ == "__main__":
    sys.exit(main())
