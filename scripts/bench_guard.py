#!/usr/bin/env python3
"""Compares new benchmark lines with the committed ones (docs/bench/*.jsonl) and says which ratios fell.

A benchmark's "ratio" is measured against a peer in the same run, so it holds on a machine whose
absolute speed varies; json_line.h orients every one of them the same way (above 1, baton is
better: value / reference for a figure better higher, reference / value for one better lower).
For each new line with a ratio this script finds the committed line of the same bench and case
and reads the change new / committed - 1; a fall of more than --threshold (default 20%) is FELL.
Absolute figures are never compared. The verdicts:

    ok        the ratio fell by no more than the threshold, or rose
    FELL      the ratio fell by more than the threshold
    new       no committed line has this bench and case
    no ratio  the committed line or the new one has no ratio to compare (no peer measured, a
              reference that failed, a line from before json_line.h's one ratio rule)
    refused   the new line was measured on a loaded machine ("loaded": true, or its ratio was
              withheld): it is not judged

Each verdict says which machine the committed line and the new one came from (and the committed
line's date and commit), and warns where they differ: the ratios are still compared, but a peer
can fare differently on another CPU. A case that appears more than once in a run (actors'
metg_grain, one line per grain) is matched by its place among the lines of that case.

    scripts/bench_guard.py build/bench-guard/*.jsonl     # the lines scripts/bench_guard.sh wrote
    build/bin/baton-bench-actors --case chain | scripts/bench_guard.py
    scripts/bench_guard.py --threshold 0.1 --json new.jsonl
    scripts/bench_guard.py --committed DIR new.jsonl     # committed lines from DIR/*.jsonl

Exit status: 0 nothing fell; 1 a case fell; 2 bad input (an unreadable file, or a line that is
not a benchmark's JSON line: the file and line are named); 3 nothing could be judged because the
machine was loaded (every line that could have been judged was refused).

Python's standard library only.
"""
import argparse
import glob
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROG = "bench_guard.py"

OK, FELL, NEW, NO_RATIO, REFUSED = "ok", "FELL", "new", "no ratio", "refused"
VERDICTS = [FELL, OK, NEW, NO_RATIO, REFUSED]  # the summary's order


class BadInput(Exception):
    """A file that cannot be read, or a line that is not a benchmark's JSON line: exit 2."""


def read_lines(path, stream=None):
    """[(where, line)] of a file of JSON lines ('-' or `stream`: standard input), blank lines
    skipped; `where` is "FILE:N". Raises BadInput naming the file and line of anything else."""
    name = "<stdin>" if path == "-" else path
    try:
        if stream is None and path != "-":
            with open(path, encoding="utf-8") as f:
                texts = f.read().splitlines()
        else:
            texts = (stream or sys.stdin).read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{name}: cannot read it: {e}") from e
    out = []
    for n, text in enumerate(texts, 1):
        text = text.strip()
        if not text:
            continue
        where = f"{name}:{n}"
        try:
            line = json.loads(text)
        except json.JSONDecodeError as e:
            raise BadInput(f"{where}: not a JSON line: {e}") from e
        if not isinstance(line, dict) or not isinstance(line.get("bench"), str) or not isinstance(line.get("case"), str):
            raise BadInput(f"{where}: not a benchmark's line (no \"bench\" and \"case\" strings)")
        out.append((where, line))
    return out


def keyed(lines):
    """{(bench, case, k): (where, line)}: k counts the earlier lines of the same bench and case
    (0 for the first), so that a case printed several times in a run pairs by its place."""
    seen = {}
    out = {}
    for where, line in lines:
        base = (line["bench"], line["case"])
        k = seen.get(base, 0)
        seen[base] = k + 1
        out[base + (k,)] = (where, line)
    return out, seen


def shown_path(path):
    """`path` relative to the repository where it lies inside it, else as given."""
    full = os.path.abspath(path)
    if full == ROOT or full.startswith(ROOT + os.sep):
        return os.path.relpath(full, ROOT)
    return path


def machine_of(line):
    """The CPU's model (and the GPU's name where one was used), or None for a line that says none."""
    machine = line.get("machine")
    if not machine:
        return None
    return f"{machine} + {line['gpu']}" if line.get("gpu") else machine


def is_loaded(line):
    """Why the line was measured on a loaded machine, or None."""
    if "withheld" in line or "ratio_refused" in line:
        why = line.get("ratio_refused") or "the machine was loaded"
        return "its ratio was withheld: " + why.replace(" (give --allow-load to print it)", "")
    if line.get("loaded") is True:
        start, cores = line.get("load_start"), line.get("cores")
        if isinstance(start, (int, float)) and cores:
            return f"measured on a loaded machine (load average {start:.2f} at the start on {cores} cores, --allow-load)"
        return "measured on a loaded machine (--allow-load)"
    return None


