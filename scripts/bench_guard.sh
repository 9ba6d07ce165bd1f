#!/usr/bin/env bash
# The benchmarks' regression guard (docs/benchmarking.md, "The regression guard"): builds with
# scripts/run.sh build, runs a short form of bench transport, actors, allreduce (2 ranks), train
# and serve, one after the other on a quiet machine, and hands their JSON lines to
# scripts/bench_guard.py, which compares each same-run ratio with the committed line of the same
# case in docs/bench/ and prints every case whose ratio fell by more than 20%. Ratios only, never
# absolute times. About 3 minutes on 2 cores; --full: the committed commands whole (15 or more).
#
#   scripts/bench_guard.sh                    every benchmark below
#   scripts/bench_guard.sh transport actors   some of them
#   scripts/bench_guard.sh --full train       the committed command itself (every case)
#   options: --no-build  --max-load L (default: half the cores)  --threshold T (default 0.2)
#            --wait S (the longest wait for the machine to calm down between benchmarks, default 120)
#
# Exit status: 0 nothing fell; 1 a case fell; 2 usage, a build that failed, or lines that are not
# JSON; 3 the machine was too loaded to judge; 4 nothing fell but a benchmark failed or could not
# run (its cases were not judged). The lines and each benchmark's stderr stay in
# $BUILD_DIR/bench-guard/ (default build/bench-guard/).
#
# Not in CI: CI's machine is shared and its timings mean nothing (bench_guard.py's verdicts are
# tested there on recorded lines: CTest bench.guard). Do not run it beside a build or another
# benchmark: it refuses to start when the 1-minute load average is above --max-load, and the
# benchmarks themselves withhold their ratios when the load is above the cores.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here" || exit 2
build_dir="${BUILD_DIR:-build}"
bin="$build_dir/bin"
out_dir="$build_dir/bench-guard"
python="${BATON_PYTHON:-/usr/bin/python3}"  # the peers' python (bench train and serve read BATON_PYTHON too)

say() { printf '[bench_guard] %s\n' "$*" >&2; }
# --help: the comment at the top; a usage error: one line.
usage() {
  if [ "${1:-2}" = 0 ]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
  else
    echo "usage: scripts/bench_guard.sh [--full] [--no-build] [--max-load L] [--threshold T] [--wait S] [NAME...] (--help)" >&2
  fi
  exit "${1:-2}"
}
above() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a > b) }'; }
load_now() { cut -d' ' -f1 /proc/loadavg; }

# What each benchmark runs: one invocation of build/bin/baton-bench-NAME per entry, its arguments.
# The quick forms (--quick) print the same case names as the committed lines but measure something
# else: 10x fewer pieces or steps, one run instead of the best of 3, a 4-grain METG sweep instead
# of 10, the metrics' collector at 20 Hz instead of 2 Hz. Their ratios move by more than 20% with
# no change to baton, so the guard runs full-size cases (the committed lines' own measurement)
# and picks the fast ones where a benchmark has a case selector:
#   transport  every case, full size (~25 s: as quick as it gets with ucx_perftest beside it)
#   actors     every case but metrics_overhead (its three cases take 80 s of the 105): the hop,
#              the cross-thread streams and latency, the chain, METG against TBB and CAF, tracing
#              (~30 s)
#   allreduce  2 ranks, every size 1 KiB-256 MiB, full iterations (~20 s; 4 ranks on 2 cores is
#              oversubscribed, and takes longer)
#   train      mlp_b64 (the runtime's per-step cost), gpt_small (the kernels), gpt_small_2threads
#              (two workers) against LibTorch and PyTorch, best of 3 (~60 s)
#   serve      --quick: no case selector, and the whole run takes 3-4 minutes. Its points keep
#              their names with fewer requests (closed_c1: 2 of 6, closed_c4: 8 of 12,
#              poisson_0.50x: 8 of 32), so bench_guard.py notes each as "measured with --quick"
#              (~30 s)
declare -A cases=(
  [transport]=""
  [actors]="--case same_thread_hop|--case cross_thread|--case chain_noop|--case metg|--case trace_overhead"
  [allreduce]="--ranks 2"
  [train]="--case mlp_b64|--case gpt_small|--case gpt_small_2threads"
  [serve]="--quick"
)
order=(transport actors allreduce train serve)

full=0 build=1 threshold=0.2 wait_s=120 max_load="" names=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h | --help) usage 0 ;;
    --full) full=1 ;;
    --no-build) build=0 ;;
    --max-load | --threshold | --wait)
      [ $# -ge 2 ] || { say "$1 needs a value"; usage; }
      awk -v v="$2" 'BEGIN { exit !(v ~ /^[0-9]+(\.[0-9]+)?$/) }' || { say "$1: '$2' is not a number"; usage; }
      case "$1" in --max-load) max_load="$2" ;; --threshold) threshold="$2" ;; --wait) wait_s="${2%.*}" ;; esac
      shift ;;
    -*) say "unknown option '$1'"; usage ;;
    *)
      [ -n "${cases[$1]+set}" ] || { say "no benchmark '$1' in the guard: ${order[*]}"; usage; }
      names+=("$1") ;;
  esac
  shift
