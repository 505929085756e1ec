"""Sharded mode for torch.distributed trainers: which tokens a rank holds
(the service's layout math, common/layout.c), moving tensors between whole
sequences and shards, and sharded_attention.

Layouts over N ranks, the sequence padded to a multiple of N (2N for zigzag),
padded positions S, S+1, ... dropped:
  striped:    rank r holds r, r+N, r+2N, ...
  contiguous: rank r holds [r*L, (r+1)*L), L the padded length / N
  zigzag:     2N chunks of c = L/2; rank r holds chunks r and 2N-1-r
Positions increase within every shard, so a rank's real tokens are a prefix
of its padded shard, in this order.
"""

import torch

_SHARD_LAYOUTS = ("striped", "contiguous", "zigzag")

MISSING_C_API = ("stria_client_submit, stria_job_export, stria_job_import and "
                 "stria_client_forward_shard/stria_client_backward_shard")


def _check(seq_len, rank, world_size, layout):
    if layout not in _SHARD_LAYOUTS:
        raise ValueError(f"stria: sharded calls name their layout: one of "
                         f"{', '.join(_SHARD_LAYOUTS)} (not {layout!r})")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"stria: world_size must be an int >= 1, not {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"stria: rank {rank!r} outside 0..{world_size - 1}")
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"stria: seq_len must be an int >= 1, not {seq_len!r}")


def shard_positions(seq_len, rank, world_size, layout="striped"):
    """The positions (int64 tensor, increasing) of the real tokens that rank
    `rank` of `world_size` holds under `layout`, in the order of its shard:
    the positions to give rotary embeddings, and the rows shard() takes."""
    _check(seq_len, rank, world_size, layout)
    n = world_size
    unit = 2 * n if layout == "zigzag" else n
    padded = (seq_len + unit - 1) // unit * unit
    L = padded // n
    if layout == "striped":
        pos = torch.arange(rank, padded, n, dtype=torch.int64)
    elif layout == "contiguous":
        pos = torch.arange(rank * L, (rank + 1) * L, dtype=torch.int64)
    else:
        c = L // 2
        lo = (2 * n - 1 - rank) * c
        pos = torch.cat([torch.arange(rank * c, (rank + 1) * c, dtype=torch.int64),
                         torch.arange(lo, lo + c, dtype=torch.int64)])
    return pos[pos < seq_len]


def shard(x, dim=1, *, rank, world_size, layout="striped"):
    """This rank's tokens of a whole-sequence tensor (tokens along `dim`,
    default 1 as in [B, S, H, D]), in shard order."""
    seq_len = x.shape[dim]
    return x.index_select(dim, shard_positions(seq_len, rank, world_size, layout).to(x.device))


def unshard(x, dim=1, *, seq_len, layout="striped", group=None):
    """The whole sequence back from shards: `x` is either the list of every
    rank's shard (rank order), or this rank's shard, gathered over the
    torch.distributed `group` (default: the world)."""
    if isinstance(x, (list, tuple)):
        shards = list(x)
    else:
        import torch.distributed as dist

        n = dist.get_world_size(group)
        rank = dist.get_rank(group)
        mine = shard_positions(seq_len, rank, n, layout).numel()
        if x.shape[dim] != mine:
            raise ValueError(f"stria: rank {rank} holds {mine} tokens of {seq_len} under "
                             f"{layout}, the shard has {x.shape[dim]}")
        # Shards differ in length by the padding: gather padded, then cut.
        longest = max(shard_positions(seq_len, r, n, layout).numel() for r in range(n))
        pad = list(x.shape)
        pad[dim] = longest - mine
        padded = torch.cat([x, x.new_zeros(pad)], dim).contiguous()
        got = [torch.empty_like(padded) for _ in range(n)]
        dist.all_gather(got, padded, group=group)
        shards = [g.narrow(dim, 0, shard_positions(seq_len, r, n, layout).numel())
                  for r, g in enumerate(got)]
    n = len(shards)
    if n < 1:
        raise ValueError("stria: unshard needs at least one shard")
    shape = list(shards[0].shape)
    shape[dim] = seq_len
    out = shards[0].new_empty(shape)
    for r, s in enumerate(shards):
        pos = shard_positions(seq_len, r, n, layout).to(s.device)
        if s.shape[dim] != pos.numel():
            raise ValueError(f"stria: shard {r} has {s.shape[dim]} tokens, rank {r} of {n} "
                             f"holds {pos.numel()} of {seq_len} under {layout}")
        out.index_copy_(dim, pos, s)
    return out


def sharded_attention(q, k, v, *, group=None, seq_len, layout="striped", causal=True,
                      softmax_scale=None, window_size=(-1, -1), cu_seqlens=None,
                      return_lse=False, client=None):
    """Attention for torch.distributed trainers where each rank of `group`
    passes the tokens it holds (shard_positions order); the ring size is the
    group's size.

    Not available yet: it needs libstria's sharded-job calls."""
    raise NotImplementedError(
        f"stria.sharded_attention needs libstria's sharded-job API ({MISSING_C_API}), which "
        f"this libstria does not have yet; use stria.attention on whole sequences, or "
        f"stria.shard/stria.unshard around it")
