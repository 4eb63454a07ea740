#!/usr/bin/env bash
# One device call for issue 17's open checks (device tool; writes under $OUT):
#   1. builds v41._cuda from source (the device's nvcc, ~60 s);
#   2. the mHC seam's one-launch path on the GPU (tests/test_gpu_fast.py -k mhc: check_mhc in bf16 and float32,
#      one launch, again, two launches) and the side-stream tests (tests/test_gpu_side_stream.py);
#   3. flash-slice-v41 decode at C = 2,048, B = 1 and 64, fp8 records, async output processing, ~2.2 min each:
#      ONE = mhc.ONE_LAUNCH on, TWO = off, then ONE again (the run-to-run spread is ~5 %: an interleaved A/B/A).
# carry: ["python/v41/_native.abi3.so"].   run: bash benches/gpu/issue17_check.sh   (~9 min)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/python:$PWD/tests:$PWD/benches/gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
rm -f python/v41/_cuda.so
timeout 100 python3 cuda/build.py > "$OUT/build.txt" 2>&1; tail -1 "$OUT/build.txt"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fast.py -k mhc tests/test_gpu_side_stream.py \
  > "$OUT/tests.txt" 2>&1
tail -3 "$OUT/tests.txt"
ONE="--set v41.kernels.mhc.ONE_LAUNCH=1"
TWO="--set v41.kernels.mhc.ONE_LAUNCH=0"
i=0
for v in ONE TWO ONE; do
  i=$((i + 1))
  timeout 135 python3 benches/gpu/flash_slice.py --slice v41 --cells 1x2048,64x2048 --prefill , --kv-cache-dtype fp8 \
    --async-output-proc ${!v} --out "$OUT/fs${i}_$v" > "$OUT/fs${i}_$v.txt" 2>&1
  echo "$i $v:"; tail -3 "$OUT/fs${i}_$v.txt"
done
