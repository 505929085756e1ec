#!/usr/bin/env python3
"""Assembles the stria wheel for this machine from a finished CMake build tree
(nothing is compiled): the Python package, libstria and the daemons.

    python3 python/build_wheel.py --build-dir build --out dist

The wheel (stria-VERSION-py3-none-PLATFORM.whl) holds stria/ as in python/,
plus stria/_lib/libstria.so.1 and stria/_bin/{stria-coordinator, stria-worker,
striactl, stria-run}. What they link from the distribution (UCX, protobuf-c,
libuv, OpenSSL) stays out of the wheel: the README names the packages and
stria names a missing one at import or at a daemon's start. A build with the
CUDA device links the CUDA runtime (libcudart); the wheel carries that library
in stria/_lib, where stria.local points the daemons. Any other library from
outside the distribution stops the build.

Standard library only; the version is python/stria/VERSION, the one the build
tree was configured with (libstria.so.VERSION must be in it).
"""

import argparse
import ast
import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.join(HERE, "stria")
DAEMONS = ("stria-coordinator", "stria-worker", "striactl", "stria-run")
# Libraries every Linux system has (glibc, the GCC runtime).
BASE = re.compile(r"^(ld-linux.*|linux-vdso|libc|libm|libdl|libpthread|librt|libresolv|"
                  r"libstdc\+\+|libgcc_s)\.so")
# Libraries the wheel carries beside libstria: the CUDA runtime.
CARRIED = re.compile(r"^libcudart\.so\.\d+$")


def fail(msg):
    sys.exit(f"build_wheel.py: {msg}")


def system_packages():
    """stria._lib.SYSTEM_PACKAGES, read without importing stria (torch)."""
    src = open(os.path.join(PKG, "_lib.py")).read()
    m = re.search(r"^SYSTEM_PACKAGES = (\{.*?\n\})", src, re.S | re.M)
    if not m:
        fail("stria/_lib.py has no SYSTEM_PACKAGES")
    return ast.literal_eval(m.group(1))


def needed(path):
    """The DT_NEEDED names of an ELF file and where this machine's loader
    resolves each (ldd; None: not found)."""
    out = subprocess.run(["ldd", path], capture_output=True, text=True)
    if out.returncode != 0:
        fail(f"ldd {path}: {out.stderr.strip() or out.stdout.strip()}")
    direct = subprocess.run(["readelf", "-d", path], capture_output=True, text=True)
    if direct.returncode != 0:
        fail(f"readelf -d {path}: {direct.stderr.strip()} (binutils is needed)")
    names = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", direct.stdout)
    where = {}
    for line in out.stdout.splitlines():
        m = re.match(r"\s*(\S+) => (not found|(\S+))", line)
        if m:
            where[m.group(1)] = m.group(3)
    return [(n, where.get(n)) for n in names]


def metadata(version):
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        try:
            import tomli as tomllib
        except ImportError:
            fail("needs Python 3.11 or newer (tomllib), or tomli")
    with open(os.path.join(HERE, "pyproject.toml"), "rb") as f:
        proj = tomllib.load(f)["project"]
    lines = ["Metadata-Version: 2.1", f"Name: {proj['name']}", f"Version: {version}",
             f"Summary: {proj['description']}",
             f"Requires-Python: {proj['requires-python']}"]
    lines += [f"Requires-Dist: {d}" for d in proj.get("dependencies", [])]
    for extra, deps in proj.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        lines += [f'Requires-Dist: {d}; extra == "{extra}"' for d in deps]
    lines.append("Description-Content-Type: text/markdown")
    with open(os.path.join(HERE, proj.get("readme", "README.md"))) as f:
        readme = f.read()
    return "\n".join(lines) + "\n\n" + readme


