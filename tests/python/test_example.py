"""examples/train_tiny_llama.py, short: the loss of every step through stria
within 1e-3 relative of the same run with SDPA."""

import importlib.util
import os

import pytest

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_train_tiny_llama_matches_sdpa(cluster, client, capsys):
    spec = importlib.util.spec_from_file_location(
        "train_tiny_llama", os.path.join(ROOT, "examples", "train_tiny_llama.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rc = mod.main(["--attn", "both", "--steps", "6", "--batch", "2", "--coordinator",
                   cluster.address])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.count("rel diff") == 6, out
    assert cluster.active_jobs() == []
