#!/usr/bin/env bash
# One device call for issue 17's open checks (device tool; writes under $OUT, prints the tables last):
#   1. builds v41._cuda from source (the device's nvcc, ~60 s);
#   2. the weight-streaming GEMM's GPU tests (tests/test_gpu_cuda.py, ~40 s);
#   3. kernel_bench.py: experts at B = 1, 8, 64 and dense linears at M = 1, 8;
#   4. flash-slice-v41 decode at C = 2,048, B = 1 and 64, fp8 records (engine start and prefills take ~2 min).
# carry: ["python/v41/_native.abi3.so"].   run: bash benches/gpu/issue17_check.sh   (~7 min)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/python:$PWD/tests:$PWD/benches/gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
rm -f python/v41/_cuda.so
timeout 100 python3 cuda/build.py > "$OUT/build.txt" 2>&1; tail -1 "$OUT/build.txt"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_cuda.py > "$OUT/tests.txt" 2>&1
tail -3 "$OUT/tests.txt"
timeout 60 python3 benches/gpu/kernel_bench.py --ops experts --batches 1,8,64 > "$OUT/kb_e.txt" 2>&1
timeout 60 python3 benches/gpu/kernel_bench.py --ops linears --batches 1,8 > "$OUT/kb_l.txt" 2>&1
timeout 200 python3 benches/gpu/flash_slice.py --slice v41 --cells 1x2048,64x2048 --prefill , --kv-cache-dtype fp8 \
  --out "$OUT/fs" > "$OUT/fs.txt" 2>&1
tail -4 "$OUT/fs.txt"
tail -12 "$OUT/kb_e.txt"
tail -20 "$OUT/kb_l.txt" | cut -c1-200
