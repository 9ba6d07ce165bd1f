#!/usr/bin/env bash
# docs/gpu.md's checks, run on a lent GPU machine from a bundle made here by
# scripts/gpu_bundle.sh. Each check has its own time limit and log; one line per check goes to
# stdout (and $OUT/summary.txt): name, exit status, seconds, and the log's last useful line.
#
#   scripts/gpu_checks.sh tests   the CUDA and NCCL tests, and the CPU runtime tests there
#   scripts/gpu_checks.sh train   baton-train on digits on cuda:0, f32 and bf16 (1000 steps)
#   scripts/gpu_checks.sh bench   baton-bench-gpu: f32, bf16, bf16 against PyTorch's sdpa
#   scripts/gpu_checks.sh torch   PyTorch alone (bf16, sdpa) at TORCH_BATCHES, for its best batch
#   scripts/gpu_checks.sh serve   baton-bench-serve on cuda:0: baton-serve continuous and static
#                                 batching against PyTorch's decode loop on the same GPU (about 4 min)
#   scripts/gpu_checks.sh graphs  baton alone at batches 2 and 8 (bf16), with the step's CUDA graphs
#                                 and without (BATON_CUDA_GRAPHS=0): what they buy (about 4 min)
#   scripts/gpu_checks.sh all     the three in turn
#   scripts/gpu_checks.sh session the GPU tests, digits and the LLMs on cuda:1, one bf16 benchmark
#                                 (what fits one lent session of 15 minutes with the start)
#
# Carry build-gpu/gpu-carry (the packed bundle; it is unpacked here) or build-gpu/gpu-bundle.
# Environment: BUNDLE (default build-gpu/gpu-bundle), OUT (the folder for logs; the device tool
# sets it), BENCH_ARGS (extra arguments for every baton-bench-gpu run).
set -uo pipefail
cd "$(dirname "$0")/.."
B=${BUNDLE:-build-gpu/gpu-bundle}
# The packed bundle (scripts/gpu_bundle.sh), carried where the bundle itself is too big to.
packed="$(dirname "$B")/gpu-carry/gpu-bundle.tar.xz"
if [ ! -x "$B/baton-tests" ] && [ -f "$packed" ]; then
  mkdir -p "$(dirname "$B")"
  tar -C "$(dirname "$B")" -xJf "$packed" 2>/dev/null ||
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$packed" "$(dirname "$B")"
fi
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT"
what=${1:-all}

# cuBLAS and NCCL come from the GPU machine's CUDA install or PyTorch's wheels (not carried).
find_lib() {
  find /usr/local /usr/lib /opt -name "$1" 2>/dev/null | head -n 1
}
cublas=$(find_lib 'libcublas.so.13')
nccl=$(find_lib 'libnccl.so.2')
# cuDNN too (loaded at run time for --attention auto|cudnn; its sub-libraries beside it).
cudnn=$(find_lib 'libcudnn.so.9')
[ -n "$cudnn" ] && export BATON_CUDNN_PATH="$cudnn"
export LD_LIBRARY_PATH="$PWD/$B/lib${cublas:+:$(dirname "$cublas")}${nccl:+:$(dirname "$nccl")}${cudnn:+:$(dirname "$cudnn")}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The UCX modules, if the bundle carries them.
[ -d "$B/lib/ucx" ] && export UCX_MODULE_DIR="$PWD/$B/lib/ucx"

summary="$OUT/summary.txt"
check() {  # check NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  local log="$OUT/$name.log" start end rc
  start=$(date +%s.%N)
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  rc=$?
  end=$(date +%s.%N)
  local last
  last=$(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-300)
  printf '%-28s rc=%-3s %6.1fs  %s\n' "$name" "$rc" "$(awk -v a="$start" -v b="$end" 'BEGIN{print b-a}')" "$last" | tee -a "$summary"
}

header() {
  {
    echo "== $(date -u +%FT%TZ) $what"
    nvidia-smi -L
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
    echo "cublas: ${cublas:-none}  nccl: ${nccl:-none}  cudnn: ${cudnn:-none}"
    python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)' 2>&1
  } | tee -a "$summary"
}

tests() {
  check cuda-tests 240 "$B/baton-tests" -tc='Cuda*' -d
  check nccl-tests 120 "$B/baton-tests" -tc='Nccl.*' -d
  check cpu-runtime-tests 90 "$B/baton-tests" -tc='Runtime.*,Plan.*,Ops.*,Schedule.*'
}

train() {
  check train-f32 90 "$B/baton-train" --model mlp --data digits --devices cuda:1 --steps 1000 --batch 64
  check train-bf16 90 "$B/baton-train" --model mlp --data digits --devices cuda:1 --steps 1000 --batch 64 \
    --precision bf16
  check train-gpt-bf16 60 "$B/baton-train" --model gpt --data text:README.md --devices cuda:1 --steps 100 \
    --batch 8 --precision bf16
}

bench() {
  # shellcheck disable=SC2086
  check bench-bf16 280 "$B/baton-bench-gpu" --device cuda:0 --precision bf16 ${BENCH_ARGS:-}
  check bench-bf16-sdpa 280 "$B/baton-bench-gpu" --device cuda:0 --precision bf16 --torch-attention sdpa ${BENCH_ARGS:-}
  check bench-f32 280 "$B/baton-bench-gpu" --device cuda:0 ${BENCH_ARGS:-}
}

