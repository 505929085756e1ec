"""The wheel's check (tests/run.sh; not a pytest module), run from a folder
with no source tree on sys.path, STRIA_LIB unset, in an environment where the
wheel is installed: `python -m stria.local --workers 2` (the daemons the
wheel carries), one stria.attention forward and backward on a tiny tensor
through it ($STRIA_COORDINATOR), compared with torch's SDPA; then SIGTERM,
and the service must stop cleanly."""

import os
import signal
import subprocess
import sys
import time

t0 = time.monotonic()
for var in ("STRIA_LIB", "STRIA_BIN_DIR", "PYTHONPATH"):
    assert var not in os.environ, f"{var} is set"
# the service starts while this process imports torch
svc = subprocess.Popen([sys.executable, "-m", "stria.local", "--workers", "2",
                        "--heartbeat-period", "2"], stdout=subprocess.PIPE, text=True,
                       env=dict(os.environ, UCX_TLS="tcp,sm,self"))
try:
    import torch

    import stria
    from stria import _lib

    pkg = os.path.dirname(os.path.abspath(stria.__file__))
    assert os.sep + "site-packages" + os.sep in pkg, f"stria from {pkg}, not an install"
    assert _lib.lib().path == os.path.join(pkg, "_lib", "libstria.so.1"), _lib.lib().path
    print(f"wheel: stria {stria.__version__} from {pkg} (torch {torch.__version__})", flush=True)
    lines = []
    for line in svc.stdout:
        lines.append(line)
        print("  | " + line.rstrip(), flush=True)
        if line.startswith("STRIA_COORDINATOR="):
            os.environ["STRIA_COORDINATOR"] = line.split("=", 1)[1].strip()
            break
    assert "STRIA_COORDINATOR" in os.environ, f"python -m stria.local exited {svc.wait()}"
    assert f"daemons in {os.path.join(pkg, '_bin')}," in lines[0], lines[0]
    print(f"wheel: service up in {time.monotonic() - t0:.1f} s", flush=True)

    torch.manual_seed(0)
    q = torch.randn(1, 64, 4, 32, requires_grad=True)
    k = torch.randn(1, 64, 2, 32, requires_grad=True)
    v = torch.randn(1, 64, 2, 32, requires_grad=True)
    o = stria.attention(q, k, v, causal=True)  # the default client: $STRIA_COORDINATOR
    o.square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(2, 1),
        v.transpose(1, 2).repeat_interleave(2, 1), is_causal=True).transpose(1, 2)
    ref.square().sum().backward()
    errs = [(o - ref).abs().max().item()] + [(g - t.grad).abs().max().item()
                                             for g, t in zip(grads, (q, k, v))]
    print("wheel: stria.attention vs SDPA max |diff| O %.1e dQ %.1e dK %.1e dV %.1e" %
          tuple(errs), flush=True)
    stria.default_client().close()
finally:
    svc.send_signal(signal.SIGTERM)
    try:
        svc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        svc.kill()
        svc.wait()
    out = svc.stdout.read()  # a few lines: read after exit (the lines above are buffered)
    for line in out.splitlines():
        print("  | " + line, flush=True)
assert svc.returncode == 0, f"python -m stria.local exited {svc.returncode} on SIGTERM"
assert out.rstrip().endswith("stria: stopped"), "python -m stria.local did not stop cleanly"
if max(errs) > 1e-4:
    sys.exit("wheel: stria.attention disagrees with SDPA")
print(f"wheel: ok in {time.monotonic() - t0:.1f} s")
