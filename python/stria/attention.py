"""Whole-sequence attention through the service, as a torch.autograd.Function,
and flash_attn-compatible calls.

Calls run on the client's cached sessions (session.py): forward sends Q, K,
V and gets O and LSE; autograd saves Q, K, V, O and LSE, and backward sends
them with dO (stria_session_backward), so the forward runs once and nothing
is held on the workers in between. A client with keep_jobs > 0 takes the
job path of before (stria_client_forward, a job kept for backward or the
forward recomputed). stria.attention calls the torch custom ops of _ops.py
(what torch.compile traces); AttentionFunction remains for keep_jobs clients
in eager mode."""

import ctypes
import math
import numbers
from typing import (TYPE_CHECKING, Any, Callable, Optional, Sequence, Tuple, TypeVar, Union,
                    cast)

import torch
from torch.autograd.function import once_differentiable

from . import _lib, _ops
from ._errors import StriaError
from ._tensors import (_DTYPES as _DTYPES, _back as _back, _empty as _empty,  # noqa: F401
                       _host as _host, _ptr as _ptr)  # (sharded.py's too)
from .client import Client, Job, default_client

if TYPE_CHECKING:
    from .session import Session

_R = TypeVar("_R")


class _Config:
    """What one call computes, besides the tensors."""

    __slots__ = ("client", "causal", "scale", "window", "cu_seqlens", "layout", "ring_size")

    def __init__(self, client: Client, causal: bool, scale: Optional[float],
                 window: Optional[Tuple[int, ...]], cu_seqlens: Optional[Tuple[int, ...]],
                 layout: int, ring_size: int) -> None:
        self.client = client
        self.causal = causal
        self.scale = scale
        self.window = window  # None or (left, right)
        self.cu_seqlens = cu_seqlens  # None or a tuple of ints
        self.layout = layout
        self.ring_size = ring_size

    def spec(self, q: torch.Tensor, k: torch.Tensor, seq_len: Optional[int] = None
             ) -> Tuple[_lib.JobSpec, Any]:
        """The job spec (and the ctypes array it points to, to keep alive);
        seq_len: the whole sequence's (a sharded job's), else q's."""
        B, S, H, D = q.shape
        s = _lib.JobSpec()
        s.struct_size = ctypes.sizeof(s)
        s.batch, s.seq_len, s.heads, s.kv_heads, s.head_dim = B, seq_len or S, H, k.shape[2], D
        s.dtype = _DTYPES[q.dtype]
        s.causal = self.causal
        s.layout = self.layout
        s.ring_size = self.ring_size
        s.scale = self.scale if self.scale is not None else 0.0
        s.step_timeout_s = self.client.step_timeout
        s.ttl_s = self.client.ttl
        s.no_queue = self.client.no_queue
        s.arrival_timeout_s = self.client.arrival_timeout
        arr = None
        if self.cu_seqlens is not None:
            arr = (ctypes.c_int64 * len(self.cu_seqlens))(*self.cu_seqlens)
            s.cu_seqlens = arr
            s.n_cu_seqlens = len(self.cu_seqlens)
        if self.window is not None:
            s.has_window = True
            s.window_left, s.window_right = self.window
        return s, arr

    def call(self, batch: int, seq_len: int) -> Tuple[_lib.Call, Any]:
        """The stria_call_t of a session call (and the array to keep alive)."""
        from .session import make_call

        return make_call(batch, seq_len, self.causal, self.scale, self.window, self.cu_seqlens)

    def session_spec(self, q: torch.Tensor, k: torch.Tensor, seq_len: Optional[int] = None,
                     sharded: bool = False) -> Callable[[int, int], _lib.SessionSpec]:
        """open_spec(max_batch, max_seq_len): the spec of a session for
        calls like this one."""
        from .session import make_spec

        from .session import _check_head_groups

        _, _, H, D = q.shape
        ring = self.ring_size
        groups = self.client.head_groups
        trainers = 0
        if sharded:
            groups = groups if isinstance(groups, int) and groups > 1 else 0
            if self.per_worker():  # the trainer's world is every worker
                trainers = ring
            else:  # the trainer's world size is each ring's size: G x it workers
                ring *= max(groups, 1)
        _check_head_groups(groups, k.shape[2], ring)
        return lambda mb, msl: make_spec(
            self.client, max_batch=mb, max_seq_len=msl, heads=H, kv_heads=k.shape[2],
            head_dim=D, dtype=_DTYPES[q.dtype], layout=self.layout, ring_size=ring,
            sharded=sharded, head_groups=groups,
            head_group_rings=self.client.head_group_rings, trainer_ranks=trainers)

    def per_worker(self) -> int:
        """Sharded calls with one trainer rank per worker (the client's
        trainer_ranks "worker" with G > 1 head groups): G, else 0."""
        groups = self.client.head_groups
        if self.client.trainer_ranks == "worker" and isinstance(groups, int) and groups > 1:
            return groups
        return 0

    def fixed(self, q: torch.Tensor, k: torch.Tensor, kind: str = "whole"
              ) -> Tuple[Any, ...]:
        """What a session for this call fixes: the session cache's key."""
        _, _, H, D = q.shape
        return (kind, self.ring_size, self.layout, _DTYPES[q.dtype], H, k.shape[2], D)


