#!/usr/bin/env python3
"""Runs `stria-bench ring --timeline` on small problems, and `stria-bench
simulate --timeline` on a predicted ring, and parses the SVG with a real XML
parser: one panel per (layout, pass) drawn, a row per rank in each,
compute and wait shapes, a legend, axis labels and the job's shape in the
title. Usage: check_timeline_svg.py STRIA-BENCH OUTDIR"""
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

NS = "{http://www.w3.org/2000/svg}"


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def klass(el):
    return el.get("class", "")


def check_svg(path, want_panels, ranks, title_has):
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        fail("%s is not well-formed XML: %s" % (path, e))
    if root.tag != NS + "svg":
        fail("root element is %s, want an svg element in the SVG namespace" % root.tag)
    for attr in ("width", "height", "viewBox"):
        if not root.get(attr):
            fail("svg element without %s" % attr)
    # self-contained: no external references
    for el in root.iter():
        for k, v in el.attrib.items():
            if "href" in k or "url(" in v:
                fail("external reference %s=%s" % (k, v))
    titles = [t for t in root.iter(NS + "text") if klass(t) == "title"]
    if len(titles) != 1 or any(s not in "".join(titles[0].itertext()) for s in title_has):
        fail("title missing or without %s" % (title_has,))
    legend = [g for g in root.iter(NS + "g") if klass(g) == "legend"]
    if len(legend) != 1:
        fail("want one legend, got %d" % len(legend))
    labels = ["".join(t.itertext()) for t in legend[0].iter(NS + "text")]
    if not any("compute" in l for l in labels) or not any("wait" in l for l in labels):
        fail("legend without compute and wait: %s" % labels)
    axis = [g for g in root.iter(NS + "g") if klass(g) == "axis"]
    if len(axis) != 1:
        fail("want one axis, got %d" % len(axis))
    axis_labels = [t for t in axis[0].iter(NS + "text") if klass(t) == "axis-label"]
    ticks = [t for t in axis[0].iter(NS + "text") if klass(t) == "tick-label"]
    if len(axis_labels) != 1 or "time" not in "".join(axis_labels[0].itertext()):
        fail("axis label missing")
    if len(ticks) < 3:
        fail("only %d tick labels" % len(ticks))
    panels = [g for g in root.iter(NS + "g") if klass(g) == "panel"]
    names = [p.get("data-name") for p in panels]
    if names != want_panels:
        fail("panels %s, want %s" % (names, want_panels))
    kinds = set()
    for p in panels:
        rows = [g for g in p.iter(NS + "g") if klass(g) == "row"]
        if int(p.get("data-rows")) != ranks or len(rows) != ranks:
            fail("panel %s: %s rows declared, %d drawn, want %d" %
                 (p.get("data-name"), p.get("data-rows"), len(rows), ranks))
        if sorted(int(r.get("data-rank")) for r in rows) != list(range(ranks)):
            fail("panel %s: rows are not ranks 0..%d" % (p.get("data-name"), ranks - 1))
        for r in rows:
            kinds.update(klass(e) for e in r.iter(NS + "rect"))
    if not {"compute", "wait", "bg"} <= kinds:
        fail("rows draw %s, want compute, wait and bg shapes" % sorted(kinds))
    return len(panels)


def main():
    bench, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    runs = [
        (["--ranks", "3", "--seq", "3000", "--pass", "both"],
         ["contiguous, forward", "striped, forward", "zigzag, forward",
          "contiguous, backward", "striped, backward", "zigzag, backward"], 3, ("N=3", "S=3000")),
        (["--ranks", "4", "--seq", "2048", "--pass", "fwd", "--window", "255",
          "--layout", "striped"],
         ["contiguous, forward", "contiguous-all-hops, forward", "striped, forward"], 4,
         ("N=4", "window (255, 0)")),
    ]
    for i, (args, panels, ranks, title) in enumerate(runs):
        svg = os.path.join(out, "timeline%d.svg" % i)
        cmd = [bench, "ring", "--reps", "1", "--heads", "1", "--head-dim", "32",
               "--timeline", svg] + args
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            fail("%s exited with %d: %s" % (" ".join(cmd), run.returncode, run.stderr))
        n = check_svg(svg, panels, ranks, title)
        print("%s: %d panels of %d rows, legend, axis and title present" % (svg, n, ranks))
    # the simulator's predicted passes, drawn by the same writer
    svg = os.path.join(out, "timeline-sim.svg")
    cmd = [bench, "simulate", "--device-tflops", "400", "--ranks", "8", "--seq", "16384",
           "--heads", "4", "--timeline", svg]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        fail("%s exited with %d: %s" % (" ".join(cmd), run.returncode, run.stderr))
    n = check_svg(svg, runs[0][1], 8, ("N=8", "S=16384"))
    print("%s: %d panels of 8 rows, legend, axis and title present" % (svg, n))
    bad = subprocess.run([bench, "ring", "--ranks", "2,4", "--timeline", "x.svg"],
                         capture_output=True, text=True, timeout=60)
    if bad.returncode != 2 or "--timeline" not in bad.stderr:
        fail("two ring sizes with --timeline: exit %d, %r" % (bad.returncode, bad.stderr))


if __name__ == "__main__":
    main()
