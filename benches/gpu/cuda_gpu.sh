#!/usr/bin/env bash
# The CUDA kernels of cuda/ on one H200 (device tool), one call: load or build v41._cuda, the GPU tests, then
# benches/gpu/kernel_bench.py (table last). v41 runs from this source tree with the extensions built here:
#   make develop && make cuda      # python/v41/_native.abi3.so, python/v41/_cuda.so
# carry: ["python/v41/_native.abi3.so", "python/v41/_cuda.so"]; when the carried _cuda.so does not load there
# (another torch build), it is rebuilt from source with the device's nvcc (about a minute).
# run: bash benches/gpu/cuda_gpu.sh [kernel_bench.py args]   (SKIP_TESTS=1, SKIP_BENCH=1 skip a stage;
# TRITON_CHECKS= leaves out the Triton kernel checks of tests/test_gpu_fast.py)
# FLASH="--slice v4 --cells 1x2048,8x2048 --prefill ," also runs flash_slice.py with V41_KERNELS=auto (CUDA kernels)
# and V41_KERNELS=triton, one after the other (FLASH_MODES="auto" runs only the first), for each KV cache dtype
# of FLASH_KV (default "auto"; "auto fp8" runs both).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/python:$PWD/tests:$PWD/benches/gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if ! python3 -c 'import torch, v41._cuda' 2>"$OUT/cuda_import.txt"; then
  echo "carried _cuda.so does not load ($(tail -1 "$OUT/cuda_import.txt")); building from source"
  python3 -m pip install -q --no-index ninja 2>/dev/null
  timeout 300 python3 cuda/build.py 2>&1 | tail -5 | tee "$OUT/cuda_build.txt" || exit 1
fi
python3 -m v41.cli --version | tee -a "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 300 python3 -m pytest -q --timeout 280 -p no:cacheprovider tests/test_gpu_cuda.py tests/test_gpu_cuda_attention.py tests/test_gpu_cuda_topk.py tests/test_gpu_cuda_indexer.py \
    ${TRITON_CHECKS-tests/test_gpu_fast.py::test_triton_kernel_equals_its_reference_on_the_gpu} 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25
fi
if [ -n "${FLASH:-}" ]; then
  for kv in ${FLASH_KV:-auto}; do
    for mode in ${FLASH_MODES:-auto triton}; do
      mkdir -p "$OUT/flash_${mode}_$kv"
      V41_KERNELS=$mode timeout "${FLASH_TIMEOUT:-200}" python3 benches/gpu/flash_slice.py \
        --out "$OUT/flash_${mode}_$kv" --kv-cache-dtype "$kv" $FLASH 2>&1 | tee "$OUT/flash_${mode}_$kv.txt" | tail -12
    done
  done
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout "${BENCH_TIMEOUT:-300}" python3 benches/gpu/kernel_bench.py "$@" 2>&1 | tee "$OUT/kernel_bench.txt"
fi