class _TooShort(Exception):
    """A call shorter than its session's ring has chunks (libstria's
    sessions refuse it; a job takes it)."""


def _on_session(cfg: _Config, q: torch.Tensor, k: torch.Tensor,
                run: Callable[["Session"], _R]) -> _R:
    """run(session) on the client's session for the call, under its lock."""
    S = q.shape[1]

    def checked(s: "Session") -> _R:
        if S < s.ring_size * (2 if s.layout == "zigzag" else 1):
            raise _TooShort
        return run(s)

    return cfg.client._on_session(cfg.fixed(q, k), q.shape[0], S, cfg.session_spec(q, k),
                                  checked)


def _session_forward(cfg: _Config, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """O and LSE on q's device, on the client's session for the call."""
    from .session import _forward_tensors

    call, arr = cfg.call(q.shape[0], q.shape[1])
    try:
        out = _forward_tensors(lambda *p: _on_session(
            cfg, q, k, lambda s: s._forward_locked(call, *p)), q, k, v)
    except _TooShort:  # a few tokens: a job (released at once)
        out = _forward(cfg, q, k, v, keep=False)[:2]
    del arr
    return out


def _session_backward(cfg: _Config, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV: the saved tensors and dO sent to a session of the call's
    fixed part (the forward's, unless it was closed since: any covering one
    computes the same)."""
    from .session import _backward_tensors

    call, arr = cfg.call(q.shape[0], q.shape[1])
    try:
        out = _backward_tensors(lambda *p: _on_session(
            cfg, q, k, lambda s: s._backward_locked(call, *p)), q, k, v, o, lse, do)
    except _TooShort:  # a few tokens: a job, forward again then backward
        out = _backward(cfg, None, q, k, v, do)
    del arr
    return out


def _forward(cfg: _Config, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: bool
             ) -> Tuple[torch.Tensor, torch.Tensor, Optional[Job]]:
    """Runs the forward pass: (O, LSE, Job or None), on q's device."""
    qh, kh, vh = _host(q), _host(k), _host(v)
    B, S, H, _ = q.shape
    o = _empty(qh.shape, q.dtype, q.device)
    lse = _empty((B, H, S), torch.float32, q.device)
    spec, arr = cfg.spec(qh, kh)
    job = cfg.client.forward(spec, _ptr(qh), _ptr(kh), _ptr(vh), _ptr(o), _ptr(lse), keep)
    del arr
    return _back(o, q.device), _back(lse, q.device), job


_BACKWARD_RETRIES = 2  # forward + backward again after a retryable backward failure


def _backward(cfg: _Config, job: Optional[Job], q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, do: torch.Tensor
              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV: on the kept job, or (recompute mode, or a job lost since)
    by running the forward pass again on the service first."""
    doh = _host(do)
    dq = _empty(q.shape, q.dtype, q.device)
    dk = _empty(k.shape, k.dtype, k.device)
    dv = _empty(v.shape, v.dtype, v.device)
    retries = _BACKWARD_RETRIES
    while True:
        if job is None or not job.alive:
            _, _, job = _forward(cfg, q, k, v, keep=True)
        assert job is not None  # keep=True: a Job
        try:
            job.backward(_ptr(doh), _ptr(dq), _ptr(dk), _ptr(dv))
            break
        except StriaError as e:
            # A worker of the job died or left (the service says the call
            # may succeed again): run forward and backward again on the
            # ring as it is now, a bounded number of times.
            if not e.retryable or retries == 0:
                raise
            retries -= 1
        finally:
            job.release()
            job = None
    return _back(dq, q.device), _back(dk, k.device), _back(dv, v.device)


class AttentionFunction(torch.autograd.Function):  # type: ignore[misc]
    """The differentiable call; use stria.attention(). LSE is an output but
    not differentiable (as in flash_attn)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: _Config
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        ctx.cfg = cfg
        ctx.job = None
        if cfg.client.keep_jobs:
            o, lse, ctx.job = _forward(cfg, q, k, v, keep=cfg.client._may_keep())
            ctx.save_for_backward(q, k, v)
        else:
            o, lse = _session_forward(cfg, q, k, v)
            ctx.save_for_backward(q, k, v, o, lse)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    @once_differentiable  # type: ignore[untyped-decorator]
    def backward(ctx: Any, do: torch.Tensor, _dlse: Optional[torch.Tensor]
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        saved: Tuple[torch.Tensor, ...] = ctx.saved_tensors
        if len(saved) == 5:
            dq, dk, dv = _session_backward(ctx.cfg, *saved, do)
        else:
            job, ctx.job = ctx.job, None
            dq, dk, dv = _backward(
                ctx.cfg, job, *cast(Tuple[torch.Tensor, torch.Tensor, torch.Tensor], saved), do)
        return dq, dk, dv, None


def _check_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, what: str = "q, k, v"
                   ) -> None:
    for name, t in zip("qkv", (q, k, v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"stria: {name} must be a torch.Tensor, not {type(t).__name__}")
    if q.dtype not in _DTYPES:
        raise TypeError(f"stria: dtype {q.dtype} is not supported (float32, bfloat16, float16)")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"stria: {what} must share a dtype (got {q.dtype}, {k.dtype}, {v.dtype})")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"stria: {what} must be on one device "
                         f"(got {q.device}, {k.device}, {v.device})")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"stria: tensors on {q.device} are not supported (cpu or cuda)")


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  tokens: str = "sequence length") -> None:
    """The checks of q [B, S, H, D], k, v [B, S, Hkv, D] (S: `tokens`)."""
    _check_tensors(q, k, v)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"stria: q, k, v must be 4-D [B, S, H, D] (got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)})")
    B, S, H, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"stria: k and v must have one shape (got {tuple(k.shape)}, "
                         f"{tuple(v.shape)})")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"stria: k {tuple(k.shape)} does not match q {tuple(q.shape)} in batch "
                         f"or head_dim")
    if k.shape[1] != S:
        raise NotImplementedError(
            f"stria: q and k must have the same {tokens} (got {S} and {k.shape[1]}): "
            f"the service computes attention within one sequence (no KV cache)")
    if min(B, S, H, D, k.shape[2]) == 0:
        raise ValueError(f"stria: empty tensors (q {tuple(q.shape)}, k {tuple(k.shape)})")
    if H % k.shape[2] != 0:
        raise ValueError(f"stria: q's {H} heads are not a multiple of k's {k.shape[2]}")


