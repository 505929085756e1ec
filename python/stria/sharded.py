"""Sharded mode for torch.distributed trainers: which tokens a rank holds
(the service's layout rule, libstria's stria_call_positions: one
implementation), moving tensors between whole sequences and shards, and
sharded_attention.

Layouts over N ranks, the sequence padded to a multiple of N (2N for zigzag),
padded positions S, S+1, ... dropped:
  striped:    rank r holds r, r+N, r+2N, ...
  contiguous: rank r holds [r*L, (r+1)*L), L the padded length / N
  zigzag:     2N chunks of c = L/2; rank r holds chunks r and 2N-1-r
  packed:     documents placed by their work (the call's document plan, from
              cu_seqlens, causal and window_size): short documents kept whole
              on one rank, the rest spread as striping spreads them; a rank
              holds its spread tokens, then its kept ones. Without documents
              it is striped.
Positions increase within every shard of striped, contiguous and zigzag, so
a rank's real tokens are a prefix of its padded shard, in this order; a
packed shard's positions increase within its spread part and within its
kept part.

sharded_attention over N ranks of a torch.distributed group runs on a
sharded session of ring size N that the group opens together once per what
a session fixes (dtype, heads, kv_heads, head_dim, layout; bounds rounded up
as for whole sequences, see stria.Client): the ranks all-gather what each
passes (shapes, options: a mismatch fails on every rank, naming the rank),
group rank 0 opens the session and broadcasts its export, every other rank
imports it. Each rank's client keeps the group's sessions; after the open a
call runs no torch.distributed collective: each rank makes its part of the
call with its own tokens (stria_session_forward_shard), and libstria
compares the ranks' calls (a mismatch fails the call on every rank, naming
the ranks). Backward sends the saved Q, K, V, O and LSE with dO
(stria_session_backward_shard): the forward runs once.

Clients with keep_jobs > 0 (on every rank of the group) take the job path
of before: a collective submit per call, backward on the kept job or on a
fresh one (forward again, then backward).
"""

import ctypes
import struct
import zlib
from typing import (TYPE_CHECKING, Any, Callable, Iterable, List, Optional, Sequence, Tuple,
                    TypeVar, Union, cast)

import torch
from torch.autograd.function import once_differentiable

from . import _lib, _ops
from .attention import (_DTYPES, _back, _Config, _check_shapes, _cu_seqlens, _empty, _host,
                        _ptr, _scale, _window)
from ._errors import NoMemoryError, StriaError
from .client import Client, Job, default_client
from .session import Session, _backward_tensors, _forward_tensors, make_call

_R = TypeVar("_R")

_SHARD_LAYOUTS = ("striped", "contiguous", "zigzag", "packed")

# The masks a shard's positions depend on (packed: the call's documents,
# causality and window; the other layouts: none of them).
_Masks = Tuple[Optional[Tuple[int, ...]], bool, Optional[Tuple[int, ...]]]


def _check(seq_len: int, rank: int, world_size: int, layout: str) -> None:
    if layout not in _SHARD_LAYOUTS:
        raise ValueError(f"stria: sharded calls name their layout: one of "
                         f"{', '.join(_SHARD_LAYOUTS)} (not {layout!r})")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"stria: world_size must be an int >= 1, not {world_size!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise ValueError(f"stria: rank {rank!r} outside 0..{world_size - 1}")
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"stria: seq_len must be an int >= 1, not {seq_len!r}")


