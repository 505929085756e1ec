"""libstria through ctypes: finding the library, its ABI, the C structs.

The structs mirror client/stria_client.h field for field (ctypes lays them out
with the C compiler's rules); every one starts with struct_size, set here to
the size this module declares, so a library of the same ABI reads exactly the
fields named below.
"""

import ctypes
import os
import re
import threading
from typing import List, Optional, Tuple

from ._errors import raise_status

#: The libstria ABI this package speaks (STRIA_CLIENT_ABI_VERSION).
ABI_VERSION = 1

DTYPE_F32, DTYPE_BF16, DTYPE_F16 = 0, 1, 2
HEAD_GROUPS_AUTO = 0xFFFFFFFF  # STRIA_HEAD_GROUPS_AUTO
LAYOUTS = {"striped": 0, "contiguous": 1, "zigzag": 2, "auto": 3, "packed": 4}
LAYOUT_NAMES = {v: k for k, v in LAYOUTS.items()}
#: Bytes of a sharded job's export (STRIA_JOB_EXPORT_BYTES).
JOB_EXPORT_BYTES = 48
#: Bytes of a session's export (STRIA_SESSION_EXPORT_BYTES).
SESSION_EXPORT_BYTES = JOB_EXPORT_BYTES
#: Bytes of any session's export, a head-grouped one's included
#: (STRIA_SESSION_EXPORT_MAX_BYTES: 16 + 40 per head group, at most 64).
SESSION_EXPORT_MAX_BYTES = 16 + 40 * 64
#: Where head groups' rings lie (stria_group_rings_t).
GROUP_RINGS = {"inside": 0, "across": 1}


class ClientParams(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("coordinator", ctypes.c_char_p),
        ("token", ctypes.c_char_p),
        ("connect_timeout_s", ctypes.c_double),
        ("rpc_timeout_s", ctypes.c_double),
        ("client_name", ctypes.c_char_p),
        ("token_file", ctypes.c_char_p),
        ("data_path", ctypes.c_int),  # stria_data_path_t: 0 auto, 1 tcp, 2 shm
        ("forward_retries", ctypes.c_int),  # 0: the default (2); negative: none
    ]


class JobSpec(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("batch", ctypes.c_int64),
        ("seq_len", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("dtype", ctypes.c_int),
        ("causal", ctypes.c_bool),
        ("layout", ctypes.c_int),
        ("ring_size", ctypes.c_int),
        ("scale", ctypes.c_float),
        ("step_timeout_s", ctypes.c_double),
        ("ttl_s", ctypes.c_double),
        ("no_queue", ctypes.c_bool),
        ("label", ctypes.c_char_p),
        ("cu_seqlens", ctypes.POINTER(ctypes.c_int64)),
        ("n_cu_seqlens", ctypes.c_size_t),
        ("has_window", ctypes.c_bool),
        ("window_left", ctypes.c_int64),
        ("window_right", ctypes.c_int64),
        ("arrival_timeout_s", ctypes.c_double),
        ("placement_hosts", ctypes.POINTER(ctypes.c_char_p)),
        ("placement_devices", ctypes.POINTER(ctypes.c_int)),
        ("placement_fallback", ctypes.c_bool),
        ("head_groups", ctypes.c_uint32),
        ("head_group_rings", ctypes.c_int),
    ]


class CallStats(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("queued_s", ctypes.c_double),
        ("upload_s", ctypes.c_double),
        ("pass_s", ctypes.c_double),
        ("download_s", ctypes.c_double),
        ("rank_compute_s_max", ctypes.c_double),
        ("rank_compute_s_min", ctypes.c_double),
        ("rank_wait_s_max", ctypes.c_double),
        ("bytes_up", ctypes.c_uint64),
        ("bytes_down", ctypes.c_uint64),
        ("ring_steps", ctypes.c_uint32),
        ("ring_bytes_sent", ctypes.c_uint64),
        ("retries", ctypes.c_uint32),
    ]


class SessionSpec(ctypes.Structure):  # stria_session_spec_t
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("max_batch", ctypes.c_int64),
        ("max_seq_len", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("dtype", ctypes.c_int),
        ("layout", ctypes.c_int),
        ("ring_size", ctypes.c_int),
        ("sharded", ctypes.c_bool),
        ("idle_timeout_s", ctypes.c_double),
        ("step_timeout_s", ctypes.c_double),
        ("arrival_timeout_s", ctypes.c_double),
        ("no_queue", ctypes.c_bool),
        ("label", ctypes.c_char_p),
        ("placement_hosts", ctypes.POINTER(ctypes.c_char_p)),
        ("placement_devices", ctypes.POINTER(ctypes.c_int)),
        ("placement_fallback", ctypes.c_bool),
        ("max_held", ctypes.c_uint32),
        ("head_groups", ctypes.c_uint32),
        ("head_group_rings", ctypes.c_int),
        ("trainer_ranks", ctypes.c_int),
    ]


class Call(ctypes.Structure):  # stria_call_t
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("batch", ctypes.c_int64),
        ("seq_len", ctypes.c_int64),
        ("causal", ctypes.c_bool),
        ("scale", ctypes.c_float),
        ("cu_seqlens", ctypes.POINTER(ctypes.c_int64)),
        ("n_cu_seqlens", ctypes.c_size_t),
        ("has_window", ctypes.c_bool),
        ("window_left", ctypes.c_int64),
        ("window_right", ctypes.c_int64),
    ]


