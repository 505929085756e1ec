"""Sharded mode: the layout math against libstria's (common/layout.c and a
submitted job's stria_job_positions), shard/unshard round trips, and
sharded_attention over 4 processes of a gloo group against the whole-sequence
stria.attention on the same ring."""

import ctypes
import os
import time

import pytest
import torch

import stria
from stria import _lib


class _Layout(ctypes.Structure):  # stria_layout_t (common/stria_layout.h)
    _fields_ = [("kind", ctypes.c_int), ("n_ranks", ctypes.c_int), ("seq", ctypes.c_int64),
                ("seq_padded", ctypes.c_int64), ("shard_tokens", ctypes.c_int64),
                ("plan", ctypes.c_void_p)]


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


def c_plan_positions(cu, seq_len, n, causal=True, window=None):
    """Every rank's positions from the C document plan itself
    (stria_docplan_make, bypassing the cache and the public call), the
    reference for stria.shard_positions(layout="packed")."""
    from stria.session import make_call  # noqa: F401  (the Call record's layout)

    L = _lib.lib()

    class Shape(ctypes.Structure):  # stria_call_shape_t (common/stria_call.h)
        _fields_ = [("batch", ctypes.c_int64), ("seq_len", ctypes.c_int64),
                    ("causal", ctypes.c_bool), ("scale", ctypes.c_float),
                    ("cu_seqlens", ctypes.POINTER(ctypes.c_int64)),
                    ("n_cu_seqlens", ctypes.c_size_t), ("has_window", ctypes.c_bool),
                    ("window_left", ctypes.c_int64), ("window_right", ctypes.c_int64)]

    arr = (ctypes.c_int64 * len(cu))(*cu)
    shape = Shape(1, seq_len, causal, 0.0, arr, len(cu), window is not None,
                  *(window or (0, 0)))
    L.stria_docplan_make.argtypes = [ctypes.POINTER(Shape), ctypes.c_int, ctypes.c_int64,
                                     ctypes.POINTER(ctypes.c_void_p)]
    L.stria_docplan_position.restype = ctypes.c_int64
    L.stria_docplan_position.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    L.stria_docplan_unref.argtypes = [ctypes.c_void_p]
    plan = ctypes.c_void_p()
    shard = (seq_len + n - 1) // n
    assert L.stria_docplan_make(ctypes.byref(shape), n, shard, ctypes.byref(plan)) == 0
    try:
        out = []
        for r in range(n):
            pos = [L.stria_docplan_position(plan, r, i) for i in range(shard)]
            out.append([p for p in pos if p < seq_len])
        return out
    finally:
        L.stria_docplan_unref(plan)


def _random_documents(g, seq_len, median):
    cu = [0]
    while cu[-1] < seq_len:
        cu.append(min(seq_len, cu[-1] + max(1, int(torch.empty(1).log_normal_(
            float(torch.tensor(median).log()), 1.0, generator=g).item()))))
    return cu


