"""The package's version (one place: python/stria/VERSION, which the C build
reads too) and the errors that name a missing system library."""

import os
import re

import stria
import stria.local
from stria import _lib

from conftest import BUILD


def test_version_is_the_builds():
    with open(os.path.join(os.path.dirname(stria.__file__), "VERSION")) as f:
        assert stria.__version__ == f.read().strip()
    assert re.fullmatch(r"\d+\.\d+\.\d+", stria.__version__)
    # the build tree the suite runs against was configured with the same one
    lib = os.path.realpath(os.path.join(BUILD, "lib", "libstria.so.1"))
    assert os.path.basename(lib) == f"libstria.so.{stria.__version__}"


def test_missing_library_hint():
    msg = "/x/libstria.so.1: libprotobuf-c.so.1: cannot open shared object file: No such file"
    assert "apt-get install libprotobuf-c1" in _lib.missing_library_hint(msg)
    for soname, pkg in [("libucp.so.0", "libucx0"), ("libuv.so.1", "libuv1"),
                        ("libcrypto.so.3", "libssl3")]:
        hint = _lib.missing_library_hint(f"{soname}: cannot open shared object file")
        assert soname in hint and f"apt-get install {pkg}" in hint
    assert _lib.missing_library_hint("some other error") is None


def test_daemon_that_cannot_start_names_the_library(tmp_path, capsys):
    """python -m stria.local, when the dynamic loader cannot start a daemon:
    the error names the library and its package, and the exit status is 1."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for prog in ("stria-coordinator", "stria-worker", "striactl"):
        p = bin_dir / prog
        p.write_text(f"#!/bin/sh\necho '{prog}: error while loading shared libraries: "
                     f"libuv.so.1: cannot open shared object file: No such file or directory' "
                     f">&2\nexit 127\n")
        p.chmod(0o755)
    rc = stria.local.main(["--workers", "1", "--bin-dir", str(bin_dir),
                           "--log-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1
    assert "stria-coordinator cannot start" in err and "apt-get install libuv1" in err, err
