"""stria's forward and backward as torch custom ops (torch.library), so that
torch.compile traces a model calling stria.attention without a graph break.

An op's schema takes only tensors and scalars: the client is reached
through an integer key (0: the default client, looked up when the op
runs; else a client registered here, held weakly). The ops run their
bodies eagerly (in compiled code too): they talk to the service through
ctypes, so CUDA graphs cannot capture them."""

import threading
import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, cast

import torch

from .client import Client, default_client

if TYPE_CHECKING:
    from .attention import _Config
    from .sharded import _Sharded

_lock = threading.Lock()
_clients: Dict[int, "weakref.ref[Client]"] = {}  # key -> weakref to a Client
_keys: Dict[int, int] = {}  # id(client) -> key


@torch.compiler.assume_constant_result  # type: ignore[untyped-decorator]
def client_key(client: Optional[Client]) -> int:
    """The integer key of `client` (None: 0, the default client at call
    time). torch.compile takes it as a constant when it traces a call."""
    if client is None:
        return 0
    with _lock:
        key = _keys.get(id(client))
        if key is not None and _clients[key]() is client:
            return key
        key = len(_clients) + 1
        _clients[key] = weakref.ref(client)
        _keys[id(client)] = key
        return key


def _client(key: int) -> Client:
    if key == 0:
        return default_client()
    client = _clients[key]()
    if client is None:
        raise ValueError("stria: the client of this call was garbage-collected")
    return client


def _config(q: torch.Tensor, key: int, causal: bool, scale: Optional[float],
            window: Optional[List[int]], cu_seqlens: Optional[Sequence[int]],
            positions: Optional[torch.Tensor], layout: int, ring_size: int) -> "_Config":
    from .attention import _Config

    if positions is not None:  # documents from restarting position_ids (stria.hf)
        from .hf import _documents

        cu_seqlens = _documents(positions, q.shape[1])
    return _Config(_client(key), causal, scale, None if window is None else tuple(window),
                   None if cu_seqlens is None else tuple(cu_seqlens), layout, ring_size)


@torch.library.custom_op(  # type: ignore[untyped-decorator]
    "stria::attention_forward", mutates_args=())
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: int, causal: bool,
                      scale: Optional[float], window: Optional[List[int]],
                      cu_seqlens: Optional[List[int]], positions: Optional[torch.Tensor],
                      layout: int, ring_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """O and LSE of whole sequences (stria.attention's forward)."""
    from .attention import _forward, _session_forward

    cfg = _config(q, key, causal, scale, window, cu_seqlens, positions, layout, ring_size)
    if cfg.client.keep_jobs:  # a job, released at once (backward recomputes)
        return cast(Tuple[torch.Tensor, torch.Tensor],
                    tuple(_forward(cfg, q, k, v, keep=False)[:2]))
    return cast(Tuple[torch.Tensor, torch.Tensor], tuple(_session_forward(cfg, q, k, v)))


@attention_forward.register_fake  # type: ignore[untyped-decorator]
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: int, causal: bool,
      scale: Optional[float], window: Optional[List[int]], cu_seqlens: Optional[List[int]],
      positions: Optional[torch.Tensor], layout: int, ring_size: int
      ) -> Tuple[torch.Tensor, torch.Tensor]:
    B, S, H, _ = q.shape
    return (q.new_empty(q.shape), q.new_empty((B, H, S), dtype=torch.float32))


@torch.library.custom_op(  # type: ignore[untyped-decorator]
    "stria::attention_backward", mutates_args=())
