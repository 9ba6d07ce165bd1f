#!/usr/bin/env python3
"""CTest bench.guard: scripts/bench_guard.py (the logic of scripts/bench_guard.sh) on recorded
lines in guard/: real lines of docs/bench/, copied into guard/committed/, and runs made from them
with their ratios changed. A fall of 30% is flagged (exit 1), one of 10% and a rise are ok, a
loaded line is refused, a case with no committed line is new, input that is all loaded exits 3,
a line that is not JSON exits 2 naming its file and line, another machine is said; and the
committed lines of docs/bench/ judged against themselves are all ok or without a ratio.

    check_bench_guard.py SCRIPT TESTDATA_DIR
"""
import glob
import json
import os
import subprocess
import sys

failures = []


def check(ok, what, r=None):
    if not ok:
        failures.append(what + (f"\n--- exit {r.returncode}, stdout ---\n{r.stdout}--- stderr ---\n{r.stderr}" if r else ""))


def main():
    script, testdata = sys.argv[1], sys.argv[2]
    guard = os.path.join(testdata, "guard")
    committed = os.path.join(guard, "committed")

    def run(*args, stdin=None):
        return subprocess.run([sys.executable, script, "--committed", committed, *args], capture_output=True,
                              text=True, input=stdin)

    def verdicts(name, *args):
        """{case: verdict object} from --json on guard/NAME.jsonl, and the run."""
        r = run("--json", *args, os.path.join(guard, name))
        out = {}
        for text in r.stdout.splitlines():
            try:
                v = json.loads(text)
            except json.JSONDecodeError:
                check(False, f"{name}: --json printed a line that is not JSON: {text}", r)
                continue
            out[v["case"]] = v
        return out, r

    # A ratio that fell by 30% FELL, and the run exits 1; the unchanged case beside it is ok.
    v, r = verdicts("fell.jsonl")
    check(r.returncode == 1, "a fall of 30% exits 1", r)
    check(v.get("transfer_bw_64KiB_shm", {}).get("verdict") == "FELL", "a fall of 30% is FELL", r)
    check(abs(v.get("transfer_bw_64KiB_shm", {}).get("change", 0) + 0.30) < 1e-4, "the change is -30%", r)
    check(v.get("cross_rank_stream_tcp", {}).get("verdict") == "ok", "an unchanged ratio beside it is ok", r)
    text = run(os.path.join(guard, "fell.jsonl"))
    check(text.returncode == 1 and "FELL: transport/transfer_bw_64KiB_shm (-30.0%)" in text.stdout,
          "the text names the case that fell and by how much", text)
    # The committed line's provenance beside its ratio.
    check("committed 2026-11-28T05:55:30Z at 98c2e27 on Intel(R) Xeon(R) Processor" in text.stdout,
          "the text gives the committed line's date, commit and machine", text)

    # A fall of 10% (of a latency's ratio: better lower, already oriented) is within the threshold...
    v, r = verdicts("dip.jsonl")
    check(r.returncode == 0 and v.get("msg_latency_shm", {}).get("verdict") == "ok", "a fall of 10% is ok", r)
    # ... but not within one of 5%: the threshold is a flag.
    v, r = verdicts("dip.jsonl", "--threshold", "0.05")
    check(r.returncode == 1 and v.get("msg_latency_shm", {}).get("verdict") == "FELL",
          "a fall of 10% FELL under --threshold 0.05", r)

    # A rise is ok.
    v, r = verdicts("improved.jsonl")
    check(r.returncode == 0 and v.get("chain_noop", {}).get("verdict") == "ok", "a rise of 25% is ok", r)
    check(abs(v.get("chain_noop", {}).get("change", 0) - 0.25) < 1e-4, "the change is +25%", r)

    # Loaded lines are refused, not judged: one whose ratio was withheld, and one printed with
    # --allow-load (its ratio, half the committed one, would otherwise have FELL). The clean line
    # beside them is judged, so the run exits 0.
    v, r = verdicts("loaded.jsonl")
    check(r.returncode == 0, "loaded lines beside a clean one: exit 0", r)
    check(v.get("cross_thread_stream_slots2", {}).get("verdict") == "refused", "a withheld ratio is refused", r)
    check(v.get("same_thread_hop", {}).get("verdict") == "refused", "a ratio printed under --allow-load is refused", r)
    check(v.get("chain_noop", {}).get("verdict") == "ok", "the clean line beside them is judged", r)
    text = run(os.path.join(guard, "loaded.jsonl"))
    check("load average 3.10 at the start is above the 2 cores" in text.stdout, "a refusal says why", text)

    # Every line loaded: nothing judged, exit 3, saying the machine was too loaded.
    r = run(os.path.join(guard, "all_loaded.jsonl"))
    check(r.returncode == 3 and "too loaded to judge" in r.stdout, "all-loaded input exits 3, saying why", r)

    # A case with no committed line is new (and does not fail the run).
    v, r = verdicts("new_case.jsonl")
    check(r.returncode == 0 and v.get("transfer_bw_4KiB_shm", {}).get("verdict") == "new",
          "a case with no committed line is new", r)
    check(v.get("msg_latency_shm", {}).get("verdict") == "ok", "the known case beside it is judged", r)

    # A line that is not JSON: exit 2, naming the file and the line.
    r = run(os.path.join(guard, "malformed.jsonl"))
    check(r.returncode == 2 and "malformed.jsonl:2" in r.stderr and "not a JSON line" in r.stderr,
          "a line that is not JSON exits 2 naming file:line", r)
    r = run(os.path.join(guard, "no_such_file.jsonl"))
    check(r.returncode == 2 and "no_such_file.jsonl" in r.stderr, "a missing file exits 2 naming it", r)
    r = run(stdin='{"bench": "actors", "case": "chain_noop", "ratio": 1.2}\n{"case": "x"}\n')
    check(r.returncode == 2 and "<stdin>:2" in r.stderr, "a line without bench on stdin exits 2 naming it", r)

    # Another machine: compared all the same, and said, case by case and in a warning.
    v, r = verdicts("other_machine.jsonl")
    check(r.returncode == 0 and all(x.get("verdict") == "ok" and x.get("machine_differs") for x in v.values())
          and len(v) == 2, "lines from another machine are compared, and marked", r)
    text = run(os.path.join(guard, "other_machine.jsonl"))
    check("warning: 2 lines measured on AMD EPYC 9454 48-Core Processor, their committed lines on "
          "Intel(R) Xeon(R) Processor" in text.stdout, "the machine difference is said", text)
    check("now on the same machine" not in text.stdout, "a row does not call another machine the same", text)

    # Notes: a --quick line against a full one, another reference; a committed line from before the
    # one ratio rule (no "better": its latency ratio was value / reference) is not read.
    v, r = verdicts("notes.jsonl")
    notes = " ".join(v.get("mlp_b64", {}).get("notes", []))
    check("--quick" in notes and "another reference" in notes, "the quick form and another reference are noted", r)
    check(v.get("msg_latency_tcp", {}).get("verdict") == "no ratio"
          and "one ratio rule" in v.get("msg_latency_tcp", {}).get("why", ""),
          "a committed ratio without \"better\" is not compared", r)

    # The committed lines against themselves (what docs/bench/ holds now): every ratio is ok at
    # +0.0%, none FELL or is refused.
    root = os.path.dirname(os.path.dirname(os.path.abspath(script)))
    docs = sorted(glob.glob(os.path.join(root, "docs", "bench", "*.jsonl")))
    r = subprocess.run([sys.executable, script, "--json", *docs], capture_output=True, text=True)
    all_v = [json.loads(t) for t in r.stdout.splitlines() if t.strip()] if r.returncode == 0 else []
    check(r.returncode == 0 and all_v, "docs/bench/*.jsonl against themselves exits 0", r)
    check(all(x["verdict"] in ("ok", "no ratio") for x in all_v), "... with only ok and no ratio", r)
    check(all(x["change"] == 0 for x in all_v if x["verdict"] == "ok"), "... and no change", r)
    check(any(x["verdict"] == "ok" for x in all_v), "... and some ratio judged", r)

    for f in failures:
        print("FAILED:", f, file=sys.stderr)
    if not failures:
        print("bench_guard.py: every check passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
