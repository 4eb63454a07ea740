#!/usr/bin/env bash
# One device call for issue 17's open checks (device tool; writes under $OUT):
#   1. builds v41._cuda from source (the device's nvcc, ~60 s);
#   2. async scheduling on the GPU (tests/test_gpu_async_scheduling.py: the pipelined engine's tokens = the
#      synchronous engine's, tiny V4 / V4.1, bf16 and fp8 caches; no host synchronisation while launching a step)
#      and the engine's greedy tokens = the CPU engine's (tests/test_gpu_fast.py -k greedy, async scheduling on);
#      no host synchronisation in a decode forward or in the sampler (logit-bias and min_tokens rows included);
#      check_mhc (bf16, float32: the collapse joined with the RMSNorm equals the two launches bit for bit);
#   3. flash-slice-v41 decode at C = 2,048, B = 1 and 64, fp8 records, ~2.2 min each: ON = mhc.FUSED_NORM (the
#      collapse and the RMSNorm in one launch, the default), OFF = two launches, then ON again (an interleaved
#      A/B/A: the run-to-run spread is ~5 %; async scheduling makes it ~0.1 % between like runs).
# TESTS_ONLY=1 stops after step 2 (whose limit is 400 s; ~5 min in all).
# carry: ["python/v41/_native.abi3.so"].   run: bash benches/gpu/issue17_check.sh   (~11 min)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/python:$PWD/tests:$PWD/benches/gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
rm -f python/v41/_cuda.so
timeout 100 python3 cuda/build.py > "$OUT/build.txt" 2>&1; tail -1 "$OUT/build.txt"
timeout 400 python3 -m pytest -q -p no:cacheprovider --durations=10 tests/test_gpu_async_scheduling.py \
  tests/test_gpu_fast.py -k "async or greedy or host_synchronisation or mhc" > "$OUT/tests.txt" 2>&1
tail -15 "$OUT/tests.txt"
[ "${TESTS_ONLY:-0}" = 1 ] && exit 0
ON="--set v41.kernels.mhc.FUSED_NORM=1"
OFF="--set v41.kernels.mhc.FUSED_NORM=0"
i=0
for v in ON OFF ON; do
  i=$((i + 1))
  timeout 135 python3 benches/gpu/flash_slice.py --slice v41 --cells 1x2048,64x2048 --prefill , --kv-cache-dtype fp8 \
    ${!v} --out "$OUT/fs${i}_$v" > "$OUT/fs${i}_$v.txt" 2>&1
  echo "$i $v:"; tail -3 "$OUT/fs${i}_$v.txt"
done