done
[ ${#names[@]} -gt 0 ] || names=("${order[@]}")

if [ "${CI:-}" = "true" ]; then
  say "CI=true: the guard measures, and CI's timings mean nothing; CTest bench.guard tests its logic"
  exit 2
fi

# Other work on the machine now: refuse before building anything.
cores="$(nproc)"
[ -n "$max_load" ] || max_load="$(awk -v c="$cores" 'BEGIN { print c / 2 }')"
load="$(load_now)"
if above "$load" "$max_load"; then
  say "load average $load is above $max_load (on $cores cores): something else is running, and ratios measured beside it say more about it than about baton"
  say "too loaded to judge: run the guard again on a quiet machine (or --max-load to move the limit)"
  exit 3
fi

if [ "$build" = 1 ]; then
  say "building (scripts/run.sh build)"
  if ! scripts/run.sh build; then
    say "the build failed"
    exit 2
  fi
fi

# A benchmark whose peer is missing would print no ratio, or one against another peer than its
# committed lines (bench train takes the faster of LibTorch and PyTorch): it is left out, saying so.
peer_missing() {
  case "$1" in
    train)
      "$python" -c "import torch" >/dev/null 2>&1 || { echo "$python cannot import torch (python3-torch)"; return; }
      [ -x "$bin/baton-bench-train-libtorch" ] || echo "$bin/baton-bench-train-libtorch was not built (libtorch-dev)" ;;
    serve)
      "$python" -c "import torch" >/dev/null 2>&1 || echo "$python cannot import torch (python3-torch)" ;;
  esac
}

rm -rf "$out_dir"
mkdir -p "$out_dir"
failed=() left_out=() loaded_out=()
started=$SECONDS
for name in "${names[@]}"; do
  prog="$bin/baton-bench-$name"
  if [ ! -x "$prog" ]; then
    say "$name: $prog is not built"
    failed+=("$name (not built)")
    continue
  fi
  why="$(peer_missing "$name")"
  if [ -n "$why" ]; then
    say "$name: left out: $why; \`scripts/run.sh bench $name --help\` installs what it needs"
    left_out+=("$name ($why)")
    continue
  fi
  # The benchmark before this one kept the cores busy: its load fades over a minute, and a start
  # reading above the cores would make this one withhold every ratio. Wait for it, up to --wait.
  waited=0
  while above "$(load_now)" "$cores" && [ "$waited" -lt "$wait_s" ]; do
    [ "$waited" = 0 ] && say "$name: load average $(load_now) is above the $cores cores: waiting for it to fall (up to ${wait_s} s)"
    sleep 5
    waited=$((waited + 5))
  done
  if above "$(load_now)" "$cores"; then
    say "$name: left out: the load average is still $(load_now), above the $cores cores"
    loaded_out+=("$name")
    continue
  fi
  if [ "$full" = 1 ]; then
    invocations=("")
  else
    IFS='|' read -r -a invocations <<<"${cases[$name]}"
    [ ${#invocations[@]} -gt 0 ] || invocations=("")
  fi
  for args in "${invocations[@]}"; do
    t0=$SECONDS
    say "$name ${args:-(every case)}"
    # shellcheck disable=SC2086  # the arguments are words of the table above
    "$prog" $args >>"$out_dir/$name.jsonl" 2>>"$out_dir/$name.log"
    rc=$?
    say "$name ${args:-(every case)}: $((SECONDS - t0)) s, exit $rc"
    if [ "$rc" = 77 ]; then
      left_out+=("$name $args (skipped: $out_dir/$name.log says why)")
    elif [ "$rc" != 0 ]; then
      failed+=("$name $args (exit $rc: $out_dir/$name.log)")
    fi
  done
done
say "measured in $((SECONDS - started)) s; the lines are in $out_dir/"

files=()
for f in "$out_dir"/*.jsonl; do [ -s "$f" ] && files+=("$f"); done
rc=0
if [ ${#files[@]} -gt 0 ]; then
  python3 scripts/bench_guard.py --threshold "$threshold" "${files[@]}"
  rc=$?
else
  say "no benchmark printed a line"
fi
for x in "${failed[@]}"; do say "failed: $x"; done
for x in "${left_out[@]}"; do say "not judged: $x"; done
for x in "${loaded_out[@]}"; do say "not judged (loaded machine): $x"; done
if [ ${#files[@]} -eq 0 ]; then
  if [ ${#loaded_out[@]} -gt 0 ] && [ ${#failed[@]} -eq 0 ]; then
    say "too loaded to judge"
    exit 3
  fi
  exit 4
fi
if [ "$rc" = 0 ] && [ $((${#failed[@]} + ${#left_out[@]} + ${#loaded_out[@]})) -gt 0 ]; then
  say "nothing fell in what ran, but not every benchmark was judged"
  exit 4
fi
exit "$rc"