@pytest.mark.parametrize("seed", range(12))
def test_packed_positions_are_the_c_plan(seed):
    """A sweep of random documents (lengths 1 to longer than a shard, none
    divisible by anything in particular), ranks 1..8, causal or not, with and
    without a window: stria.shard_positions(layout="packed") is the C plan's
    placement, every token placed once, most short documents whole on one
    rank, and striping when there is one document."""
    g = torch.Generator().manual_seed(seed)
    n = 1 + seed % 8
    seq_len = int(torch.randint(n, 3000, (1,), generator=g))
    cu = _random_documents(g, seq_len, [4, 40, 400][seed % 3])
    causal = seed % 2 == 0
    window = (16, 0 if causal else 16) if seed % 4 >= 2 else None
    ws = window if window is not None else (-1, -1)
    got = [stria.shard_positions(seq_len, r, n, "packed", cu_seqlens=cu, causal=causal,
                                 window_size=ws).tolist() for r in range(n)]
    want = c_plan_positions(cu, seq_len, n, causal, window) if len(cu) > 2 else \
        [stria.shard_positions(seq_len, r, n, "striped").tolist() for r in range(n)]
    assert got == want
    assert sorted(p for r in got for p in r) == list(range(seq_len))
    owner = {p: r for r, ps in enumerate(got) for p in ps}
    whole = sum(len({owner[p] for p in range(a, b)}) == 1 for a, b in zip(cu, cu[1:]) if b > a)
    if seed % 3 == 0 and window is None:  # hundreds of short documents: most fit a rank
        assert whole > (len(cu) - 1) // 2, f"{whole} of {len(cu) - 1} documents kept whole"
    # the same answer again (the process's plan cache) and through shard()
    x = torch.arange(seq_len).view(1, seq_len, 1, 1)
    for r in range(n):
        s = stria.shard(x, 1, rank=r, world_size=n, layout="packed", cu_seqlens=cu,
                        causal=causal, window_size=ws)
        assert s.flatten().tolist() == got[r]
    shards = [stria.shard(x, 1, rank=r, world_size=n, layout="packed", cu_seqlens=cu,
                          causal=causal, window_size=ws) for r in range(n)]
    assert torch.equal(stria.unshard(shards, 1, seq_len=seq_len, layout="packed",
                                     cu_seqlens=cu, causal=causal, window_size=ws), x)


def test_packed_bad_documents_are_refused_as_the_service_refuses_them():
    with pytest.raises(ValueError, match="cu_seqlens must end at seq_len"):
        stria.shard_positions(100, 0, 4, "packed", cu_seqlens=[0, 10, 90])
    with pytest.raises(ValueError, match="cu_seqlens must not decrease"):
        stria.shard_positions(100, 0, 4, "packed", cu_seqlens=[0, 50, 40, 100])
    with pytest.raises(ValueError, match="cu_seqlens"):
        stria.shard_positions(100, 0, 4, "packed", cu_seqlens=[5, 50, 100])
    # one document, or none: striped
    assert stria.shard_positions(100, 1, 4, "packed").tolist() == \
        stria.shard_positions(100, 1, 4, "striped").tolist()


def test_bad_arguments():
    with pytest.raises(ValueError, match="name their layout"):
        stria.shard_positions(10, 0, 2, "auto")
    with pytest.raises(ValueError, match="rank"):
        stria.shard_positions(10, 2, 2)
    with pytest.raises(ValueError, match="shard 1"):
        stria.unshard([torch.zeros(1, 5), torch.zeros(1, 4)], 1, seq_len=10)


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


# ---- stria_job_positions of a real sharded job -------------------------------------

def _spec(client, B, S, H, Hkv, D, layout, ring):
    from stria.attention import _Config

    cfg = _Config(client, True, None, None, None, _lib.LAYOUTS[layout], ring)
    return cfg.spec(torch.empty(B, 1, H, D), torch.empty(B, 1, Hkv, D), S)[0]


@pytest.fixture
def short_ttl(cluster):
    """A client whose jobs expire after 1 s idle: a sharded job whose
    handles ran no rank cannot be released (releasing such a handle frees
    nothing: the job ends when every rank has run and released), so the
    service drops it at its TTL."""
    with stria.Client(cluster.address, ttl=1) as c:
        yield c


@pytest.mark.parametrize("layout", ["striped", "contiguous", "zigzag"])
def test_shard_positions_agree_with_the_job(short_ttl, no_active_jobs, layout):
    """A submitted job's positions (stria_job_positions) are
    shard_positions', rank by rank, and an imported handle says the same."""
    client = short_ttl
    for S in (77, 8, 1000):
        job = client.submit(_spec(client, 1, S, 2, 2, 16, layout, 4))
        try:
            assert (job.ring_size, job.layout) == (4, layout)
            other = client.import_job(job.export())
            try:
                assert other.id == job.id
                for r in range(4):
                    want = stria.shard_positions(S, r, 4, layout)
                    assert torch.equal(job.positions(r), want), (S, r)
                    assert torch.equal(other.positions(r), want), (S, r)
                    assert job.shard_tokens(r) == want.numel()
            finally:
                other.release()
            with pytest.raises(ValueError, match="rank 4 outside"):
                job.shard_tokens(4)
        finally:
            job.release()


