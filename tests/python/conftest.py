"""The Python suite's service: a coordinator and 4 workers on loopback,
started once per session from the Release build and stopped at the end.

Every process started here carries STRIA_TEST_RUN (tests/run.sh sets it; one
is made up when pytest runs alone), so tests/reap.sh finds any survivor, and
each gets SIGKILL if pytest itself dies (a parent-death signal)."""

import os
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("STRIA_BUILD_DIR") or os.path.join(ROOT, "build")
BIN = os.path.join(BUILD, "bin")
N_WORKERS = 4

if not os.environ.get("STRIA_TEST_RUN"):
    os.environ["STRIA_TEST_RUN"] = f"pytest-{os.getpid()}-{int(time.time())}"
os.environ.setdefault("STRIA_LIB", os.path.join(BUILD, "lib", "libstria.so.1"))
try:
    import stria  # installed by tests/run.sh
except ImportError:  # else the source tree's
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import stria

from stria.local import LocalService  # noqa: E402


class Cluster(LocalService):
    """The suite's service: the Release build's daemons; a missing build
    stops the session with a clear message."""

    def __init__(self, n_workers=N_WORKERS, token_file=None, memory="2G", log_dir=None):
        try:
            # a 2 s heartbeat: a loaded machine's stalls must not mark workers dead
            super().__init__(n_workers, bin_dir=BIN, token_file=token_file, memory=memory,
                             log_dir=log_dir, heartbeat_period=2,
                             env={"UCX_TLS": "tcp,sm,self"})
        except FileNotFoundError as e:
            pytest.exit(f"{e} (or set STRIA_BUILD_DIR)", returncode=2)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    # the daemons' logs stay in pytest's temporary folder (the last runs' are kept)
    c = Cluster(log_dir=str(tmp_path_factory.mktemp("service")))
    yield c
    bad = c.stop()
    assert not bad, f"{', '.join(bad)} did not exit cleanly on SIGTERM (logs in {c.dir})"


@pytest.fixture(scope="session")
def client(cluster):
    with stria.Client(cluster.address, step_timeout=60) as c:
        stria.set_default_client(c)
        yield c
        stria.set_default_client(None)


def session_ids():
    """The service's ids of the sessions this process's clients hold open
    (the suite's client keeps sessions between tests)."""
    return {i for c in list(stria.client._clients) if not c.closed for i in c.open_session_ids}


def stray_jobs(cluster):
    """The jobs on the service that are no open session of this process."""
    mine = session_ids()
    return [j for j in cluster.active_jobs() if j["id"] not in mine]


@pytest.fixture
def no_active_jobs(cluster):
    """Asserts that a test leaves no job open on the service but the
    sessions this process's clients hold."""
    yield
    deadline = time.monotonic() + 5
    while stray_jobs(cluster) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stray_jobs(cluster) == []


_log_dirs = []


@pytest.fixture(autouse=True, scope="session")
def _remember_logs(cluster):
    _log_dirs.append(cluster.dir)


def pytest_terminal_summary(terminalreporter):
    if terminalreporter.stats.get("failed") and _log_dirs:
        terminalreporter.write_line(f"the service's logs: {_log_dirs[0]}")
