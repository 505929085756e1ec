"""Sessions under stria.attention: reused across a model's layers and a run's
lengths, bounded by max_sessions (least recently used closed first), closed
with the client; the backward sends O and LSE (the forward runs once); and
stria.Session, the explicit form (whole-sequence and sharded)."""

import threading

import pytest
import torch

import stria
from reference import attention as ref_attention, max_err
from stria.session import MIN_TOKENS, rounded_bounds


def rand(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.fixture
def opens(monkeypatch):
    """Counts the sessions opened (stria_session_open) while the test runs."""
    n = [0]
    real = stria.Client._open_session_locked

    def counting(self, *a, **kw):
        n[0] += 1
        return real(self, *a, **kw)

    monkeypatch.setattr(stria.Client, "_open_session_locked", counting)
    return n


@pytest.fixture
def fresh(cluster):
    with stria.Client(cluster.address, step_timeout=60) as c:
        yield c


def test_rounded_bounds():
    assert rounded_bounds(1, 7) == (1, MIN_TOKENS)
    assert rounded_bounds(3, 5000) == (4, 4096)  # 15000 tokens -> 16384 over a batch of 4
    assert rounded_bounds(2, MIN_TOKENS) == (2, MIN_TOKENS)
    mb, msl = rounded_bounds(5, 999)
    assert mb == 8 and mb * msl >= 5 * 999 and (mb * msl) & (mb * msl - 1) == 0


# two layers' worth of shapes: [B, S, H, Hkv, D]; the lengths of a run
LAYERS = [(4, 2, 16), (2, 1, 32)]
LENGTHS = [(2, 40), (1, 17), (1, 96), (2, 64), (1, 128)]


def test_sessions_are_reused_over_layers_and_lengths(cluster, fresh, opens, no_active_jobs):
    """100 calls (forward and backward) over two layers' shapes and five
    lengths: one session per layer shape, opened once; every result the
    reference's."""
    c = fresh
    calls = 0
    for i in range(10):
        for B, S in LENGTHS:
            for li, (H, Hkv, D) in enumerate(LAYERS):
                q = rand(B, S, H, D, seed=3 * calls).requires_grad_()
                k = rand(B, S, Hkv, D, seed=3 * calls + 1).requires_grad_()
                v = rand(B, S, Hkv, D, seed=3 * calls + 2).requires_grad_()
                o = stria.attention(q, k, v, client=c)
                calls += 1
                if i < 2 or (i == 9 and li == 1):  # checked against the reference
                    do = rand(B, S, H, D, seed=7)
                    o.backward(do)
                    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
                    ro, _ = ref_attention(*ref, causal=True)
                    ro.backward(do.double())
                    assert max_err(o, ro) < 1e-5
                    for got, want in zip((q.grad, k.grad, v.grad), ref):
                        assert max_err(got, want.grad) < 1e-4
    assert calls == 100
    assert len(c.sessions) == 2 and opens[0] == 2
    assert sorted(s.heads for s in c.sessions) == [2, 4]
    ids = {j["id"] for j in cluster.active_jobs()}
    assert set(c.open_session_ids) <= ids


def test_longer_calls_get_one_larger_session(fresh, opens):
    """A call beyond its session's bounds opens one that covers both, and
    the smaller one is closed."""
    c = fresh
    x = rand(1, 64, 1, 16)
    stria.attention(x, x, x, client=c)
    (small,) = c.sessions
    assert small.max_batch * small.max_seq_len == MIN_TOKENS
    y = rand(2, 2100, 1, 16)  # 4200 tokens, batch 2
    o = stria.attention(y, y, y, client=c)
    (big,) = c.sessions
    assert not small.alive and big.alive
    assert (big.max_batch, big.max_batch * big.max_seq_len) == (2, 8192)
    assert max_err(o, ref_attention(y, y, y)[0]) < 1e-5
    stria.attention(x, x, x, client=c)  # the large session serves the short call too
    assert c.sessions == [big] and opens[0] == 2


def test_max_sessions_closes_the_least_recently_used(cluster, opens, no_active_jobs):
    with stria.Client(cluster.address, max_sessions=2) as c:
        xs = {h: rand(1, 32, h, 16, seed=h) for h in (1, 2, 4)}
        stria.attention(xs[1], xs[1], xs[1], client=c)
        stria.attention(xs[2], xs[2], xs[2], client=c)
        first = {s.heads: s for s in c.sessions}
        stria.attention(xs[1], xs[1], xs[1], client=c)  # 1 used last: 2 goes next
        stria.attention(xs[4], xs[4], xs[4], client=c)
        assert sorted(s.heads for s in c.sessions) == [1, 4] and opens[0] == 3
        assert first[1].alive and not first[2].alive
        assert len(c.open_session_ids) == 2
    with pytest.raises(ValueError, match="max_sessions"):
        stria.Client(cluster.address, max_sessions=0)


def test_sessions_close_with_the_client(cluster, no_active_jobs):
    c = stria.Client(cluster.address)
    x = rand(1, 32, 2, 16)
    stria.attention(x, x, x, client=c)
    stria.attention(x.half(), x.half(), x.half(), client=c)
    sessions = c.sessions
    ids = set(c.open_session_ids)
    assert len(sessions) == 2 and len(ids) == 2
    c.close()
    assert not any(s.alive for s in sessions) and c.sessions == []
    assert not ids & {j["id"] for j in cluster.active_jobs()}
    with pytest.raises(RuntimeError, match="closed"):
        stria.attention(x, x, x, client=c)


def test_backward_sends_o_and_lse(fresh, monkeypatch):
    """Forward once, backward once: no forward again, no job."""
    from stria.session import Session

    counts = {"forward": 0, "backward": 0}
    for name in counts:
        real = getattr(Session, f"_{name}_locked")

        def counting(self, *a, _real=real, _name=name, **kw):
            counts[_name] += 1
            return _real(self, *a, **kw)

        monkeypatch.setattr(Session, f"_{name}_locked", counting)
    monkeypatch.setattr(stria.Client, "forward", lambda *a, **kw: pytest.fail("a job call"))
    q, k, v = (rand(2, 50, 2, 16, seed=s).requires_grad_() for s in range(3))
    o = stria.attention(q, k, v, client=fresh, window_size=(9, 0), softmax_scale=0.2)
    assert counts == {"forward": 1, "backward": 0}
    o.sum().backward()
    assert counts == {"forward": 1, "backward": 1}
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ro, _ = ref_attention(*ref, causal=True, scale=0.2, window=(9, 0))
    ro.sum().backward()
    for got, want in zip((q.grad, k.grad, v.grad), ref):
        assert max_err(got, want.grad) < 1e-4


def test_backward_after_its_session_was_closed(fresh):
    """Backward brings everything it needs: a session closed since forward
    (evicted, or its client's cache cleared) is not needed."""
    q, k, v = (rand(1, 40, 2, 16, seed=s).requires_grad_() for s in range(3))
    o = stria.attention(q, k, v, client=fresh)
    for s in fresh.sessions:
        s.close()
    assert fresh.sessions == []
    o.sum().backward()
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_attention(*ref)[0].sum().backward()
    assert max_err(q.grad, ref[0].grad) < 1e-4


def test_flash_attn_calls_share_a_session(fresh, opens):
    prev = stria.set_default_client(fresh)
    try:
        q, k, v = rand(1, 64, 4, 16, seed=1), rand(1, 64, 2, 16, seed=2), rand(1, 64, 2, 16)
        stria.flash_attn_func(q, k, v, causal=True)
        cu = torch.tensor([0, 10, 64], dtype=torch.int32)
        o = stria.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 54, 54, causal=True)
        want, _ = ref_attention(q.double(), k.double(), v.double(), True, cu_seqlens=[0, 10, 64])
        assert max_err(o, want[0]) < 1e-5
        assert len(fresh.sessions) == 1 and opens[0] == 1
    finally:
        stria.set_default_client(prev)