def _scale(softmax_scale: Optional[float]) -> Optional[float]:
    if softmax_scale is None:
        return None
    if not isinstance(softmax_scale, numbers.Real) or not math.isfinite(softmax_scale) or \
            softmax_scale <= 0:
        raise ValueError(f"stria: softmax_scale must be a finite number > 0, not "
                         f"{softmax_scale!r}")
    return float(softmax_scale)


def _window(window_size: Sequence[int], causal: bool) -> Optional[Tuple[int, int]]:
    try:
        left, right = (int(x) for x in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"stria: window_size must be a pair of ints, not {window_size!r}")
    if left < -1 or right < -1:
        raise ValueError(f"stria: window_size {window_size!r}: -1 (unbounded) or >= 0 expected")
    if causal:
        right = 0  # as flash_attn: causal bounds the right side at the query
        if left == -1:
            return None
    elif left == -1 and right == -1:
        return None
    return (left, right)


def _cu_seqlens(cu: Union[torch.Tensor, Sequence[int], None]) -> Optional[Tuple[int, ...]]:
    if cu is None:
        return None
    if isinstance(cu, torch.Tensor):
        if cu.dim() != 1 or cu.dtype.is_floating_point or cu.dtype == torch.bool:
            raise ValueError("stria: cu_seqlens must be a 1-D integer tensor")
        return tuple(int(x) for x in cu.tolist())
    try:
        return tuple(int(x) for x in cu)
    except (TypeError, ValueError):
        raise ValueError(f"stria: cu_seqlens must be a sequence of ints, not {cu!r}")


