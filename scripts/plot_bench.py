#!/usr/bin/env python3
"""Plots baton's benchmark JSON lines as SVG (no dependencies beyond Python 3).

    build/bin/baton-bench-parallel  > /tmp/parallel.jsonl
    build/bin/baton-bench-allreduce > /tmp/allreduce.jsonl
    scripts/plot_bench.py bubble    /tmp/parallel.jsonl  docs/bubble.svg
    scripts/plot_bench.py allreduce /tmp/allreduce.jsonl docs/allreduce.svg [/tmp/transport.jsonl]
    build/bin/baton-bench-allreduce --hosts 2 > /tmp/hier.jsonl
    build/bin/baton-bench-allreduce --hosts 2 --link-gbit 2 >> /tmp/hier.jsonl
    scripts/plot_bench.py hier      /tmp/hier.jsonl      docs/allreduce_hier.svg

With baton-bench-transport's lines as a fourth argument, the all-reduce plot also draws
ucx_perftest's tag_bw over shared memory (the transport's ceiling) at the sizes it measured.
"""
import json
import math
import sys

W, H, L, R, T, B = 640, 400, 70, 170, 40, 55
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]


def svg(title, xlabel, ylabel, series, xlog=False, ylog=False, xticks=None):
    """series: [(name, [(x, y)], dashed)]"""
    xs = [x for _, pts, _ in series for x, _ in pts]
    ys = [y for _, pts, _ in series for _, y in pts if y > 0 or not ylog]
    fx = (lambda v: math.log2(v)) if xlog else (lambda v: v)
    fy = (lambda v: math.log10(v)) if ylog else (lambda v: v)
    x0, x1 = fx(min(xs)), fx(max(xs))
    y0, y1 = (fy(min(ys)), fy(max(ys))) if ylog else (0.0, max(ys) * 1.05)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y1 = y0 + 1
    px = lambda v: L + (fx(v) - x0) / (x1 - x0) * (W - L - R)
    py = lambda v: H - B - (fy(v) - y0) / (y1 - y0) * (H - T - B)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="14">{title}</text>',
           f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>',
           f'<text x="{(L + W - R) / 2}" y="{H - 15}" text-anchor="middle">{xlabel}</text>',
           f'<text x="18" y="{(T + H - B) / 2}" text-anchor="middle" transform="rotate(-90 18 {(T + H - B) / 2})">{ylabel}</text>']
    for x, label in (xticks or [(x, str(x)) for x in sorted(set(xs))]):
        out.append(f'<text x="{px(x):.1f}" y="{H - B + 16}" text-anchor="middle">{label}</text>')
    for i in range(5):
        v = y0 + (y1 - y0) * i / 4
        val = 10 ** v if ylog else v
        out.append(f'<line x1="{L - 4}" y1="{py(val):.1f}" x2="{W - R}" y2="{py(val):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{L - 6}" y="{py(val) + 4:.1f}" text-anchor="end">{val:.3g}</text>')
    for i, (name, pts, dashed) in enumerate(series):
        c = COLORS[i % len(COLORS)]
        pts = sorted(p for p in pts if p[1] > 0 or not ylog)
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        dash = ' stroke-dasharray="5,4"' if dashed else ""
        out.append(f'<polyline points="{path}" fill="none" stroke="{c}" stroke-width="2"{dash}/>')
        for x, y in pts:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{c}"/>')
        ly = T + 18 * i
        out.append(f'<line x1="{W - R + 10}" y1="{ly}" x2="{W - R + 30}" y2="{ly}" stroke="{c}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{W - R + 35}" y="{ly + 4}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out)


def lines(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip().startswith("{")]


def bubble(rows):
    series = []
    for k in (2, 4):
        for sched in ("gpipe", "1f1b"):
            pts = [(int(r["case"].split("_")[2][1:]), r["value"]) for r in rows
                   if r["case"].startswith(f"bubble_K{k}_") and r["case"].endswith(sched)]
            series.append((f"K={k} {sched}", pts, False))
        pts = [(int(r["case"].split("_")[2][1:]), r["reference"]) for r in rows
               if r["case"].startswith(f"bubble_K{k}_") and r["case"].endswith("gpipe")]
        series.append((f"K={k} (K-1)/(M+K-1)", pts, True))
    return svg("Pipeline bubble: idle fraction per stage", "micro-batches M", "idle fraction", series)


def allreduce(rows, transport=()):
    series = []
    # perftest's one-way bandwidth is a ceiling for busbw: a ring moves 2(n-1)/n of the tensor
    # through every link, and busbw counts exactly those bytes. UCX's defaults ("ceiling", with
    # CMA) where the line has it; before 2026-11-25 that was the line's "reference".
    ceiling = []
    for r in transport:
        case = r.get("case", "")
        top = r.get("ceiling", r.get("reference"))
        if case.startswith("transfer_bw_") and case.endswith("_shm") and top is not None:
            size = case[len("transfer_bw_"):-len("_shm")]
            scale = 1 << 20 if size.endswith("MiB") else 1 << 10
            ceiling.append((int(size[:-3]) * scale, top))
    if ceiling:
        series.append(("ucx_perftest tag_bw (shm, UCX defaults)", sorted(ceiling), True))
    rows = [r for r in rows if r.get("case", "").startswith("allreduce_busbw_")]
    for n in (2, 4):
        mine = [(r["bytes"], r["value"]) for r in rows if r.get("ranks") == n]
        ref = [(r["bytes"], r["reference"]) for r in rows if r.get("ranks") == n and "reference" in r]
        if mine:
            series.append((f"baton, {n} ranks", mine, False))
        if ref:
            series.append((f"MPI, {n} ranks", ref, True))
    sizes = sorted({r["bytes"] for r in rows})
    ticks = [(b, f"{b >> 20}M" if b >= 1 << 20 else f"{b >> 10}K") for b in sizes]
    return svg("All-reduce bus bandwidth", "bytes", "busbw GB/s (log)", series, xlog=True, ylog=True, xticks=ticks)


def hier(rows):
    """baton-bench-allreduce --hosts 2: hierarchical, flat ring and MPI, per link (the veth as it
    is, and limited); where a size was measured twice, the mean."""
    series = []
    for link, suffix in (("veth", ""), ("2 Gbit/s", "_2gbit")):
        picked = [r for r in rows if r.get("case", "").startswith("allreduce_hier_")
                  and r["case"].endswith("_2x2" + suffix)]
        for name, key, dashed in (("hierarchical", "value", False), ("flat ring", "flat_ring", False),
                                  ("MPI", "reference", True)):
            by_size = {}
            for r in picked:
                if key in r:
                    by_size.setdefault(r["bytes"], []).append(r[key])
            pts = [(b, sum(v) / len(v)) for b, v in by_size.items()]
            if pts:
                series.append((f"{name}, {link}", pts, dashed))
    sizes = sorted({r["bytes"] for r in rows if r.get("case", "").startswith("allreduce_hier_")})
    ticks = [(b, f"{b >> 20}M" if b >= 1 << 20 else f"{b >> 10}K") for b in sizes]
    return svg("All-reduce across 2 hosts x 2 ranks (TCP)", "bytes", "busbw GB/s (log)", series, xlog=True, ylog=True,
               xticks=ticks)


if __name__ == "__main__":
    if len(sys.argv) not in (4, 5) or sys.argv[1] not in ("bubble", "allreduce", "hier"):
        sys.exit(__doc__)
    rows = lines(sys.argv[2])
    if sys.argv[1] == "bubble":
        text = bubble(rows)
    elif sys.argv[1] == "hier":
        text = hier(rows)
    else:
        text = allreduce(rows, lines(sys.argv[4]) if len(sys.argv) == 5 else ())
    with open(sys.argv[3], "w") as f:
        f.write(text)