# ---- stria.Session ------------------------------------------------------------------

def test_explicit_session(fresh, no_active_jobs):
    s = stria.Session(heads=4, kv_heads=2, head_dim=16, max_seq_len=256, max_batch=2,
                      dtype=torch.float32, client=fresh)
    try:
        assert s.alive and s.id in fresh.open_session_ids and s not in fresh.sessions
        q, k, v, do = rand(2, 100, 4, 16, seed=1), rand(2, 100, 2, 16, seed=2), \
            rand(2, 100, 2, 16, seed=3), rand(2, 100, 4, 16, seed=4)
        o, lse = s.forward(q, k, v, causal=False, window_size=(5, 5))
        dq, dk, dv = s.backward(q, k, v, o, lse, do, causal=False, window_size=(5, 5))
        ref = [t.double().requires_grad_() for t in (q, k, v)]
        ro, rlse = ref_attention(*ref, causal=False, window=(5, 5))
        ro.backward(do.double())
        assert max_err(o, ro) < 1e-5 and max_err(lse, rlse) < 1e-5
        for got, want in zip((dq, dk, dv), ref):
            assert max_err(got, want.grad) < 1e-4
        assert s.stats()["calls"] == 2
        # what the session fixes is checked before libstria reads a buffer
        with pytest.raises(TypeError, match="float32"):
            s.forward(q.half(), k.half(), v.half())
        with pytest.raises(ValueError, match="heads"):
            s.forward(rand(2, 100, 2, 16), k, v)
        with pytest.raises(ValueError, match="bounds"):
            x = rand(3, 10, 4, 16)
            s.forward(x, x[..., :2, :], x[..., :2, :])
        with pytest.raises(ValueError, match="whole-sequence"):
            s.forward_shard(0, q, k, v, seq_len=100)
    finally:
        s.close()
    assert not s.alive
    with pytest.raises(RuntimeError, match="closed"):
        s.forward(q, k, v)


