"""The autograd Function's plumbing, bits, lifecycle, errors and the
flash_attn-compatible calls."""

import gc
import inspect
import os
import subprocess
import threading

import pytest
import torch

import stria
from reference import attention as ref_attention, max_err


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


# ---- gradcheck ---------------------------------------------------------------

# float32 on purpose (the service has no float64): gradcheck warns about it
_FLOAT32_GRADCHECK = pytest.mark.filterwarnings("ignore:Input #.*double precision")


@_FLOAT32_GRADCHECK
@pytest.mark.parametrize("opts", [
    dict(causal=True),
    dict(causal=False, window_size=(2, 1)),
    dict(causal=True, cu_seqlens=[0, 3, 7]),
    dict(causal=True, window_size=(3, 0), layout="zigzag", softmax_scale=0.3),
], ids=["causal", "window", "documents", "zigzag-window-scale"])
def test_gradcheck(client, opts):
    """torch.autograd.gradcheck of the whole chain (float32 through the
    service, so a coarse step and tolerance; the numerics suite holds the
    values to the float64 bar)."""
    q = rand(1, 7, 2, 16, seed=1).requires_grad_()
    k = rand(1, 7, 1, 16, seed=2).requires_grad_()
    v = rand(1, 7, 1, 16, seed=3).requires_grad_()
    fn = lambda q, k, v: stria.attention(q, k, v, **opts)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-2, atol=2e-3, rtol=2e-2,
                                    fast_mode=True)


@_FLOAT32_GRADCHECK
def test_gradcheck_batch_fast_mode(client):
    q = rand(2, 33, 4, 32, seed=4).requires_grad_()
    k = rand(2, 33, 2, 32, seed=5).requires_grad_()
    v = rand(2, 33, 2, 32, seed=6).requires_grad_()
    assert torch.autograd.gradcheck(lambda q, k, v: stria.attention(q, k, v), (q, k, v),
                                    eps=1e-2, atol=2e-3, rtol=2e-2, fast_mode=True)


# ---- bits --------------------------------------------------------------------

def _run(q, k, v, do, **opts):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o, lse = stria.attention(q, k, v, return_lse=True, **opts)
    o.backward(do)
    return [o.detach(), lse, q.grad, k.grad, v.grad]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_inputs_give_the_same_bits(client, dtype):
    B, S, H, Hkv, D = 2, 131, 4, 2, 32
    q, k, v = rand(B, S, H, D, dtype=dtype, seed=7), rand(B, S, Hkv, D, dtype=dtype, seed=8), \
        rand(B, S, Hkv, D, dtype=dtype, seed=9)
    do = rand(B, S, H, D, dtype=dtype, seed=10)
    want = _run(q, k, v, do)
    # [B, H, S, D] storage seen as [B, S, H, D] (what transformers hands over),
    # a slice of a wider tensor, and a reversed-stride copy
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    kt = torch.cat([k, k], dim=3)[..., :D]
    vt = v.flip(0).contiguous().flip(0)
    dot = do.transpose(1, 2).contiguous().transpose(1, 2)
    assert not qt.is_contiguous() and not kt.is_contiguous()
    got = _run(qt, kt, vt, dot)
    for name, a, b in zip(["o", "lse", "dq", "dk", "dv"], want, got):
        assert torch.equal(a, b), f"{name} differs between strided and contiguous inputs"


def test_two_runs_give_the_same_bits(client):
    q, k, v, do = rand(1, 257, 4, 64, seed=11), rand(1, 257, 2, 64, seed=12), \
        rand(1, 257, 2, 64, seed=13), rand(1, 257, 4, 64, seed=14)
    a = _run(q, k, v, do, layout="zigzag")
    b = _run(q, k, v, do, layout="zigzag")
    for name, x, y in zip(["o", "lse", "dq", "dk", "dv"], a, b):
        assert torch.equal(x, y), f"{name} differs between two runs"


def test_masks_and_scale_reach_the_service(client):
    """Window, documents and scale change the result as the reference does
    (a call that dropped one of them would match the plain call instead)."""
    B, S, H, D = 1, 96, 2, 16
    q, k, v = rand(B, S, H, D, seed=15), rand(B, S, H, D, seed=16), rand(B, S, H, D, seed=17)
    cases = [dict(window=(10, 0)), dict(cu_seqlens=[0, 5, 40, 96]), dict(scale=0.05),
             dict(causal=False, window=(4, 7))]
    for c in cases:
        causal = c.get("causal", True)
        want, _ = ref_attention(q.double(), k.double(), v.double(), causal, c.get("scale"),
                                c.get("window"), c.get("cu_seqlens"))
        plain, _ = ref_attention(q.double(), k.double(), v.double(), causal)
        o = stria.attention(q, k, v, causal=causal, softmax_scale=c.get("scale"),
                            window_size=c.get("window", (-1, -1)),
                            cu_seqlens=c.get("cu_seqlens"))
        assert max_err(o, want) < 1e-5, c
        assert max_err(plain, want) > 1e-2, c  # the case does change the result


