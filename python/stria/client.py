"""stria.Client: one connection to the coordinator, safe to share between
threads.

libstria's rule is one thread at a time per client and its jobs, so every
call takes the client's lock (PyTorch runs backward on its own threads); the
GIL is released during the C calls (ctypes does), so other Python threads
run meanwhile. Jobs whose last Python reference goes away (a graph dropped
without backward) are released by a finalizer: at once when the lock is
free, otherwise by the thread that holds it, before it lets go.
"""

import atexit
import ctypes
import os
import threading
import weakref

from . import _lib

DEFAULT_COORDINATOR = "127.0.0.1:7400"


class Job:
    """A job held on the service between forward and backward.

    ``release()`` frees the workers' memory; it also happens when the object
    is garbage-collected and when its client closes."""

    def __init__(self, client, ptr):
        self._client = client
        self._ptr = ptr
        L = _lib.lib()
        self._id = int(L.stria_job_id(ptr))
        self.ring_size = int(L.stria_job_ring_size(ptr))
        self.layout = _lib.LAYOUT_NAMES.get(int(L.stria_job_layout(ptr)), "unknown")
        self._finalizer = weakref.finalize(self, client._release_ptr, ptr)

    def _call(self, fn):
        """fn(L) under the client's lock, on a live handle."""
        if not self.alive:
            raise RuntimeError(f"stria job {self.id} was released")
        return self._client._locked(lambda: fn(_lib.lib()))

    @property
    def id(self):
        """The job's id: a sharded job that lost a worker moves to its
        replacement (a new id) inside forward_shard, and this follows."""
        if self.alive:
            self._id = int(_lib.lib().stria_job_id(self._ptr))
        return self._id

    @property
    def alive(self):
        return self._finalizer.alive and not self._client.closed

    def backward(self, d_o, dq, dk, dv, stats=None):
        """dO in, dQ/dK/dV out (addresses of contiguous host buffers)."""
        st = ctypes.byref(stats) if stats is not None else None
        self._call(lambda L: _lib.check(L.stria_client_backward(
            self._ptr, d_o, dq, dk, dv, None, None, st)))

    # ---- sharded jobs (Client.submit / Client.import_job) ----------------

    def export(self):
        """The handle's bytes for the other ranks (they hold the job's
        secret: hand them only to the trainer's own processes)."""
        buf = ctypes.create_string_buffer(_lib.JOB_EXPORT_BYTES)
        n = ctypes.c_size_t()
        self._call(lambda L: _lib.check(L.stria_job_export(
            self._ptr, buf, len(buf), ctypes.byref(n))))
        return buf.raw[:n.value]

    def shard_tokens(self, rank):
        """How many tokens ring rank `rank` holds."""
        n = self._call(lambda L: int(L.stria_job_shard_tokens(self._ptr, rank)))
        if n < 0:
            raise ValueError(f"stria: rank {rank} outside job {self.id}'s ring of "
                             f"{self.ring_size}")
        return n

    def positions(self, rank):
        """The global positions of rank `rank`'s tokens, in its order (int64)."""
        import torch

        out = torch.empty(self.shard_tokens(rank), dtype=torch.int64)
        self._call(lambda L: _lib.check(L.stria_job_positions(
            self._ptr, rank, ctypes.c_void_p(out.data_ptr()))))
        return out

    def forward_shard(self, rank, q, k, v, o, lse):
        """Rank `rank`'s forward pass (addresses of contiguous host buffers
        of its tokens); returns when every rank's pass is done."""
        self._call(lambda L: _lib.check(L.stria_client_forward_shard(
            self._ptr, rank, q, k, v, o, lse)))

    def backward_shard(self, rank, d_o, dq, dk, dv):
        """Rank `rank`'s backward pass, after its forward pass."""
        self._call(lambda L: _lib.check(L.stria_client_backward_shard(
            self._ptr, rank, d_o, dq, dk, dv)))

    def release(self):
        self._finalizer()


