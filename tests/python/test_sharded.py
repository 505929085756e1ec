"""Sharded mode: the layout math against libstria's (common/layout.c),
shard/unshard round trips, and sharded_attention's clear refusal while
libstria lacks sharded jobs."""

import ctypes

import pytest
import torch

import stria
from stria import _lib


class _Layout(ctypes.Structure):  # stria_layout_t (common/stria_common.h)
    _fields_ = [("kind", ctypes.c_int), ("n_ranks", ctypes.c_int), ("seq", ctypes.c_int64),
                ("seq_padded", ctypes.c_int64), ("shard_tokens", ctypes.c_int64)]


def c_positions(seq_len, rank, n, layout):
    """The real tokens' positions of a rank, from the C layout code that
    libstria carries (an internal function, here only as the reference)."""
    L = _lib.lib()
    L.stria_layout_init.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                                    ctypes.POINTER(_Layout)]
    L.stria_layout_position.restype = ctypes.c_int64
    L.stria_layout_position.argtypes = [ctypes.POINTER(_Layout), ctypes.c_int, ctypes.c_int64]
    lay = _Layout()
    assert L.stria_layout_init(_lib.LAYOUTS[layout], n, seq_len, ctypes.byref(lay)) == 0
    pos = [L.stria_layout_position(ctypes.byref(lay), rank, i) for i in range(lay.shard_tokens)]
    return [p for p in pos if p < seq_len]


@pytest.mark.parametrize("layout", ["striped", "contiguous", "zigzag"])
@pytest.mark.parametrize("seq_len,n", [(1, 1), (7, 4), (16, 4), (509, 4), (1000, 3), (33, 8)])
def test_positions_match_the_c_layout(seq_len, n, layout):
    seen = []
    for r in range(n):
        got = stria.shard_positions(seq_len, r, n, layout)
        assert got.tolist() == c_positions(seq_len, r, n, layout), (r, layout)
        seen += got.tolist()
    assert sorted(seen) == list(range(seq_len))


@pytest.mark.parametrize("layout", ["striped", "contiguous", "zigzag"])
def test_shard_unshard_round_trip(layout):
    x = torch.randn(2, 301, 3, 8)
    shards = [stria.shard(x, 1, rank=r, world_size=4, layout=layout) for r in range(4)]
    assert sum(s.shape[1] for s in shards) == 301
    assert torch.equal(stria.unshard(shards, 1, seq_len=301, layout=layout), x)
    # another dim
    y = x.transpose(0, 1).contiguous()
    shards = [stria.shard(y, 0, rank=r, world_size=4, layout=layout) for r in range(4)]
    assert torch.equal(stria.unshard(shards, 0, seq_len=301, layout=layout), y)


def test_bad_arguments():
    with pytest.raises(ValueError, match="name their layout"):
        stria.shard_positions(10, 0, 2, "auto")
    with pytest.raises(ValueError, match="rank"):
        stria.shard_positions(10, 2, 2)
    with pytest.raises(ValueError, match="shard 1"):
        stria.unshard([torch.zeros(1, 5), torch.zeros(1, 4)], 1, seq_len=10)


def test_sharded_attention_names_the_missing_c_api():
    x = torch.zeros(1, 8, 2, 16)
    with pytest.raises(NotImplementedError, match="stria_client_submit.*stria_job_export"):
        stria.sharded_attention(x, x, x, seq_len=32)


def _gather_rank(rank, world, init, layout, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        x = torch.arange(2 * 301 * 3, dtype=torch.float32).reshape(2, 301, 3)
        mine = stria.shard(x, 1, rank=rank, world_size=world, layout=layout)
        whole = stria.unshard(mine, 1, seq_len=301, layout=layout)
        torch.save(torch.equal(whole, x), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["zigzag"])
def test_unshard_over_a_gloo_group(tmp_path, layout):
    """4 processes: each rank's shard gathered back over torch.distributed."""
    import torch.multiprocessing as mp

    init = f"file://{tmp_path}/rendezvous"
    out = str(tmp_path / "ok")
    mp.start_processes(_gather_rank, args=(4, init, layout, out), nprocs=4,
                       start_method="fork")
    assert all(torch.load(f"{out}.{r}") for r in range(4))
