#!/usr/bin/env python3
"""Every file and stria_ name docs/ARCHITECTURE.md mentions exists.

The architecture document says where things live; when code moves and the
document does not, it sends readers to files and functions that are gone.
This reads the document and checks two kinds of token:

- repository paths, `dir/file.ext` or `dir/` whose first part is a tracked
  top-level folder (build outputs such as build/bin/... and system paths such
  as /proc/... are not the repository's): each must exist on disk relative to
  the root. A bare source file name in backquotes (`coord_place.c`) must be
  the name of a tracked file, or be named in a tracked CMake file (generated
  at build time, like stria_methods.h). A path with a wildcard (`kernels/cuda/*.cu`), a placeholder
  (`tests/fuzz/fuzz_<target>.c`) or a brace list
  (`kernels/cpu/{portable,avx2}.c`) must match at least one file.
- identifiers starting with stria_ or STRIA_ (stria__ internals included):
  each must occur in a tracked source file (.c .h .cu .cuh .py .cmake .proto
  .sh .in, CMakeLists.txt). A pattern (`stria_attn_fwd*`, `stria__wjob_*`,
  `stria_<module>_...`) or a prefix ending in _ must match at least one.

It prints each missing one with its line number and fails, or one summary
line.

usage: check_docs.py [ROOT]   (default: the repository holding this file)
"""
import fnmatch
import glob
import os
import re
import subprocess
import sys

DOC = os.path.join("docs", "ARCHITECTURE.md")
SOURCE_EXT = (".c", ".h", ".cu", ".cuh", ".py", ".cmake", ".proto", ".sh", ".in")
# A path: parts of name characters (with * ? and <placeholder>, {a,b} lists)
# joined by '/', not preceded by a name character, '/', '.', '-' or ':'.
PATH = re.compile(r"(?<![\w/.:\-<>*{])((?:[\w.*?<>{},\-]+/)+[\w.*?<>{},\-]*)")
# A name: stria_ or STRIA_ then name characters, * and <placeholder>.
NAME = re.compile(r"(?<![\w.])((?:stria|STRIA)_(?:[\w*]|<\w+>)*)")
# A bare source file name inside a `code` span.
CODE = re.compile(r"`([^`]*)`")
BARE = re.compile(r"(?<![\w/.\-{,<>*])([\w\-*<>]+\.(?:c|h|cu|cuh|py|sh|proto|cmake))(?![\w/])")
IDENT = re.compile(r"\b(?:stria|STRIA)_\w*")


def tracked(root):
    """Tracked files (git ls-files), or every file under root without git."""
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "-z"], check=True,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL).stdout
        return [p for p in out.decode("utf-8", "replace").split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for dirpath, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith((".git", "build"))]
            files += [os.path.relpath(os.path.join(dirpath, n), root) for n in names]
        return files


def expand_braces(token):
    m = re.search(r"\{([^{}]*)\}", token)
    if m is None:
        return [token]
    out = []
    for alt in m.group(1).split(","):
        out += expand_braces(token[:m.start()] + alt + token[m.end():])
    return out


def as_glob(token):
    return re.sub(r"<\w+>", "*", token)


def path_found(root, token):
    for alt in expand_braces(token):
        pat = as_glob(alt)
        if any(c in pat for c in "*?["):
            if glob.glob(os.path.join(root, pat)):
                continue
            return False
        if not os.path.exists(os.path.join(root, pat)):
            return False
    return True


def file_found(bases, cmake, token):
    if "*" in token or "<" in token:
        return bool(fnmatch.filter(bases, as_glob(token)))
    return token in bases or token in cmake


def name_found(names, token):
    if "*" in token or "<" in token:
        rx = re.compile(fnmatch.translate(as_glob(token)))
        return any(rx.match(n) for n in names)
    if token.endswith("_"):
        return any(n.startswith(token) for n in names)
    return token in names


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))
    files = tracked(root)
    tops = {f.split("/")[0] for f in files if "/" in f}
    bases = {os.path.basename(f) for f in files}
    cmake = ""
    names = set()
    for f in files:
        if f.endswith(".cmake") or os.path.basename(f) == "CMakeLists.txt":
            with open(os.path.join(root, f), encoding="utf-8", errors="replace") as fh:
                cmake += fh.read()
        if f.endswith(SOURCE_EXT) or os.path.basename(f) == "CMakeLists.txt":
            try:
                with open(os.path.join(root, f), encoding="utf-8", errors="replace") as fh:
                    names.update(IDENT.findall(fh.read()))
            except OSError:
                pass
    with open(os.path.join(root, DOC), encoding="utf-8") as fh:
        lines = fh.read().split("\n")

    paths_seen, names_seen, missing = set(), set(), []
    for no, line in enumerate(lines, 1):
        for m in PATH.finditer(line):
            token = m.group(1).rstrip(".,")
            if token.split("/")[0] not in tops:
                continue
            paths_seen.add(token)
            if not path_found(root, token):
                missing.append((no, "path", token))
        for span in CODE.findall(line):
            for token in BARE.findall(span):
                paths_seen.add(token)
                if not file_found(bases, cmake, token):
                    missing.append((no, "file", token))
        for m in NAME.finditer(line):
            token = m.group(1)
            names_seen.add(token)
            if not name_found(names, token):
                missing.append((no, "name", token))

    for no, kind, token in missing:
        print("%s:%d: %s not found: %s" % (DOC, no, kind, token))
    if missing:
        print("%d paths and %d names checked, %d missing" % (
            len(paths_seen), len(names_seen), len(missing)))
        return 1
    print("%d paths and %d names checked, all found" % (len(paths_seen), len(names_seen)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