def test_job_export_and_import(short_ttl, cluster, no_active_jobs):
    client = short_ttl
    job = client.submit(_spec(client, 1, 16, 2, 2, 16, "striped", 2))
    try:
        data = job.export()
        assert len(data) == _lib.JOB_EXPORT_BYTES == 48
        forged = data[:-1] + bytes([data[-1] ^ 1])  # the secret is checked
        with pytest.raises(stria.StriaError):
            client.import_job(forged).release()
    finally:
        job.release()
    deadline = time.monotonic() + 10
    while cluster.active_jobs() and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(stria.StriaError):  # expired: the service forgot it
        client.import_job(data).release()


# ---- refusals without a group ----------------------------------------------------

def test_sharded_attention_refusals_without_a_group():
    x = torch.zeros(1, 8, 2, 16)
    with pytest.raises(ValueError, match="sharded calls name their layout.*'auto'"):
        stria.sharded_attention(x, x, x, seq_len=32, layout="auto")
    with pytest.raises(RuntimeError, match="init_process_group"):
        stria.sharded_attention(x, x, x, seq_len=32)


# ---- 4 processes of a gloo group ---------------------------------------------------

WORLD = 4
B, S = 2, 77  # S not a multiple of 4 or 8: padded shards
# name: (layout, heads, kv_heads, head_dim, options)
CASES = {
    "striped": ("striped", 4, 4, 32, {}),
    "zigzag": ("zigzag", 4, 4, 32, {}),
    "contiguous": ("contiguous", 4, 4, 32, {}),
    "gqa-zigzag": ("zigzag", 4, 1, 32, {}),
    "noncausal-window-scale": ("striped", 2, 2, 16,
                               dict(causal=False, window_size=(9, 5), softmax_scale=0.3)),
    "keep-striped": ("striped", 4, 2, 32, dict(keep=True)),
    # documents placed by their work: short ones kept whole on a rank
    "packed-docs": ("packed", 4, 2, 32, dict(cu_seqlens=[0, 3, 10, 11, 40, 77])),
    "packed-docs-window": ("packed", 2, 1, 16,
                           dict(cu_seqlens=[0, 1, 9, 30, 31, 52, 77], window_size=(6, 0))),
}


def _inputs(name):
    layout, H, Hkv, D, _ = CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return [torch.randn(*shape, generator=g) for shape in
            ((B, S, H, D), (B, S, Hkv, D), (B, S, Hkv, D), (B, S, H, D))]


def _opts(name):
    opts = dict(CASES[name][4])
    opts.pop("keep", None)
    return opts


def _masks(name):
    """What the case's shards depend on (packed: its documents and masks)."""
    opts = _opts(name)
    return {k: opts[k] for k in ("cu_seqlens", "causal", "window_size") if k in opts}


def _count_collectives(dist):
    """Counts the torch.distributed collectives sharded_attention runs."""
    counts = {"all_gather": 0, "broadcast": 0}
    for name in counts:
        real = getattr(dist, name)

        def counting(*a, _real=real, _name=name, **kw):
            counts[_name] += 1
            return _real(*a, **kw)

        setattr(dist, name, counting)
    return counts


