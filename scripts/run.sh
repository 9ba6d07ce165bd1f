#!/usr/bin/env bash
# baton's one entry point on a fresh Debian 12 machine (root):
#   scripts/run.sh demo [ARGS...]   install what is missing, build, train a small GPT on Debian's
#                                   licence texts (tokenised) with a live dashboard and print a
#                                   sample (DASHBOARD=HOST:PORT to choose, =off for none);
#                                   `demo mlp [ARGS...]`: the MLP on digits instead
#   scripts/run.sh test [ARGS...]   install what is missing, build, run the whole test suite (ctest;
#                                   ARGS go to ctest), and without ARGS then the float suites again
#                                   under OpenBLAS's other CPU kernel families (OPENBLAS_CORETYPE)
#   scripts/run.sh bench NAME [...] install, build, run build/bin/baton-bench-NAME (JSON lines);
#                                   `bench gpu`: the GPT step on cuda:0 against PyTorch, or, without
#                                   a CUDA device, a "skipped" line for it and the CPU variant
#   scripts/run.sh build            install what is missing and build only
#   scripts/run.sh sanitize         the tests under AddressSanitizer + UndefinedBehaviorSanitizer
#                                   (build-asan/, every test) and ThreadSanitizer (build-tsan/,
#                                   the runtime, transport and collective tests)
#   scripts/run.sh fuzz [SECONDS]   build the libFuzzer targets with clang (build-fuzz/) and run
#                                   each for SECONDS (default 30) on its corpus in fuzz/corpus/
# Idempotent: packages are installed only when missing, CMake configures only once, and Ninja
# (with ccache) rebuilds only what changed. Environment: BUILD_DIR (default build),
# BUILD_TYPE (default Release), JOBS (default nproc), CI=true turns warnings into errors.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
build_dir="${BUILD_DIR:-build}"
build_type="${BUILD_TYPE:-Release}"
jobs="${JOBS:-$(nproc)}"

log() { printf '[run.sh] %s\n' "$*" >&2; }

# ccache keys on the compiler's arguments, which name the checkout's absolute path: relative to
# it, a second clone (CI's, in another folder) finds what the first compiled.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$here}"

# Debian packages the build, the tests and the benchmarks need (libsleef-dev: the vectorised
# GELU, kernels/src/vmath.cpp; libtbb-dev and libcaf-dev: the peers baton-bench-actors measures
# in the same run).
packages=(
  g++ cmake ninja-build ccache pkg-config
  libboost1.81-dev libfmt-dev doctest-dev libucx-dev ucx-utils libopenblas-dev libcli11-dev zlib1g-dev
  iproute2 openssh-client openssh-server openmpi-bin libopenmpi-dev
  libtbb-dev libcaf-dev libsentencepiece-dev libsleef-dev
)

# Only the tests need these: the dashboard's browser test drives headless Chromium, the
# checkpoint test reads a file with python3, and bench.gpu.reference runs PyTorch (Debian's
# python3-torch, for /usr/bin/python3), and the Slurm tests start a one-node cluster of their own
# (slurm-wlm's slurmctld and slurmd, munge; tests/slurm/cluster.sh). Without them those tests
# skip, and under CI=true a skip of anything but a GPU fails (tests/skip.h), so CI must install
# them.
test_packages=(chromium python3 python3-torch libtorch-dev slurm-wlm munge nodejs)
# The openai client tests need npm too: Debian's package, unless an npm is there already (a
# NodeSource nodejs carries its own, and conflicts with Debian's npm).
command -v npm >/dev/null 2>&1 || test_packages+=(npm)