def test_head_groups_session_and_client(cluster, no_active_jobs):
    """A session of 2 head groups x rings of 2 (the suite's 4 workers):
    the fp64 reference's values, GQA and documents; stria.attention through
    a Client(head_groups=2); and the refusals, named."""
    with stria.Client(cluster.address, step_timeout=60, head_groups=2) as c:
        s = stria.Session(heads=4, kv_heads=2, head_dim=16, max_seq_len=256, dtype=torch.float32,
                          ring_size=4, head_groups=2, client=c)
        try:
            assert s.ring_size == 4 and s.head_groups == 2
            q, k, v, do = rand(1, 200, 4, 16, seed=5), rand(1, 200, 2, 16, seed=6), \
                rand(1, 200, 2, 16, seed=7), rand(1, 200, 4, 16, seed=8)
            docs = [0, 7, 90, 91, 200]
            o, lse = s.forward(q, k, v, cu_seqlens=docs)
            dq, dk, dv = s.backward(q, k, v, o, lse, do, cu_seqlens=docs)
            ref = [t.double().requires_grad_() for t in (q, k, v)]
            ro, rlse = ref_attention(*ref, cu_seqlens=docs)
            ro.backward(do.double())
            assert max_err(o, ro) < 1e-5 and max_err(lse, rlse) < 1e-5
            for got, want in zip((dq, dk, dv), ref):
                assert max_err(got, want.grad) < 1e-4
            assert s.stats()["calls"] == 2
        finally:
            s.close()
        # the client's whole-sequence calls run head-grouped sessions too
        q2 = rand(2, 96, 4, 16, seed=9).requires_grad_()
        o2 = stria.attention(q2, q2[..., :2, :], q2[..., :2, :], ring_size=4, client=c)
        want = ref_attention(q2.double(), q2[..., :2, :].double(), q2[..., :2, :].double())[0]
        assert max_err(o2, want) < 1e-5
        with pytest.raises(ValueError, match="needs ring_size"):
            stria.attention(q2, q2, q2, client=c)
        with pytest.raises(ValueError, match="must divide kv_heads 3"):
            stria.Session(heads=6, kv_heads=3, head_dim=16, max_seq_len=64, ring_size=4,
                          head_groups=2, client=c)
    with stria.Client(cluster.address) as c:
        # auto: the suite's workers share one host, so one ring, and it says so
        s = stria.Session(heads=4, head_dim=16, max_seq_len=64, head_groups="auto", client=c)
        try:
            assert s.head_groups == 1 and s.ring_size == 4
        finally:
            s.close()
        with pytest.raises(ValueError, match="head_groups must be"):
            stria.Session(heads=4, head_dim=16, max_seq_len=64, head_groups="many", client=c)
        with pytest.raises(ValueError, match="head_group_rings must be"):
            stria.Session(heads=4, head_dim=16, max_seq_len=64, ring_size=4, head_groups=2,
                          head_group_rings="sideways", client=c)
        # rings across hosts need a host per ring rank: the suite has one
        with pytest.raises(stria.StriaError, match="need 2 hosts with 2 workers each"):
            stria.Session(heads=4, head_dim=16, max_seq_len=64, ring_size=4, head_groups=2,
                          head_group_rings="across", client=c)