class ShardBuffer(ctypes.Structure):  # stria_shard_buffer_t
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("outer", ctypes.c_int64),
        ("tokens", ctypes.c_int64),
        ("row_bytes", ctypes.c_int64),
        ("outer_stride", ctypes.c_int64),
    ]


class SessionStats(ctypes.Structure):  # stria_session_stats_t
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("calls", ctypes.c_uint64),
        ("failed", ctypes.c_uint64),
        ("retries", ctypes.c_uint64),
        ("reopened", ctypes.c_uint64),
        ("bytes_up", ctypes.c_uint64),
        ("bytes_down", ctypes.c_uint64),
        ("last_call_s", ctypes.c_double),
        ("last_pass_s", ctypes.c_double),
        ("last_minflt", ctypes.c_uint64),
        ("generation", ctypes.c_uint32),
        ("last_ring_bytes", ctypes.c_uint64),
        ("last_steps", ctypes.c_uint32),
    ]


_P = ctypes.c_void_p
_CALL = ctypes.POINTER(Call)
_SIGNATURES = {
    "stria_client_abi_version": (ctypes.c_uint, []),
    "stria_status_name": (ctypes.c_char_p, [ctypes.c_int]),
    "stria_error_msg": (ctypes.c_char_p, []),
    "stria_error_retryable": (ctypes.c_bool, []),
    "stria_client_connect": (ctypes.c_int, [ctypes.POINTER(ClientParams), ctypes.POINTER(_P)]),
    "stria_client_close": (None, [_P]),
    "stria_client_forward": (
        ctypes.c_int,
        [_P, ctypes.POINTER(JobSpec), _P, _P, _P, _P, _P, _P, _P, ctypes.POINTER(CallStats),
         ctypes.POINTER(_P)],
    ),
    "stria_client_backward": (
        ctypes.c_int, [_P, _P, _P, _P, _P, _P, _P, ctypes.POINTER(CallStats)]),
    "stria_client_release": (ctypes.c_int, [_P]),
    "stria_job_id": (ctypes.c_uint64, [_P]),
    "stria_job_ring_size": (ctypes.c_int, [_P]),
    "stria_job_layout": (ctypes.c_int, [_P]),
    # sharded jobs
    "stria_client_submit": (ctypes.c_int, [_P, ctypes.POINTER(JobSpec), ctypes.POINTER(_P)]),
    "stria_job_export": (ctypes.c_int, [_P, _P, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]),
    "stria_job_import": (ctypes.c_int, [_P, _P, ctypes.c_size_t, ctypes.POINTER(_P)]),
    "stria_job_shard_tokens": (ctypes.c_int64, [_P, ctypes.c_int]),
    "stria_job_positions": (ctypes.c_int, [_P, ctypes.c_int, _P]),
    "stria_client_forward_shard": (ctypes.c_int, [_P, ctypes.c_int, _P, _P, _P, _P, _P]),
    "stria_client_backward_shard": (ctypes.c_int, [_P, ctypes.c_int, _P, _P, _P, _P]),
    "stria_job_data_path": (ctypes.c_int, [_P, ctypes.c_int]),
    # sessions
    "stria_session_open": (ctypes.c_int, [_P, ctypes.POINTER(SessionSpec), ctypes.POINTER(_P)]),
    "stria_session_forward": (ctypes.c_int, [_P, _CALL, _P, _P, _P, _P, _P]),
    "stria_session_backward": (ctypes.c_int, [_P, _CALL, _P, _P, _P, _P, _P, _P, _P, _P, _P]),
    "stria_session_forward_shard": (ctypes.c_int, [_P, _CALL, ctypes.c_int, _P, _P, _P, _P, _P]),
    "stria_session_backward_shard": (
        ctypes.c_int, [_P, _CALL, ctypes.c_int, _P, _P, _P, _P, _P, _P, _P, _P, _P]),
    "stria_session_export": (
        ctypes.c_int, [_P, _P, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]),
    "stria_session_import": (ctypes.c_int, [_P, _P, ctypes.c_size_t, ctypes.POINTER(_P)]),
    "stria_session_shard_tokens": (ctypes.c_int64, [_P, ctypes.c_int64, ctypes.c_int]),
    "stria_session_positions": (ctypes.c_int, [_P, ctypes.c_int64, ctypes.c_int, _P]),
    "stria_session_spec_get": (ctypes.c_int, [_P, _P]),
    "stria_call_shard_tokens": (ctypes.c_int64, [ctypes.c_int, ctypes.c_int, _CALL, ctypes.c_int]),
    "stria_call_positions": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, _CALL, ctypes.c_int, _P]),
    "stria_session_buffer": (
        ctypes.c_int, [_P, _CALL, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ShardBuffer)]),
    "stria_session_ring_size": (ctypes.c_int, [_P]),
    "stria_session_ranks": (ctypes.c_int, [_P]),
    "stria_session_head_group": (ctypes.c_void_p, [_P, ctypes.c_int]),
    "stria_session_layout": (ctypes.c_int, [_P]),
    "stria_session_id": (ctypes.c_uint64, [_P]),
    "stria_session_stats": (ctypes.c_int, [_P, ctypes.POINTER(SessionStats)]),
    "stria_session_close": (ctypes.c_int, [_P]),
}