def test_lse_is_not_differentiable(client):
    q = rand(1, 16, 2, 16).requires_grad_()
    o, lse = stria.attention(q, q.detach(), q.detach(), return_lse=True)
    assert o.requires_grad and not lse.requires_grad


def test_backward_on_another_thread(client):
    """PyTorch may run backward on its own thread: the client serialises."""
    q = rand(1, 64, 2, 16).requires_grad_()
    outs, errors = [], []

    def work(seed):
        try:
            x = rand(1, 64, 2, 16, seed=seed).requires_grad_()
            o = stria.attention(x, x, x)
            o.sum().backward()
            outs.append(x.grad)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    stria.attention(q, q, q).sum().backward()
    for t in threads:
        t.join()
    assert not errors and len(outs) == 4


def test_the_gil_is_released_during_calls(client):
    """Another Python thread keeps running while a call is in libstria."""
    import time

    x = rand(1, 4096, 4, 64, seed=21)
    spans = []

    def call():
        t0 = time.perf_counter()
        stria.attention(x, x, x)
        spans.append(time.perf_counter() - t0)

    t = threading.Thread(target=call)
    last, gap = time.perf_counter(), 0.0
    t.start()
    while t.is_alive():
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
    t.join()
    assert gap < 0.5 * spans[0], f"this thread stalled {gap:.3f} s of a {spans[0]:.3f} s call"


def test_contiguous_cpu_inputs_are_not_copied():
    from stria.attention import _host

    x = rand(1, 8, 2, 16)
    assert _host(x) is x
    y = x.transpose(1, 2)
    assert _host(y).is_contiguous() and torch.equal(_host(y), y)


# ---- lifecycle ---------------------------------------------------------------

def _inputs(seed=20):
    return [rand(1, 64, 2, 16, seed=seed + i).requires_grad_() for i in range(3)]


def test_calls_hold_nothing_but_the_clients_sessions(cluster, client, no_active_jobs):
    """Forward, backward and a no_grad call leave on the service only the
    sessions the client keeps (no job between forward and backward)."""
    from conftest import stray_jobs

    q, k, v = _inputs()
    o = stria.attention(q, k, v)
    assert stray_jobs(cluster) == [] and client.sessions
    o.sum().backward()
    assert stray_jobs(cluster) == []
    with torch.no_grad():
        o = stria.attention(q, k, v)
    assert not o.requires_grad
    assert stray_jobs(cluster) == []
    assert sorted(j["id"] for j in cluster.active_jobs()) == sorted(client.open_session_ids)


def test_kept_jobs_go_after_backward_and_with_a_dropped_graph(cluster, no_active_jobs):
    from conftest import stray_jobs

    with stria.Client(cluster.address, keep_jobs=2) as c:
        q, k, v = _inputs()
        want_q = None
        o = stria.attention(q, k, v, client=c)
        assert c.jobs_kept == 1 and len(stray_jobs(cluster)) == 1
        o.sum().backward()
        want_q = q.grad.clone()
        assert c.jobs_kept == 0 and stray_jobs(cluster) == []
        # the same gradient as the session path
        q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
        stria.attention(q2, k2, v2).sum().backward()
        assert torch.equal(q2.grad, want_q)
        # a graph dropped without backward releases its job
        o = stria.attention(q, k, v, client=c)
        o2 = stria.attention(q, k, v, client=c)
        o3 = stria.attention(q, k, v, client=c)  # over the bound: not kept
        assert c.jobs_kept == 2 and len(stray_jobs(cluster)) == 2
        del o, o2, o3
        gc.collect()
        assert c.jobs_kept == 0 and stray_jobs(cluster) == []


def test_a_dropped_graph_on_another_thread(cluster, no_active_jobs):
    """A finalizer that runs while another thread holds the client releases
    through that thread."""
    from conftest import stray_jobs

    with stria.Client(cluster.address, keep_jobs=4) as c:
        q, k, v = _inputs()
        o = stria.attention(q, k, v, client=c)
        t = threading.Thread(target=lambda: stria.attention(*_inputs(30), client=c))
        t.start()
        del o
        gc.collect()
        t.join()
        stria.attention(*_inputs(40), client=c).detach()  # a call after: the queue is empty
        gc.collect()
        assert c.jobs_kept == 0 and stray_jobs(cluster) == []


