"""stria: exact attention for PyTorch trainers through a stria service.

    import stria
    o = stria.attention(q, k, v)              # q [B, S, H, D], k, v [B, S, Hkv, D]
    o.sum().backward()

Calls run on sessions (a ring opened once, reused by every call that fits
it) that the Client opens on first use; stria.Session is the explicit form.
flash_attn users switch by import (stria.flash_attn_func,
stria.flash_attn_varlen_func); Hugging Face models through stria.hf.register();
torch.distributed trainers holding shards of a sequence through
stria.sharded_attention.
The package is pure Python over libstria (ctypes): it finds the library
through $STRIA_LIB, the build tree of its source checkout, or the install
prefix.
"""

from typing import Any

from ._errors import (AuthError, BusyError, InvalidArgumentError, NoMemoryError, StriaError,
                      UnreachableError)
from ._lib import ABI_VERSION
from .attention import AttentionFunction, attention, flash_attn_func, flash_attn_varlen_func
from .client import Client, Job, default_client, set_default_client
from .session import Session
from .sharded import (ShardedAttentionFunction, shard, shard_positions, sharded_attention,
                      unshard)


def _version() -> str:
    """stria/VERSION: the version's one place (the C build reads it too)."""
    import os

    try:
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "VERSION")) as f:
            return f.read().strip()
    except OSError:
        from importlib.metadata import version

        return version("stria")


__version__ = _version()

__all__ = [
    "ABI_VERSION", "AttentionFunction", "AuthError", "BusyError", "Client",
    "InvalidArgumentError", "Job", "NoMemoryError", "Session", "ShardedAttentionFunction",
    "StriaError",
    "UnreachableError", "attention", "default_client", "flash_attn_func",
    "flash_attn_varlen_func", "set_default_client", "shard", "shard_positions",
    "sharded_attention", "unshard",
]


def __getattr__(name: str) -> Any:
    if name in ("hf", "local"):  # stria.hf imports transformers only when asked for
        import importlib

        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'stria' has no attribute {name!r}")