def ratio_of(line):
    """(ratio, None) where the line has one to compare, else (None, why not). A line without
    "better" predates json_line.h's one ratio rule: its ratio may be the other way round (the
    transport latency's was value / reference), so it is not read."""
    r = line.get("ratio")
    if r is None or isinstance(r, bool) or not isinstance(r, (int, float)):
        for key in ("reference_failed", "reference_missing", "skipped", "error"):
            if line.get(key):
                return None, f"{key.replace('_', ' ')}: {line[key]}"
        return None, "no peer was measured in its run" if "ratio" not in line else "it is null (not finite)"
    if "better" not in line:
        return None, "it predates json_line.h's one ratio rule (no \"better\"), so it may be the other way round"
    if not math.isfinite(r) or r <= 0:
        return None, f"{r} is not a positive number"
    return float(r), None


def reference_name(line):
    return line.get("reference_name") or line.get("reference_is")


def quick(line):
    return "--quick" in str(line.get("command", "")).split()


def lines(n):
    return f"{n} line" if n == 1 else f"{n} lines"


def short(r):
    return "—" if r is None else f"{r:.3g}"


def judge(new_where, new, old_entry, threshold):
    """The verdict on one new line against its committed line (old_entry: (where, line) or None)."""
    v = {
        "bench": new["bench"], "case": new["case"], "verdict": None,
        "committed_ratio": None, "ratio": None, "change": None,
        "machine": machine_of(new), "date": new.get("date"), "commit": new.get("commit"),
        "command": new.get("command"), "line": new_where,
        "committed_machine": None, "committed_date": None, "committed_commit": None,
        "committed_command": None, "committed_line": None,
        "machine_differs": False, "why": "", "notes": [],
    }
    new_ratio, new_why = ratio_of(new)
    v["ratio"] = new_ratio
    old = None
    if old_entry is not None:
        old_where, old = old_entry
        v.update(committed_machine=machine_of(old), committed_date=old.get("date"),
                 committed_commit=old.get("commit"), committed_command=old.get("command"),
                 committed_line=old_where)
        # Said only where both lines name their machine (a line from before provenance.h names none).
        v["machine_differs"] = None not in (machine_of(old), machine_of(new)) and machine_of(old) != machine_of(new)
        if v["machine_differs"]:
            v["notes"].append(f"another machine: committed on {machine_of(old)}, now on {machine_of(new)}")
        if quick(new) and not quick(old):
            v["notes"].append("measured with --quick, the committed line without: fewer pieces, steps or requests")
        old_ref, new_ref = reference_name(old), reference_name(new)
        if old_ref and new_ref and old_ref != new_ref:
            v["notes"].append(f"another reference: committed against {old_ref}, now against {new_ref}")
        if new.get("reference_missing") and not old.get("reference_missing"):
            v["notes"].append(f"a reference is missing now: {new['reference_missing']}")
        old_ratio, old_why = ratio_of(old)
        if is_loaded(old):
            old_ratio, old_why = None, "it was measured on a loaded machine"
        v["committed_ratio"] = old_ratio
    loaded = is_loaded(new)
    if loaded:
        v["ratio"] = None
        v["verdict"], v["why"] = REFUSED, loaded
    elif old is None:
        v["verdict"], v["why"] = NEW, "no committed line of this bench and case"
    else:
        if old_ratio is None:
            v["verdict"], v["why"] = NO_RATIO, f"the committed line has no ratio: {old_why}"
        elif new_ratio is None:
            v["verdict"], v["why"] = NO_RATIO, f"the new line has no ratio: {new_why}"
        else:
            v["change"] = new_ratio / old_ratio - 1.0
            # "More than": a fall of exactly the threshold is not one (1e-9: the ratios' 6 digits'
            # rounding must not tip it over).
            fell = -v["change"] > threshold + 1e-9
            v["verdict"] = FELL if fell else OK
            v["why"] = (f"fell by {-v['change']:.1%}, more than {threshold:.0%}" if fell else "")
    return v


def name_of(v):
    return f"{v['bench']}/{v['case']}" + (f"#{v['place']}" if v.get("place") else "")


def ratios_of(v):
    return f"{short(v['committed_ratio'])} -> {short(v['ratio'])}"


def text_of(v, width, ratio_width):
    """One case as a row: verdict, case, the ratios, the change, where each line came from, why."""
    change = "" if v["change"] is None else f"{v['change']:+.1%}"
    if v["committed_line"] is not None:
        same = not v["machine_differs"] and v["machine"] is not None and v["machine"] == v["committed_machine"]
        now = "the same machine" if same else v["machine"]
        where = (f"committed {v['committed_date'] or 'undated'} at {v['committed_commit'] or 'an unknown commit'} "
                 f"on {v['committed_machine'] or 'an unnamed machine'}; now on {now or 'an unnamed machine'}")
    else:
        where = f"now on {v['machine'] or 'an unnamed machine'}"
    extra = "; ".join(x for x in [v["why"]] + v["notes"] if x)
    return (f"{v['verdict']:<9} {name_of(v):<{width}}  {ratios_of(v):<{ratio_width}}  {change:>7}  {where}"
            + (f" ({extra})" if extra else ""))


