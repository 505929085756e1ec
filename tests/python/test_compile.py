"""torch.compile of a model calling stria: the forward and backward are
torch custom ops (stria/_ops.py), so the tiny Llama of test_hf.py compiles
with fullgraph=True and no graph break; backend="aot_eager" gives eager's
logits and gradients exactly, the default backend within 1e-4 relative L2.

The checks run in a child process: once a process has compiled a backward,
torch refuses fork-based multiprocessing (test_sharded.py's ranks)."""

import os
import subprocess
import sys

import pytest
import torch

TOL = 1e-4
HERE = os.path.dirname(os.path.abspath(__file__))


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run(model, ids, params):
    """Logits and the parameters' gradients (params: the uncompiled model)."""
    params.zero_grad()
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in params.named_parameters()}


def model():
    import transformers
    from test_hf import llama_config

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(llama_config(),
                                                         attn_implementation="stria")


def ids(seed):
    return torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(seed))


def check_no_graph_break():
    m = model()
    x = ids(1)
    explained = torch._dynamo.explain(lambda i: m(input_ids=i, labels=i, use_cache=False).loss)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    print("graph breaks:", explained.graph_break_count)


def check_model(backend):
    m = model()
    x = ids(2)
    logits_e, grads_e = run(m, x, m)
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend=backend)
    logits_c, grads_c = run(compiled, x, m)
    if backend == "aot_eager":
        assert torch.equal(logits_c, logits_e)
        assert all(torch.equal(grads_c[n], g) for n, g in grads_e.items())
    else:
        assert rel(logits_c, logits_e) < TOL
        bad = {n: rel(grads_c[n], g) for n, g in grads_e.items() if rel(grads_c[n], g) >= TOL}
        assert not bad, f"gradients off by more than {TOL} relative L2: {bad}"
    # a second step runs the compiled graph again (no recompile)
    logits_2, _ = run(compiled, ids(3), m)
    assert rel(logits_2, run(m, ids(3), m)[0]) < TOL


def check_attention(client):
    """stria.attention compiled alone, with an explicit client and options;
    LSE stays non-differentiable."""
    import stria

    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 48, 4, 16, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        return stria.attention(q, k, v, window_size=(8, 0), cu_seqlens=[0, 20, 48],
                               return_lse=True, client=client)

    o_e, lse_e = f(q, k, v)
    o_e.sum().backward()
    grads_e = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    o_c, lse_c = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    o_c.sum().backward()
    assert torch.equal(o_c, o_e) and torch.equal(lse_c, lse_e)
    assert not lse_c.requires_grad
    assert all(torch.equal(t.grad, g) for t, g in zip((q, k, v), grads_e))


def main(address, backend):
    import stria
    import stria.hf

    with stria.Client(address, step_timeout=60) as client:
        stria.set_default_client(client)
        stria.hf.register()
        if backend == "aot_eager":
            check_no_graph_break()
            check_attention(client)
        check_model(backend)
        stria.set_default_client(None)
    print("ok")


def child(cluster, backend):
    pytest.importorskip("transformers")
    env = dict(os.environ)
    try:
        import stria
    except ImportError:
        pass
    else:  # the stria this suite imports (installed, or the source tree's)
        path = os.path.dirname(os.path.dirname(stria.__file__))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH")) if p)
    r = subprocess.run([sys.executable, os.path.abspath(__file__), cluster.address, backend],
                       cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("ok"), r.stdout + r.stderr[-5000:]


def test_aot_eager_no_graph_break_equals_eager(cluster):
    child(cluster, "aot_eager")


def test_default_backend_within_1e_4(cluster):
    child(cluster, "inductor")


def _sharded_rank(rank, world, init, address, out):
    """One rank of a gloo group: sharded_attention compiled (aot_eager,
    fullgraph) against eager, forward and backward, exactly."""
    import torch.distributed as dist

    import stria

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        with stria.Client(address, step_timeout=60) as client:
            g = torch.Generator().manual_seed(5)
            whole = [torch.randn(1, 77, 4, 16, generator=g) for _ in range(4)]
            q, k, v, do = (stria.shard(t, 1, rank=rank, world_size=world, layout="zigzag")
                           for t in whole)

            def f(q, k, v):
                return stria.sharded_attention(q, k, v, seq_len=77, layout="zigzag",
                                               window_size=(20, 0), client=client)

            results = []
            for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
                qkv = [t.clone().requires_grad_() for t in (q, k, v)]
                o = fn(*qkv)
                o.backward(do)
                results.append([o.detach()] + [t.grad for t in qkv])
            ok = all(torch.equal(a, b) for a, b in zip(*results))
            # one graph, with the op in it (fullgraph: no break)
            ok = ok and torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
        torch.save(ok, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_sharded_compiled_equals_eager(cluster, tmp_path):
    """2 forked ranks (this process never compiles: fork stays allowed)."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "ok")
    mp.start_processes(_sharded_rank, args=(2, f"file://{tmp_path}/rendezvous",
                                            cluster.address, out),
                       nprocs=2, start_method="fork")
    assert all(torch.load(f"{out}.{r}") for r in range(2))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