def _layout(layout: str) -> int:
    if layout not in _lib.LAYOUTS:
        raise ValueError(f"stria: unknown layout {layout!r} (expected one of "
                         f"{', '.join(_lib.LAYOUTS)})")
    return _lib.LAYOUTS[layout]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
              softmax_scale: Optional[float] = None, window_size: Sequence[int] = (-1, -1),
              cu_seqlens: Union[torch.Tensor, Sequence[int], None] = None, layout: str = "auto",
              ring_size: int = 0, return_lse: bool = False, client: Optional[Client] = None
              ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Exact attention over whole sequences through the stria service.

    q: [B, S, H, D]; k, v: [B, S, Hkv, D] (H a multiple of Hkv), float32,
    bfloat16 or float16, any strides, on the CPU or a CUDA device. Returns O
    [B, S, H, D] in q's dtype on q's device, and with return_lse also LSE
    [B, H, S] float32 (natural log; not differentiable).

    causal, softmax_scale (default 1/sqrt(D)), window_size (flash_attn's:
    a query at p sees keys in [p - left, p + right], -1 unbounded; causal
    bounds the right side at 0) and cu_seqlens (documents, as flash_attn
    varlen: 0 first, S last, applied to every batch row) say what is
    computed. layout: how tokens are dealt to the ring ("auto": the service
    chooses, "packed" on workers of host memory, so that each call's
    documents are placed by their work where that balances, striped
    otherwise; "striped", "contiguous", "zigzag", "packed"); ring_size:
    ranks (0: every healthy worker). client: a stria.Client (default: stria.default_client()).

    Runs on a session of the client's (opened on first use, kept for the
    calls after it: see stria.Client). Differentiable in q, k and v:
    autograd keeps O and LSE besides q, k and v, and backward sends them, so
    the forward runs once.

    Arguments:
        q: (batch_size, seqlen, nheads, headdim)
        k: (batch_size, seqlen, nheads_k, headdim)
        v: (batch_size, seqlen, nheads_k, headdim)
        causal: bool. Whether to apply causal attention mask.
        softmax_scale: float. The scaling of QK^T before softmax (default 1/sqrt(headdim)).
        window_size: (left, right). If not (-1, -1), implements sliding window local attention.
        cu_seqlens: None, or (n_docs + 1,) ints: the documents of every batch row.
        layout: "auto", "striped", "contiguous", "zigzag" or "packed".
        ring_size: int. Ranks of the ring (0: every healthy worker).
        return_lse: bool. Whether to return the logsumexp too.
        client: stria.Client, or None for stria.default_client().
    Returns:
        out: (batch_size, seqlen, nheads, headdim).
        softmax_lse [optional, if return_lse=True]: (batch_size, nheads, seqlen). The
            logsumexp of each row of the matrix QK^T * scaling (e.g., log of the softmax
            normalization factor).
    """
    return _attention(q, k, v, causal, softmax_scale, window_size, cu_seqlens, layout, ring_size,
                      return_lse, client)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
               softmax_scale: Optional[float], window_size: Sequence[int],
               cu_seqlens: Union[torch.Tensor, Sequence[int], None], layout: str, ring_size: int,
               return_lse: bool, client: Optional[Client],
               positions: Optional[torch.Tensor] = None
               ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """stria.attention; positions (stria.hf, compiling): position_ids whose
    restarts the ops turn into cu_seqlens when they run."""
    _check_shapes(q, k, v)
    softmax_scale = _scale(softmax_scale)
    if not isinstance(ring_size, int) or ring_size < 0:
        raise ValueError(f"stria: ring_size must be an int >= 0, not {ring_size!r}")
    window, cu, layout_id = _window(window_size, bool(causal)), _cu_seqlens(cu_seqlens), \
        _layout(layout)
    if torch.compiler.is_compiling() or \
            not (client if client is not None else default_client()).keep_jobs:
        # the custom ops (_ops.py): what torch.compile traces
        o, lse = _ops.attention_forward(
            q, k, v, _ops.client_key(client), bool(causal), softmax_scale,
            None if window is None else list(window), None if cu is None else list(cu),
            positions, layout_id, ring_size)
        return (o, lse) if return_lse else o
    cfg = _Config(client if client is not None else default_client(), bool(causal),
                  softmax_scale, window, cu, layout_id, ring_size)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        o, lse = AttentionFunction.apply(q, k, v, cfg)
    elif cfg.client.keep_jobs:
        o, lse, _ = _forward(cfg, q.detach(), k.detach(), v.detach(), keep=False)
    else:
        o, lse = _session_forward(cfg, q.detach(), k.detach(), v.detach())
    return (o, lse) if return_lse else o


def _unsupported(dropout_p: float, softcap: float, alibi_slopes: Optional[torch.Tensor]) -> None:
    if dropout_p:
        raise NotImplementedError(f"stria: dropout_p={dropout_p} is not supported (0.0 only)")
    if softcap:
        raise NotImplementedError(f"stria: softcap={softcap} is not supported (0.0 only)")
    if alibi_slopes is not None:
        raise NotImplementedError("stria: alibi_slopes are not supported (None only)")


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),  # -1 means infinite context window
    softcap: float = 0.0,  # 0.0 means deactivated
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor, None]]:
    """flash_attn.flash_attn_func (2.8) through stria: q [B, S, H, D], k, v
    [B, S, Hkv, D]. Always deterministic. With return_attn_probs returns
    (out, softmax_lse [B, H, S], None): stria never forms the probabilities.
    dropout_p, softcap and alibi_slopes other than the defaults raise
    NotImplementedError.

    Arguments:
        q: (batch_size, seqlen, nheads, headdim)
        k: (batch_size, seqlen, nheads_k, headdim)
        v: (batch_size, seqlen, nheads_k, headdim)
        dropout_p: float. Dropout probability (0.0 only).
        softmax_scale: float. The scaling of QK^T before applying softmax.
            Default to 1 / sqrt(headdim).
        causal: bool. Whether to apply causal attention mask (e.g., for auto-regressive modeling).
        window_size: (left, right). If not (-1, -1), implements sliding window local attention.
        softcap: float. Anything > 0 activates softcapping attention (0.0 only).
        alibi_slopes: (nheads,) or (batch_size, nheads), fp32 (None only).
        deterministic: bool. Ignored: stria's backward is always deterministic.
        return_attn_probs: bool. Whether to return the logsumexp too (the probabilities
            are never formed: None in their place).
    Return:
        out: (batch_size, seqlen, nheads, headdim).
        softmax_lse [optional, if return_attn_probs=True]: (batch_size, nheads, seqlen). The
            logsumexp of each row of the matrix QK^T * scaling (e.g., log of the softmax
            normalization factor).
        S_dmask [optional, if return_attn_probs=True]: None.
    """
    _unsupported(dropout_p, softcap, alibi_slopes)
    out = attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                    window_size=window_size, return_lse=return_attn_probs)
    if return_attn_probs:
        return out[0], out[1], None
    return out


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: Union[torch.Tensor, Sequence[int]],
    cu_seqlens_k: Union[torch.Tensor, Sequence[int]],
    max_seqlen_q: Optional[int],
    max_seqlen_k: Optional[int],
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),  # -1 means infinite context window
    softcap: float = 0.0,  # 0.0 means deactivated
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor, None]]:
    """flash_attn.flash_attn_varlen_func (2.8) through stria: q [total, H, D],
    k, v [total, Hkv, D], documents cu_seqlens_q (which must equal
    cu_seqlens_k). With return_attn_probs returns (out, softmax_lse
    [H, total], None). Different q/k documents, block_table, dropout_p,
    softcap and alibi_slopes raise NotImplementedError.

    Arguments:
        q: (total_q, nheads, headdim), where total_q = total number of query tokens in the batch.
        k: (total_k, nheads_k, headdim), where total_k = total number of key tokens in the batch.
        v: (total_k, nheads_k, headdim), where total_k = total number of key tokens in the batch.
        cu_seqlens_q: (batch_size + 1,), dtype torch.int32. The cumulative sequence lengths
           of the sequences in the batch, used to index into q.
        cu_seqlens_k: (batch_size + 1,), dtype torch.int32. Must equal cu_seqlens_q.
        max_seqlen_q: int. Maximum query sequence length in the batch.
        max_seqlen_k: int. Maximum key sequence length in the batch (unused).
        dropout_p: float. Dropout probability (0.0 only).
        softmax_scale: float. The scaling of QK^T before applying softmax.
            Default to 1 / sqrt(headdim).
        causal: bool. Whether to apply causal attention mask (e.g., for auto-regressive modeling).
        window_size: (left, right). If not (-1, -1), implements sliding window local attention.
        softcap: float. Anything > 0 activates softcapping attention (0.0 only).
        alibi_slopes: (nheads,) or (batch_size, nheads), fp32 (None only).
        deterministic: bool. Ignored: stria's backward is always deterministic.
        return_attn_probs: bool. Whether to return the logsumexp too (the probabilities
            are never formed: None in their place).
        block_table: paged KV cache (None only).
    Return:
        out: (total, nheads, headdim).
        softmax_lse [optional, if return_attn_probs=True]: (nheads, total_q_seqlen). The
            logsumexp of each row of the matrix QK^T * scaling (e.g., log of the softmax
            normalization factor).
        S_dmask [optional, if return_attn_probs=True]: None.
    """
    _unsupported(dropout_p, softcap, alibi_slopes)
    if block_table is not None:
        raise NotImplementedError("stria: block_table (paged KV cache) is not supported")
    cq, ck = _cu_seqlens(cu_seqlens_q), _cu_seqlens(cu_seqlens_k)
    if cq != ck:
        raise NotImplementedError("stria: cu_seqlens_q and cu_seqlens_k must be equal (the "
                                  "service computes self-attention within each document)")
    _check_tensors(q, k, v)
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"stria: varlen q, k, v must be 3-D [total, H, D] (got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)})")
    if cq is not None and max_seqlen_q is not None and len(cq) > 1:
        longest = max(b - a for a, b in zip(cq, cq[1:]))
        if longest > int(max_seqlen_q):
            raise ValueError(f"stria: max_seqlen_q {max_seqlen_q} is below the longest "
                             f"document ({longest} tokens)")
    out = attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), causal=causal,
                    softmax_scale=softmax_scale, window_size=window_size, cu_seqlens=cq,
                    return_lse=return_attn_probs)
    if return_attn_probs:
        return out[0].squeeze(0), out[1].squeeze(0), None
    return cast(torch.Tensor, out).squeeze(0)