def _refused(fn):
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def _sharded_rank(rank, world, init, address, out, device):
    """One rank: every case, calls that reuse a session, then the refusals;
    results to files."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    counts = _count_collectives(dist)
    plain = stria.Client(address, step_timeout=60, arrival_timeout=30)
    keeping = stria.Client(address, step_timeout=60, arrival_timeout=30, keep_jobs=2)
    try:
        res = {}
        for name, (layout, *_rest) in CASES.items():
            c = keeping if CASES[name][4].get("keep") else plain
            q, k, v, do = (stria.shard(t, 1, rank=rank, world_size=world, layout=layout,
                                       **_masks(name))
                           .to(device).requires_grad_() for t in _inputs(name))
            o, lse = stria.sharded_attention(q, k, v, seq_len=S, layout=layout,
                                             return_lse=True, client=c, **_opts(name))
            kept = c.jobs_kept
            o.backward(do.detach())
            res[name] = dict(o=o.detach().cpu(), lse=lse.cpu(), dq=q.grad.cpu(),
                             dk=k.grad.cpu(), dv=v.grad.cpu(), kept=kept, after=c.jobs_kept,
                             device=str(o.device))
        # no_grad, on the striped case's session
        q, k, v, _ = (stria.shard(t, 1, rank=rank, world_size=world, layout="striped")
                      for t in _inputs("striped"))
        with torch.no_grad():
            res["no_grad"] = stria.sharded_attention(q.to(device), k.to(device), v.to(device),
                                                     seq_len=S, client=plain).cpu()
        # more calls of the striped case's session, other lengths within its
        # bounds: no collective, no other session
        before = dict(counts)
        for n in (S, 50, 33, S, 64):
            xs = [stria.shard(t[:, :n], 1, rank=rank, world_size=world, layout="striped")
                  .to(device).requires_grad_() for t in _inputs("striped")]
            stria.sharded_attention(*xs[:3], seq_len=n, client=plain).backward(xs[3].detach())
        res["reuse"] = dict(before=before, after=dict(counts),
                            sessions=len(plain.sessions), kept=len(keeping.sessions))
        # refusals at a session's opening (a kind no session of the group
        # has: 3, 5, 6 heads; head_dim 20): every rank raises, naming the
        # rank at fault
        errors = {}

        def x(H, D=16, n=S):
            t = torch.zeros(1, stria.shard_positions(n, rank, world, "striped").numel(), H, D)
            return t.to(device)

        t3 = x(3)
        cut = slice(0, -1 if rank == 2 else None)
        errors["tokens"] = _refused(lambda: stria.sharded_attention(
            t3[:, cut], t3[:, cut], t3[:, cut], seq_len=S, client=plain))
        t5 = x(5)
        bad = t5.double() if rank == 1 else t5
        errors["dtype"] = _refused(lambda: stria.sharded_attention(bad, t5, t5, seq_len=S,
                                                                   client=plain))
        t6 = x(6)
        errors["causal"] = _refused(lambda: stria.sharded_attention(
            t6, t6, t6, seq_len=S, client=plain, causal=rank != 3))
        t20 = x(2, 20)  # head_dim 20: the service refuses rank 0's session
        errors["submit"] = _refused(lambda: stria.sharded_attention(t20, t20, t20, seq_len=S,
                                                                    client=plain))
        res["errors"] = errors
        torch.save(res, f"{out}.{rank}")
    finally:
        plain.close()
        keeping.close()
        dist.destroy_process_group()


def _run_ranks(tmp, address, device, start_method, timeout=300):
    import torch.multiprocessing as mp

    init = f"file://{tmp}/rendezvous"
    out = os.path.join(tmp, "rank")
    ctx = mp.start_processes(_sharded_rank, args=(WORLD, init, address, out, device),
                             nprocs=WORLD, start_method=start_method, join=False)
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {WORLD} ranks did not finish within {timeout} s")
    return [torch.load(f"{out}.{r}") for r in range(WORLD)]


@pytest.fixture(scope="module")
def sharded_runs(cluster, client, tmp_path_factory):
    """The 4 ranks' results (forked: the small inputs are rebuilt in each)."""
    return _run_ranks(str(tmp_path_factory.mktemp("sharded")), cluster.address, "cpu", "fork")


def _whole(name):
    """The whole-sequence call on the same ring: O, LSE, dQ, dK, dV."""
    layout = CASES[name][0]
    q, k, v, do = _inputs(name)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o, lse = stria.attention(q, k, v, layout=layout, ring_size=WORLD, return_lse=True,
                             **_opts(name))
    o.backward(do)
    return dict(o=o.detach(), lse=lse, dq=q.grad, dk=k.grad, dv=v.grad)