def _stripe(rank: int, world_size: int, layout: str, head_groups: int) -> int:
    """The stripe trainer rank `rank` holds: with G head groups and one
    trainer rank per worker, rank h G + l holds stripe l (N / G) + h of a
    striping over N (Session(trainer_ranks=N)); else its own."""
    if not isinstance(head_groups, int) or isinstance(head_groups, bool) or head_groups < 1:
        raise ValueError(f"stria: head_groups must be an int >= 1, not {head_groups!r}")
    if head_groups == 1:
        return rank
    if layout != "striped":
        raise ValueError(f"stria: head_groups {head_groups} (one trainer rank per worker) "
                         f"needs the striped layout, not {layout!r}")
    if world_size % head_groups:
        raise ValueError(f"stria: head_groups {head_groups} must divide world_size "
                         f"{world_size}")
    return rank % head_groups * (world_size // head_groups) + rank // head_groups


def _masks(layout: str, cu_seqlens: Union[torch.Tensor, Sequence[int], None], causal: bool,
           window_size: Sequence[int]) -> _Masks:
    """The masks as the layout rule reads them; documents for packed only
    (the others place tokens by seq_len alone)."""
    if layout != "packed":
        return None, True, None
    return _cu_seqlens(cu_seqlens), bool(causal), _window(window_size, bool(causal))


def _positions(seq_len: int, rank: int, world_size: int, layout: str, masks: _Masks
               ) -> torch.Tensor:
    """libstria's positions of rank's tokens (stria_call_shard_tokens,
    stria_call_positions)."""
    cu, causal, window = masks
    call, arr = make_call(1, seq_len, causal, None, window, cu)
    L = _lib.lib()
    kind = _lib.LAYOUTS[layout]
    n = int(L.stria_call_shard_tokens(kind, world_size, ctypes.byref(call), rank))
    if n < 0:  # refused: the library's message names what
        _lib.check(L.stria_call_positions(kind, world_size, ctypes.byref(call), rank,
                                          ctypes.byref(ctypes.c_int64())))
        raise ValueError(f"stria: no positions for rank {rank} of {world_size} under {layout}")
    out = torch.empty(max(n, 1), dtype=torch.int64)
    _lib.check(L.stria_call_positions(kind, world_size, ctypes.byref(call), rank,
                                      ctypes.c_void_p(out.data_ptr())))
    del arr
    return out[:n]


def shard_positions(seq_len: int, rank: int, world_size: int, layout: str = "striped", *,
                    cu_seqlens: Union[torch.Tensor, Sequence[int], None] = None,
                    causal: bool = True, window_size: Sequence[int] = (-1, -1),
                    head_groups: int = 1) -> torch.Tensor:
    """The positions (int64 tensor) of the real tokens that rank `rank` of
    `world_size` holds under `layout`, in the order of its shard: the
    positions to give rotary embeddings, and the rows shard() takes. The
    service's own rule (libstria), so trainer and workers always agree.

    Arguments:
        seq_len: int. The whole sequence's length.
        rank: int. The rank, 0 <= rank < world_size.
        world_size: int. The ranks of the ring.
        layout: "striped", "contiguous", "zigzag" or "packed".
        cu_seqlens: packed only: None, or (n_docs + 1,) positions from 0 to seq_len, the
            documents the call will pass (the plan places them by their work).
        causal, window_size: packed only: the call's, as in stria.attention (the work
            of a document depends on them).
        head_groups: int. Striped only: a session of G head groups called by one
            trainer rank per worker (Session(trainer_ranks=world_size)): rank h G + l
            holds stripe l (world_size / G) + h, so that the G ranks of host h hold
            together what ring rank h holds. 1 (default): rank r holds stripe r.
    Returns:
        positions: (shard_tokens,), int64; increasing for striped, contiguous and zigzag,
        for packed increasing within the spread tokens, then within the kept ones.
    Raises:
        ValueError naming the bad argument (a layout, rank or cu_seqlens the service
        would refuse).
    """
    _check(seq_len, rank, world_size, layout)
    return _positions(seq_len, _stripe(rank, world_size, layout, head_groups), world_size,
                      layout, _masks(layout, cu_seqlens, causal, window_size))


def shard(x: torch.Tensor, dim: int = 1, *, rank: int, world_size: int,
          layout: str = "striped", cu_seqlens: Union[torch.Tensor, Sequence[int], None] = None,
          causal: bool = True, window_size: Sequence[int] = (-1, -1),
          head_groups: int = 1) -> torch.Tensor:
    """This rank's tokens of a whole-sequence tensor (tokens along `dim`,
    default 1 as in [B, S, H, D]), in shard order.

    Arguments:
        x: a whole-sequence tensor, e.g. (batch_size, seqlen, nheads, headdim).
        dim: int. The tokens' dimension.
        rank, world_size, layout, cu_seqlens, causal, window_size, head_groups: as in
            stria.shard_positions (packed needs the call's documents).
    Returns:
        x's rows of this rank's tokens along dim, in shard order.
    """
    seq_len = x.shape[dim]
    pos = shard_positions(seq_len, rank, world_size, layout, cu_seqlens=cu_seqlens,
                          causal=causal, window_size=window_size, head_groups=head_groups)
    return x.index_select(dim, pos.to(x.device))


def unshard(x: Union[torch.Tensor, Sequence[torch.Tensor]], dim: int = 1, *, seq_len: int,
            layout: str = "striped", group: Any = None,
            cu_seqlens: Union[torch.Tensor, Sequence[int], None] = None, causal: bool = True,
            window_size: Sequence[int] = (-1, -1), head_groups: int = 1) -> torch.Tensor:
    """The whole sequence back from shards: `x` is either the list of every
    rank's shard (rank order), or this rank's shard, gathered over the
    torch.distributed `group` (default: the world).

    Arguments:
        x: every rank's shard (a list, rank order), or this rank's shard (a tensor).
        dim: int. The tokens' dimension.
        seq_len: int. The whole sequence's length.
        layout: "striped", "contiguous", "zigzag" or "packed".
        group: the torch.distributed group (None: the world), for a single shard.
        cu_seqlens, causal, window_size: packed only, the call's (as in
            stria.shard_positions).
        head_groups: int. As in stria.shard_positions (one trainer rank per worker).
    Returns:
        the whole sequence: x's shape with seq_len tokens along dim.
    """
    masks = _masks(layout, cu_seqlens, causal, window_size)

    def positions(r: int, n: int) -> torch.Tensor:
        _check(seq_len, r, n, layout)
        return _positions(seq_len, _stripe(r, n, layout, head_groups), n, layout, masks)

    if isinstance(x, (list, tuple)):
        shards = list(x)
    else:
        import torch.distributed as dist

        x = cast(torch.Tensor, x)
        n = dist.get_world_size(group)
        rank = dist.get_rank(group)
        mine = positions(rank, n).numel()
        if x.shape[dim] != mine:
            raise ValueError(f"stria: rank {rank} holds {mine} tokens of {seq_len} under "
                             f"{layout}, the shard has {x.shape[dim]}")
        # Shards differ in length by the padding: gather padded, then cut.
        longest = max(positions(r, n).numel() for r in range(n))
        pad = list(x.shape)
        pad[dim] = longest - mine
        padded = torch.cat([x, x.new_zeros(pad)], dim).contiguous()
        got = [torch.empty_like(padded) for _ in range(n)]
        dist.all_gather(got, padded, group=group)
        shards = [g.narrow(dim, 0, positions(r, n).numel()) for r, g in enumerate(got)]
    n = len(shards)
    if n < 1:
        raise ValueError("stria: unshard needs at least one shard")
    shape = list(shards[0].shape)
    shape[dim] = seq_len
    out = shards[0].new_empty(shape)
    for r, s in enumerate(shards):
        pos = positions(r, n).to(s.device)
        if s.shape[dim] != pos.numel():
            raise ValueError(f"stria: shard {r} has {s.shape[dim]} tokens, rank {r} of {n} "
                             f"holds {pos.numel()} of {seq_len} under {layout}")
        out.index_copy_(dim, pos, s)
    return out


# ---- sharded_attention ---------------------------------------------------------

# What each rank passes, all-gathered before the job is submitted (int64).
_DESC = ("error", "batch", "tokens", "heads", "kv_heads", "head_dim", "dtype", "causal",
         "seq_len", "softmax_scale", "window_left", "window_right", "cu_seqlens", "keep")
_NAMES = {_DTYPES[d]: str(d).replace("torch.", "") for d in _DTYPES}
_HEADER = 8 + _lib.JOB_EXPORT_BYTES  # ok, keep, export length, 5 spare, the export
# a session's: ok, export length, 6 spare, max_batch and max_seq_len (int64), the export
_SHEADER = 24 + _lib.SESSION_EXPORT_MAX_BYTES


class _Sharded:
    """One sharded_attention call's settings: the job's _Config plus the
    group and this rank's place in it."""

    def __init__(self, cfg: _Config, group: Any, rank: int, world: int, seq_len: int,
                 layout_name: str) -> None:
        self.cfg = cfg
        self.group = group
        self.rank = rank
        self.world = world
        self.seq_len = seq_len
        self.layout_name = layout_name
        self.src = 0 if group is None else _dist().get_global_rank(group, 0)
        # the key of the group's sessions in a client
        self.group_key = group if group is not None else _dist().group.WORLD
        self.device = torch.device("cpu")
        if _dist().get_backend(group) == "nccl":  # NCCL moves CUDA tensors only
            self.device = torch.device("cuda", torch.cuda.current_device())

    def tokens(self, rank: int) -> int:
        """The tokens rank `rank` holds in this call (its layout's rule;
        packed: the call's documents, causality and window)."""
        c = self.cfg
        masks: _Masks = (c.cu_seqlens, c.causal, c.window) if self.layout_name == "packed" \
            else (None, True, None)
        stripe = _stripe(rank, self.world, self.layout_name, c.per_worker() or 1)
        return int(_positions(self.seq_len, stripe, self.world, self.layout_name,
                              masks).numel())


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def _describe(sh: _Sharded, q: torch.Tensor, k: torch.Tensor, keep: bool) -> List[int]:
    c = sh.cfg
    B, T, H, D = q.shape
    wl, wr = c.window if c.window is not None else (-2, -2)
    scale = struct.unpack("<q", struct.pack("<d", c.scale or 0.0))[0]
    cu = zlib.crc32(repr(c.cu_seqlens).encode()) if c.cu_seqlens is not None else -1
    return [0, B, T, H, k.shape[2], D, _DTYPES[q.dtype], int(c.causal), sh.seq_len, scale,
            wl, wr, cu, int(keep)]


def _agree(sh: _Sharded, mine: Optional[List[int]], local_error: Optional[BaseException]
           ) -> bool:
    """All-gathers every rank's description; raises on every rank when one
    failed its local checks or differs from rank 0 (naming it). Returns rank
    0's wish to keep the job."""
    dist = _dist()
    t = torch.tensor(mine if local_error is None else [1] + [0] * (len(_DESC) - 1),
                     dtype=torch.int64, device=sh.device)
    got = [torch.empty_like(t) for _ in range(sh.world)]
    dist.all_gather(got, t, group=sh.group)
    rows = [g.tolist() for g in got]
    if local_error is not None:
        raise local_error
    for r, row in enumerate(rows):
        if row[0]:
            raise RuntimeError(f"stria: sharded_attention: rank {r} of the group refused its "
                               f"arguments (its own error says why)")
    ref = rows[0]
    for r, row in enumerate(rows):
        want = sh.tokens(r)
        if row[2] != want:
            raise ValueError(f"stria: sharded_attention: rank {r} passes {row[2]} tokens, it "
                             f"holds {want} of {sh.seq_len} under {sh.layout_name} over "
                             f"{sh.world} ranks (see stria.shard_positions)")
        for i, name in enumerate(_DESC[:-1]):
            if name != "tokens" and row[i] != ref[i]:
                a, b = ref[i], row[i]
                if name == "dtype":
                    a, b = _NAMES[a], _NAMES[b]
                elif name == "softmax_scale":
                    a, b = (struct.unpack("<d", struct.pack("<q", x))[0] or None for x in (a, b))
                raise ValueError(f"stria: sharded_attention: rank {r}'s {name} ({b}) differs "
                                 f"from rank 0's ({a}): every rank must pass the same shapes "
                                 f"and options")
    return bool(ref[-1])


def _open_job(sh: _Sharded, q: torch.Tensor, k: torch.Tensor, want_keep: bool,
              local_error: Optional[BaseException] = None) -> Tuple[Job, bool]:
    """The collective part: agree, submit on rank 0, broadcast, import.
    Returns (this rank's Job, keep)."""
    keep = _agree(sh, _describe(sh, q, k, want_keep) if local_error is None else None,
                  local_error)
    client = sh.cfg.client
    header = torch.zeros(_HEADER, dtype=torch.uint8)
    job: Optional[Job] = None
    error: Optional[BaseException] = None
    if sh.rank == 0:
        keep = keep and client._may_keep()
        spec, arr = sh.cfg.spec(q, k, sh.seq_len)
        try:
            job = client.submit(spec, keep=keep)
            data = job.export()
            header[0], header[1], header[2] = 1, int(keep), len(data)
            header[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        except BaseException as e:  # the peers must hear of it, then it is raised here
            error = e
            if job is not None:
                job.release()
        del arr
    header = header.to(sh.device)
    _dist().broadcast(header, sh.src, group=sh.group)
    if error is not None:
        raise error
    header = header.cpu()
    if not header[0]:
        raise RuntimeError("stria: sharded_attention: rank 0 of the group could not submit "
                           "the job (its own error says why)")
    keep = bool(header[1])
    if job is None:
        job = client.import_job(bytes(header[8:8 + int(header[2])].tolist()), keep=keep)
    try:
        n = job.shard_tokens(sh.rank)
        if n != q.shape[1]:  # the Python layout math disagrees with the service's
            raise RuntimeError(f"stria: job {job.id} gives rank {sh.rank} {n} tokens, "
                               f"stria.shard_positions {q.shape[1]}")
    except BaseException:
        job.release()
        raise
    return job, keep


def _run_forward(sh: _Sharded, job: Job, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    qh, kh, vh = _host(q), _host(k), _host(v)
    B, T, H, _ = q.shape
    o = _empty(qh.shape, q.dtype, q.device)
    lse = _empty((B, H, T), torch.float32, q.device)
    job.forward_shard(sh.rank, _ptr(qh), _ptr(kh), _ptr(vh), _ptr(o), _ptr(lse))
    return _back(o, q.device), _back(lse, q.device)


def _sharded_forward(sh: _Sharded, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     want_keep: bool
                     ) -> Tuple[torch.Tensor, torch.Tensor, Optional[Job]]:
    """(O, LSE, the kept Job or None)."""
    job: Optional[Job]
    job, keep = _open_job(sh, q, k, want_keep)
    try:
        o, lse = _run_forward(sh, job, q, k, v)
    except BaseException:
        job.release()
        raise
    if not keep:
        job.release()
        job = None
    return o, lse, job


def _sharded_backward(sh: _Sharded, job: Optional[Job], q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, do: torch.Tensor
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of this rank's tokens: on the kept job, or by a second
    collective submit (forward, then backward)."""
    doh = _host(do)
    dq = _empty(q.shape, q.dtype, q.device)
    dk = _empty(k.shape, k.dtype, k.device)
    dv = _empty(v.shape, v.dtype, v.device)
    if job is None:
        job, _ = _open_job(sh, q, k, want_keep=False)
        try:
            _run_forward(sh, job, q, k, v)
        except BaseException:
            job.release()
            raise
    try:
        job.backward_shard(sh.rank, _ptr(doh), _ptr(dq), _ptr(dk), _ptr(dv))
    finally:
        job.release()
    return _back(dq, q.device), _back(dk, k.device), _back(dv, v.device)


# ---- the session path -----------------------------------------------------------

def _open_session(sh: _Sharded, q: torch.Tensor, k: torch.Tensor, mb: int, msl: int) -> Session:
    """The group's collective open of a sharded session bounded by (mb,
    msl): agree, open on group rank 0 and broadcast its export, import on
    the others. Every rank of the group runs it at the same call: the one
    its cache (the same on every rank) has no session for."""
    _agree(sh, _describe(sh, q, k, False), None)
    client = sh.cfg.client
    header = torch.zeros(_SHEADER, dtype=torch.uint8)
    session: Optional[Session] = None
    error: Optional[BaseException] = None
    if sh.rank == 0:
        open_spec = sh.cfg.session_spec(q, k, sharded=True)

        def opened(b: int, s: int) -> Session:
            return client._locked(lambda: client._open_session_locked(open_spec(b, s)))

        try:
            try:
                session = opened(mb, msl)
            except NoMemoryError:
                # the rounded bounds are beyond the workers' memory: the call's own
                if mb * msl <= q.shape[0] * sh.seq_len:
                    raise
                session = opened(q.shape[0], sh.seq_len)
            data = session._raw_export()
            header[0], header[1] = 1, len(data)
            head = struct.pack("<qq", session.max_batch, session.max_seq_len) + data
            header[8:24 + len(data)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        except BaseException as e:  # the peers must hear of it, then it is raised here
            error = e
            if session is not None:
                session.close()
                session = None
    header = header.to(sh.device)
    _dist().broadcast(header, sh.src, group=sh.group)
    if error is not None:
        raise error
    header = header.cpu()
    if not header[0]:
        raise RuntimeError("stria: sharded_attention: rank 0 of the group could not open the "
                           "session (its own error says why)")
    if session is None:
        mb, msl = struct.unpack("<qq", bytes(header[8:24].tolist()))
        data = bytes(header[24:24 + int(header[1])].tolist())
        _, _, H, D = q.shape
        session = client._locked(lambda: client._import_session_locked(
            data, max_batch=mb, max_seq_len=msl, heads=H, kv_heads=k.shape[2], head_dim=D,
            dtype=_DTYPES[q.dtype], sharded=True))
    return session


def _on_group_session(  # type: ignore[return]  # the loop returns or raises
        sh: _Sharded, q: torch.Tensor, k: torch.Tensor, fn: Callable[[Session], _R]) -> _R:
    """fn(session) on the client's session of the group for this call
    (opened collectively when the group has none that covers it), under
    the client's lock; no collective otherwise."""
    client = sh.cfg.client
    cache = client._group_cache(sh.group_key)
    fixed = sh.cfg.fixed(q, k, "sharded")
    with cache.lock:
        for again in (False, True):
            s = cache.session(fixed, q.shape[0], sh.seq_len,
                              lambda mb, msl, _no_queue: _open_session(sh, q, k, mb, msl),
                              lambda old: old.close())
            n = sh.tokens(sh.rank)
            if n != q.shape[1]:
                raise ValueError(f"stria: sharded_attention: rank {sh.rank} passes "
                                 f"{q.shape[1]} tokens, it holds {n} of {sh.seq_len} under "
                                 f"{sh.layout_name} over {sh.world} ranks (see "
                                 f"stria.shard_positions)")
            try:
                return s._call(lambda L: fn(s))
            except StriaError as e:
                # The service closed the session, idle past its deadline
                # (libstria opens only whole-sequence ones again): every
                # rank's call finds so, so the group opens it again together.
                if again or e.name != "STRIA_ERR_NOT_FOUND":
                    raise
                cache.drop(fixed, lambda old: old.close())


def _session_forward(sh: _Sharded, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    call, arr = sh.cfg.call(q.shape[0], sh.seq_len)
    out = _forward_tensors(lambda *p: _on_group_session(
        sh, q, k, lambda s: s._forward_shard_locked(call, sh.rank, *p)), q, k, v)
    del arr
    return out


def _session_backward(sh: _Sharded, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    call, arr = sh.cfg.call(q.shape[0], sh.seq_len)
    out = _backward_tensors(lambda *p: _on_group_session(
        sh, q, k, lambda s: s._backward_shard_locked(call, sh.rank, *p)), q, k, v, o, lse, do)
    del arr
    return out


def _peers_open(sh: _Sharded, client: Client, q: Any, k: Any) -> bool:
    """Whether, as far as this rank can tell from its own (refused)
    arguments, its peers are about to open a session together: its client
    has no session of the group, or none of these heads and head size (and
    dtype, when it is one) that covers the call."""
    if client.keep_jobs:
        return True  # the job path agrees on every call
    cache = client._group_caches.get(sh.group_key)
    sessions = [] if cache is None else [(f, s) for f, s in cache.entries.items() if s.alive]
    if not sessions:
        return True
    try:
        B, H, Hkv, D = q.shape[0], q.shape[2], k.shape[2], q.shape[3]
    except Exception:
        return False  # not even shapes: raised here only
    dtype = _DTYPES.get(getattr(q, "dtype", None))
    for fixed, s in sessions:
        if fixed[1:3] == (sh.world, _lib.LAYOUTS[sh.layout_name]) and \
                fixed[4:] == (H, Hkv, D) and dtype in (None, fixed[3]) and \
                s.covers(B, sh.seq_len):
            return False
    return True


class ShardedAttentionFunction(torch.autograd.Function):  # type: ignore[misc]
    """The differentiable sharded call; use stria.sharded_attention()."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sh: _Sharded
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        ctx.sh = sh
        ctx.job = None
        if sh.cfg.client.keep_jobs:
            o, lse, ctx.job = _sharded_forward(sh, q, k, v, want_keep=True)
            ctx.save_for_backward(q, k, v)
        else:
            o, lse = _session_forward(sh, q, k, v)
            ctx.save_for_backward(q, k, v, o, lse)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    @once_differentiable  # type: ignore[untyped-decorator]
    def backward(ctx: Any, do: torch.Tensor, _dlse: Optional[torch.Tensor]
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        saved: Tuple[torch.Tensor, ...] = ctx.saved_tensors
        if len(saved) == 5:
            dq, dk, dv = _session_backward(ctx.sh, *saved, do)
        else:
            job, ctx.job = ctx.job, None
            dq, dk, dv = _sharded_backward(
                ctx.sh, job, *cast(Tuple[torch.Tensor, torch.Tensor, torch.Tensor], saved), do)
        return dq, dk, dv, None


def sharded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: Any = None,
                      seq_len: int, layout: str = "striped", causal: bool = True,
                      softmax_scale: Optional[float] = None,
                      window_size: Sequence[int] = (-1, -1),
                      cu_seqlens: Union[torch.Tensor, Sequence[int], None] = None,
                      return_lse: bool = False, client: Optional[Client] = None
                      ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Exact attention for torch.distributed trainers (context parallelism):
    each rank of `group` (default: the world) passes only the tokens it holds
    of a `seq_len`-token sequence, in stria.shard_positions(seq_len, rank,
    world_size, layout) order (stria.shard cuts them), and gets its tokens'
    O back; the service runs one ring of the group's size over them (with a
    Client(head_groups=G): G rings of the group's size, each over its
    group of heads, rank r's tokens going to worker r of every ring; with a
    Client(head_groups=G, trainer_ranks="worker"): G rings of the group's
    size / G, one rank per worker, rank r's tokens cut by
    stria.shard(..., head_groups=G)).

    q: [B, T, H, D], k, v: [B, T, Hkv, D] (T: this rank's tokens), as in
    stria.attention; layout: "striped", "contiguous", "zigzag" or "packed"
    (named: the shards depend on it; packed places the documents of
    cu_seqlens by their work, so stria.shard_positions takes the same
    cu_seqlens, causal and window_size); causal, softmax_scale, window_size and cu_seqlens
    (global positions) as in stria.attention; with return_lse also LSE
    [B, H, T]. Every rank must pass the same shapes and options, and make
    the same calls in the same order. client: this process's stria.Client
    (default: stria.default_client()); every rank's must have the same
    max_sessions and keep_jobs.

    The first call of a kind (what a session fixes, within its bounds) is a
    collective over `group`: the ranks compare their arguments (a mismatch
    fails on every rank, naming the rank), rank 0 opens a session and
    broadcasts its handle (gloo, or NCCL with CUDA tensors for the handle),
    the others import it. Later calls run no collective: libstria compares
    the ranks' calls and fails one that differs on every rank, naming the
    ranks; a rank whose own arguments are refused raises at once, and its
    peers' call fails when it does not arrive (arrival_timeout). A session
    the service closed, idle past its deadline (Client's idle_timeout), is
    opened again by the group at the next call (a collective once more).

    Differentiable in q, k and v: backward sends the saved q, k, v, O and LSE
    with dO, so the forward runs once. (Clients with keep_jobs: a job per
    call, as before sessions.)

    Arguments:
        q: (batch_size, shard_tokens, nheads, headdim): this rank's tokens.
        k: (batch_size, shard_tokens, nheads_k, headdim)
        v: (batch_size, shard_tokens, nheads_k, headdim)
        group: the torch.distributed group (None: the world).
        seq_len: int. The whole sequence's length.
        layout: "striped", "contiguous", "zigzag" or "packed".
        causal: bool. Whether to apply causal attention mask.
        softmax_scale: float. The scaling of QK^T before softmax (default 1/sqrt(headdim)).
        window_size: (left, right). If not (-1, -1), implements sliding window local attention.
        cu_seqlens: None, or (n_docs + 1,) global positions: the documents of every batch row.
        return_lse: bool. Whether to return the logsumexp too.
        client: stria.Client, or None for stria.default_client().
    Returns:
        out: (batch_size, shard_tokens, nheads, headdim).
        softmax_lse [optional, if return_lse=True]: (batch_size, nheads, shard_tokens).
    """
    if layout not in _SHARD_LAYOUTS:
        raise ValueError(f"stria: sharded calls name their layout: one of "
                         f"{', '.join(_SHARD_LAYOUTS)} (not {layout!r})")
    if torch.compiler.is_compiling():
        return _traced(q, k, v, group, seq_len, layout, causal, softmax_scale, window_size,
                       cu_seqlens, return_lse, client)
    dist = _dist()
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("stria.sharded_attention is a collective over a torch.distributed "
                           "group: call torch.distributed.init_process_group first (or use "
                           "stria.attention on whole sequences)")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("stria: sharded_attention: this process is not in `group`")
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"stria: seq_len must be an int >= 1, not {seq_len!r}")
    sh = _Sharded(None, group, rank, world, seq_len, layout)  # type: ignore[arg-type]  # cfg below
    client = client if client is not None else default_client()
    try:  # a rank's own mistakes reach its peers through the all-gather
        _check_shapes(q, k, v, tokens="number of tokens")
        cu = _cu_seqlens(cu_seqlens)
        if cu is not None and (len(cu) < 2 or cu[0] != 0 or cu[-1] != seq_len):
            raise ValueError(f"stria: cu_seqlens must run from 0 to seq_len {seq_len} "
                             f"(got {cu[0] if cu else None} .. {cu[-1] if cu else None})")
        sh.cfg = _Config(client, bool(causal), _scale(softmax_scale),
                         _window(window_size, bool(causal)), cu, _lib.LAYOUTS[layout], world)
    except (TypeError, ValueError, NotImplementedError) as e:
        # when the peers open a session now, they hear of it through their
        # all-gather; on an open session they fail at their arrival timeout
        if _peers_open(sh, client, q, k):
            _agree(sh, None, e)
        raise
    if not client.keep_jobs:  # the custom ops (_ops.py)
        c = sh.cfg
        o, lse = _ops.sharded_forward(q, k, v, _ops.sharded_key(client, group, seq_len, layout),
                                      c.causal, c.scale, _list(c.window), _list(c.cu_seqlens))
        return (o, lse) if return_lse else o
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if grad:
        o, lse = ShardedAttentionFunction.apply(q, k, v, sh)
    elif client.keep_jobs:
        o, lse, _ = _sharded_forward(sh, q.detach(), k.detach(), v.detach(), want_keep=False)
    else:
        o, lse = _session_forward(sh, q.detach(), k.detach(), v.detach())
    return (o, lse) if return_lse else o


def _list(t: Optional[Iterable[int]]) -> Optional[List[int]]:
    return None if t is None else list(t)


def _traced(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, seq_len: int,
            layout: str, causal: bool, softmax_scale: Optional[float],
            window_size: Sequence[int], cu_seqlens: Union[torch.Tensor, Sequence[int], None],
            return_lse: bool, client: Optional[Client]
            ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """sharded_attention under torch.compile: the arguments' checks (a
    rank's own mistakes raise here, without reaching its peers), then the
    custom op, which runs eagerly (its first call of a kind is the
    collective open)."""
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"stria: seq_len must be an int >= 1, not {seq_len!r}")
    _check_shapes(q, k, v, tokens="number of tokens")
    cu = _cu_seqlens(cu_seqlens)
    if cu is not None and (len(cu) < 2 or cu[0] != 0 or cu[-1] != seq_len):
        raise ValueError(f"stria: cu_seqlens must run from 0 to seq_len {seq_len} "
                         f"(got {cu[0] if cu else None} .. {cu[-1] if cu else None})")
    o, lse = _ops.sharded_forward(q, k, v, _ops.sharded_key(client, group, seq_len, layout),
                                  bool(causal), _scale(softmax_scale),
                                  _list(_window(window_size, bool(causal))), _list(cu))
    return (o, lse) if return_lse else o