def _run_ranks(target, args, errors):
    """target(*a) for each a of args, a thread each, all at once."""
    threads = [threading.Thread(target=target, args=a) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors


def _reference(q, k, v, do):
    """The fp64 reference's O, dQ, dK, dV of a causal call."""
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    ro, _ = ref_attention(*ref)
    ro.backward(do.double())
    return ro, ref[0].grad, ref[1].grad, ref[2].grad


@pytest.mark.parametrize("groups", [0, 2])
def test_explicit_sharded_session_export_import(cluster, no_active_jobs, groups):
    """A sharded session of 2 ranks (with head groups: 2 rings of 2, the
    suite's 4 workers): opened through one client, imported through
    another, the two ranks' calls from two threads; the halves put together
    are the whole-sequence result."""
    S, layout = 61, "zigzag"
    ring = 2 * max(groups, 1)
    q, k, v, do = (rand(1, S, 2, 16, seed=s) for s in range(4))
    with stria.Client(cluster.address, step_timeout=60, arrival_timeout=30) as c0, \
            stria.Client(cluster.address, step_timeout=60, arrival_timeout=30) as c1:
        s0 = stria.Session(heads=2, head_dim=16, max_seq_len=128, dtype=torch.float32,
                           layout=layout, ring_size=ring, sharded=True, client=c0,
                           head_groups=groups)
        s1 = c1.import_session(s0.export())
        assert (s1.ring_size, s1.ranks, s1.layout, s1.heads, s1.max_seq_len) == \
            (ring, 2, layout, 2, 128)
        assert s1.head_groups == max(groups, 1)
        for r in range(2):
            assert torch.equal(s0.positions(S, r), stria.shard_positions(S, r, 2, layout))
        out, errors = {}, []

        def rank(r, s):
            try:
                qs, ks, vs, dos = (stria.shard(t, 1, rank=r, world_size=2, layout=layout)
                                   for t in (q, k, v, do))
                o, lse = s.forward_shard(r, qs, ks, vs, seq_len=S)
                out[r] = (o,) + s.backward_shard(r, qs, ks, vs, o, lse, dos, seq_len=S)
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        _run_ranks(rank, [(0, s0), (1, s1)], errors)
        for i, want in enumerate(_reference(q, k, v, do)):
            got = stria.unshard([out[0][i], out[1][i]], 1, seq_len=S, layout=layout)
            assert max_err(got, want) < 1e-4, i
        s1.close()
        s0.close()
    with pytest.raises(ValueError, match="export"):
        stria.Client.import_session(c0, b"nope")


def test_tensor_parallel_ranks_call_their_head_group(cluster, no_active_jobs):
    """A tensor-parallel x context-parallel trainer (2 x 2 ranks, a thread
    and a client each) on a sharded session of 2 head groups x rings of 2:
    rank (j, g) passes ring rank j's tokens of head group g to ring g
    (Session.head_group); put together, the fp64 reference's values."""
    S, H, G, R = 70, 4, 2, 2
    q, k, v, do = (rand(1, S, H, 16, seed=20 + s) for s in range(4))
    clients = [stria.Client(cluster.address, step_timeout=60, arrival_timeout=30)
               for _ in range(R * G)]
    try:
        s0 = stria.Session(heads=H, head_dim=16, max_seq_len=128, dtype=torch.float32,
                           ring_size=R * G, sharded=True, head_groups=G, client=clients[0])
        data = s0.export()
        sessions = [s0] + [c.import_session(data) for c in clients[1:]]
        ring = sessions[0].head_group(1)
        assert (ring.heads, ring.ring_size, ring.alive) == (H // G, R, True)
        with pytest.raises(ValueError, match="head group 2"):
            sessions[0].head_group(2)
        out, errors = {}, []

        def rank(j, g, s):
            try:
                heads = slice(g * H // G, (g + 1) * H // G)
                qs, ks, vs, dos = (stria.shard(t[:, :, heads], 1, rank=j, world_size=R)
                                   for t in (q, k, v, do))
                r = s.head_group(g)
                o, lse = r.forward_shard(j, qs, ks, vs, seq_len=S)
                out[j, g] = (o,) + r.backward_shard(j, qs, ks, vs, o, lse, dos, seq_len=S)
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        _run_ranks(rank, [(i % R, i // R, sessions[i]) for i in range(R * G)], errors)
        for i, want in enumerate(_reference(q, k, v, do)):
            got = torch.cat([stria.unshard([out[j, g][i] for j in range(R)], 1, seq_len=S)
                             for g in range(G)], dim=2)
            assert max_err(got, want) < 1e-4, i
        ring.close()  # borrowed: nothing happens
        assert ring.alive
        for s in reversed(sessions):
            s.close()
        assert not ring.alive
    finally:
        for c in clients:
            c.close()


def test_one_trainer_rank_per_worker(cluster, no_active_jobs):
    """A sharded session of 2 head groups x rings of 2 called by 4 trainer
    ranks (trainer_ranks=4, a thread and a client each): rank h G + l
    passes stripe l R + h with all its heads (stria.shard(...,
    head_groups=2)), part l of ring rank h's shard on both rings; put
    together, the fp64 reference's values."""
    S, H, G, N = 75, 4, 2, 4
    q, k, v, do = (rand(1, S, H, 16, seed=40 + s) for s in range(4))
    clients = [stria.Client(cluster.address, step_timeout=60, arrival_timeout=30)
               for _ in range(N)]
    try:
        s0 = stria.Session(heads=H, head_dim=16, max_seq_len=128, dtype=torch.float32,
                           ring_size=N, sharded=True, head_groups=G, trainer_ranks=N,
                           client=clients[0])
        sessions = [s0] + [c.import_session(s0.export()) for c in clients[1:]]
        for s in sessions:
            assert (s.ranks, s.head_groups, s.ring_size) == (N, G, N)
        for t in range(N):
            pos = stria.shard_positions(S, t, N, head_groups=G)
            assert torch.equal(s0.positions(S, t), pos)
            assert torch.equal(pos, stria.shard_positions(S, t % G * (N // G) + t // G, N))
        out, errors = {}, []

        def rank(t, s):
            try:
                qs, ks, vs, dos = (stria.shard(x, 1, rank=t, world_size=N, head_groups=G)
                                   for x in (q, k, v, do))
                o, lse = s.forward_shard(t, qs, ks, vs, seq_len=S)
                out[t] = (o,) + s.backward_shard(t, qs, ks, vs, o, lse, dos, seq_len=S)
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        _run_ranks(rank, list(enumerate(sessions)), errors)
        for i, want in enumerate(_reference(q, k, v, do)):
            got = stria.unshard([out[t][i] for t in range(N)], 1, seq_len=S, head_groups=G)
            assert max_err(got, want) < 1e-4, i
        with pytest.raises(ValueError, match="needs the striped layout"):
            stria.shard_positions(S, 0, N, "zigzag", head_groups=G)
        with pytest.raises(ValueError, match="must divide world_size"):
            stria.shard_positions(S, 0, 3, head_groups=G)
        with pytest.raises(ValueError, match="trainer_ranks must be"):
            stria.Session(heads=H, head_dim=16, max_seq_len=128, ring_size=N, sharded=True,
                          head_groups=G, trainer_ranks=-1, client=clients[0])
        with pytest.raises(stria.StriaError, match="needs the striped layout"):
            stria.Session(heads=H, head_dim=16, max_seq_len=128, ring_size=N, sharded=True,
                          head_groups=G, trainer_ranks=N, layout="zigzag", client=clients[0])
        for s in reversed(sessions):
            s.close()
    finally:
        for c in clients:
            c.close()


def test_sessions_close_at_interpreter_exit(cluster, client, no_active_jobs):
    """A process that exits without closing its client leaves no session on
    the service (cached and explicit ones)."""
    import os
    import subprocess
    import sys

    script = f"""
import torch, stria
c = stria.Client({cluster.address!r})
x = torch.randn(1, 16, 2, 16)
stria.attention(x, x, x, client=c)
s = stria.Session(heads=2, head_dim=16, max_seq_len=64, client=c)
print(*c.open_session_ids)
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    ids = {int(i) for i in r.stdout.split()}
    assert len(ids) == 2
    assert not ids & {j["id"] for j in cluster.active_jobs()}


def test_a_session_the_workers_have_no_room_for_closes_the_clients_own(no_active_jobs):
    """One worker with room for about one session: the second kind's open
    does not wait in the queue for the memory the client's own first
    session holds (it would forever): the client closes that one."""
    from conftest import Cluster

    c = Cluster(n_workers=1, memory="150M")
    try:
        with stria.Client(c.address, step_timeout=60) as cl:
            a, b = rand(1, 64, 8, 64, seed=1), rand(1, 64, 4, 64, seed=2)
            stria.attention(a, a, a, client=cl)
            done = []
            t = threading.Thread(target=lambda: done.append(stria.attention(a, b, b, client=cl)),
                                 daemon=True)
            t.start()
            t.join(60)
            assert done, "the second session waits for the memory of the first"
            assert max_err(done[0], ref_attention(a, b, b)[0]) < 1e-5
    finally:
        c.stop()


def test_sharded_ranks_build_their_tensors_in_the_arena(tmp_path):
    """Session.empty: a sharded rank's Q, K, V and dO built in its arena (its
    worker on this host maps it) move no byte over TCP, and the results are
    those of tensors of its own."""
    import os

    from stria.local import LocalService

    from conftest import BIN

    S, layout = 96, "striped"
    q, k, v, do = (rand(1, S, 2, 16, seed=s) for s in range(4))
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (tmp_path / "logs").mkdir()
    svc = LocalService(2, bin_dir=BIN, log_dir=str(tmp_path / "logs"), heartbeat_period=2,
                       env={"UCX_TLS": "tcp,sm,self", "RUNTIME_DIRECTORY": str(run)})
    try:
        with stria.Client(svc.address, step_timeout=60, arrival_timeout=30) as c0, \
                stria.Client(svc.address, step_timeout=60, arrival_timeout=30) as c1:
            s0 = stria.Session(heads=2, head_dim=16, max_seq_len=S, dtype=torch.float32,
                               layout=layout, ring_size=2, sharded=True, client=c0)
            s1 = c1.import_session(s0.export())
            out, errors = {}, []

            def rank(r, s):
                try:
                    t = {name: s.empty(name, rank=r, seq_len=S) for name in ("q", "k", "v", "do")}
                    for name, full in (("q", q), ("k", k), ("v", v), ("do", do)):
                        t[name].copy_(stria.shard(full, 1, rank=r, world_size=2, layout=layout))
                    o, lse = s.forward_shard(r, t["q"], t["k"], t["v"], seq_len=S)
                    grads = s.backward_shard(r, t["q"], t["k"], t["v"], o, lse, t["do"], seq_len=S)
                    out[r] = (o,) + grads + (s.stats()["bytes_up"],)
                except Exception as e:  # pragma: no cover - reported below
                    errors.append(e)

            threads = [threading.Thread(target=rank, args=(r, s)) for r, s in ((0, s0), (1, s1))]
            for th in threads:
                th.start()
            for th in threads:
                th.join(120)
            assert not errors, errors
            assert out[0][4] == 0 and out[1][4] == 0, "inputs went over TCP"
            ref = [t.double().requires_grad_() for t in (q, k, v)]
            ro, _ = ref_attention(*ref)
            ro.backward(do.double())
            for i, want in enumerate((ro, ref[0].grad, ref[1].grad, ref[2].grad)):
                got = stria.unshard([out[0][i], out[1][i]], 1, seq_len=S, layout=layout)
                assert max_err(got, want) < 1e-4, i
            with pytest.raises(ValueError, match="none of"):
                s0.empty("x", rank=0, seq_len=S)
            s1.close()
            s0.close()
    finally:
        assert not svc.stop()
    assert os.path.isdir(run)
