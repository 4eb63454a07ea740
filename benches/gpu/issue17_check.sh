#!/usr/bin/env bash
# One device call for issue 17's open checks (device tool; writes under $OUT, prints the tables last):
#   1. builds v41._cuda from source (the device's nvcc, ~60 s);
#   2. the weight-streaming GEMM's GPU tests (tests/test_gpu_cuda.py, ~40 s);
#   3. kernel_bench.py: experts at B = 1, 8, 64, also with wstream.FIVE_CTAS (registers capped for 5 CTAs per SM);
#   4. time permitting, flash-slice-v41 decode at C = 2,048, B = 64, fp8 records, with the faster FIVE_CTAS.
# carry: ["python/v41/_native.abi3.so"].   run: bash benches/gpu/issue17_check.sh   (~5 min)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/python:$PWD/tests:$PWD/benches/gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
rm -f python/v41/_cuda.so
timeout 100 python3 cuda/build.py > "$OUT/build.txt" 2>&1; tail -1 "$OUT/build.txt"
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_cuda.py > "$OUT/tests.txt" 2>&1
tail -3 "$OUT/tests.txt"
timeout 60 python3 benches/gpu/kernel_bench.py --ops experts --batches 1,8,64 --five-ctas > "$OUT/kb_e.txt" 2>&1
FIVE=$(python3 - "$OUT/kb_e.txt" <<'PY'
import sys
tot = [0.0, 0.0]
for line in open(sys.argv[1]):
    c = [x.strip() for x in line.split("|")[1:-1]]
    if len(c) >= 10 and c[1] in ("B=8", "B=64"):
        tot[0] += float(c[2].replace(",", "")); tot[1] += float(c[9].replace(",", ""))
print(int(tot[1] < tot[0]) if tot[0] else 0)
PY
)
echo "FIVE_CTAS faster: ${FIVE:-0}"
if [ "$SECONDS" -lt 230 ]; then
  timeout 150 python3 benches/gpu/flash_slice.py --slice v41 --cells 64x2048 --prefill , --kv-cache-dtype fp8 \
    --set "v41.kernels.wstream.FIVE_CTAS=${FIVE:-0}" --out "$OUT/fs" > "$OUT/fs.txt" 2>&1
  tail -3 "$OUT/fs.txt"
fi
tail -12 "$OUT/kb_e.txt"
