#!/usr/bin/env bash
# One device call for issue 17's open checks (device tool; writes under $OUT; kernel tables, then flash-slice):
#   1. builds v41._cuda from source (the device's nvcc, ~60 s);
#   2. the weight-streaming GEMM's GPU tests (tests/test_gpu_cuda.py, ~70 s);
#   3. kernel_bench.py: experts at B = 1, 8, 64 (with wstream.FIVE_CTAS flipped too) and dense linears at M = 1, 8;
#   4. flash-slice-v41 decode at C = 2,048, B = 1 and 64, fp8 records, with FIVE_CTAS on and off (~2.5 min each);
#   5. with PROFILE=1: profile_step.py at B = 1 and 64 (every kernel of a step by name, ~1.5 min each).
# carry: ["python/v41/_native.abi3.so"].   run: [PROFILE=1] bash benches/gpu/issue17_check.sh   (~9 min; 12 with PROFILE)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/python:$PWD/tests:$PWD/benches/gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
rm -f python/v41/_cuda.so
timeout 100 python3 cuda/build.py > "$OUT/build.txt" 2>&1; tail -1 "$OUT/build.txt"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_cuda.py > "$OUT/tests.txt" 2>&1
tail -3 "$OUT/tests.txt"
timeout 60 python3 benches/gpu/kernel_bench.py --ops experts --batches 1,8,64 --five-ctas > "$OUT/kb_e.txt" 2>&1
timeout 60 python3 benches/gpu/kernel_bench.py --ops linears --batches 1,8 > "$OUT/kb_l.txt" 2>&1
tail -12 "$OUT/kb_e.txt"
tail -20 "$OUT/kb_l.txt" | cut -c1-200
for f in 1 0; do
  timeout 130 python3 benches/gpu/flash_slice.py --slice v41 --cells 1x2048,64x2048 --prefill , --kv-cache-dtype fp8 \
    --set "v41.kernels.wstream.FIVE_CTAS=$f" --out "$OUT/fs$f" > "$OUT/fs$f.txt" 2>&1
  echo "FIVE_CTAS=$f:"; tail -3 "$OUT/fs$f.txt"
done
if [ "${PROFILE:-0}" = 1 ]; then
  for b in 1 64; do
    timeout 150 python3 benches/gpu/profile_step.py --slice v41 --batch $b --context 2048 --prefill 0 \
      --kv-cache-dtype fp8 --top 80 > "$OUT/prof$b.txt" 2>&1
    grep -m2 "==" "$OUT/prof$b.txt"
  done
fi