install_missing() {
  local missing=()
  for p in "${packages[@]}" "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing: ${missing[*]}"
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { log "need root (or sudo) to install: ${missing[*]}"; exit 1; }
    sudo="sudo"
  fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# The 8x8 digits set (1,797 rows) that Debian's python3-sklearn ships as digits.csv.gz: download
# the .deb and extract that one file into data/. The package itself is not installed (it
# conflicts with Boost 1.81's dependencies). Quiet and instant once data/digits.csv.gz exists.
fetch_data() {
  local dest="data/digits.csv.gz"
  [ -s "$dest" ] && return 0
  command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null || {
    log "cannot fetch $dest: needs apt-get and dpkg-deb (Debian); copy digits.csv.gz there by hand"
    return 0
  }
  log "fetching $dest from Debian's python3-sklearn package"
  local tmp
  tmp="$(mktemp -d)"
  chmod 755 "$tmp"
  if ! (cd "$tmp" && apt-get download -qq python3-sklearn >"$tmp/apt.log" 2>&1); then
    local sudo=""
    [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && sudo="sudo"
    $sudo apt-get update -qq >/dev/null 2>&1 || true
    if ! (cd "$tmp" && apt-get download -qq python3-sklearn >"$tmp/apt.log" 2>&1); then
      log "apt-get download python3-sklearn failed:"
      cat "$tmp/apt.log" >&2
      rm -rf "$tmp"
      exit 1
    fi
  fi
  local deb member
  deb="$(ls "$tmp"/python3-sklearn_*.deb)"
  member="$(dpkg-deb -c "$deb" | awk '{print $NF}' | grep '/sklearn/datasets/data/digits\.csv\.gz$' | head -n 1 || true)"
  if [ -z "$member" ]; then
    log "no digits.csv.gz in $(basename "$deb")"
    rm -rf "$tmp"
    exit 1
  fi
  mkdir -p data
  if ! dpkg-deb --fsys-tarfile "$deb" | tar -xO -f - "$member" >"$tmp/digits.csv.gz"; then
    log "could not extract $member from $(basename "$deb")"
    rm -rf "$tmp"
    exit 1
  fi
  mv "$tmp/digits.csv.gz" "$dest"
  rm -rf "$tmp"
  log "wrote $dest ($(wc -c <"$dest") bytes)"
}

# configure [EXTRA CMAKE ARGS...]: the arguments are part of what decides whether to reconfigure.
configure() {
  local werror=OFF
  [ "${CI:-}" = "true" ] && werror=ON
  local want="type=$build_type werror=$werror san=${BATON_SANITIZE:-} extra=$*"
  if [ -f "$build_dir/build.ninja" ] && [ "$(cat "$build_dir/.run-sh-config" 2>/dev/null)" = "$want" ]; then
    return 0
  fi
  log "configuring $build_dir ($want)"
  cmake -S . -B "$build_dir" -G Ninja \
    -DCMAKE_BUILD_TYPE="$build_type" \
    -DCMAKE_CXX_COMPILER_LAUNCHER=ccache \
    -DBATON_WERROR="$werror" \
    -DBATON_SANITIZE="${BATON_SANITIZE:-}" "$@" >/dev/null
  echo "$want" > "$build_dir/.run-sh-config"
}

build() {
  install_missing
  fetch_data
  configure
  log "building ($jobs jobs)"
  # To stderr: stdout carries only what the program prints (a benchmark's JSON lines).
  cmake --build "$build_dir" -j "$jobs" >&2
}

# The sanitizer stages. Without CUDA (its runtime trips ASan's shadow-memory checks, and there
# is no GPU to test here anyway; so nvcc compiles nothing here) and without benchmarks (they
# measure, and would measure the sanitizers). Errors stop the test that made them. Warnings
# are the main build's gate (-Werror there): with the sanitizers GCC 12 warns inside
# libstdc++'s <regex> (-Wmaybe-uninitialized).
# Each builds only what it runs: ASan the programs ctest runs (not the browser test, which it
# does not run, nor the demo); TSan the concurrency tests alone (tests/CMakeLists.txt makes
# baton-tests of them in a TSan build). Debug information is line tables only (-g1): the
# sanitizers' reports name file, line and function from them, and full -g costs compile and
# link time for nothing the reports print. -O1, as the sanitizers' documentation advises: it
# compiles in about 60% of -O2's time under ASan (tests/test_dashboard.cpp: 162 s against 280 s
# on an Intel Xeon KVM), and the tests they run are short now that validation is.
sanitizer_debug_flags="-O1 -g1 -DNDEBUG"
asan_targets=(baton-tests baton-mp-tests baton-bad-input-tests baton-launch-tests baton-sample-tests baton-slurm-tests baton-serve-tests baton-serve-http-tests baton-skip-selftest hello_mlp custom_op)

sanitize() {
  install_missing python3  # the checkpoint test's independent reader (a failure under CI without it)
  fetch_data
  export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
  export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:strict_string_checks=1"
  # The soak test's 10^6 pieces take minutes under the sanitizers; leaks show with fewer.
  export BATON_SOAK_PIECES=200000
  # The schedule property test's 10,000 random plans: a tenth under the sanitizers.
  export BATON_SCHEDULE_CASES=1000
  # baton-serve's soak: 10^5 requests in the main build, 5,000 under the sanitizers.
  export BATON_SERVE_SOAK=5000
  (
    build_dir="build-asan" build_type=RelWithDebInfo BATON_SANITIZE="address;undefined"
    configure -DBATON_WITH_CUDA=OFF -DBATON_BUILD_BENCHMARKS=OFF -DBATON_WERROR=OFF \
      -DCMAKE_CXX_FLAGS=-fno-sanitize-recover=undefined -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$sanitizer_debug_flags"
    log "building $build_dir: AddressSanitizer + UndefinedBehaviorSanitizer ($jobs jobs)"
    cmake --build "$build_dir" -j "$jobs" --target "${asan_targets[@]}" >&2
    log "running every test under AddressSanitizer + UndefinedBehaviorSanitizer"
    ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" -E '^browser\.'
  )
  (
    build_dir="build-tsan" build_type=RelWithDebInfo BATON_SANITIZE="thread"
    configure -DBATON_WITH_CUDA=OFF -DBATON_BUILD_BENCHMARKS=OFF -DBATON_WERROR=OFF \
      -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$sanitizer_debug_flags"
    log "building $build_dir: ThreadSanitizer ($jobs jobs)"
    cmake --build "$build_dir" -j "$jobs" --target baton-tests >&2
    log "running the runtime, transport and collective tests under ThreadSanitizer"
    # Every test of baton-tests, the one program this stage builds (made of the concurrency tests
    # alone, tests/CMakeLists.txt), chosen by the program CTest runs, not by name: build-tsan also
    # registers the other programs' tests, unbuilt.
    tsan_tests="$(ctest --test-dir "$build_dir" --show-only=json-v1 | python3 -c 'import json, sys; print(",".join(str(i) for i, t in enumerate(json.load(sys.stdin)["tests"], 1) if any(a.endswith("/baton-tests") for a in t.get("command", []))) or sys.exit("no test of baton-tests is registered"))')"
    ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" -I "0,0,0,$tsan_tests"
  )
}

# libFuzzer targets (fuzz/): clang from Debian, ASan + UBSan. Each runs for $1 seconds from its
# corpus in fuzz/corpus/<name> (read only) plus what it finds (build-fuzz/corpus/<name>); a
# crash, leak or timeout fails the stage and leaves the input in build-fuzz/artifacts/.
fuzz() {
  local seconds="${1:-30}"
  install_missing clang
  (
    build_dir="build-fuzz" build_type=RelWithDebInfo BATON_SANITIZE=""
    export CC=clang CXX=clang++
    # Warnings are GCC's business (the main build is -Werror); clang 14's differ.
    configure -DCMAKE_CXX_COMPILER=clang++ -DBATON_FUZZ=ON -DBATON_BUILD_TESTS=OFF -DBATON_BUILD_BENCHMARKS=OFF \
      -DBATON_WERROR=OFF -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$sanitizer_debug_flags"
    local targets
    targets=$(cd fuzz/corpus && ls)
    log "building the fuzz targets: $(echo $targets)"
    cmake --build "$build_dir" -j "$jobs" --target $(for t in $targets; do printf 'fuzz-%s ' "$t"; done) >&2
    mkdir -p "$build_dir/artifacts"
    # The targets run $jobs at a time: each is one process on one core for its full time (a
    # libFuzzer run without -jobs/-workers is single-threaded), so two on 2 cores fuzz as long as
    # one after the other did, in half the wall time.
    fuzz_one() {
      local t="$1"
      mkdir -p "$build_dir/corpus/$t"
      if ! UCX_MEM_EVENTS=no "$build_dir/bin/fuzz-$t" -max_total_time="$seconds" -max_len=65536 -timeout=20 \
          -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix="$build_dir/artifacts/$t-" \
          "$build_dir/corpus/$t" "fuzz/corpus/$t" >"$build_dir/fuzz-$t.log" 2>&1; then
        tail -n 60 "$build_dir/fuzz-$t.log" >&2
        log "fuzz-$t found a problem; the input is in $build_dir/artifacts/ (rerun: $build_dir/bin/fuzz-$t FILE)"
        return 1
      fi
      log "fuzz-$t: $(grep -E '^stat::number_of_executed_units|^Done' "$build_dir/fuzz-$t.log" | tail -n 1)"
    }
    local running=0 failed=0
    for t in $targets; do
      if ((running >= jobs)); then
        wait -n || failed=1
        running=$((running - 1))
      fi
      log "fuzzing $t for ${seconds}s"
      fuzz_one "$t" &
      running=$((running + 1))
    done
    while ((running > 0)); do
      wait -n || failed=1
      running=$((running - 1))
    done
    ((failed == 0)) || exit 1
  )
}

# What CI must have that no test can check by itself: bench.gpu.reference exits 77 (CTest: skipped)
# without a python3 that imports torch, and is a benchmark, not a doctest (tests/skip.h).
ci_preconditions() {
  if ! /usr/bin/python3 -c "import torch" >/dev/null 2>&1; then
    log "CI=true: /usr/bin/python3 cannot import torch (python3-torch): the PyTorch reference would be skipped"
    exit 1
  fi
}

# Debian's OpenBLAS picks its kernels by CPU at run time (DYNAMIC_ARCH), and each family sums
# in its own order, so the tolerances of the float tests must hold under each (tests/equivalence.h).
# After the suite ran with this machine's own kernels, the float suites (parallel training
# against one device, SBP, vocabulary parallel, checkpoints, training) run again under every
# other family this CPU can execute: Haswell (AVX2 + FMA; Zen uses the same kernels), SkylakeX
# (AVX-512) and Sandybridge (AVX, no FMA).
float_suites_under_other_blas_kernels() {
  local flags own
  flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
  # The last "Core:" line: where OpenBLAS fell back below the CPU's features, the program starts
  # itself again with the features' kernels before main (kernels/include/baton/kernels/blas_choice.h).
  own="$(env -u OPENBLAS_CORETYPE OPENBLAS_VERBOSE=2 "$build_dir/bin/baton-tests" --count 2>&1 | sed -n 's/^Core: //p' | tail -n 1)"
  # The suite ran under OPENBLAS_CORETYPE where the environment sets it (it is kept: blas_choice.h),
  # and then this CPU's own family has not run yet: it runs here with the others.
  local ran="${OPENBLAS_CORETYPE:-$own}"
  local families=()
  [ -n "${OPENBLAS_CORETYPE:-}" ] && [ -n "$own" ] && families+=("$own")
  [[ "$flags" == *" avx2 "* && "$flags" == *" fma "* ]] && families+=(Haswell)
  [[ "$flags" == *" avx512f "* && "$flags" == *" avx512bw "* && "$flags" == *" avx512vl "* && "$flags" == *" avx512dq "* ]] && families+=(SkylakeX)
  [[ "$flags" == *" avx "* ]] && families+=(Sandybridge)
  local done_families=" "
  for family in "${families[@]}"; do
    [ "${family,,}" = "${ran,,}" ] && continue
    [[ "$done_families" == *" ${family,,} "* ]] && continue
    done_families+="${family,,} "
    log "the float suites with OpenBLAS's $family kernels (OPENBLAS_CORETYPE=$family; the suite ran with ${ran:-unknown}; this CPU's own: ${own:-unknown})"
    OPENBLAS_CORETYPE="$family" ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" \
      -R '^(Parallel|Sbp|VocabParallel|Ops\.VocabParallel|Checkpoint|Training|Balance)\.|^Serve\.(TheDecodeStep|GreedyGeneration|ABatchChanges|PipelineAndTensorParallel)'
  done
}

# The first port from 8080 on that nobody listens to on 127.0.0.1 (bash's /dev/tcp connects).
free_port() {
  local port
  for port in $(seq 8080 8179); do
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      echo "$port"
      return 0
    fi
  done
  echo 0  # baton-train picks one and prints it
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
  build)
    build
    ;;
  sanitize)
    sanitize
    ;;
  fuzz)
    fuzz "$@"
    ;;
  demo)
    build
    # Trains a small GPT on the licence texts every Debian has (/usr/share/common-licenses, from
    # base-files), tokenised by a SentencePiece BPE model of 512 pieces, for about a minute on 2
    # cores: 2-way data parallelism x a 2-stage pipeline (1F1B) on 4 in-process devices, which
    # gives the same weights as one device. It ends with the held-out loss (the last tenth of
    # the stream: most of GPL-3, put last) and 200 tokens of text drawn from the model.
    # `scripts/run.sh demo mlp`: the MLP (64-256-256-10) on the 8x8 digits instead, with the same
    # parallel layout (held-out accuracy ~98%).
    # Other baton-train flags may follow and override these (e.g. --steps 2000, --dp 1 --pp 1).
    # The dashboard: on 127.0.0.1 (only this machine sees it); from a terminal it stays up two
    # minutes after training so that there is time to look (Ctrl-C ends it).
    dashboard=()
    if [ "${DASHBOARD:-}" != "off" ]; then
      listen="${DASHBOARD:-127.0.0.1:$(free_port)}"
      dashboard=(--dashboard "$listen")
      [ -t 1 ] && dashboard+=(--dashboard-linger 120)
      log "dashboard: http://${listen/#:/127.0.0.1:}/ (baton-train prints the address it serves)"
    fi
    if [ "${1:-}" = mlp ]; then
      shift
      exec "$build_dir/bin/baton-train" --model mlp --data digits --steps 1000 --batch 64 --dp 2 --pp 2 --microbatches 2 \
        "${dashboard[@]}" "$@"
    fi
    # The token shards, made once into $build_dir/demo-data (well under a second) and again only
    # when the licence files or the tokenizer's settings change (inputs.txt records them).
    licenses=/usr/share/common-licenses
    [ -d "$licenses" ] || { log "demo: $licenses is missing (Debian's base-files ships it)"; exit 1; }
    [ -x "$build_dir/bin/baton-prepare-data" ] || { log "demo: no $build_dir/bin/baton-prepare-data (needs libsentencepiece-dev)"; exit 1; }
    shards="$build_dir/demo-data/licenses"
    inputs=()
    for f in "$licenses"/*; do  # the links (GPL -> GPL-3, ...) would repeat a text
      [ -f "$f" ] && [ ! -L "$f" ] && [ "$f" != "$licenses/GPL-3" ] && inputs+=("$f")
    done
    [ -f "$licenses/GPL-3" ] && inputs+=("$licenses/GPL-3")
    want="bpe 512 val 0.1 $(stat -c '%n %s %Y' "${inputs[@]}" | tr '\n' ' ')"
    if [ ! -f "$shards/index.json" ] || [ "$(cat "$shards/inputs.txt" 2>/dev/null)" != "$want" ]; then
      log "demo: tokenising ${#inputs[@]} licence texts into $shards"
      rm -rf "$shards"
      args=()
      for f in "${inputs[@]}"; do args+=(--input "$f"); done
      "$build_dir/bin/baton-prepare-data" "${args[@]}" --train-tokenizer --vocab-size 512 \
        --model-type bpe --val-fraction 0.1 --output "$shards" >&2
      echo "$want" >"$shards/inputs.txt"
    fi
    exec "$build_dir/bin/baton-train" --model gpt --data "tokens:$shards" --steps 1000 --batch 16 --seq 64 \
      --d-model 96 --heads 4 --layers 3 --lr 5e-3 --warmup 30 --cosine \
      --dp 2 --pp 2 --microbatches 2 --sample 200 --sample-prompt "This License" "${dashboard[@]}" "$@"
    ;;
  test)
    # Outside CI not fatal: without them (offline, no root) those tests skip, saying why. In CI
    # they must be there.
    if [ "${CI:-}" = "true" ]; then
      install_missing "${test_packages[@]}"
      ci_preconditions
    else
      ( install_missing "${test_packages[@]}" ) || log "could not install ${test_packages[*]}: the tests that need them will skip"
    fi
    build
    log "running the test suite"
    ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" "$@"
    # The float suites again under other CPU kernel families of OpenBLAS, only with no ctest
    # arguments given (a whole run).
    if [ $# -eq 0 ]; then float_suites_under_other_blas_kernels; fi
    ;;
  bench)
    name="${1:-}"
    [ -n "$name" ] || { log "usage: scripts/run.sh bench NAME (e.g. actors)"; exit 2; }
    shift
    # baton-bench-train's references are Debian's PyTorch (python3-torch, for /usr/bin/python3)
    # and LibTorch (libtorch-dev, the same 1.13, which baton-bench-train-libtorch is built with);
    # baton-bench-memory's and baton-bench-serve's are the same PyTorch; baton-bench-gpu's is PyTorch too where no python3 on PATH has torch (a GPU machine's pip one).
    bench_packages=()
    [ "$name" = train ] && bench_packages+=(python3-torch libtorch-dev)
    [ "$name" = memory ] && bench_packages+=(python3-torch)
    [ "$name" = serve ] && bench_packages+=(python3-torch)  # the peer, and the random weights' writer
    [ "$name" = data ] && bench_packages+=(python3-torch python3-numpy)
    if [ "$name" = gpu ] && ! python3 -c "import torch" >/dev/null 2>&1; then bench_packages+=(python3-torch); fi
    if [ ${#bench_packages[@]} -gt 0 ]; then
      had="$(dpkg-query -W -f='${Status}\n' "${bench_packages[@]}" 2>/dev/null | grep -c "install ok installed" || true)"
      install_missing "${bench_packages[@]}"
      # CMake looks for LibTorch when it configures: configure again once it has been installed.
      [ "$had" = "${#bench_packages[@]}" ] || rm -f "$build_dir/.run-sh-config"
    fi
    build
    # bench parallel: the pipeline bubble and training, then the all-reduce against
    # MPI_Allreduce; as root also across two hosts (network namespaces): dp training, and the
    # hierarchical all-reduce over the veth as it is and over a link limited to 2 Gbit/s.
    if [ "$name" = parallel ]; then
      rc=0
      "$build_dir/bin/baton-bench-parallel" "$@" || rc=$?
      "$build_dir/bin/baton-bench-allreduce" "$@" || rc=$?
      if [ "$(id -u)" = 0 ]; then
        "$build_dir/bin/baton-bench-parallel" --only hosts "$@" || rc=$?
        "$build_dir/bin/baton-bench-allreduce" --hosts 2 "$@" || rc=$?
        "$build_dir/bin/baton-bench-allreduce" --hosts 2 --link-gbit 2 "$@" || rc=$?
      fi
      exit "$rc"
    fi
    prog="$build_dir/bin/baton-bench-$name"
    if [ ! -x "$prog" ]; then
      log "no benchmark '$name'; there are: $(ls "$build_dir/bin" | sed -n 's/^baton-bench-//p' | tr '\n' ' ')"
      exit 2
    fi
    exec "$prog" "$@"
    ;;
  *)
    echo "usage: scripts/run.sh demo|test|bench NAME|build|sanitize|fuzz [ARGS...]" >&2
    exit 2
    ;;
esac
