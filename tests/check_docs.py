#!/usr/bin/env python3
"""Every file, link and stria_ name the project's pages mention exists.

The pages say where things live; when code moves and a page does not, it
sends readers to files and functions that are gone. This reads every page
(README.md, docs/*.md and the pages in folders under docs/, such as
docs/modules/*.md) and checks three kinds of token:

- repository paths, `dir/file.ext` or `dir/` whose first part is a tracked
  top-level folder (build outputs such as build/bin/... and system paths such
  as /proc/... are not the repository's): each must exist on disk relative to
  the root. A bare source file name in backquotes (`coord_place.c`) must be
  the name of a tracked file, or be named in a tracked CMake file (generated
  at build time, like stria_methods.h). A path with a wildcard (`kernels/cuda/*.cu`), a placeholder
  (`tests/fuzz/fuzz_<target>.c`) or a brace list
  (`kernels/cpu/{portable,avx2}.c`) must match at least one file. A path
  that git ignores (a local virtual environment such as bench/.venv) is
  not the repository's and is skipped; a path that names a program built
  from a tracked source (tests/worker/bench_worker_passes, built from
  tests/worker/bench_worker_passes.c) counts as found.
- relative Markdown links, `[text](modules/worker.md#threads)`: the file
  (the part before any #) must exist, relative to the page, and an anchor
  into a Markdown page must be one of its headings (GitHub's rule: lower
  case, punctuation dropped, spaces as hyphens, -1, -2 for repeats).
- identifiers starting with stria_ or STRIA_ (stria__ internals included):
  each must occur in a tracked source file (.c .h .cu .cuh .py .cmake .proto
  .sh .in, CMakeLists.txt). A pattern (`stria_attn_fwd*`, `stria__wjob_*`,
  `stria_<module>_...`) or a prefix ending in _ must match at least one.
  A metric series of a histogram (`stria_worker_step_seconds_sum`, _count,
  _bucket) counts as its family's name; a name that CMake composes
  (`foreach(t stria striactl)` and `${t}_needs_no_libuv` make
  stria_needs_no_libuv) counts when its tail is such a composition's and its
  head a word of the CMake files; a name inside a package's file name
  (`stria_<version>_amd64.deb`) is no identifier and is skipped.

It prints each missing one as PAGE:LINE and fails, or one summary line.

usage: check_docs.py [ROOT]   (default: the repository holding this file)
"""
import fnmatch
import glob
import os
import re
import subprocess
import sys

# The pages: README.md, docs/*.md and docs/<folder>/**/*.md.
TOP_PAGES = ("README.md",)
DOCS_DIR = "docs"
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
# A relative Markdown link's target.
LINK = re.compile(r"\]\(([^()\s]+)\)")
# A name CMake composes from a variable and a tail: ${t}_needs_no_libuv.
CMAKE_TAIL = re.compile(r"\$\{\w+\}(_\w+)")
# The series a Prometheus histogram adds to its family's name.
HISTOGRAM_SUFFIXES = ("_sum", "_count", "_bucket")
# Package files whose names start like an identifier.
PACKAGE_FILE = re.compile(r"[\w<>.\-]*\.(?:deb|rpm|whl)\b")


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


def pages(root):
    """The pages to read, relative to root, in a stable order."""
    out = [p for p in TOP_PAGES if os.path.isfile(os.path.join(root, p))]
    docs = os.path.join(root, DOCS_DIR)
    for dirpath, dirs, names in os.walk(docs):
        dirs.sort()
        for n in sorted(names):
            if n.endswith(".md"):
                out.append(os.path.relpath(os.path.join(dirpath, n), root))
    return out


def heading_anchors(path, cache={}):
    """The anchors of a Markdown page's headings (outside code blocks)."""
    if path in cache:
        return cache[path]
    anchors, seen, fenced = set(), {}, False
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().split("\n")
    except OSError:
        lines = []
    for line in lines:
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or m is None:
            continue
        text = re.sub(r"[^\w\- ]", "", m.group(1).replace("`", "").lower()).replace(" ", "-")
        n = seen.get(text, 0)
        seen[text] = n + 1
        anchors.add(text if n == 0 else "%s-%d" % (text, n))
    cache[path] = anchors
    return anchors


