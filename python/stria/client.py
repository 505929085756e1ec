"""stria.Client: one connection to the coordinator, safe to share between
threads, and the sessions it opens for calls.

libstria's rule is one thread at a time per client and its jobs, so every
call takes the client's lock (PyTorch runs backward on its own threads); the
GIL is released during the C calls (ctypes does), so other Python threads
run meanwhile. Jobs and sessions whose last Python reference goes away (a
graph dropped without backward, a Session dropped unclosed) are released by
a finalizer: at once when the lock is free, otherwise by the thread that
holds it, before it lets go.

The calls of stria.attention and stria.sharded_attention run on sessions the
client opens on first use and keeps (session.py's _Cache): one per what a
session fixes, bounded by max_sessions, least recently used closed first;
all closed with the client, and at interpreter exit.
"""

import atexit
import ctypes
import os
import threading
import weakref
from types import TracebackType
from typing import (TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Type, TypeVar,
                    Union)

from . import _lib

if TYPE_CHECKING:
    import torch

    from .session import Session, _Cache

_T = TypeVar("_T")
_Buf = Union[ctypes.c_void_p, int, None]  # a host buffer's address

DEFAULT_COORDINATOR = "127.0.0.1:7400"


class Job:
    """A job held on the service between forward and backward.

    ``release()`` frees the workers' memory; it also happens when the object
    is garbage-collected and when its client closes."""

    def __init__(self, client: "Client", ptr: ctypes.c_void_p) -> None:
        self._client = client
        self._ptr = ptr
        L = _lib.lib()
        self._id = int(L.stria_job_id(ptr))
        self.ring_size = int(L.stria_job_ring_size(ptr))
        self.layout = _lib.LAYOUT_NAMES.get(int(L.stria_job_layout(ptr)), "unknown")
        self._finalizer = weakref.finalize(self, client._release_ptr, ptr)

    def _call(self, fn: Callable[[ctypes.CDLL], _T]) -> _T:
        """fn(L) under the client's lock, on a live handle."""
        if not self.alive:
            raise RuntimeError(f"stria job {self.id} was released")
        return self._client._locked(lambda: fn(_lib.lib()))

    @property
    def id(self) -> int:
        """The job's id: a sharded job that lost a worker moves to its
        replacement (a new id) inside forward_shard, and this follows."""
        if self.alive:
            self._id = int(_lib.lib().stria_job_id(self._ptr))
        return self._id

    @property
    def alive(self) -> bool:
        return self._finalizer.alive and not self._client.closed

    def backward(self, d_o: _Buf, dq: _Buf, dk: _Buf, dv: _Buf,
                 stats: Optional[_lib.CallStats] = None) -> None:
        """dO in, dQ/dK/dV out (addresses of contiguous host buffers)."""
        st = ctypes.byref(stats) if stats is not None else None
        self._call(lambda L: _lib.check(L.stria_client_backward(
            self._ptr, d_o, dq, dk, dv, None, None, st)))

    # ---- sharded jobs (Client.submit / Client.import_job) ----------------

    def export(self) -> bytes:
        """The handle's bytes for the other ranks (they hold the job's
        secret: hand them only to the trainer's own processes)."""
        buf = ctypes.create_string_buffer(_lib.JOB_EXPORT_BYTES)
        n = ctypes.c_size_t()
        self._call(lambda L: _lib.check(L.stria_job_export(
            self._ptr, buf, len(buf), ctypes.byref(n))))
        return buf.raw[:n.value]

    def shard_tokens(self, rank: int) -> int:
        """How many tokens ring rank `rank` holds."""
        n = self._call(lambda L: int(L.stria_job_shard_tokens(self._ptr, rank)))
        if n < 0:
            raise ValueError(f"stria: rank {rank} outside job {self.id}'s ring of "
                             f"{self.ring_size}")
        return n

    def positions(self, rank: int) -> "torch.Tensor":
        """The global positions of rank `rank`'s tokens, in its order (int64)."""
        import torch

        out = torch.empty(self.shard_tokens(rank), dtype=torch.int64)
        self._call(lambda L: _lib.check(L.stria_job_positions(
            self._ptr, rank, ctypes.c_void_p(out.data_ptr()))))
        return out

    def forward_shard(self, rank: int, q: _Buf, k: _Buf, v: _Buf, o: _Buf, lse: _Buf) -> None:
        """Rank `rank`'s forward pass (addresses of contiguous host buffers
        of its tokens); returns when every rank's pass is done."""
        self._call(lambda L: _lib.check(L.stria_client_forward_shard(
            self._ptr, rank, q, k, v, o, lse)))

    def backward_shard(self, rank: int, d_o: _Buf, dq: _Buf, dk: _Buf, dv: _Buf) -> None:
        """Rank `rank`'s backward pass, after its forward pass."""
        self._call(lambda L: _lib.check(L.stria_client_backward_shard(
            self._ptr, rank, d_o, dq, dk, dv)))

    def release(self) -> None:
        """Frees the job on the service (idempotent)."""
        self._finalizer()