# ---- errors ------------------------------------------------------------------

def test_bad_dtypes_raise_type_error_before_any_call(cluster, client):
    before = cluster.ctl("status")["jobs_submitted"]
    for dt in (torch.float64, torch.int32, torch.int8):
        x = torch.zeros(1, 8, 2, 16, dtype=dt)
        with pytest.raises(TypeError, match="not supported"):
            stria.attention(x, x, x)
    x = torch.zeros(1, 8, 2, 16)
    with pytest.raises(TypeError, match="share a dtype"):
        stria.attention(x, x.half(), x)
    assert cluster.ctl("status")["jobs_submitted"] == before


def test_bad_shapes_raise_value_error(client):
    x = torch.zeros(1, 8, 2, 16)
    with pytest.raises(ValueError, match="4-D"):
        stria.attention(x[0], x[0], x[0])
    with pytest.raises(ValueError, match="multiple"):
        stria.attention(torch.zeros(1, 8, 3, 16), x, x)
    with pytest.raises(NotImplementedError, match="same sequence length"):
        stria.attention(x, torch.zeros(1, 9, 2, 16), torch.zeros(1, 9, 2, 16))
    with pytest.raises(ValueError, match="layout"):
        stria.attention(x, x, x, layout="diagonal")
    with pytest.raises(ValueError, match="softmax_scale"):
        stria.attention(x, x, x, softmax_scale=float("nan"))


def test_bad_head_dim_is_refused_by_the_service(client):
    x = torch.zeros(1, 8, 2, 20)
    with pytest.raises(stria.InvalidArgumentError, match="head_dim") as e:
        stria.attention(x, x, x)
    assert isinstance(e.value, ValueError) and e.value.name == "STRIA_ERR_INVALID_ARG"


def test_bad_documents_are_refused_naming_them(client):
    x = torch.zeros(1, 8, 2, 16)
    with pytest.raises(stria.InvalidArgumentError, match="cu_seqlens"):
        stria.attention(x, x, x, cu_seqlens=[0, 5, 3, 8])


def test_too_many_ranks_is_busy(client):
    x = torch.zeros(1, 64, 2, 16)
    c = stria.Client(client.coordinator, no_queue=True)
    try:
        with pytest.raises(stria.BusyError) as e:
            stria.attention(x, x, x, ring_size=5, client=c)
        assert e.value.name == "STRIA_ERR_BUSY"
    finally:
        c.close()


def test_a_dead_coordinator_is_unreachable():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nobody listens there now
    with pytest.raises(stria.UnreachableError) as e:
        stria.Client(f"127.0.0.1:{port}", connect_timeout=2)
    assert isinstance(e.value, ConnectionError) and str(port) in str(e.value)


def test_a_coordinator_that_dies_mid_session(tmp_path):
    """A session's calls need no coordinator; opening one does."""
    from conftest import Cluster

    c = Cluster(n_workers=1)
    try:
        cl = stria.Client(c.address, connect_timeout=2)
        x = rand(1, 16, 2, 16)
        want = stria.attention(x, x, x, client=cl)
        c.coordinator.stop()
        assert torch.equal(stria.attention(x, x, x, client=cl), want)  # its session
        y = rand(1, 16, 4, 16)  # 4 heads: another session
        with pytest.raises(stria.StriaError) as e:
            stria.attention(y, y, y, client=cl)
        assert isinstance(e.value, stria.UnreachableError), e.value
        cl.close()
    finally:
        c.stop()


def test_no_worker_has_the_memory():
    from conftest import Cluster

    c = Cluster(n_workers=1, memory="64M")
    try:
        with stria.Client(c.address) as cl:
            x = torch.empty(1, 65536, 8, 64)
            with pytest.raises(stria.NoMemoryError) as e:
                stria.attention(x, x, x, client=cl)
            assert e.value.name == "STRIA_ERR_NO_MEMORY"
    finally:
        c.stop()


def test_token_file(tmp_path, monkeypatch):
    from conftest import Cluster

    tok = tmp_path / "token"
    tok.write_text("py-s3cret\n")
    c = Cluster(n_workers=1, token_file=str(tok))
    try:
        with pytest.raises(stria.AuthError):
            stria.Client(c.address)
        wrong = tmp_path / "wrong"
        wrong.write_text("nope\n")
        with pytest.raises(stria.AuthError):
            stria.Client(c.address, token_file=str(wrong))
        monkeypatch.setenv("STRIA_TOKEN_FILE", str(tok))
        monkeypatch.setenv("STRIA_COORDINATOR", c.address)
        with stria.Client() as cl:  # both from the environment
            x = rand(1, 16, 2, 16)
            o = stria.attention(x, x, x, client=cl)
            assert max_err(o, ref_attention(x.double(), x.double(), x.double())[0]) < 1e-5
    finally:
        c.stop()