def ignored(root, token):
    """Whether git ignores the path (a local output, not the repository's)."""
    try:
        # the folder form too: a pattern such as /bench/.venv/ matches folders only
        for form in (token, token.rstrip("/") + "/"):
            if subprocess.run(["git", "-C", root, "check-ignore", "-q", "--no-index", "--", form],
                              stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL).returncode == 0:
                return True
        return False
    except OSError:
        return False


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
        full = os.path.join(root, pat)
        if os.path.exists(full):
            continue
        # a program built from a tracked source of the same name
        if any(os.path.isfile(full + ext) for ext in (".c", ".cu")):
            continue
        return False
    return True


def file_found(bases, cmake, token):
    if "*" in token or "<" in token:
        return bool(fnmatch.filter(bases, as_glob(token)))
    return token in bases or token in cmake


def name_found(names, tails, cmake, token):
    if "*" in token or "<" in token:
        rx = re.compile(fnmatch.translate(as_glob(token)))
        return any(rx.match(n) for n in names)
    if token.endswith("_"):
        return any(n.startswith(token) for n in names)
    if token in names:
        return True
    for suffix in HISTOGRAM_SUFFIXES:
        if token.endswith(suffix) and token[:-len(suffix)] in names:
            return True
    # ${t}_needs_no_libuv with t one of a list CMake names (foreach(t stria striactl))
    return any(token.endswith(t) and len(token) > len(t) and
               re.search(r"\b%s\b" % re.escape(token[:-len(t)]), cmake) for t in tails)


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))
    files = tracked(root)
    tops = {f.split("/")[0] for f in files if "/" in f}
    bases = {os.path.basename(f) for f in files}
    cmake = ""
    names = set()
    tails = set()
    for f in files:
        if f.endswith(".cmake") or os.path.basename(f) == "CMakeLists.txt":
            with open(os.path.join(root, f), encoding="utf-8", errors="replace") as fh:
                text = fh.read()
            cmake += text
            tails.update(CMAKE_TAIL.findall(text))
        if f.endswith(SOURCE_EXT) or os.path.basename(f) == "CMakeLists.txt":
            try:
                with open(os.path.join(root, f), encoding="utf-8", errors="replace") as fh:
                    names.update(IDENT.findall(fh.read()))
            except OSError:
                pass
    paths_seen, names_seen, links_seen, missing = set(), set(), set(), []
    checked = pages(root)
    for page in checked:
        with open(os.path.join(root, page), encoding="utf-8") as fh:
            lines = fh.read().split("\n")
        here = os.path.dirname(page)
        for no, line in enumerate(lines, 1):
            for m in PATH.finditer(line):
                token = m.group(1).rstrip(".,")
                if token.split("/")[0] not in tops:
                    continue
                paths_seen.add(token)
                if not path_found(root, token) and not ignored(root, token):
                    missing.append((page, no, "path", token))
            for span in CODE.findall(line):
                for token in BARE.findall(span):
                    paths_seen.add(token)
                    if not file_found(bases, cmake, token):
                        missing.append((page, no, "file", token))
            for m in LINK.finditer(line):
                target, _, anchor = m.group(1).partition("#")
                if re.match(r"^[a-z][a-z0-9+.\-]*:", target):
                    continue  # a URL
                full = os.path.normpath(os.path.join(root, here, target) if target
                                        else os.path.join(root, page))
                links_seen.add((here, m.group(1)))
                if not os.path.exists(full):
                    missing.append((page, no, "link", m.group(1)))
                elif anchor and full.endswith(".md") and anchor not in heading_anchors(full):
                    missing.append((page, no, "anchor", m.group(1)))
            files = [(f.start(), f.end()) for f in PACKAGE_FILE.finditer(line)]
            for m in NAME.finditer(line):
                token = m.group(1)
                if any(a <= m.start() < b for a, b in files):
                    continue  # part of a package's file name
                names_seen.add(token)
                if not name_found(names, tails, cmake, token):
                    missing.append((page, no, "name", token))

    for page, no, kind, token in missing:
        print("%s:%d: %s not found: %s" % (page, no, kind, token))
    summary = "%d pages: %d paths, %d links and %d names checked" % (
        len(checked), len(paths_seen), len(links_seen), len(names_seen))
    if missing:
        print("%s, %d missing" % (summary, len(missing)))
        return 1
    print("%s, all found" % summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