_lib = None
_lib_lock = threading.Lock()


#: The Debian/Ubuntu package that provides each shared library the wheel's
#: libstria and daemons link from the distribution (a missing one is named in
#: the error at import or at a daemon's start).
SYSTEM_PACKAGES = {
    "libucp.so.0": "libucx0", "libucs.so.0": "libucx0", "libuct.so.0": "libucx0",
    "libucm.so.0": "libucx0", "libprotobuf-c.so.1": "libprotobuf-c1", "libuv.so.1": "libuv1",
    "libcrypto.so.3": "libssl3", "libssl.so.3": "libssl3", "libnuma.so.1": "libnuma1",
    "libstdc++.so.6": "libstdc++6", "libgcc_s.so.1": "libgcc-s1",
}

#: The folders of an installed wheel: the daemons, libstria (and a CUDA
#: runtime, for a build that links one).
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
PACKAGE_BIN = os.path.join(PACKAGE_DIR, "_bin")
PACKAGE_LIB = os.path.join(PACKAGE_DIR, "_lib")

_MISSING = re.compile(r"([^\s:]+\.so[.\d]*): cannot open shared object file")


def missing_library_hint(message: Optional[str]) -> Optional[str]:
    """For a dynamic loader's error ("libuv.so.1: cannot open shared object
    file"), a sentence naming the missing library and the package that
    provides it; None for any other message."""
    m = _MISSING.search(message or "")
    if not m:
        return None
    soname = os.path.basename(m.group(1))
    pkg = SYSTEM_PACKAGES.get(soname)
    if pkg:
        return (f"the system library {soname} is missing: install it from the distribution "
                f"(apt-get install {pkg})")
    return f"the shared library {soname} is missing"


