#!/usr/bin/env python3
"""No private name is defined in two modules.

Internals are named stria__* (shared inside a module through its *_int.h, or
static). The same name defined in two modules sends grep, ctags and code maps
to the wrong one, so every stria__ function is defined in one module only.
This reads the definitions from the sources (static ones included: the
optimised libraries inline many, so the binaries cannot tell) and fails
naming each name defined in more than one module.

A module is a top-level folder (common, kernels, transport, proto, client,
tools, bench), or daemon/<part> (ring, service, coordinator, worker). Definitions
in headers are templates compiled into each file that includes them (the
x86 kernel variants): they are not read.

In the rooms that follow libuv's naming (NAMED_ROOMS: the worker, libstria
and the UCX link), a name also says how far it reaches: `stria_` public,
`stria__` shared between the files of a module (and declared in one of its
*_int.h headers), plain names for statics. There a static function named
stria__* or a stria__ function that no *_int.h of its module declares fails.

usage: check_private_names.py [ROOT]   (default: the repository holding this file)
"""
import os
import re
import sys

MODULES = ("common", "kernels", "transport", "proto", "client", "tools", "bench", "daemon")
# A definition: at column 0, a return type and the name, the parameter list
# closed on this line or a later one, then a body (not a ';').
HEAD = re.compile(r"^(?!typedef\b)(?:[A-Za-z_][\w]*[\s\*]+)+?(stria__\w+)\s*\(")


# (folder, file name prefix) of the rooms whose names say how far they reach
NAMED_ROOMS = (("daemon/worker", "worker"), ("client", "client"), ("transport", "ucx"))
STATIC_HEAD = re.compile(r"^static\b[^=;(]*?\b(stria__\w+)\s*\(")
DECL = re.compile(r"\b(stria__\w+)\s*\(")


def named_room(rel):
    folder, name = os.path.split(rel)
    for room, prefix in NAMED_ROOMS:
        if folder == room and name.startswith(prefix) and name.endswith(".c"):
            return room
    return None


def shared_declarations(root, room):
    """stria__ names declared in the *_int.h headers of a room's folder."""
    names = set()
    folder = os.path.join(root, room)
    for name in os.listdir(folder):
        if name.endswith("_int.h"):
            with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
                names.update(DECL.findall(f.read()))
    return names


def naming_faults(root, rel, path):
    """What breaks the naming rule in one file of a named room."""
    room = named_room(rel)
    if room is None:
        return []
    declared = shared_declarations(root, room)
    faults = []
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    for i, line in enumerate(lines):
        m = STATIC_HEAD.match(line)
        if m is not None:
            faults.append("%s:%d: static %s: a static's name is plain (no stria__)" %
                          (rel, i + 1, m.group(1)))
    for fn, line in definitions(path):
        if fn not in declared and not lines[line - 1].startswith("static"):
            faults.append("%s:%d: %s is shared but no *_int.h of %s declares it" %
                          (rel, line, fn, room))
    return faults


def module_of(path):
    parts = path.split(os.sep)
    return "/".join(parts[:2]) if parts[0] == "daemon" else parts[0]


def definitions(path):
    """(name, line) of every stria__ function defined in a C or CUDA file."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    i = 0
    while i < len(lines):
        m = HEAD.match(lines[i])
        if m is None:
            i += 1
            continue
        start = i
        # join the head until the parameter list closes
        text = lines[i]
        while text.count("(") > text.count(")") and i + 1 < len(lines):
            i += 1
            text += " " + lines[i].strip()
        rest = text[text.rfind(")") + 1:].strip()
        if rest.startswith("{") or (rest == "" and i + 1 < len(lines) and
                                    lines[i + 1].startswith("{")):
            yield m.group(1), start + 1
        i += 1


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))
    where = {}
    files = 0
    faults = []
    for top in MODULES:
        for dirpath, _, names in os.walk(os.path.join(root, top)):
            for name in sorted(names):
                if not name.endswith((".c", ".cu")):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root)
                files += 1
                for fn, line in definitions(path):
                    where.setdefault(fn, []).append((module_of(rel), "%s:%d" % (rel, line)))
                faults.extend(naming_faults(root, rel, path))
    clashes = {fn: places for fn, places in where.items()
               if len({m for m, _ in places}) > 1}
    for fn in sorted(clashes):
        print("%s is defined in %d modules: %s" % (
            fn, len({m for m, _ in clashes[fn]}), ", ".join(p for _, p in clashes[fn])))
    for fault in faults:
        print(fault)
    print("%d stria__ functions in %d files: %d defined in more than one module; %d against "
          "the naming rule of %s" % (len(where), files, len(clashes), len(faults),
                                      ", ".join(r for r, _ in NAMED_ROOMS)))
    failed = int(bool(clashes)) + int(bool(faults))
    # the runner's summary line
    print("%d passed, %d failed" % (2 - failed, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
