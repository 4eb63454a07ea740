#!/usr/bin/env bash
# One device call for issue 17's open checks (device tool; writes under $OUT; kernel tables, then flash-slice):
#   1. builds v41._cuda from source (the device's nvcc, ~60 s);
#   2. GPU tests: the weight-streaming GEMM (tests/test_gpu_cuda.py, ~80 s) and the side stream
#      (tests/test_gpu_side_stream.py: logits bit for bit with and without it, eager and graph replays);
#   3. kernel_bench.py: dense linears at M = 1, 16, 32, 64 (the CUDA kernel with 1-8 row groups per pass against
#      Triton, and with at most 4 groups: column rg4);
#   4. flash-slice-v41 decode at C = 2,048, B = 1 and 64, fp8 records: with the side stream and CUDA linears up to
#      64 rows (NEW), then as before (OLD: no side stream, CUDA linears up to 8 rows), ~2.2 min each;
#   5. with PROFILE=1: profile_step.py at B = 1 and 64 (every kernel of a step by name, ~1.5 min each).
# carry: ["python/v41/_native.abi3.so"].   run: [PROFILE=1] bash benches/gpu/issue17_check.sh   (~9 min)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/python:$PWD/tests:$PWD/benches/gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
rm -f python/v41/_cuda.so
timeout 100 python3 cuda/build.py > "$OUT/build.txt" 2>&1; tail -1 "$OUT/build.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_cuda.py tests/test_gpu_side_stream.py \
  > "$OUT/tests.txt" 2>&1
tail -3 "$OUT/tests.txt"
timeout 120 python3 benches/gpu/kernel_bench.py --ops linears --batches 1,16,32,64 --row-groups 4 > "$OUT/kb_l.txt" 2>&1
tail -38 "$OUT/kb_l.txt" | cut -c1-200
OLD="--set v41.kernels.side_stream.ENABLED=0 --set v41.kernels.wstream.MAX_ROWS=8"
NEW="--set v41.kernels.side_stream.ENABLED=1 --set v41.kernels.wstream.MAX_ROWS=64"
for v in NEW OLD; do
  timeout 135 python3 benches/gpu/flash_slice.py --slice v41 --cells 1x2048,64x2048 --prefill , --kv-cache-dtype fp8 \
    ${!v} --out "$OUT/fs_$v" > "$OUT/fs_$v.txt" 2>&1
  echo "$v:"; tail -3 "$OUT/fs_$v.txt"
done
if [ "${PROFILE:-0}" = 1 ]; then
  for b in 1 64; do
    timeout 150 python3 benches/gpu/profile_step.py --slice v41 --batch $b --context 2048 --prefill 0 \
      --kv-cache-dtype fp8 --top 80 > "$OUT/prof$b.txt" 2>&1
    grep -m2 "==" "$OUT/prof$b.txt"
  done
fi