def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                       lse: torch.Tensor, do: torch.Tensor, key: int, causal: bool,
                       scale: Optional[float], window: Optional[List[int]],
                       cu_seqlens: Optional[List[int]], positions: Optional[torch.Tensor],
                       layout: int, ring_size: int
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV: the saved tensors and dO sent to a session."""
    from .attention import _backward, _session_backward

    cfg = _config(q, key, causal, scale, window, cu_seqlens, positions, layout, ring_size)
    if cfg.client.keep_jobs:
        return cast(Tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                    tuple(_backward(cfg, None, q, k, v, do)))
    return cast(Tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                tuple(_session_backward(cfg, q, k, v, o, lse, do)))


@attention_backward.register_fake  # type: ignore[untyped-decorator]
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
      do: torch.Tensor, key: int, causal: bool, scale: Optional[float],
      window: Optional[List[int]], cu_seqlens: Optional[List[int]],
      positions: Optional[torch.Tensor], layout: int, ring_size: int
      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_N_OPTIONS = 8  # the forward's arguments after q, k, v
_POSITIONS = 5  # positions' index among them


def _setup_context(ctx: Any, inputs: Tuple[Any, ...],
                   output: Tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, v = inputs[:3]
    o, lse = output
    options = list(inputs[3:])
    positions, options[_POSITIONS] = options[_POSITIONS], None
    ctx.save_for_backward(q, k, v, o, lse, *(() if positions is None else (positions,)))
    ctx.options = options
    ctx.mark_non_differentiable(lse)


def _backward_fn(ctx: Any, do: torch.Tensor, _dlse: Optional[torch.Tensor]
                 ) -> Tuple[Optional[torch.Tensor], ...]:
    q, k, v, o, lse, *positions = ctx.saved_tensors
    options = list(ctx.options)
    if positions:
        options[_POSITIONS] = positions[0]
    dq, dk, dv = attention_backward(q, k, v, o, lse, do, *options)
    return (dq, dk, dv) + (None,) * _N_OPTIONS


attention_forward.register_autograd(_backward_fn, setup_context=_setup_context)


# ---- sharded_attention ----------------------------------------------------------

# key -> (client key, group, seq_len, layout name)
_groups: Dict[int, Tuple[int, Any, int, str]] = {}
# (client key, id(group), seq_len, layout name) -> key
_group_keys: Dict[Tuple[int, Optional[int], int, str], int] = {}


@torch.compiler.assume_constant_result  # type: ignore[untyped-decorator]
def sharded_key(client: Optional[Client], group: Any, seq_len: int, layout_name: str) -> int:
    """The integer key of a sharded call's client, group (None: the world),
    sequence length and layout; the group is held here."""
    ck = client_key(client)
    with _lock:
        ident = (ck, None if group is None else id(group), seq_len, layout_name)
        key = _group_keys.get(ident)
        if key is None or _groups[key][1] is not group:
            key = len(_groups) + 1
            _groups[key] = (ck, group, seq_len, layout_name)
            _group_keys[ident] = key
        return key


def _sharded(key: int, causal: bool, scale: Optional[float], window: Optional[List[int]],
             cu_seqlens: Optional[List[int]]) -> "_Sharded":
    from . import _lib
    from .attention import _Config
    from .sharded import _dist, _Sharded

    ck, group, seq_len, layout_name = _groups[key]
    dist = _dist()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    cfg = _Config(_client(ck), causal, scale, None if window is None else tuple(window),
                  None if cu_seqlens is None else tuple(cu_seqlens), _lib.LAYOUTS[layout_name],
                  world)
    return _Sharded(cfg, group, rank, world, seq_len, layout_name)


@torch.library.custom_op(  # type: ignore[untyped-decorator]
    "stria::sharded_forward", mutates_args=())
def sharded_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: int, causal: bool,
                    scale: Optional[float], window: Optional[List[int]],
                    cu_seqlens: Optional[List[int]]) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's O and LSE (stria.sharded_attention's forward); the
    first call of a kind is a collective over the group."""
    from .sharded import _session_forward, _sharded_forward

    sh = _sharded(key, causal, scale, window, cu_seqlens)
    if sh.cfg.client.keep_jobs:
        return cast(Tuple[torch.Tensor, torch.Tensor],
                    tuple(_sharded_forward(sh, q, k, v, want_keep=False)[:2]))
    return cast(Tuple[torch.Tensor, torch.Tensor], tuple(_session_forward(sh, q, k, v)))


@sharded_forward.register_fake  # type: ignore[untyped-decorator]
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: int, causal: bool,
      scale: Optional[float], window: Optional[List[int]], cu_seqlens: Optional[List[int]]
      ) -> Tuple[torch.Tensor, torch.Tensor]:
    B, T, H, _ = q.shape
    return (q.new_empty(q.shape), q.new_empty((B, H, T), dtype=torch.float32))


@torch.library.custom_op(  # type: ignore[untyped-decorator]
    "stria::sharded_backward", mutates_args=())
def sharded_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                     lse: torch.Tensor, do: torch.Tensor, key: int, causal: bool,
                     scale: Optional[float], window: Optional[List[int]],
                     cu_seqlens: Optional[List[int]]
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's dQ, dK, dV."""
    from .sharded import _session_backward, _sharded_backward

    sh = _sharded(key, causal, scale, window, cu_seqlens)
    if sh.cfg.client.keep_jobs:
        return cast(Tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                    tuple(_sharded_backward(sh, None, q, k, v, do)))
    return cast(Tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                tuple(_session_backward(sh, q, k, v, o, lse, do)))


@sharded_backward.register_fake  # type: ignore[untyped-decorator]
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
      do: torch.Tensor, key: int, causal: bool, scale: Optional[float],
      window: Optional[List[int]], cu_seqlens: Optional[List[int]]
      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _sharded_setup_context(ctx: Any, inputs: Tuple[Any, ...],
                           output: Tuple[torch.Tensor, torch.Tensor]) -> None:
    ctx.save_for_backward(*inputs[:3], *output)
    ctx.options = inputs[3:]
    ctx.mark_non_differentiable(output[1])


def _sharded_backward_fn(ctx: Any, do: torch.Tensor, _dlse: Optional[torch.Tensor]
                         ) -> Tuple[Optional[torch.Tensor], ...]:
    dq, dk, dv = sharded_backward(*ctx.saved_tensors, do, *ctx.options)
    return (dq, dk, dv) + (None,) * len(ctx.options)


sharded_forward.register_autograd(_sharded_backward_fn, setup_context=_sharded_setup_context)
