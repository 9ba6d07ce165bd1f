#!/usr/bin/env bash
# Packs what a GPU machine without UCX, Boost, fmt or OpenBLAS needs to run baton's CUDA checks:
# the programs and the shared libraries they load that the GPU machine lacks (everything ldd
# lists except glibc's own and CUDA's: cuBLAS comes from the GPU machine's CUDA 13 install).
# Usage: scripts/gpu_bundle.sh [BUILD_DIR] -> BUILD_DIR/gpu-bundle, and the same packed as
# BUILD_DIR/gpu-carry/gpu-bundle.tar.xz (prints both sizes): the lent machine's carry limit is
# 64 MiB with the working tree, which the bundle alone passed once OpenBLAS (36 MB) and the
# programs grew; packed it is about 27 MB (13 MB before the serving programs joined it).
# scripts/gpu_checks.sh unpacks it. See docs/gpu.md.
set -euo pipefail
build=${1:-build}
out="$build/gpu-bundle"
rm -rf "$out"
mkdir -p "$out/lib"
# baton-bench-gpu only where the build has it (BATON_BUILD_BENCHMARKS=ON), with its PyTorch
# reference beside it, where it looks first.
progs=(baton-tests baton-train)
# The serving engine's tests, for the decode step on the GPU (Serve.TheDecodeStepOnTheGpu*), and
# the serving benchmark on the GPU (baton-serve, baton-bench-serve and its PyTorch peer).
if [ -x "$build/bin/baton-serve-tests" ]; then progs+=(baton-serve-tests); fi
if [ -x "$build/bin/baton-bench-serve" ] && [ -x "$build/bin/baton-serve" ]; then
  progs+=(baton-serve baton-bench-serve)
  cp "$(dirname "$0")/../apps/bench/serve_torch.py" "$out/"
fi
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
mkdir -p "$build/gpu-carry"
tar -C "$build" -cf - gpu-bundle | xz -T2 -6 > "$build/gpu-carry/gpu-bundle.tar.xz"
du -sh "$build/gpu-carry/gpu-bundle.tar.xz"
