#!/usr/bin/env bash
# Packs what a GPU machine without UCX, Boost, fmt or OpenBLAS needs to run baton's CUDA checks:
# the programs and the shared libraries they load that the GPU machine lacks (everything ldd
# lists except glibc's own and CUDA's: cuBLAS comes from the GPU machine's CUDA 13 install).
# Usage: scripts/gpu_bundle.sh [BUILD_DIR] -> BUILD_DIR/gpu-bundle (prints its size; the lent
# machine's carry limit is 64 MiB). See docs/gpu.md.
set -euo pipefail
build=${1:-build}
out="$build/gpu-bundle"
rm -rf "$out"
mkdir -p "$out/lib"
# baton-bench-gpu only where the build has it (BATON_BUILD_BENCHMARKS=ON), with its PyTorch
# reference beside it, where it looks first.
progs=(baton-tests baton-train)
if [ -x "$build/bin/baton-bench-gpu" ]; then
  progs+=(baton-bench-gpu)
  cp "$(dirname "$0")/../apps/bench/gpt_torch.py" "$out/"
fi
for prog in "${progs[@]}"; do
  cp "$build/bin/$prog" "$out/"
  ldd "$build/bin/$prog" | awk '$3 ~ /^\// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so.*|libm.so.*|libdl.so.*|librt.so.*|libpthread.so.*|ld-linux*|libcublas*|libcudart*|libnccl*) ;;
      *) cp -L "$lib" "$out/lib/" ;;
    esac
  done
done
strip "$out"/baton-* "$out"/lib/*.so* 2>/dev/null || true
du -sh "$out"