class Client:
    """A connection to a stria coordinator.

    coordinator: "HOST:PORT"; default ``$STRIA_COORDINATOR``, else
    127.0.0.1:7400. token_file: the service's token file; default
    ``$STRIA_TOKEN_FILE`` (none when unset).

    Calls (stria.attention, the flash_attn calls, Hugging Face models,
    stria.sharded_attention) run on sessions the client opens on first use
    and reuses: one per ring size, layout, dtype, heads, kv_heads and
    head_dim (and torch.distributed group), bounded by the calls' batch and
    batch * length rounded up to powers of two (at least
    stria.session.MIN_TOKENS tokens), so a model's layers and a run's
    lengths share a few sessions. Backward sends the saved Q, K, V, O and
    LSE: the forward runs once, and the workers hold nothing between calls
    but the sessions' buffers. max_sessions: how many sessions the client
    keeps for calls (whole-sequence ones, and each group's sharded ones),
    the least recently used closed first. idle_timeout: the service closes a
    session idle this long (0: 60 s); libstria opens it again on the next
    call. ``sessions`` lists the open ones; ``close()`` closes them.

    keep_jobs: the job path of before sessions, kept for compatibility: N >
    0 runs every call of this client as a job, forward keeping up to N jobs
    open for backward (beyond that bound backward recomputes the forward on
    the service).

    step_timeout: the deadline of a ring step in seconds; ttl: the job
    path's job TTL (0: the service's). no_queue: fail with BusyError instead
    of waiting for workers. arrival_timeout: sharded calls: how long a call
    waits for the other ranks once one arrived (0: the service's 60 s).
    forward_retries: how many times libstria tries a call again, inside the
    call, after a retryable failure (a worker died or left; whole-sequence
    calls); 0: its default (2), negative: never. A failed call's StriaError
    says whether it is retryable (``.retryable``).

    head_groups: whole-sequence calls' sessions run as head_groups rings of
    ring_size / head_groups ranks each, one per group of heads (see
    stria.Session; "auto": one per host of the ring where that fits); the
    calls must then name ring_size (not with "auto"), and head_groups must
    divide their kv_heads. Sharded calls (stria.sharded_attention) of a
    world of W ranks run on head_groups rings of W workers each, rank j's
    tokens going to worker j of every ring, each ring its group's heads
    ("auto": one ring of W). head_group_rings: where those rings lie,
    "inside" hosts (default) or "across" them (see stria.Session).
    trainer_ranks: with head_groups G > 1, "ring" (default: as above) or
    "worker": a sharded world of W ranks runs on G rings of W / G workers,
    one trainer rank per worker, rank h G + l passing stripe l W/G + h
    with all its heads (stria.shard(..., head_groups=G)), its heads going
    to worker h of every ring (see stria.Session's trainer_ranks).
    """

    def __init__(self, coordinator: Optional[str] = None, token_file: Optional[str] = None, *,
                 connect_timeout: float = 0.0, rpc_timeout: float = 0.0,
                 name: str = "stria-python", keep_jobs: int = 0, step_timeout: float = 0.0,
                 ttl: float = 0.0, no_queue: bool = False, arrival_timeout: float = 0.0,
                 forward_retries: int = 0, max_sessions: int = 4,
                 idle_timeout: float = 0.0, head_groups: Union[int, str] = 0,
                 head_group_rings: str = "inside", trainer_ranks: str = "ring") -> None:
        self.closed = True  # until connected (__del__ of a failed constructor)
        L = _lib.lib()
        self.coordinator: str = coordinator or os.environ.get("STRIA_COORDINATOR") or \
            DEFAULT_COORDINATOR
        token_file = token_file or os.environ.get("STRIA_TOKEN_FILE") or None
        if keep_jobs < 0:
            raise ValueError(f"keep_jobs must be >= 0, not {keep_jobs}")
        if not isinstance(max_sessions, int) or isinstance(max_sessions, bool) or \
                max_sessions < 1:
            raise ValueError(f"max_sessions must be an int >= 1, not {max_sessions!r}")
        if head_groups != "auto" and (not isinstance(head_groups, int) or
                                      isinstance(head_groups, bool) or head_groups < 0):
            raise ValueError(f"head_groups must be \"auto\" or an int >= 0, not "
                             f"{head_groups!r}")
        self.keep_jobs = int(keep_jobs)
        from .session import _group_rings

        _group_rings(head_group_rings)
        if trainer_ranks not in ("ring", "worker"):
            raise ValueError(f"trainer_ranks must be \"ring\" or \"worker\", not "
                             f"{trainer_ranks!r}")
        self.head_groups = head_groups
        self.head_group_rings = head_group_rings
        self.trainer_ranks = trainer_ranks
        self.max_sessions = max_sessions
        self.idle_timeout = float(idle_timeout)
        self.name = name
        self.step_timeout = float(step_timeout)
        self.ttl = float(ttl)
        self.no_queue = bool(no_queue)
        self.arrival_timeout = float(arrival_timeout)
        self._lock = threading.Lock()
        # (kind, pointer, token) a finalizer could not release at once
        self._pending: List[Tuple[str, ctypes.c_void_p, Optional[int]]] = []
        self._pending_lock = threading.Lock()
        self._kept = 0
        # open jobs' pointers -> whether they count as kept
        self._ptrs: Dict[Optional[int], bool] = {}
        # open sessions' pointer values -> (token, pointer)
        self._session_ptrs: Dict[Optional[int], Tuple[int, ctypes.c_void_p]] = {}
        self._cache: Optional["_Cache"] = None  # whole-sequence calls' sessions (session._Cache)
        # a torch.distributed group -> its sharded calls' _Cache
        self._group_caches: Dict[Any, "_Cache"] = {}
        self._group_caches_lock = threading.Lock()
        self._pid = os.getpid()
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
        self.closed = False
        _clients.add(self)

    # ---- locking ---------------------------------------------------------

    def _drain_locked(self) -> None:
        while True:
            with self._pending_lock:
                if not self._pending:
                    return
                kind, ptr, token = self._pending.pop()
            if kind == "job":
                self._release_locked(ptr)
            else:
                self._close_session_locked(ptr, token)

    def _unlock(self) -> None:
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

    def _locked(self, fn: Callable[[], _T]) -> _T:
        if self.closed:
            raise RuntimeError("stria client is closed")
        self._lock.acquire()
        try:
            if self.closed:
                raise RuntimeError("stria client is closed")
            return fn()
        finally:
            self._unlock()

    def _release_locked(self, ptr: ctypes.c_void_p) -> None:
        if ptr.value in self._ptrs:
            if self._ptrs.pop(ptr.value):
                self._kept -= 1
            _lib.lib().stria_client_release(ptr)

    def _release_ptr(self, ptr: ctypes.c_void_p) -> None:
        """A Job's finalizer: any thread, maybe one that holds the lock."""
        self._queue("job", ptr, None)

    def _queue_close(self, ptr: ctypes.c_void_p, token: int) -> None:
        """A Session's finalizer: any thread, maybe one that holds the lock."""
        self._queue("session", ptr, token)

    def _queue(self, kind: str, ptr: ctypes.c_void_p, token: Optional[int]) -> None:
        if self.closed:
            return
        with self._pending_lock:
            self._pending.append((kind, ptr, token))
        if self._lock.acquire(blocking=False):
            self._unlock()

    # ---- sessions ----------------------------------------------------------

    def _open_session_locked(self, spec: _lib.SessionSpec, into: Optional["Session"] = None
                             ) -> "Session":
        """Opens a session (the lock held); `into`: the Session to fill in
        (stria.Session's constructor), else a new one."""
        ptr = ctypes.c_void_p()
        _lib.check(_lib.lib().stria_session_open(self._ptr, ctypes.byref(spec),
                                                 ctypes.byref(ptr)))
        return self._adopt_locked(ptr, into, spec.max_batch, spec.max_seq_len, spec.heads,
                                  spec.kv_heads or spec.heads, spec.head_dim, spec.dtype,
                                  spec.sharded)

    def _import_session_locked(self, data: bytes, **info: Any) -> "Session":
        ptr = ctypes.c_void_p()
        _lib.check(_lib.lib().stria_session_import(self._ptr, data, len(data),
                                                   ctypes.byref(ptr)))
        return self._adopt_locked(ptr, None, **info)

    def _adopt_locked(self, ptr: ctypes.c_void_p, into: Optional["Session"], *args: Any,
                      **kw: Any) -> "Session":
        from .session import Session

        try:
            s = (into if into is not None else Session._blank())._setup(self, ptr, *args, **kw)
        except BaseException:
            _lib.lib().stria_session_close(ptr)
            raise
        self._session_ptrs[ptr.value] = (s._token, ptr)
        return s

    def _close_session_locked(self, ptr: ctypes.c_void_p, token: Optional[int]) -> None:
        if self._session_ptrs.get(ptr.value, (None,))[0] == token:
            del self._session_ptrs[ptr.value]
            _lib.lib().stria_session_close(ptr)  # frees the handle whatever it says

    def import_session(self, data: bytes) -> "Session":
        """A Session from another process's ``Session.export()`` bytes (a
        sharded session's other ranks).

        Arguments:
            data: the bytes of Session.export() (another rank's).
        Returns:
            the Session, open on this client.
        """
        from .session import Session

        info, raw = Session._parse_export(data)
        return self._locked(lambda: self._import_session_locked(raw, **info))

    def _whole_cache(self) -> "_Cache":
        if self._cache is None:
            from .session import _Cache

            self._cache = _Cache(self.max_sessions, evict_on_busy=True)
        return self._cache

    def _group_cache(self, group: Any) -> "_Cache":
        """The sharded sessions' cache of a torch.distributed group."""
        with self._group_caches_lock:
            c = self._group_caches.get(group)
            if c is None:
                from .session import _Cache

                c = self._group_caches[group] = _Cache(self.max_sessions)
            return c

    def _on_session(self, fixed: Tuple[Any, ...], batch: int, seq_len: int,
                    open_spec: Callable[[int, int], _lib.SessionSpec],
                    fn: Callable[["Session"], _T]) -> _T:
        """fn(session) on the cached whole-sequence session for `fixed`
        covering the call (opened with open_spec(max_batch, max_seq_len)
        when none does), all under the lock."""
        cache = self._whole_cache()

        def open_fn(mb: int, msl: int, no_queue: bool) -> "Session":
            from ._errors import NoMemoryError

            def opened(b: int, s: int) -> "Session":
                spec = open_spec(b, s)
                spec.no_queue = spec.no_queue or no_queue
                return self._open_session_locked(spec)

            try:
                return opened(mb, msl)
            except NoMemoryError:
                if mb * msl <= batch * seq_len:
                    raise
            # the rounded bounds are beyond the workers' memory: the call's own
            return opened(batch, seq_len)

        def run() -> _T:
            s = cache.session(fixed, batch, seq_len, open_fn, lambda s: s._close_locked())
            return fn(s)

        return self._locked(run)

    @property
    def sessions(self) -> List["Session"]:
        """The open sessions the client keeps for calls (whole-sequence and
        sharded; not the stria.Session objects opened through it)."""
        out: List["Session"] = []
        for cache in [self._cache, *list(self._group_caches.values())]:
            if cache is not None:
                out += cache.open_sessions()
        return out

    @property
    def open_session_ids(self) -> List[int]:
        """The service's ids of every open session of this client (cached
        or explicit)."""
        L = _lib.lib()
        return self._locked(lambda: [int(L.stria_session_id(p))
                                     for _, p in self._session_ptrs.values()])

    # ---- calls -----------------------------------------------------------

    def _may_keep(self) -> bool:
        return self._kept < self.keep_jobs

    def forward(self, spec: _lib.JobSpec, q: _Buf, k: _Buf, v: _Buf, o: _Buf, lse: _Buf,
                keep: bool, stats: Optional[_lib.CallStats] = None) -> Optional[Job]:
        """One forward call (addresses of contiguous host buffers). Returns a
        Job when keep is true, else releases the job and returns None.

        Arguments:
            spec: the job's stria_job_spec_t.
            q, k, v: the inputs' addresses; o, lse: the outputs'.
            keep: hold the job on the service for backward.
            stats: a CallStats to fill in, or None.
        Returns:
            the Job (keep), else None.
        """
        L = _lib.lib()

        def call() -> Optional[ctypes.c_void_p]:
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

    def _open(self, make: Callable[[ctypes.CDLL, Any], int], keep: bool) -> Job:
        """A Job from make(L, &ptr) (a sharded job's handle); keep: it counts
        against keep_jobs until released."""
        def call() -> ctypes.c_void_p:
            ptr = ctypes.c_void_p()
            _lib.check(make(_lib.lib(), ctypes.byref(ptr)))
            self._ptrs[ptr.value] = bool(keep)
            self._kept += bool(keep)
            return ptr

        return Job(self, self._locked(call))

    def submit(self, spec: _lib.JobSpec, keep: bool = False) -> Job:
        """Submits a sharded job (spec.ring_size ranks, a named layout) and
        returns its Job once its workers are reserved; nothing runs yet.

        Arguments:
            spec: the job's stria_job_spec_t.
            keep: the job counts against keep_jobs until released.
        Returns:
            the Job.
        """
        return self._open(lambda L, out: L.stria_client_submit(self._ptr, ctypes.byref(spec),
                                                               out), keep)

    def import_job(self, data: bytes, keep: bool = False) -> Job:
        """Opens a sharded job from another process's Job.export() bytes.

        Arguments:
            data: the bytes of Job.export() (another rank's).
            keep: the job counts against keep_jobs until released.
        Returns:
            the Job.
        """
        data = bytes(data)
        return self._open(lambda L, out: L.stria_job_import(self._ptr, data, len(data), out),
                          keep)

    def close(self) -> None:
        """Closes every session, releases every open job and closes the
        connection (idempotent). In a process forked from the one that
        connected, it only forgets them (they are the parent's)."""
        if self.closed:
            return
        with self._lock:
            if self.closed:
                return
            self.closed = True
            L = _lib.lib()
            if os.getpid() == self._pid:
                for _, ptr in list(self._session_ptrs.values()):
                    L.stria_session_close(ptr)
            self._session_ptrs.clear()
            for cache in [self._cache, *self._group_caches.values()]:
                if cache is not None:
                    cache.forget()
            self._ptrs.clear()
            if os.getpid() == self._pid:
                L.stria_client_close(self._ptr)

    @property
    def jobs_kept(self) -> int:
        """Jobs held open for backward now."""
        return self._kept

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"stria.Client({self.coordinator!r}{', closed' if self.closed else ''})"