def main(argv=None, stdin=None, stdout=None):
    out = stdout or sys.stdout
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", help="files of new JSON lines ('-' or none: standard input)")
    p.add_argument("--committed", default=os.path.join(ROOT, "docs", "bench"),
                   help="the folder of the committed NAME.jsonl files (default: docs/bench)")
    p.add_argument("--threshold", type=float, default=0.20,
                   help="the fall of a ratio, as a fraction, beyond which a case FELL (default 0.20)")
    p.add_argument("--json", action="store_true", help="one JSON object per case instead of text")
    a = p.parse_args(argv)
    if not 0 <= a.threshold < 1:
        print(f"{PROG}: --threshold {a.threshold}: a fraction from 0 to 1 (0.2 is 20%)", file=sys.stderr)
        return 2
    try:
        committed_files = sorted(glob.glob(os.path.join(a.committed, "*.jsonl")))
        if not committed_files:
            raise BadInput(f"{a.committed}: no committed lines (*.jsonl) there")
        committed = []
        for path in committed_files:
            committed += read_lines(path)
        files = a.files or ["-"]
        if files == ["-"] and stdin is None and sys.stdin.isatty():
            raise BadInput("no new lines: give their files, or pipe them in")
        new = []
        for path in files:
            new += read_lines(path, stdin if path == "-" else None)
        if not new:
            raise BadInput(f"no benchmark lines in {', '.join('<stdin>' if f == '-' else f for f in files)}")
    except BadInput as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2

    old_by_key, old_counts = keyed(committed)
    _, new_counts = keyed(new)
    verdicts = []
    seen = {}
    for where, line in new:
        base = (line["bench"], line["case"])
        k = seen.get(base, 0)
        seen[base] = k + 1
        v = judge(where, line, old_by_key.get(base + (k,)), a.threshold)
        if max(old_counts.get(base, 0), new_counts.get(base, 0)) > 1:
            v["place"] = k + 1
        verdicts.append(v)

    counts = {name: sum(1 for v in verdicts if v["verdict"] == name) for name in VERDICTS}
    judged = counts[OK] + counts[FELL]
    if a.json:
        for v in verdicts:
            print(json.dumps(v), file=out)
    else:
        width = max(len(name_of(v)) for v in verdicts)
        heading = "ratio: committed -> now"
        ratio_width = max([len(heading)] + [len(ratios_of(v)) for v in verdicts])
        print(f"{'verdict':<9} {'case':<{width}}  {heading:<{ratio_width}}  {'change':>7}  where the lines come from",
              file=out)
        for v in verdicts:
            print(text_of(v, width, ratio_width), file=out)

    # The summary, on stderr under --json (stdout is then JSON only).
    say = sys.stderr if a.json else out
    parts = ", ".join(f"{counts[name]} {name}" for name in VERDICTS if counts[name])
    print(f"{PROG}: {lines(len(verdicts))} against {shown_path(a.committed)}/*.jsonl: {parts} "
          f"(FELL: the ratio fell by more than {a.threshold:.0%})", file=say)
    differ = sorted({(v["committed_machine"], v["machine"]) for v in verdicts if v["machine_differs"]})
    for old_m, new_m in differ:
        n = sum(1 for v in verdicts if v["machine_differs"] and (v["committed_machine"], v["machine"]) == (old_m, new_m))
        print(f"{PROG}: warning: {lines(n)} measured on {new_m}, their committed lines on {old_m}: "
              "ratios compared all the same, but a peer can fare differently on another CPU", file=say)
    fell = [v for v in verdicts if v["verdict"] == FELL]
    if fell:
        print(f"{PROG}: FELL: " + ", ".join(f"{v['bench']}/{v['case']} ({v['change']:+.1%})" for v in fell), file=say)
        return 1
    if judged == 0 and counts[REFUSED] > 0:
        print(f"{PROG}: the machine was too loaded to judge: {lines(counts[REFUSED])} refused and none judged; "
              "run again on a quiet machine", file=say)
        return 3
    if counts[REFUSED]:
        print(f"{PROG}: {lines(counts[REFUSED])} refused (loaded machine): those cases were not judged", file=say)
    if judged == 0:
        print(f"{PROG}: no ratio could be compared: nothing was judged", file=say)
    return 0


if __name__ == "__main__":
    sys.exit(main())