def _candidates() -> Tuple[List[str], bool]:
    """Where libstria may be, in order: STRIA_LIB; the package's own _lib
    (a wheel carries it there); the build tree of the source checkout this
    package sits in; the install prefix; the dynamic loader's search."""
    env = os.environ.get("STRIA_LIB")
    if env:
        return [env], True
    out = [os.path.join(PACKAGE_LIB, "libstria.so.1")]
    root = os.path.dirname(os.path.dirname(PACKAGE_DIR))  # python/stria -> repository root
    for build in ("build", "build-release"):
        out.append(os.path.join(root, build, "lib", "libstria.so.1"))
    import sys

    for prefix in {sys.prefix, "/usr/local", "/usr"}:
        for libdir in ("lib", "lib64", "lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu"):
            out.append(os.path.join(prefix, libdir, "libstria.so.1"))
    out.append("libstria.so.1")  # the dynamic loader's own search
    return out, False


def _load() -> ctypes.CDLL:
    cands, explicit = _candidates()
    errors = []
    for path in cands:
        if os.sep in path and not os.path.exists(path):
            if explicit:
                errors.append(f"{path}: no such file")
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            hint = missing_library_hint(str(e))
            if hint and os.sep in path:  # found, but what it links is not: say so first
                raise ImportError(f"cannot load libstria at {path}: {hint} ({e})") from None
            errors.append(f"{path}: {e}")
            continue
        if not hasattr(lib, "stria_client_abi_version"):
            errors.append(f"{path}: not libstria (no stria_client_abi_version)")
            continue
        lib.stria_client_abi_version.restype = ctypes.c_uint
        abi = lib.stria_client_abi_version()
        if abi != ABI_VERSION:
            raise ImportError(
                f"libstria at {path} speaks ABI {abi}, this stria package speaks ABI "
                f"{ABI_VERSION}: install the matching library or package (or point STRIA_LIB "
                f"at one)")
        missing = [name for name in _SIGNATURES if not hasattr(lib, name)]
        if missing:
            raise ImportError(f"libstria at {path} lacks {', '.join(missing)}: it is older "
                              f"than this package; build or install a newer one")
        for name, (res, args) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype = res
            fn.argtypes = args
        lib.path = path  # type: ignore[attr-defined]
        return lib
    where = ("STRIA_LIB" if explicit else
             "STRIA_LIB (unset), the package, the build tree, the install prefix")
    raise ImportError(f"cannot load libstria (looked in {where}): " + "; ".join(errors or
                      ["not found; build it (cmake --build build) or set STRIA_LIB"]))


def lib() -> ctypes.CDLL:
    """The loaded library (loaded on first use)."""
    global _lib
    if _lib is None:
        with _lib_lock:
            if _lib is None:
                _lib = _load()
    return _lib


def check(status: int) -> None:
    """Raises the StriaError of a failed call, with the calling thread's
    library message (thread-local in libstria: read it right after the call,
    on the same thread)."""
    if status == 0:
        return
    L = lib()
    name = L.stria_status_name(status).decode("ascii", "replace")
    msg = (L.stria_error_msg() or b"").decode("utf-8", "replace")
    raise_status(status, name, msg, bool(L.stria_error_retryable()))
