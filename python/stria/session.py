"""Sessions: a ring opened once on the service and used for many calls.

A session fixes the ring (its size and layout), the dtype, the heads and the
head size, and bounds a call's batch and length; a call names its own shape
within the bounds and its own masks (causal, scale, window, documents). The
backward call brings what autograd keeps anyway (Q, K, V, O, LSE, dO), so
nothing is held on the workers between calls and the forward runs once.

``stria.Session`` is the explicit form. ``stria.attention``, the
flash_attn-compatible calls, the Hugging Face registration and
``stria.sharded_attention`` open sessions through their ``Client`` on first
use and reuse them (the client's session cache, ``_Cache`` below).
"""

import collections
import ctypes
import itertools
import struct
import threading
import weakref
from typing import (TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple,
                    TypeVar, Union)

import torch

from . import _lib
from ._errors import BusyError
from ._tensors import _DTYPES, _TORCH_DTYPES, _back, _empty, _host, _ptr

if TYPE_CHECKING:
    from .client import Client

_T = TypeVar("_T")

#: The fewest tokens (batch * seq_len) the sessions a client opens for its
#: calls are bounded by: bounds are rounded up to a power of two, at least
#: this, so that short calls and the lengths of a run share sessions.
MIN_TOKENS = 4096

# Session.export(): this header, then libstria's export. The header carries
# what the session fixes, so that an importing process checks its tensors
# against it (libstria reads the caller's buffers by the session's shapes).
_EXPORT_MAGIC = b"stS1"
_EXPORT_HEADER = struct.Struct("<4sqqqqqi?3x")


def _pow2(n: int) -> int:
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def rounded_bounds(batch: int, seq_len: int) -> Tuple[int, int]:
    """(max_batch, max_seq_len) of the session the cache opens for a call:
    the batch rounded up to a power of two, and the tokens (batch *
    seq_len) rounded up to a power of two, at least MIN_TOKENS."""
    mb = _pow2(batch)
    tokens = max(_pow2(batch * seq_len), MIN_TOKENS, mb)
    return mb, tokens // mb


def make_call(batch: int, seq_len: int, causal: bool, scale: Optional[float],
              window: Optional[Tuple[int, ...]], cu_seqlens: Optional[Sequence[int]]
              ) -> Tuple[_lib.Call, Any]:
    """A stria_call_t and the ctypes array it points to (keep both alive
    during the call)."""
    c = _lib.Call()
    c.struct_size = ctypes.sizeof(c)
    c.batch, c.seq_len = int(batch), int(seq_len)
    c.causal = bool(causal)
    c.scale = scale if scale is not None else 0.0
    arr = None
    if cu_seqlens is not None:
        arr = (ctypes.c_int64 * len(cu_seqlens))(*cu_seqlens)
        c.cu_seqlens = arr
        c.n_cu_seqlens = len(cu_seqlens)
    if window is not None:
        c.has_window = True
        c.window_left, c.window_right = window
    return c, arr


def make_spec(client: "Client", *, max_batch: int, max_seq_len: int, heads: int, kv_heads: int,
              head_dim: int, dtype: int, layout: int, ring_size: int, sharded: bool,
              idle_timeout: Optional[float] = None, label: Optional[str] = None,
              head_groups: Union[int, str] = 0, head_group_rings: str = "inside",
              trainer_ranks: int = 0) -> _lib.SessionSpec:
    """A stria_session_spec_t with the client's deadlines and queueing
    (dtype and layout as libstria's numbers); the label's bytes are kept on
    the returned object."""
    s = _lib.SessionSpec()
    s.struct_size = ctypes.sizeof(s)
    s.max_batch, s.max_seq_len = int(max_batch), int(max_seq_len)
    s.heads, s.kv_heads, s.head_dim = int(heads), int(kv_heads), int(head_dim)
    s.dtype, s.layout, s.ring_size, s.sharded = dtype, layout, int(ring_size), bool(sharded)
    s.head_groups = _lib.HEAD_GROUPS_AUTO if head_groups == "auto" else int(head_groups)
    s.head_group_rings = _group_rings(head_group_rings)
    s.trainer_ranks = int(trainer_ranks)
    s.idle_timeout_s = client.idle_timeout if idle_timeout is None else float(idle_timeout)
    s.step_timeout_s = client.step_timeout
    s.arrival_timeout_s = client.arrival_timeout
    s.no_queue = client.no_queue
    s._label = (label if label is not None else client.name + " session").encode()
    s.label = s._label
    return s