class Client:
    """A connection to a stria coordinator.

    coordinator: "HOST:PORT"; default ``$STRIA_COORDINATOR``, else
    127.0.0.1:7400. token_file: the service's token file; default
    ``$STRIA_TOKEN_FILE`` (none when unset). keep_jobs: how many jobs forward
    may keep open for backward (0, the default: forward releases its job and
    backward recomputes the forward pass on the service, so no worker memory
    is held between them; beyond the bound forward falls back to that).
    step_timeout, ttl: per-job deadlines in seconds (0: the service's).
    no_queue: fail with BusyError instead of waiting for workers.
    arrival_timeout: sharded jobs: how long a pass waits for the other ranks
    once one arrived (0: the service's 60 s).
    forward_retries: how many times libstria submits a forward again, inside
    the call, after a retryable failure (a worker died or left); 0: its
    default (2), negative: never. A failed call's StriaError says whether it
    is retryable (``.retryable``).
    """

    def __init__(self, coordinator=None, token_file=None, *, connect_timeout=0.0,
                 rpc_timeout=0.0, name="stria-python", keep_jobs=0, step_timeout=0.0, ttl=0.0,
                 no_queue=False, arrival_timeout=0.0, forward_retries=0):
        L = _lib.lib()
        self.coordinator = coordinator or os.environ.get("STRIA_COORDINATOR") or \
            DEFAULT_COORDINATOR
        token_file = token_file or os.environ.get("STRIA_TOKEN_FILE") or None
        if keep_jobs < 0:
            raise ValueError(f"keep_jobs must be >= 0, not {keep_jobs}")
        self.keep_jobs = int(keep_jobs)
        self.step_timeout = float(step_timeout)
        self.ttl = float(ttl)
        self.no_queue = bool(no_queue)
        self.arrival_timeout = float(arrival_timeout)
        self.closed = False
        self._lock = threading.Lock()
        self._pending = []  # job pointers a finalizer could not release at once
        self._pending_lock = threading.Lock()
        self._kept = 0
        self._ptrs = {}  # open jobs' pointers -> whether they count as kept
        p = _lib.ClientParams()
        p.struct_size = ctypes.sizeof(p)
        p.coordinator = self.coordinator.encode()
        p.token_file = token_file.encode() if token_file else None
        p.connect_timeout_s = connect_timeout
        p.rpc_timeout_s = rpc_timeout
        p.client_name = name.encode()
        p.forward_retries = int(forward_retries)
        ptr = ctypes.c_void_p()
        _lib.check(L.stria_client_connect(ctypes.byref(p), ctypes.byref(ptr)))
        self._ptr = ptr

    # ---- locking ---------------------------------------------------------

    def _drain_locked(self):
        while True:
            with self._pending_lock:
                if not self._pending:
                    return
                ptr = self._pending.pop()
            self._release_locked(ptr)

    def _unlock(self):
        """Lets go of the lock, first releasing what finalizers queued; a
        finalizer that queued while we held the lock relies on this."""
        while True:
            self._drain_locked()
            self._lock.release()
            with self._pending_lock:
                if not self._pending:
                    return
            if not self._lock.acquire(blocking=False):
                return  # the new holder drains

    def _locked(self, fn):
        if self.closed:
            raise RuntimeError("stria client is closed")
        self._lock.acquire()
        try:
            if self.closed:
                raise RuntimeError("stria client is closed")
            return fn()
        finally:
            self._unlock()

    def _release_locked(self, ptr):
        if ptr.value in self._ptrs:
            if self._ptrs.pop(ptr.value):
                self._kept -= 1
            _lib.lib().stria_client_release(ptr)

    def _release_ptr(self, ptr):
        """A Job's finalizer: any thread, maybe one that holds the lock."""
        if self.closed:
            return
        with self._pending_lock:
            self._pending.append(ptr)
        if self._lock.acquire(blocking=False):
            self._unlock()

    # ---- calls -----------------------------------------------------------

    def _may_keep(self):
        return self._kept < self.keep_jobs

    def forward(self, spec, q, k, v, o, lse, keep, stats=None):
        """One forward call (addresses of contiguous host buffers). Returns a
        Job when keep is true, else releases the job and returns None."""
        L = _lib.lib()

        def call():
            job = ctypes.c_void_p()
            _lib.check(L.stria_client_forward(
                self._ptr, ctypes.byref(spec), q, k, v, o, lse, None, None,
                ctypes.byref(stats) if stats is not None else None, ctypes.byref(job)))
            if not keep:
                L.stria_client_release(job)
                return None
            self._ptrs[job.value] = True
            self._kept += 1
            return job

        ptr = self._locked(call)
        return Job(self, ptr) if ptr is not None else None

    def _open(self, make, keep):
        """A Job from make(L, &ptr) (a sharded job's handle); keep: it counts
        against keep_jobs until released."""
        def call():
            ptr = ctypes.c_void_p()
            _lib.check(make(_lib.lib(), ctypes.byref(ptr)))
            self._ptrs[ptr.value] = bool(keep)
            self._kept += bool(keep)
            return ptr

        return Job(self, self._locked(call))

    def submit(self, spec, keep=False):
        """Submits a sharded job (spec.ring_size ranks, a named layout) and
        returns its Job once its workers are reserved; nothing runs yet."""
        return self._open(lambda L, out: L.stria_client_submit(self._ptr, ctypes.byref(spec),
                                                               out), keep)

    def import_job(self, data, keep=False):
        """Opens a sharded job from another process's Job.export() bytes."""
        data = bytes(data)
        return self._open(lambda L, out: L.stria_job_import(self._ptr, data, len(data), out),
                          keep)

    def close(self):
        """Releases every open job and closes the connection (idempotent)."""
        if self.closed:
            return
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._ptrs.clear()
            _lib.lib().stria_client_close(self._ptr)

    @property
    def jobs_kept(self):
        """Jobs held open for backward now."""
        return self._kept

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        return f"stria.Client({self.coordinator!r}{', closed' if self.closed else ''})"


_default = None
_default_lock = threading.Lock()


def default_client():
    """The client that calls without ``client=`` use: made on first use from
    the environment (STRIA_COORDINATOR, STRIA_TOKEN_FILE), closed at exit."""
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            _default = Client()
        return _default


def set_default_client(client):
    """Makes `client` (or None: a fresh one from the environment on next
    use) the default; returns the previous one (not closed)."""
    global _default
    with _default_lock:
        prev, _default = _default, client
        return prev


@atexit.register
def _close_default():
    if _default is not None:
        _default.close()
