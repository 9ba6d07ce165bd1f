#!/usr/bin/env python3
"""Writes docs/benchmarks.md from the benchmarks' committed JSON lines (docs/bench/*.jsonl).

Each docs/bench/NAME.jsonl holds the lines of the last clean run of a benchmark, as
`scripts/run.sh bench NAME > docs/bench/NAME.jsonl` printed them on a quiet machine
(apps/bench/json_line.h says what the keys mean). This script makes one table per benchmark
from them: the case, baton's value and unit, the peer's value, the ratio (how many times better
baton is: above 1, baton is better), which way is better, the load at the start, the machine,
the date, the commit, and the command that reproduces the line. A line measured on a loaded
machine shows that instead of a ratio. The same lines give the same file, byte for byte.

    python3 scripts/bench_table.py                      # docs/bench/*.jsonl -> docs/benchmarks.md
    python3 scripts/bench_table.py --check              # exit 1 if docs/benchmarks.md is stale
    python3 scripts/bench_table.py --input-dir DIR --output FILE

Python's standard library only.
"""
import argparse
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND = "python3 scripts/bench_table.py"
COLUMNS = ["Case", "Value", "Better", "Reference", "Ratio", "Load at start", "Machine", "Date", "Commit", "Command"]
# A benchmark's own columns, after Ratio: (heading, key, comparative). A comparative key follows
# the ratio's rule (above 1, baton is better) and is not shown where the ratio is not.
EXTRA_COLUMNS = {
    # baton-bench-serve: one line per system and load point (apps/bench/bench_serve.cpp).
    "serve": [
        ("TTFT p99 (s)", "ttft_p99_s", False),
        ("TPOT p99 (s)", "tpot_p99_s", False),
        ("TPOT p99 vs PyTorch", "tpot_p99_vs_torch", True),
        ("Continuous vs static", "vs_static_tokens_per_s", True),
    ],
    # baton-bench-plan: baton-plan's predicted step time against the same layout trained here, and
    # per model the worst error, Kendall's tau and the pick (apps/bench/bench_plan.cpp).
    "plan": [
        ("Predicted (s)", "predicted_s", False),
        ("Measured (s)", "measured_s", False),
        ("Worst error %", "worst_error_pct", False),
        ("Kendall tau", "kendall_tau", False),
        ("Pick / best", "pick_over_best", False),
    ],
    # baton-bench-gpu: MFU, and PyTorch under torch.compile (the higher anchor) where it ran.
    "gpu": [
        ("MFU", "mfu", False),
        ("PyTorch MFU", "reference_mfu", False),
        ("vs torch.compile", "compile_ratio", True),
    ],
}


def shown_path(path):
    """`path` relative to the repository where it lies inside it (the file must not depend on
    where the script was run from), else as given."""
    full = os.path.abspath(path)
    if full == ROOT or full.startswith(ROOT + os.sep):
        return os.path.relpath(full, ROOT)
    return path


def number(v):
    """A figure as a reader wants it: thousands grouped, three significant digits below 100."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if v != v:  # nan never comes from json_line.h (it prints null), but a file may hold anything
        return "nan"
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.1f}"
    if a == 0:
        return "0"
    return f"{v:.3g}"


def cell(text):
    """Text for a Markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def value_of(line):
    if "value" in line and line["value"] is not None:
        unit = line.get("unit", "")
        return f"{number(line['value'])} {unit}".strip()
    if line.get("value", 0) is None:
        return "null (not finite)"
    for key in ("error", "skipped"):
        if key in line:
            return f"{key}: {line[key]}"
    return "—"


def reference_of(line):
    if "reference" in line and line["reference"] is not None:
        name = line.get("reference_name") or line.get("reference_is") or ""
        return f"{number(line['reference'])} ({name})" if name else number(line["reference"])
    for key, what in (("reference_failed", "failed"), ("reference_missing", "missing")):
        if key in line:
            return f"{what}: {line[key]}"
    return "—"


def ratio_of(line):
    """The ratio, or why there is none to show: a loaded machine's line shows no ratio, even one
    printed with --allow-load."""
    if "withheld" in line or "ratio_refused" in line:
        why = line.get("ratio_refused", "the machine was loaded")
        return f"withheld: {why}"
    if line.get("loaded") is True:
        return "not shown: measured on a loaded machine (--allow-load)"
    if "ratio" in line and line["ratio"] is not None:
        return f"{number(line['ratio'])}×"
    return "—"