def test_another_abi_is_refused(tmp_path, monkeypatch):
    """A library of another ABI version is refused naming both versions."""
    src = tmp_path / "fake.c"
    src.write_text("unsigned stria_client_abi_version(void) { return 7; }\n")
    so = tmp_path / "libstria.so.1"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    monkeypatch.setenv("STRIA_LIB", str(so))
    monkeypatch.setattr(stria._lib, "_lib", None)  # load afresh; restored after the test
    with pytest.raises(ImportError, match="ABI 7.*ABI 1"):
        stria.Client("127.0.0.1:1")


# ---- flash_attn-compatible calls ---------------------------------------------

# flash_attn 2.8's signatures, copied from flash_attn/flash_attn_interface.py
# (flash-attn does not install without a GPU).
FLASH_ATTN_2_8 = {
    "flash_attn_func": "(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, "
                       "window_size=(-1, -1), softcap=0.0, alibi_slopes=None, "
                       "deterministic=False, return_attn_probs=False)",
    "flash_attn_varlen_func": "(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, "
                              "max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False, "
                              "window_size=(-1, -1), softcap=0.0, alibi_slopes=None, "
                              "deterministic=False, return_attn_probs=False, block_table=None)",
}


@pytest.mark.parametrize("name", sorted(FLASH_ATTN_2_8))
def test_flash_attn_signatures(name):
    # the parameters, their order, kinds and defaults (stria's are annotated;
    # flash_attn's are not)
    sig = inspect.signature(getattr(stria, name))
    bare = sig.replace(parameters=[p.replace(annotation=inspect.Parameter.empty)
                                   for p in sig.parameters.values()],
                       return_annotation=inspect.Signature.empty)
    assert str(bare) == FLASH_ATTN_2_8[name]


def test_flash_attn_func(client):
    B, S, H, D = 2, 40, 4, 32
    q, k, v = rand(B, S, H, D, seed=1), rand(B, S, 2, D, seed=2), rand(B, S, 2, D, seed=3)
    want, want_lse = ref_attention(q.double(), k.double(), v.double(), causal=False)
    o = stria.flash_attn_func(q, k, v)  # flash_attn's default: not causal
    assert max_err(o, want) < 1e-5
    o, lse, probs = stria.flash_attn_func(q, k, v, causal=True, window_size=(5, 3),
                                          return_attn_probs=True)
    want, want_lse = ref_attention(q.double(), k.double(), v.double(), True, window=(5, 0))
    assert max_err(o, want) < 1e-5 and max_err(lse, want_lse) < 1e-5 and probs is None


def test_flash_attn_varlen_func(client):
    cu = torch.tensor([0, 7, 30, 64], dtype=torch.int32)
    q, k, v = rand(64, 4, 16, seed=1), rand(64, 2, 16, seed=2), rand(64, 2, 16, seed=3)
    q.requires_grad_()
    o, lse, _ = stria.flash_attn_varlen_func(q, k, v, cu, cu, 34, 34, causal=True,
                                             return_attn_probs=True)
    want, want_lse = ref_attention(q.double()[None], k.double()[None], v.double()[None], True,
                                   cu_seqlens=cu.tolist())
    assert o.shape == (64, 4, 16) and lse.shape == (4, 64)
    assert max_err(o, want[0]) < 1e-5 and max_err(lse, want_lse[0]) < 1e-5
    o.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


@pytest.mark.parametrize("kwargs,needle", [
    (dict(dropout_p=0.1), "dropout_p"),
    (dict(softcap=30.0), "softcap"),
    (dict(alibi_slopes=torch.ones(2)), "alibi_slopes"),
])
def test_flash_attn_unsupported_arguments(kwargs, needle):
    x = torch.zeros(1, 8, 2, 16)
    with pytest.raises(NotImplementedError, match=needle):
        stria.flash_attn_func(x, x, x, **kwargs)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match=needle):
        stria.flash_attn_varlen_func(x[0], x[0], x[0], cu, cu, 8, 8, **kwargs)


def test_flash_attn_varlen_different_documents():
    x = torch.zeros(8, 2, 16)
    with pytest.raises(NotImplementedError, match="cu_seqlens_q and cu_seqlens_k"):
        stria.flash_attn_varlen_func(x, x, x, torch.tensor([0, 8]), torch.tensor([0, 4, 8]),
                                     8, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible: CUDA tensors "
                    "(pinned host staging) are tested only where torch sees a GPU")
