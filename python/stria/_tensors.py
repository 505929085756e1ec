"""Tensors to and from libstria: the dtypes it takes, contiguous host copies
(pinned for CUDA tensors), results back on the caller's device."""

import ctypes
from typing import Sequence

import torch

from . import _lib

_DTYPES = {torch.float32: _lib.DTYPE_F32, torch.bfloat16: _lib.DTYPE_BF16,
           torch.float16: _lib.DTYPE_F16}
_TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}


def _host(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host tensor with t's values: t itself when it already is
    one; a CUDA tensor goes through pinned memory."""
    if t.device.type == "cpu":
        return t.contiguous()
    h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    h.copy_(t)
    return h


def _empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    pin = device.type == "cuda"
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


def _back(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if device.type == "cpu" else t.to(device, non_blocking=False)


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())