def platform_tag():
    tag = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    if not tag.startswith("linux_"):
        fail(f"a Linux wheel only (this platform: {tag})")
    return tag


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", default=os.path.join(os.path.dirname(HERE), "build"),
                    help="the CMake build tree (default: build/ of this checkout)")
    ap.add_argument("--out", default="dist", help="the folder for the wheel (default dist)")
    args = ap.parse_args()

    with open(os.path.join(PKG, "VERSION")) as f:
        version = f.read().strip()
    build = os.path.abspath(args.build_dir)
    lib = os.path.join(build, "lib", "libstria.so.1")
    if not os.path.exists(lib):
        fail(f"{lib} is missing: build stria first (cmake --build {args.build_dir})")
    if os.path.basename(os.path.realpath(lib)) != f"libstria.so.{version}":
        fail(f"{lib} is {os.path.basename(os.path.realpath(lib))}, not version {version} "
             f"(python/stria/VERSION): reconfigure and rebuild {args.build_dir}")
    files = []  # (name in the wheel, source path, executable)
    for dirpath, dirnames, filenames in os.walk(PKG):
        dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", "_bin", "_lib"))
        for fn in sorted(filenames):
            if fn.endswith(".py") or fn in ("VERSION", "py.typed"):
                src = os.path.join(dirpath, fn)
                files.append((os.path.relpath(src, HERE), src, False))
    binaries = [("stria/_lib/libstria.so.1", os.path.realpath(lib))]
    for d in DAEMONS:
        p = os.path.join(build, "bin", d)
        if not os.access(p, os.X_OK):
            fail(f"{p} is missing: build stria first (cmake --build {args.build_dir})")
        binaries.append((f"stria/_bin/{d}", p))
    known = system_packages()
    carried, report = {}, {}
    for name, path in binaries:
        for soname, where in needed(path):
            if soname in known:
                report.setdefault(f"{soname} ({known[soname]})", []).append(
                    os.path.basename(name))
            elif BASE.match(soname):
                continue
            elif CARRIED.match(soname):
                if not where:
                    fail(f"{path} links {soname}, which this machine's loader does not find")
                carried[soname] = os.path.realpath(where)
            else:
                fail(f"{path} links {soname}, neither a distribution library stria knows "
                     f"(stria/_lib.py SYSTEM_PACKAGES) nor one the wheel carries")
    binaries += [(f"stria/_lib/{so}", src) for so, src in sorted(carried.items())]
    files += [(name, src, True) for name, src in binaries]

    tag = f"py3-none-{platform_tag()}"
    dist = f"stria-{version}.dist-info"
    wheel_txt = ("Wheel-Version: 1.0\nGenerator: stria build_wheel.py\n"
                 f"Root-Is-Purelib: false\nTag: {tag}\n")
    os.makedirs(args.out, exist_ok=True)
    whl = os.path.join(args.out, f"stria-{version}-{tag}.whl")
    tmp = whl + ".part"
    record = []
    # fixed timestamps: the same tree gives the same wheel
    stamp = (1980, 1, 1, 0, 0, 0)

    def add(zf, name, data, mode):
        info = zipfile.ZipInfo(name, stamp)
        info.external_attr = (0o100000 | mode) << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        zf.writestr(info, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")

    with zipfile.ZipFile(tmp, "w") as zf:
        for name, src, exe in files:
            with open(src, "rb") as f:
                add(zf, name, f.read(), 0o755 if exe else 0o644)
        add(zf, f"{dist}/METADATA", metadata(version).encode(), 0o644)
        add(zf, f"{dist}/WHEEL", wheel_txt.encode(), 0o644)
        add(zf, f"{dist}/top_level.txt", b"stria\n", 0o644)
        record.append(f"{dist}/RECORD,,")
        info = zipfile.ZipInfo(f"{dist}/RECORD", stamp)
        info.external_attr = 0o100644 << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        zf.writestr(info, "\n".join(record) + "\n")
    shutil.move(tmp, whl)
    print(f"build_wheel.py: {whl} ({os.path.getsize(whl) / 1e6:.1f} MB, from {build})")
    print("  system libraries (Debian/Ubuntu packages): " +
          "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(report.items())))
    if carried:
        print(f"  carried in stria/_lib: {', '.join(sorted(carried))}")


if __name__ == "__main__":
    main()
