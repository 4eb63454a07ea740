#!/usr/bin/env bash
# Engram offload on one H200 (device tool), one call: the GPU tests (UVA fill kernel, engine offload = resident
# tokens under CUDA graphs), then engram_offload.py (flash-slice-v41 layers 0/1/14, 32 GiB tables per layer:
# resident vs uva vs copy). Tables last.
# run: bash benches/gpu/engram_gpu.sh        carry: ["python/v41/_native.abi3.so"]
# STAGES="tests bench" (default both); BENCH_ARGS passes options to engram_offload.py.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/python:$PWD/tests:$PWD/benches/gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGES=${STAGES:-"tests bench"}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
df -h /dev/shm | tee -a "$OUT/gpu.txt"; free -g | tee -a "$OUT/gpu.txt"; ulimit -l | tee -a "$OUT/gpu.txt"
for stage in $STAGES; do
  case $stage in
    tests) timeout 300 python3 -m pytest -q -x --timeout 250 -p no:cacheprovider tests/test_engram_fill.py \
             tests/test_engram_offload.py -k "${TESTS_K:-(gpu or graph) and not interpreter}" 2>&1 \
             | tee "$OUT/gpu_tests.txt" | tail -5 ;;
    bench) timeout 540 python3 benches/gpu/engram_offload.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | grep -v "^INFO" \
             | tee "$OUT/engram_offload.txt" ;;
  esac
done