def _group_rings(name: str) -> int:
    """head_group_rings as libstria's number: "inside" or "across"."""
    if name not in _lib.GROUP_RINGS:
        raise ValueError(f"stria: head_group_rings must be \"inside\" or \"across\", not "
                         f"{name!r}")
    return _lib.GROUP_RINGS[name]


def _check_head_groups(head_groups: Union[int, str], kv_heads: Optional[int],
                       ring_size: int) -> None:
    """head_groups as libstria takes it (libstria checks it again, with the
    same words): "auto", or an int >= 0 dividing kv_heads and ring_size."""
    if head_groups == "auto":
        return
    if not isinstance(head_groups, int) or isinstance(head_groups, bool) or head_groups < 0:
        raise ValueError(f"stria: head_groups must be \"auto\" or an int >= 0, not "
                         f"{head_groups!r}")
    if head_groups <= 1:
        return
    if kv_heads is not None and kv_heads % head_groups:
        raise ValueError(f"stria: head_groups {head_groups} must divide kv_heads {kv_heads} "
                         f"(a GQA group of query heads stays whole)")
    if ring_size < 1 or ring_size % head_groups:
        raise ValueError(f"stria: head_groups {head_groups} needs ring_size, a multiple of it "
                         f"(head_groups x the ranks of each ring; got {ring_size})")


_tokens = itertools.count(1)


def _close_later(client_ref: "weakref.ref[Client]", ptr: ctypes.c_void_p, token: int) -> None:
    """A Session's finalizer: closes its handle through the client (at once
    when its lock is free, else by the thread that holds it)."""
    client = client_ref()
    if client is not None:
        client._queue_close(ptr, token)