_clients: "weakref.WeakSet[Client]" = weakref.WeakSet()  # every connected client, closed at exit
_default: Optional[Client] = None
_default_lock = threading.Lock()


def default_client() -> Client:
    """The client that calls without ``client=`` use: made on first use from
    the environment (STRIA_COORDINATOR, STRIA_TOKEN_FILE), closed at exit."""
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            _default = Client()
        return _default


def set_default_client(client: Optional[Client]) -> Optional[Client]:
    """Makes `client` (or None: a fresh one from the environment on next
    use) the default; returns the previous one (not closed).

    Arguments:
        client: the new default Client, or None.
    Returns:
        the previous default Client, or None.
    """
    global _default
    with _default_lock:
        prev, _default = _default, client
        return prev


#: How long interpreter exit waits for the clients to close their sessions
#: (closing tells the coordinator, which libstria waits for while it is out
#: of reach; the service closes an abandoned session at its idle timeout).
EXIT_CLOSE_S = 10.0


@atexit.register
def _close_all() -> None:
    """At exit: every client's sessions closed, its connection too, on a
    daemon thread given EXIT_CLOSE_S."""
    clients = [c for c in list(_clients) if not c.closed]
    if not clients:
        return

    def close() -> None:
        for c in clients:
            try:
                c.close()
            except Exception:
                pass

    try:
        t = threading.Thread(target=close, name="stria-exit", daemon=True)
        t.start()
    except RuntimeError:  # no new threads at this point of the shutdown
        close()
        return
    t.join(EXIT_CLOSE_S)