def test_cuda_tensors(client):  # pragma: no cover - needs a GPU
    q = rand(1, 64, 2, 32).cuda().requires_grad_()
    o, lse = stria.attention(q, q, q, return_lse=True)
    assert o.device == q.device and lse.device == q.device
    o.sum().backward()
    qc = q.detach().cpu().requires_grad_()
    oc = stria.attention(qc, qc, qc)
    oc.sum().backward()
    assert torch.equal(o.cpu(), oc.detach()) and torch.equal(q.grad.cpu(), qc.grad)


# ---- the ctypes mirror of the C structs -----------------------------------------

def test_ctypes_structs_mirror_the_header(tmp_path):
    """Every field the package declares sits at the offset the C compiler
    gives it in client/stria_client.h, and the sizes agree (a field added or
    moved in the header without the package fails here); the export sizes
    and the *_INIT macros' struct_size agree too."""
    import ctypes

    from conftest import ROOT
    from stria import _lib

    structs = {"stria_client_params_t": _lib.ClientParams, "stria_job_spec_t": _lib.JobSpec,
               "stria_call_stats_t": _lib.CallStats,
               "stria_session_spec_t": _lib.SessionSpec, "stria_call_t": _lib.Call,
               "stria_session_stats_t": _lib.SessionStats}
    lines, want = [], []
    for macro, value in (("STRIA_JOB_EXPORT_BYTES", _lib.JOB_EXPORT_BYTES),
                         ("STRIA_SESSION_EXPORT_BYTES", _lib.SESSION_EXPORT_BYTES),
                         ("STRIA_SESSION_EXPORT_MAX_BYTES", _lib.SESSION_EXPORT_MAX_BYTES),
                         ("STRIA_HEAD_GROUPS_AUTO", _lib.HEAD_GROUPS_AUTO),
                         ("STRIA_GROUP_RINGS_ACROSS", _lib.GROUP_RINGS["across"])):
        lines.append(f'printf("%zu\\n", (size_t){macro});')
        want.append(value)
    for cname, init in (("stria_session_spec_t", "STRIA_SESSION_SPEC_INIT"),
                        ("stria_call_t", "STRIA_CALL_INIT"),
                        ("stria_session_stats_t", "STRIA_SESSION_STATS_INIT")):
        lines.append(f'{{ {cname} x = {init}; printf("%zu\\n", x.struct_size); }}')
        want.append(ctypes.sizeof(structs[cname]))
    for cname, py in structs.items():
        lines.append(f'printf("%zu\\n", sizeof({cname}));')
        want.append(ctypes.sizeof(py))
        for name, _ in py._fields_:
            lines.append(f'printf("%zu\\n", offsetof({cname}, {name}));')
            want.append(getattr(py, name).offset)
    src = tmp_path / "offsets.c"
    src.write_text("#include <stddef.h>\n#include <stdio.h>\n#include \"stria_client.h\"\n"
                   "int main(void) {\n" + "\n".join(lines) + "\nreturn 0;\n}\n")
    exe = tmp_path / "offsets"
    subprocess.run(["cc", "-std=c11", "-I", os.path.join(ROOT, "client"), "-I",
                    os.path.join(ROOT, "common"), "-o", str(exe), str(src)], check=True)
    got = [int(x) for x in subprocess.run([str(exe)], capture_output=True, text=True,
                                          check=True).stdout.split()]
    assert got == want


def test_errors_say_whether_they_are_retryable(client):
    x = torch.zeros(1, 8, 2, 20)
    with pytest.raises(stria.InvalidArgumentError) as e:
        stria.attention(x, x, x)
    assert e.value.retryable is False


def test_backward_after_a_worker_died_runs_again_on_the_rest():
    """A kept job whose worker died fails its backward retryably; the
    package then runs forward and backward again on the ring as it is."""
    from conftest import Cluster

    c = Cluster(n_workers=3)
    try:
        cl = stria.Client(c.address, keep_jobs=1, step_timeout=30)
        q, k, v = (rand(1, 48, 2, 16).requires_grad_() for _ in range(3))
        o = stria.attention(q, k, v, client=cl)
        c.workers[2].proc.kill()  # the job's rank 2
        c.workers[2].proc.wait()
        o.sum().backward()
        ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        ro, _ = ref_attention(*ref, causal=True)
        ro.sum().backward()
        for got, want in ((q.grad, ref[0].grad), (k.grad, ref[1].grad), (v.grad, ref[2].grad)):
            assert max_err(got, want) < 1e-4
        cl.close()
    finally:
        c.stop()