def _forward_tensors(run: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """run(q, k, v, o, lse) on host buffers (addresses); (O, LSE) on q's
    device."""
    qh, kh, vh = _host(q), _host(k), _host(v)
    B, T, H, _ = q.shape
    o = _empty(qh.shape, q.dtype, q.device)
    lse = _empty((B, H, T), torch.float32, q.device)
    run(_ptr(qh), _ptr(kh), _ptr(vh), _ptr(o), _ptr(lse))
    return _back(o, q.device), _back(lse, q.device)


def _backward_tensors(run: Callable[..., Any], q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """run(q, k, v, o, lse, dO, dQ, dK, dV) on host buffers; (dQ, dK, dV) on
    the inputs' devices."""
    hosts = [_host(t) for t in (q, k, v, o, lse, do)]
    dq = _empty(q.shape, q.dtype, q.device)
    dk = _empty(k.shape, k.dtype, k.device)
    dv = _empty(v.shape, v.dtype, v.device)
    run(*(_ptr(t) for t in hosts), _ptr(dq), _ptr(dk), _ptr(dv))
    del hosts
    return _back(dq, q.device), _back(dk, k.device), _back(dv, v.device)


class Session:
    """A session on the stria service: one ring opened once (the
    coordinator admits it, the workers allocate its buffers and connect its
    links), then calls that cost one request per rank.

    ``stria.Session(heads=8, head_dim=128, max_seq_len=32768)`` opens one
    (through ``client``, default ``stria.default_client()``): heads,
    kv_heads (default heads), head_dim and dtype fixed; a call's batch at most
    max_batch and its batch * seq_len at most max_batch * max_seq_len;
    layout "striped" (default), "contiguous", "zigzag", "packed" (each
    call's documents placed by their work; a sharded rank's tokens then come
    from stria.shard_positions with the call's cu_seqlens) or "auto" (the
    service chooses); ring_size ranks (0:
    every healthy worker); sharded: calls come from ``ranks`` processes
    (ring_size / head_groups), one rank each (open it in one, hand
    ``export()`` to the others, ``Client.import_session``); idle_timeout: the service closes it after
    this long without a call (0: 60 s; libstria opens it again on the next
    call); label: what striactl shows. head_groups G (0 or 1: none): G
    rings of ring_size / G ranks, ring g computing query heads
    [g H/G, (g+1) H/G) and their kv heads, a call's upload sending each
    group's heads to its ring (head parallelism, its all-to-all done by
    the upload); G divides kv_heads and ring_size (required). Sharded with
    G groups: ring_size / G trainer ranks, rank j passing ring rank j's
    tokens with all their heads (``shard_tokens``/``positions`` over
    ``ranks``), each group's heads going to worker j of its ring; no
    ``empty()`` buffers then. head_groups "auto": one group per host of the ring when
    the hosts hold equal shares and divide kv_heads, else 1 (``head_groups``
    then says which). head_group_rings: where the G rings lie: "inside"
    (default: ring g on the next ring_size / G workers of the service's
    ring, which lists workers host by host, so with one host per group
    no ring byte crosses hosts) or "across" (ring rank j of every ring on
    host j, each ring spanning the hosts: a sharded trainer whose rank j
    runs on host j then uploads to its own host only); with "auto", one
    group per host ("inside") or per worker of a host ("across").
    trainer_ranks (sharded, striped, with G groups): 0 (default) for the
    ring_size / G ranks above, or ring_size for one trainer rank per
    worker (Transformer Engine's a2a+p2p layout): rank t = h G + l holds
    stripe l (ring_size / G) + h of a striping over ring_size
    (``positions``, or ``stria.shard(..., head_groups=G)``) and each
    group's heads of it go to worker h of that group's ring; with
    head_group_rings "across" and rank t on host t // G, every upload
    stays on its host.

    ``forward``/``backward`` (whole sequences) and
    ``forward_shard``/``backward_shard`` (a sharded session's rank) take
    torch tensors (CPU or CUDA, any strides) and return new ones; backward
    takes the forward's O and LSE, so the forward never runs again. Calls
    on one session run one at a time (the client's lock). ``close()`` frees
    the workers' memory; it also happens when the object is garbage
    collected, when its client closes and at interpreter exit.
    """

    _parent: Optional["Session"] = None  # a head group's ring: the session it is borrowed from

    def __init__(self, *, heads: int, head_dim: int, max_seq_len: int, max_batch: int = 1,
                 kv_heads: Optional[int] = None, dtype: torch.dtype = torch.bfloat16,
                 layout: str = "striped", ring_size: int = 0, sharded: bool = False,
                 idle_timeout: float = 0.0, label: Optional[str] = None,
                 client: Optional["Client"] = None, head_groups: Union[int, str] = 0,
                 head_group_rings: str = "inside", trainer_ranks: int = 0) -> None:
        from .client import default_client

        if dtype not in _DTYPES:
            raise TypeError(f"stria: dtype {dtype} is not supported (float32, bfloat16, "
                            f"float16)")
        if layout not in _lib.LAYOUTS:
            raise ValueError(f"stria: unknown layout {layout!r} (expected one of "
                             f"{', '.join(_lib.LAYOUTS)})")
        kv_heads = heads if kv_heads is None else kv_heads
        for name, val in (("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim),
                          ("max_seq_len", max_seq_len), ("max_batch", max_batch)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"stria: {name} must be an int >= 1, not {val!r}")
        if not isinstance(ring_size, int) or ring_size < 0:
            raise ValueError(f"stria: ring_size must be an int >= 0, not {ring_size!r}")
        _check_head_groups(head_groups, kv_heads, ring_size)
        if not isinstance(trainer_ranks, int) or isinstance(trainer_ranks, bool) or \
                trainer_ranks < 0:
            raise ValueError(f"stria: trainer_ranks must be an int >= 0, not {trainer_ranks!r}")
        client = client if client is not None else default_client()
        spec = make_spec(client, max_batch=max_batch, max_seq_len=max_seq_len, heads=heads,
                         kv_heads=kv_heads, head_dim=head_dim, dtype=_DTYPES[dtype],
                         layout=_lib.LAYOUTS[layout], ring_size=ring_size, sharded=sharded,
                         idle_timeout=idle_timeout, label=label, head_groups=head_groups,
                         head_group_rings=head_group_rings, trainer_ranks=trainer_ranks)
        client._locked(lambda: client._open_session_locked(spec, self))

    # ---- construction (Client) ----------------------------------------------

    def _setup(self, client: "Client", ptr: ctypes.c_void_p, max_batch: int, max_seq_len: int,
               heads: int, kv_heads: int, head_dim: int, dtype: int, sharded: bool
               ) -> "Session":
        """Fills in an opened or imported handle (dtype: libstria's number);
        the client registers it."""
        L = _lib.lib()
        self._client = client
        self._ptr = ptr
        self._token = next(_tokens)
        self.max_batch, self.max_seq_len = int(max_batch), int(max_seq_len)
        self.heads, self.kv_heads, self.head_dim = int(heads), int(kv_heads), int(head_dim)
        self.dtype = _TORCH_DTYPES[int(dtype)]
        self.sharded = bool(sharded)
        self.ring_size = int(L.stria_session_ring_size(ptr))
        self.ranks = int(L.stria_session_ranks(ptr))
        fixed = _lib.SessionSpec()
        fixed.struct_size = ctypes.sizeof(fixed)
        self.head_groups = max(1, int(fixed.head_groups)) \
            if L.stria_session_spec_get(ptr, ctypes.byref(fixed)) == 0 else 1
        self.layout = _lib.LAYOUT_NAMES.get(int(L.stria_session_layout(ptr)), "unknown")
        self._id = int(L.stria_session_id(ptr))
        self._finalizer = weakref.finalize(self, _close_later, weakref.ref(client), ptr,
                                           self._token)
        self._finalizer.atexit = False  # the client closes it at exit (client._close_all)
        return self

    @classmethod
    def _blank(cls) -> "Session":
        return cls.__new__(cls)

    # ---- state --------------------------------------------------------------

    @property
    def client(self) -> "Client":
        """The Client the session was opened through."""
        return self._client

    @property
    def alive(self) -> bool:
        """Open (not closed, nor its client)."""
        if self._parent is not None:  # a head group's ring lives as long as its session
            return self._parent.alive
        c = self._client
        return not c.closed and c._session_ptrs.get(self._ptr.value, (None,))[0] == self._token

    def _check_alive(self) -> None:
        if not self.alive:
            raise RuntimeError(f"stria session {self._id} is closed")

    @property
    def id(self) -> int:
        """The session's id at the service (its job's id; a session opened
        anew, after it expired or for a retry, has a new one)."""
        if self.alive:
            self._id = int(_lib.lib().stria_session_id(self._ptr))
        return self._id

    def covers(self, batch: int, seq_len: int) -> bool:
        """Whether a call of `batch` rows of `seq_len` tokens is within the
        bounds."""
        return batch <= self.max_batch and batch * seq_len <= self.max_batch * self.max_seq_len

    def _call(self, fn: Callable[[ctypes.CDLL], _T]) -> _T:
        """fn(L) under the client's lock, on an open handle."""
        def run() -> _T:
            self._check_alive()
            return fn(_lib.lib())
        return self._client._locked(run)

    def stats(self) -> Dict[str, Any]:
        """What the session did so far (stria_session_stats_t as a dict)."""
        st = _lib.SessionStats()
        st.struct_size = ctypes.sizeof(st)
        self._call(lambda L: _lib.check(L.stria_session_stats(self._ptr, ctypes.byref(st))))
        return {name: getattr(st, name)  # type: ignore[misc]
                for name, _ in st._fields_ if name != "struct_size"}

    def head_group(self, g: int) -> "Session":
        """Ring g of a session of head groups: a Session of heads / G and
        kv_heads / G over ring_size / G ranks, borrowed from this one (it
        lives and closes with it; its own close() does nothing). A
        tensor-parallel x context-parallel trainer's rank (j, g), holding
        ring rank j's tokens of head group g, calls it as rank j with its
        own heads (``forward_shard``/``backward_shard``): nothing is routed.
        """
        G = self.head_groups
        if not isinstance(g, int) or isinstance(g, bool) or not 0 <= g < max(G, 1) or G < 2:
            raise ValueError(f"stria: head group {g!r} of session {self._id} (head_groups {G})")
        ptr = self._call(lambda L: L.stria_session_head_group(self._ptr, g))
        view = Session._blank()
        view._setup(self._client, ctypes.c_void_p(ptr), self.max_batch, self.max_seq_len,
                    self.heads // G, self.kv_heads // G, self.head_dim, _DTYPES[self.dtype],
                    self.sharded)
        view._finalizer.detach()
        view._parent = self
        return view

    def close(self) -> None:
        """Closes the session (idempotent): the workers free its memory."""
        if self._parent is not None:
            return  # a head group's ring: its session closes it
        c = self._client
        if c.closed:
            self._finalizer.detach()
            return
        c._locked(lambda: self._close_locked())

    def _close_locked(self) -> None:
        self._finalizer.detach()
        self._client._close_session_locked(self._ptr, self._token)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "" if self.alive else ", closed"
        kind = "sharded " if self.sharded else ""
        return (f"<stria.Session {self._id}: {kind}{self.ring_size} ranks {self.layout}, "
                f"{str(self.dtype).replace('torch.', '')} h{self.heads}/{self.kv_heads} "
                f"d{self.head_dim}, batch <= {self.max_batch}, tokens <= "
                f"{self.max_batch * self.max_seq_len}{state}>")

    # ---- export / import ----------------------------------------------------

    def _raw_export(self) -> bytes:
        """libstria's export (stria_session_export)."""
        buf = ctypes.create_string_buffer(_lib.SESSION_EXPORT_MAX_BYTES)
        n = ctypes.c_size_t()
        self._call(lambda L: _lib.check(L.stria_session_export(self._ptr, buf, len(buf),
                                                               ctypes.byref(n))))
        return buf.raw[:n.value]

    def export(self) -> bytes:
        """Bytes for ``Client.import_session`` in the trainer's other
        processes (a sharded session's ranks). They hold the session's
        secret: hand them only to the trainer's own processes."""
        raw = self._raw_export()
        head = _EXPORT_HEADER.pack(_EXPORT_MAGIC, self.max_batch, self.max_seq_len, self.heads,
                                   self.kv_heads, self.head_dim, _DTYPES[self.dtype],
                                   self.sharded)
        return head + raw

    @staticmethod
    def _parse_export(data: bytes) -> Tuple[Dict[str, Any], bytes]:
        data = bytes(data)
        if len(data) <= _EXPORT_HEADER.size or data[:4] != _EXPORT_MAGIC:
            raise ValueError("stria: not a Session.export() of this package")
        magic, mb, msl, h, hkv, d, dt, sharded = _EXPORT_HEADER.unpack_from(data)
        return dict(max_batch=mb, max_seq_len=msl, heads=h, kv_heads=hkv, head_dim=d, dtype=dt,
                    sharded=sharded), data[_EXPORT_HEADER.size:]

    # ---- sharded sessions: which tokens a rank holds ------------------------

    def shard_tokens(self, seq_len: int, rank: int) -> int:
        """How many tokens ring rank `rank` holds in a call of `seq_len`."""
        n = self._call(lambda L: int(L.stria_session_shard_tokens(self._ptr, int(seq_len),
                                                                  int(rank))))
        if n < 0:
            raise ValueError(f"stria: rank {rank} or seq_len {seq_len} outside session "
                             f"{self._id} (rings of {self.ranks})")
        return n

    def positions(self, seq_len: int, rank: int) -> torch.Tensor:
        """The global positions of rank `rank`'s tokens in a call of
        `seq_len`, in its order (int64)."""
        out = torch.empty(self.shard_tokens(seq_len, rank), dtype=torch.int64)
        self._call(lambda L: _lib.check(L.stria_session_positions(
            self._ptr, int(seq_len), int(rank), ctypes.c_void_p(out.data_ptr()))))
        return out

    # ---- the arena: tensors built where the workers read them ----------------

    _TENSORS = {"q": 1, "k": 2, "v": 3, "do": 4, "o": 5, "lse": 6, "dq": 7, "dk": 8, "dv": 9}

    def empty(self, tensor: str, *, rank: int, seq_len: int, batch: int = 1) -> torch.Tensor:
        """A sharded session's rank `rank`'s tensor for calls of `batch` x
        `seq_len`, in the rank's arena (memory of this process the rank's
        worker on this host maps): build Q, K, V (and dO) there and the calls
        given these tensors move none of their bytes; a forward's O and LSE
        land where a backward of the same shape reads them.

        Arguments:
            tensor: "q", "k", "v", "do" (inputs), "o", "lse" (the forward's
                outputs, the backward's inputs), "dq", "dk", "dv".
            rank: this process's ring rank (its first use opens the rank on
                its worker: every rank must).
            seq_len: the calls' global sequence length.
            batch: the calls' batch size.
        Returns:
            A CPU tensor of the session's dtype (LSE float32): (batch,
            shard_tokens, nheads or nheads_k, headdim), LSE (batch, nheads,
            shard_tokens). Valid until the session is closed or opened anew;
            its contents are whatever the last call left.
        Raises:
            StriaError (STRIA_ERR_UNSUPPORTED) when the rank's worker is not on
            this host or offers no arena (the message says why), or the
            session is whole-sequence.
        """
        if tensor not in self._TENSORS:
            raise ValueError(f"stria: tensor {tensor!r} is none of "
                             f"{', '.join(self._TENSORS)}")
        if not self.covers(batch, seq_len):
            raise ValueError(f"stria: a call of batch {batch} x {seq_len} tokens is beyond "
                             f"session {self._id}'s bounds")
        call, arr = make_call(batch, seq_len, True, None, None, None)
        buf = _lib.ShardBuffer()
        buf.struct_size = ctypes.sizeof(buf)
        self._call(lambda L: _lib.check(L.stria_session_buffer(
            self._ptr, ctypes.byref(call), int(rank), self._TENSORS[tensor], ctypes.byref(buf))))
        del arr
        n = int(buf.tokens)
        lse = tensor == "lse"
        dtype = torch.float32 if lse else self.dtype
        heads = self.kv_heads if tensor in ("k", "v", "dk", "dv") else self.heads
        shape = (batch, self.heads, n) if lse else (batch, n, heads, self.head_dim)
        count = batch * n * (self.heads if lse else heads * self.head_dim)
        size = torch.empty((), dtype=dtype).element_size()
        raw = (ctypes.c_char * max(count * size, 1)).from_address(int(buf.data or 0))
        t = torch.frombuffer(raw, dtype=dtype, count=count) if count > 0 else \
            torch.empty(0, dtype=dtype)
        out = t.view(shape)
        out._stria_session = self  # the arena outlives the view
        return out

    # ---- calls ----------------------------------------------------------------

    def _check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: Optional[int] = None,
               seq_len: Optional[int] = None) -> Tuple[int, int]:
        """The tensors against what the session fixes (libstria reads the
        buffers by the session's shapes); (batch, seq_len) of the call."""
        from .attention import _check_shapes

        _check_shapes(q, k, v, tokens="sequence length" if rank is None else
                      "number of tokens")
        B, T, H, D = q.shape
        if q.dtype != self.dtype:
            raise TypeError(f"stria: session {self._id} is {self.dtype}, the tensors "
                            f"{q.dtype}")
        if (H, k.shape[2], D) != (self.heads, self.kv_heads, self.head_dim):
            raise ValueError(f"stria: session {self._id} has heads {self.heads}, kv_heads "
                             f"{self.kv_heads}, head_dim {self.head_dim}; the tensors {H}, "
                             f"{k.shape[2]}, {D}")
        if (rank is None) == self.sharded:
            use = ("sharded: use forward_shard/backward_shard" if self.sharded else
                   "whole-sequence: use forward/backward")
            raise ValueError(f"stria: session {self._id} is {use}")
        S = T if rank is None else seq_len
        if not isinstance(S, int) or S < 1:
            raise ValueError(f"stria: seq_len must be an int >= 1, not {S!r}")
        if not self.covers(B, S):
            raise ValueError(f"stria: a call of batch {B} x {S} tokens is beyond session "
                             f"{self._id}'s bounds (batch <= {self.max_batch}, batch * "
                             f"seq_len <= {self.max_batch * self.max_seq_len})")
        if rank is not None:
            want = self.shard_tokens(S, rank)
            if T != want:
                raise ValueError(f"stria: rank {rank} passes {T} tokens, it holds {want} of "
                                 f"{S} in session {self._id}")
        return B, S

    def _check_outputs(self, q: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                       do: torch.Tensor) -> None:
        B, T, H, _ = q.shape
        for name, t in (("o", o), ("do", do)):
            if not isinstance(t, torch.Tensor) or t.shape != q.shape or t.dtype != q.dtype:
                raise ValueError(f"stria: {name} must be a {q.dtype} tensor of q's shape "
                                 f"{tuple(q.shape)}")
        if not isinstance(lse, torch.Tensor) or lse.shape != (B, H, T) or \
                lse.dtype != torch.float32:
            raise ValueError(f"stria: lse must be a float32 tensor of shape {(B, H, T)}")

    @staticmethod
    def _options(causal: bool, softmax_scale: Optional[float], window_size: Sequence[int],
                 cu_seqlens: Union[torch.Tensor, Sequence[int], None]
                 ) -> Tuple[bool, Optional[float], Optional[Tuple[int, int]],
                            Optional[Tuple[int, ...]]]:
        from .attention import _cu_seqlens, _scale, _window

        return (bool(causal), _scale(softmax_scale), _window(window_size, bool(causal)),
                _cu_seqlens(cu_seqlens))

    # The _locked calls: the client's lock held, the handle open; pointers
    # of contiguous host buffers of the call's shape.

    def _forward_locked(self, call: _lib.Call, q: Any, k: Any, v: Any, o: Any, lse: Any) -> None:
        _lib.check(_lib.lib().stria_session_forward(self._ptr, ctypes.byref(call), q, k, v, o,
                                                    lse))

    def _backward_locked(self, call: _lib.Call, q: Any, k: Any, v: Any, o: Any, lse: Any,
                         do: Any, dq: Any, dk: Any, dv: Any) -> None:
        _lib.check(_lib.lib().stria_session_backward(self._ptr, ctypes.byref(call), q, k, v,
                                                     o, lse, do, dq, dk, dv))

    def _forward_shard_locked(self, call: _lib.Call, rank: int, q: Any, k: Any, v: Any, o: Any,
                              lse: Any) -> None:
        _lib.check(_lib.lib().stria_session_forward_shard(self._ptr, ctypes.byref(call), rank,
                                                          q, k, v, o, lse))

    def _backward_shard_locked(self, call: _lib.Call, rank: int, q: Any, k: Any, v: Any,
                               o: Any, lse: Any, do: Any, dq: Any, dk: Any, dv: Any) -> None:
        _lib.check(_lib.lib().stria_session_backward_shard(
            self._ptr, ctypes.byref(call), rank, q, k, v, o, lse, do, dq, dk, dv))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                softmax_scale: Optional[float] = None, window_size: Sequence[int] = (-1, -1),
                cu_seqlens: Union[torch.Tensor, Sequence[int], None] = None
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        """A whole-sequence call: q [B, S, H, D], k, v [B, S, Hkv, D] in the
        session's dtype; returns (O [B, S, H, D], LSE [B, H, S] float32) on
        q's device. Options as in stria.attention. Not differentiable: pass
        O and LSE to backward.

        Arguments:
            q: (batch_size, seqlen, nheads, headdim)
            k: (batch_size, seqlen, nheads_k, headdim)
            v: (batch_size, seqlen, nheads_k, headdim)
            causal, softmax_scale, window_size, cu_seqlens: as in stria.attention.
        Returns:
            out: (batch_size, seqlen, nheads, headdim).
            softmax_lse: (batch_size, nheads, seqlen), float32.
        """
        B, S = self._check(q, k, v)
        call, arr = make_call(B, S, *self._options(causal, softmax_scale, window_size,
                                                   cu_seqlens))
        out = _forward_tensors(lambda *p: self._call(lambda L: self._forward_locked(call, *p)),
                               q, k, v)
        del arr
        return out

    def backward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                 lse: torch.Tensor, do: torch.Tensor, *, causal: bool = True,
                 softmax_scale: Optional[float] = None, window_size: Sequence[int] = (-1, -1),
                 cu_seqlens: Union[torch.Tensor, Sequence[int], None] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The backward of a forward call with the same tensors and options:
        returns (dQ, dK, dV).

        Arguments:
            q, k, v: the forward's inputs.
            o, lse: the forward's outputs.
            do: (batch_size, seqlen, nheads, headdim), the gradient of o.
            causal, softmax_scale, window_size, cu_seqlens: the forward's.
        Returns:
            dq, dk, dv: the shapes of q, k, v.
        """
        B, S = self._check(q, k, v)
        self._check_outputs(q, o, lse, do)
        call, arr = make_call(B, S, *self._options(causal, softmax_scale, window_size,
                                                   cu_seqlens))
        out = _backward_tensors(
            lambda *p: self._call(lambda L: self._backward_locked(call, *p)), q, k, v, o, lse,
            do)
        del arr
        return out

    def forward_shard(self, rank: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      seq_len: int, causal: bool = True, softmax_scale: Optional[float] = None,
                      window_size: Sequence[int] = (-1, -1),
                      cu_seqlens: Union[torch.Tensor, Sequence[int], None] = None
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Rank `rank`'s part of a sharded session's call over `seq_len`
        global tokens: its tokens only (``shard_tokens``/``positions``);
        every rank makes the same calls in the same order. Returns its
        (O, LSE) when every rank's pass is done.

        Arguments:
            rank: this process's ring rank.
            q: (batch_size, shard_tokens, nheads, headdim)
            k, v: (batch_size, shard_tokens, nheads_k, headdim)
            seq_len: the global sequence length.
            causal, softmax_scale, window_size, cu_seqlens: as in stria.attention.
        Returns:
            out: (batch_size, shard_tokens, nheads, headdim).
            softmax_lse: (batch_size, nheads, shard_tokens), float32.
        """
        B, S = self._check(q, k, v, rank, seq_len)
        call, arr = make_call(B, S, *self._options(causal, softmax_scale, window_size,
                                                   cu_seqlens))
        out = _forward_tensors(
            lambda *p: self._call(lambda L: self._forward_shard_locked(call, rank, *p)), q, k,
            v)
        del arr
        return out

    def backward_shard(self, rank: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor, *, seq_len: int,
                       causal: bool = True, softmax_scale: Optional[float] = None,
                       window_size: Sequence[int] = (-1, -1),
                       cu_seqlens: Union[torch.Tensor, Sequence[int], None] = None
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rank `rank`'s part of a sharded backward call: (dQ, dK, dV) of its
        tokens.

        Arguments:
            rank: this process's ring rank.
            q, k, v, o, lse: the forward_shard's inputs and outputs.
            do: the gradient of o.
            seq_len, causal, softmax_scale, window_size, cu_seqlens: the forward_shard's.
        Returns:
            dq, dk, dv: the shapes of q, k, v.
        """
        B, S = self._check(q, k, v, rank, seq_len)
        self._check_outputs(q, o, lse, do)
        call, arr = make_call(B, S, *self._options(causal, softmax_scale, window_size,
                                                   cu_seqlens))
        out = _backward_tensors(
            lambda *p: self._call(lambda L: self._backward_shard_locked(call, rank, *p)), q, k,
            v, o, lse, do)
        del arr
        return out


class _Cache:
    """The sessions a client opens for its calls: at most one per fixed part
    (kind, ring size, layout, dtype, heads, kv_heads, head_dim; a sharded
    call's group), at most `limit`, least recently used closed first.

    A call that its fixed part's session does not cover gets a new session
    bounded by both (the larger batch and the more tokens, rounded up: see
    rounded_bounds), and the old one is closed before the new one opens (the
    service may not have the memory for both). The caller holds `lock` (a
    whole-sequence cache: the client's lock; a group's: its own) across
    session() and its call, so that no session closes under a call.
    """

    def __init__(self, limit: int, evict_on_busy: bool = False) -> None:
        self.limit = limit
        self.evict_on_busy = evict_on_busy
        # fixed -> Session
        self.entries: "collections.OrderedDict[Any, Session]" = collections.OrderedDict()
        self.lock = threading.RLock()

    def session(self, fixed: Any, batch: int, seq_len: int,
                open_fn: Callable[[int, int, bool], Session],
                close_fn: Callable[[Session], Any]) -> Session:
        """The session for a call; open_fn(max_batch, max_seq_len, no_queue)
        opens one (no_queue: fail busy rather than wait, whatever the
        client says), close_fn(session) closes one.

        With evict_on_busy, a session is opened without queueing while the
        cache holds others, and when the service is busy the least recently
        used is closed and the open tried again: the memory the service
        would wait for may be this client's own sessions'. (A group's cache
        does not: its ranks' caches must stay the same, and only rank 0
        opens.)"""
        s = self.entries.get(fixed)
        if s is not None and s.alive and s.covers(batch, seq_len):
            self.entries.move_to_end(fixed)
            return s
        mb, msl = rounded_bounds(batch, seq_len)
        if s is not None:
            del self.entries[fixed]
            if s.alive:
                tokens = max(mb * msl, s.max_batch * s.max_seq_len)
                mb = max(mb, s.max_batch)
                msl = tokens // mb
                close_fn(s)
        while len(self.entries) >= self.limit:
            _, old = self.entries.popitem(last=False)
            if old.alive:
                close_fn(old)
        while True:
            others = self.evict_on_busy and bool(self.entries)
            try:
                s = open_fn(mb, msl, others)
                break
            except BusyError:
                if not others:
                    raise
                _, old = self.entries.popitem(last=False)
                if old.alive:
                    close_fn(old)
        self.entries[fixed] = s
        return s

    def drop(self, fixed: Any, close_fn: Callable[[Session], Any]) -> None:
        """Forgets (and closes) the session for `fixed`."""
        s = self.entries.pop(fixed, None)
        if s is not None and s.alive:
            close_fn(s)

    def open_sessions(self) -> List[Session]:
        return [s for s in self.entries.values() if s.alive]

    def forget(self) -> None:
        self.entries.clear()