def _unshard(runs, name, key):
    layout = CASES[name][0]
    dim = 2 if key == "lse" else 1
    return stria.unshard([r[name][key] for r in runs], dim, seq_len=S, layout=layout,
                         **_masks(name))


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_equals_the_whole_sequence(sharded_runs, client, name):
    """O, LSE and every gradient, put back together from the 4 ranks, are
    the whole-sequence call's bits (the same ring computes them), and the
    float64 reference's values."""
    from reference import attention as ref_attention, max_err

    want = _whole(name)
    for key in ("o", "lse", "dq", "dk", "dv"):
        got = _unshard(sharded_runs, name, key)
        assert torch.equal(got, want[key]), \
            f"{name}: {key} differs from the whole-sequence call by " \
            f"{(got - want[key]).abs().max().item():.3g}"
    q, k, v, do = (t.double().requires_grad_() for t in _inputs(name))
    opts = _opts(name)
    o, _ = ref_attention(q, k, v, opts.get("causal", True), opts.get("softmax_scale"),
                         opts.get("window_size"), opts.get("cu_seqlens"))
    o.backward(do)
    for key, ref in (("o", o), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert max_err(_unshard(sharded_runs, name, key), ref) < 1e-4, (name, key)


def test_sharded_job_lifetime(sharded_runs, no_active_jobs):
    """The session path keeps no job between forward and backward; keep mode
    holds the job until backward; every rank released its handles and
    closed its sessions (the fixture: no job left on the service)."""
    for r in sharded_runs:
        assert (r["striped"]["kept"], r["striped"]["after"]) == (0, 0)
        assert (r["keep-striped"]["kept"], r["keep-striped"]["after"]) == (1, 0)


def test_sharded_calls_after_the_first_run_no_collective(sharded_runs):
    """Five more forward and backward calls of the striped case, three other
    lengths: no torch.distributed collective, no new session."""
    for r in sharded_runs:
        reuse = r["reuse"]
        assert reuse["after"] == reuse["before"], reuse
        # 7 kinds (the job-path case keeps none), at most max_sessions
        assert reuse["sessions"] == 4 and reuse["kept"] == 0



def test_sharded_refusals_name_the_rank(sharded_runs):
    for rank, r in enumerate(sharded_runs):
        e = r["errors"]
        assert e["tokens"].startswith("ValueError") and "rank 2 passes 18 tokens, it holds 19" in \
            e["tokens"], e["tokens"]
        if rank == 1:
            assert e["dtype"].startswith("TypeError") and "float64" in e["dtype"]
        else:
            assert e["dtype"].startswith("RuntimeError") and "rank 1 of the group refused" \
                in e["dtype"], e["dtype"]
        assert e["causal"].startswith("ValueError") and "rank 3's causal (0) differs" in \
            e["causal"], e["causal"]
        if rank == 0:
            assert e["submit"].startswith("InvalidArgumentError") and "head_dim" in e["submit"]
        else:
            assert e["submit"].startswith("RuntimeError") and "rank 0 of the group could not " \
                "open the session" in e["submit"], e["submit"]


def _mismatch_rank(rank, world, init, address, out):
    """Rank 1 passes causal=False on an open session: libstria (not a
    collective) fails that call on every rank; then a call that agrees.
    Then a session that expires."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    counts = _count_collectives(dist)
    c = stria.Client(address, step_timeout=60, arrival_timeout=30)
    try:
        q, k, v, _ = (stria.shard(t, 1, rank=rank, world_size=world, layout="striped")
                      for t in _inputs("striped"))
        first = stria.sharded_attention(q, k, v, seq_len=S, client=c)
        before = dict(counts)
        res = {"error": _refused(lambda: stria.sharded_attention(q, k, v, seq_len=S, client=c,
                                                                 causal=rank != 1))}
        try:
            res["after"] = stria.sharded_attention(q, k, v, seq_len=S, client=c)
            res["same"] = torch.equal(res["after"], first)
        except Exception as e:
            res["after"] = f"{type(e).__name__}: {e}"
        res["collectives"] = (before, dict(counts))
        # a session the service closed, idle past its deadline (1 s): the
        # group opens it again together, once
        with stria.Client(address, step_timeout=60, arrival_timeout=30, idle_timeout=1) as short:
            first = stria.sharded_attention(q, k, v, seq_len=S, client=short)
            ids = short.open_session_ids
            time.sleep(3)
            before = dict(counts)
            res["expired"] = _refused(lambda: res.setdefault("again", stria.sharded_attention(
                q, k, v, seq_len=S, client=short)))
            res["reopened"] = (ids, short.open_session_ids, before, dict(counts))
            res["same_again"] = torch.equal(res.get("again", first * 0), first)
        torch.save(res, f"{out}.{rank}")
    finally:
        c.close()
        dist.destroy_process_group()


def test_a_call_that_differs_between_ranks_fails_on_every_rank(tmp_path):
    """On an open session the ranks' calls are compared by libstria, not by
    a collective: rank 1's causal=False fails the call on every rank, naming
    the ranks; the session then serves the next call. And a session the
    service closed for idleness is opened again by the group at the next
    call. (A service of its own: a worker that fails here must not take the
    suite's with it.)"""
    import torch.multiprocessing as mp

    from conftest import Cluster

    cl = Cluster(n_workers=2)
    try:
        out = str(tmp_path / "rank")
        mp.start_processes(_mismatch_rank, nprocs=2, start_method="fork",
                           args=(2, f"file://{tmp_path}/rendezvous", cl.address, out))
        runs = [torch.load(f"{out}.{r}") for r in range(2)]
    finally:
        bad = cl.stop()
    # a rank that compared the differing calls fails as for bad input; the
    # other may first hear its abort (STRIA_ERR_PEER), naming the same cause
    assert any("STRIA_ERR_INVALID_ARG" in (r["error"] or "") for r in runs), runs
    for r in runs:
        assert r["error"] is not None and ("STRIA_ERR_INVALID_ARG" in r["error"] or
                                           "STRIA_ERR_PEER" in r["error"]) and \
            "differs between rank" in r["error"], r["error"]
        before, after = r["collectives"]
        assert before == after
        assert r.get("same") is True, r["after"]
        assert r["expired"] is None and r["same_again"]
        ids, ids_again, before, after = r["reopened"]
        assert len(ids) == len(ids_again) == 1 and ids != ids_again
        assert {n: after[n] - before[n] for n in after} == {"all_gather": 1, "broadcast": 1}
    assert not bad, f"{', '.join(bad)} did not exit cleanly"


GROUPED = ("striped", "packed-docs")  # the cases a head-grouped client runs


PER_WORKER = ("striped", "noncausal-window-scale")  # striped: one trainer rank per worker


def _grouped_rank(rank, world, init, address, out, per_worker=False):
    """One rank with a Client(head_groups=2) on the suite's 4 workers: of 2
    ranks, each call on 2 rings of 2 workers, rank r's tokens going to
    worker r of both rings; with `per_worker`, of 4 ranks
    (trainer_ranks="worker"), rank h 2 + l passing stripe l 2 + h with all
    its heads. Results to files."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    c = stria.Client(address, step_timeout=60, arrival_timeout=30, head_groups=2,
                     trainer_ranks="worker" if per_worker else "ring")
    try:
        res = {}
        for name in PER_WORKER if per_worker else GROUPED:
            layout = CASES[name][0]
            cut = dict(head_groups=2) if per_worker else dict(layout=layout, **_masks(name))
            q, k, v, do = (stria.shard(t, 1, rank=rank, world_size=world, **cut).requires_grad_()
                           for t in _inputs(name))
            o, lse = stria.sharded_attention(q, k, v, seq_len=S, layout=layout,
                                             return_lse=True, client=c, **_opts(name))
            o.backward(do.detach())
            res[name] = dict(o=o.detach(), lse=lse, dq=q.grad, dk=k.grad, dv=v.grad)
        s = next(iter(c.sessions))
        res["rings"] = (s.ring_size, s.ranks, s.head_groups)
        torch.save(res, f"{out}.{rank}")
    finally:
        c.close()
        dist.destroy_process_group()


def test_sharded_head_groups_over_a_gloo_group(cluster, tmp_path, no_active_jobs):
    """sharded_attention of 2 ranks through a Client(head_groups=2): sessions
    of 2 head groups x rings of 2; put together, O, LSE and every gradient
    are the whole-sequence call's bits on the same rings (a head-grouped
    client's stria.attention) and the float64 reference's values."""
    import torch.multiprocessing as mp

    from reference import attention as ref_attention, max_err

    out = str(tmp_path / "rank")
    mp.start_processes(_grouped_rank, nprocs=2, start_method="fork",
                       args=(2, f"file://{tmp_path}/rendezvous", cluster.address, out))
    runs = [torch.load(f"{out}.{r}") for r in range(2)]
    assert all(r["rings"] == (4, 2, 2) for r in runs), [r["rings"] for r in runs]
    with stria.Client(cluster.address, step_timeout=60, head_groups=2) as c:
        for name in GROUPED:
            layout = CASES[name][0]
            q, k, v, do = (t.requires_grad_() for t in _inputs(name))
            o, lse = stria.attention(q, k, v, layout=layout, ring_size=4, return_lse=True,
                                     client=c, **_opts(name))
            o.backward(do)
            want = dict(o=o.detach(), lse=lse, dq=q.grad, dk=k.grad, dv=v.grad)
            for key in want:
                got = stria.unshard([r[name][key] for r in runs], 2 if key == "lse" else 1,
                                    seq_len=S, layout=layout, **_masks(name))
                assert torch.equal(got, want[key]), (name, key)
            rq, rk, rv, rdo = (t.double().requires_grad_() for t in _inputs(name))
            opts = _opts(name)
            ro, _ = ref_attention(rq, rk, rv, opts.get("causal", True), opts.get("softmax_scale"),
                                  opts.get("window_size"), opts.get("cu_seqlens"))
            ro.backward(rdo)
            assert max_err(want["o"], ro) < 1e-4 and max_err(want["dk"], rk.grad) < 1e-4, name


def test_sharded_one_trainer_rank_per_worker_over_a_gloo_group(cluster, tmp_path,
                                                               no_active_jobs):
    """sharded_attention of 4 ranks through a Client(head_groups=2,
    trainer_ranks="worker"): sessions of 2 head groups x rings of 2 called
    by one rank per worker; put together (stria.unshard(...,
    head_groups=2)), O, LSE and every gradient are the whole-sequence
    call's bits on the same rings."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "rank")
    mp.start_processes(_grouped_rank, nprocs=4, start_method="fork",
                       args=(4, f"file://{tmp_path}/rendezvous", cluster.address, out, True))
    runs = [torch.load(f"{out}.{r}") for r in range(4)]
    assert all(r["rings"] == (4, 4, 2) for r in runs), [r["rings"] for r in runs]
    with stria.Client(cluster.address, step_timeout=60, head_groups=2) as c:
        for name in PER_WORKER:
            q, k, v, do = (t.requires_grad_() for t in _inputs(name))
            o, lse = stria.attention(q, k, v, ring_size=4, return_lse=True, client=c,
                                     **_opts(name))
            o.backward(do)
            want = dict(o=o.detach(), lse=lse, dq=q.grad, dk=k.grad, dv=v.grad)
            for key in want:
                got = stria.unshard([r[name][key] for r in runs], 2 if key == "lse" else 1,
                                    seq_len=S, head_groups=2)
                assert torch.equal(got, want[key]), (name, key)
    with pytest.raises(ValueError, match="trainer_ranks must be"):
        stria.Client(cluster.address, trainer_ranks="host")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible: sharded_attention "
                    "with CUDA tensors (pinned host staging) is tested only where torch sees "
                    "a GPU")
def test_sharded_cuda_tensors(cluster, client, tmp_path):  # pragma: no cover - needs a GPU
    """The same 4 ranks with CUDA tensors (spawned: CUDA does not survive a
    fork): results on the GPU, bits of the CPU run."""
    runs = _run_ranks(str(tmp_path), cluster.address, "cuda", "spawn")
    for name in ("striped", "gqa-zigzag"):
        want = _whole(name)
        assert all(r[name]["device"].startswith("cuda") for r in runs)
        for key in ("o", "lse", "dq", "dk", "dv"):
            assert torch.equal(_unshard(runs, name, key), want[key]), (name, key)