def load_of(line):
    if "load_start" not in line:
        return "—"
    cores = line.get("cores")
    loaded = " (loaded)" if line.get("loaded") is True else ""
    return f"{line['load_start']:.2f} on {cores} cores{loaded}" if cores else f"{line['load_start']:.2f}{loaded}"


def machine_of(line):
    machine = line.get("machine", "—")
    return f"{machine} + {line['gpu']}" if line.get("gpu") else machine


def extra_of(line, key, comparative):
    """A benchmark's own column: the figure, or for a comparative one what ratio_of() would say
    in its place on a loaded machine."""
    if comparative and ("withheld" in line or "ratio_refused" in line or line.get("loaded") is True):
        return "not shown (load)"
    if key not in line or line[key] is None:
        return "—"
    return f"{number(line[key])}×" if comparative else number(line[key])


def row(line):
    extra = [extra_of(line, key, comparative) for _, key, comparative in EXTRA_COLUMNS.get(line.get("bench"), [])]
    return [
        line.get("case", "?"),
        value_of(line),
        line.get("better", "—"),
        reference_of(line),
        ratio_of(line),
        *extra,
        load_of(line),
        machine_of(line),
        line.get("date", "—"),
        line.get("commit", "—"),
        f"`{line['command']}`" if line.get("command") else "—",
    ]


def read_lines(input_dir):
    """{bench: [(file, line)]}, in file name order then line order. Exits naming the file and
    line of anything that is not a JSON object."""
    benches = {}
    for path in sorted(glob.glob(os.path.join(input_dir, "*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            for n, text in enumerate(f, 1):
                text = text.strip()
                if not text:
                    continue
                try:
                    line = json.loads(text)
                except json.JSONDecodeError as e:
                    sys.exit(f"bench_table.py: {path}:{n}: not a JSON line: {e}")
                if not isinstance(line, dict) or "bench" not in line:
                    sys.exit(f"bench_table.py: {path}:{n}: not a benchmark's line (no \"bench\")")
                benches.setdefault(line["bench"], []).append((path, line))
    return benches


def render(input_dir):
    benches = read_lines(input_dir)
    source = shown_path(input_dir)
    out = [
        f"<!-- Generated by `{COMMAND}` from {source}/*.jsonl. Do not edit by hand: run it again. -->",
        "# Benchmarks",
        "",
        f"Generated by `{COMMAND}` from the JSON lines in `{source}/`: do not edit this file by hand.",
        "Each `NAME.jsonl` there holds the lines of the last clean run of one benchmark, printed on a quiet",
        "machine by `scripts/run.sh bench NAME > docs/bench/NAME.jsonl`; to update a table, run that,",
        "commit the lines, and run the script again.",
        "",
        "How to read a row: **Value** is baton's figure and **Better** which way it is better. **Reference**",
        "is the peer measured in the same run (what a user could pick instead). **Ratio** is how many times",
        "better baton is than the peer, whatever the unit: above 1, baton is better (for a figure better",
        "lower it is reference / value). A line measured on a machine whose load was above its cores shows",
        "no ratio. **Command** reproduces the line.",
    ]
    if not benches:
        out += ["", f"No benchmark lines are committed yet (`{source}/*.jsonl`)."]
    for bench in sorted(benches):
        lines = benches[bench]
        files = sorted({shown_path(p) for p, _ in lines})
        out += ["", f"## {bench}", "", "From " + ", ".join(f"`{f}`" for f in files) + ".", ""]
        columns = COLUMNS[:5] + [heading for heading, _, _ in EXTRA_COLUMNS.get(bench, [])] + COLUMNS[5:]
        out.append("| " + " | ".join(columns) + " |")
        out.append("|" + "|".join("---" for _ in columns) + "|")
        for _, line in lines:
            out.append("| " + " | ".join(cell(c) for c in row(line)) + " |")
    return "\n".join(out) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input-dir", default=os.path.join(ROOT, "docs", "bench"),
                   help="the folder of NAME.jsonl files (default: docs/bench)")
    p.add_argument("--output", default=os.path.join(ROOT, "docs", "benchmarks.md"),
                   help="the Markdown file to write (default: docs/benchmarks.md)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if --output is not what it would be")
    a = p.parse_args()
    text = render(a.input_dir)
    if a.check:
        try:
            with open(a.output, encoding="utf-8") as f:
                current = f.read()
        except FileNotFoundError:
            current = None
        if current != text:
            print(f"bench_table.py: {a.output} is stale: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    with open(a.output, "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