# A lent session's share: every test that needs the GPU (not the CPU ones), the trainings, and
# the bf16 benchmark against PyTorch's sdpa at BENCH_BATCH (32: the batch of the README's figure),
# baton's attention by --attention auto (cuDNN's where it loads: PyTorch's own libcudnn), PyTorch
# eager and under torch.compile, both sides with GELU's tanh form (BENCH_GELU: GPT-2's and
# Megatron's, the form cuBLASLt's GELU epilogues compute; the GPT training check keeps erf). The
# limits add up to 480 s, so that the whole fits 8 minutes of a lent machine's time with its
# start (every check's log says how long it took). serve-gpu: serving's decode step (a Program
# on cuda:0, the paged KV cache) against the CPU's logits.
session() {
  check gpu-tests 150 "$B/baton-tests" -tc='Cuda*,MemoryPlan.Cuda*,Nccl.OneRank.*,Nccl.Failure.*' -d
  if [ -x "$B/baton-serve-tests" ]; then
    check serve-gpu 20 "$B/baton-serve-tests" -tc='Serve.TheDecodeStepOnTheGpu*' -d
  fi
  check train-f32 30 "$B/baton-train" --model mlp --data digits --devices cuda:1 --steps 1000 --batch 64
  check train-bf16 30 "$B/baton-train" --model mlp --data digits --devices cuda:1 --steps 1000 --batch 64 \
    --precision bf16
  check train-llama-bf16 30 "$B/baton-train" --model llama --data text:README.md --devices cuda:1 --steps 100 \
    --batch 8 --precision bf16 --kv-heads 2
  check train-gpt-bf16 30 "$B/baton-train" --model gpt --data text:README.md --devices cuda:1 --steps 100 \
    --batch 8 --precision bf16 --attention auto
  # shellcheck disable=SC2086
  check bench-bf16-sdpa 190 "$B/baton-bench-gpu" --device cuda:0 --precision bf16 --torch-attention sdpa \
    --attention auto --torch-compile on --batch "${BENCH_BATCH:-32}" --gelu "${BENCH_GELU:-tanh}" ${BENCH_ARGS:-}
  epilogues_refused
  graphs_refused
}

# The notes of one kind in the logs (PATTERN, shortened by the sed expression STRIP), counted
# into the summary under TITLE: the checks pass either way.
tally() {  # tally TITLE PATTERN STRIP
  local lines
  lines=$(grep -h "$2" "$OUT"/*.log 2>/dev/null | sed "$3" | sort | uniq -c | sort -rn | head -n 8)
  if [ -n "$lines" ]; then
    { echo "$1:"; echo "$lines"; } | tee -a "$summary"
  else
    echo "$1: none" | tee -a "$summary"
  fi
}

# The segments that gave their CUDA graphs up (each says so once on stderr, with the capture's
# error) and ran their kernels one by one.
graphs_refused() {
  tally "segments that ran without CUDA graphs" "kernels one by one" 's/^baton: segment .[^ ]* //'
}

# What the step as CUDA graphs buys where launching dominates: baton alone (no PyTorch) at small
# batches, with the segments pass (its default) and without (BATON_CUDA_GRAPHS=0), bf16.
graphs() {
  local b
  for b in ${GRAPH_BATCHES:-2 8}; do
    # shellcheck disable=SC2086
    check "graphs-on-b$b" 60 "$B/baton-bench-gpu" --device cuda:0 --precision bf16 --attention auto --no-reference \
      --batch "$b" --gelu tanh ${BENCH_ARGS:-}
    # shellcheck disable=SC2086
    BATON_CUDA_GRAPHS=0 check "graphs-off-b$b" 60 "$B/baton-bench-gpu" --device cuda:0 --precision bf16 \
      --attention auto --no-reference --batch "$b" --gelu tanh ${BENCH_ARGS:-}
  done
  graphs_refused
}

# The cuBLASLt epilogues that ran apart (each kernel says so once on stderr: no algorithm for the
# shape, or a failure).
epilogues_refused() {
  tally "epilogues that ran apart" "run apart" 's/^baton: [^:]*: //'
}

# PyTorch alone at several batches (bf16 autocast, fused attention: as a user would run it), to
# find its best batch; one JSON line each.
torch_sweep() {
  local b
  for b in ${TORCH_BATCHES:-4 8 16 32}; do
    check "torch-sdpa-bf16-b$b" 120 python3 "$B/gpt_torch.py" --device cuda --d-model 1024 --heads 16 --layers 8 \
      --seq 1024 --vocab 32768 --batch "$b" --precision bf16 --attention sdpa
  done
}

# Serving on the GPU (baton-serve --device cuda:0, the decode kernels and the KV cache in device
# memory) against the PyTorch peer on the same GPU: the continuous-batching goal of step 15 is
# measured at 16 clients. Its JSON lines go to $OUT/serve-bench-gpu.log.
serve() {
  if [ -x "$B/baton-bench-serve" ]; then
    check serve-bench-gpu 300 "$B/baton-bench-serve" --device cuda:0 --allow-load
  else
    echo "serve: the bundle has no baton-bench-serve (scripts/gpu_bundle.sh with benchmarks built)" | tee -a "$summary"
  fi
}

header
case "$what" in
  tests) tests ;;
  train) train ;;
  bench) bench ;;
  torch) torch_sweep ;;
  all) tests; train; bench ;;
  session) session ;;
  serve) serve ;;
  graphs) graphs ;;
  *) echo "usage: $0 tests|train|bench|torch|all|session|serve|graphs" >&2; exit 2 ;;
esac
