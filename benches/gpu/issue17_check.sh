#!/usr/bin/env bash
# One device call for issue 17's open checks (device tool; writes under $OUT):
#   1. builds v41._cuda from source (the device's nvcc, ~60 s);
#   2. flash-slice-v41 decode at C = 2,048, B = 1 and 64, fp8 records, three ways (~2.2 min each): OLD without the
#      side stream (kernels/side_stream.py), SIDE with it, ASYNC with it and the engine's async_output_proc.
# carry: ["python/v41/_native.abi3.so"].   run: bash benches/gpu/issue17_check.sh   (~8 min)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/python:$PWD/tests:$PWD/benches/gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
rm -f python/v41/_cuda.so
timeout 100 python3 cuda/build.py > "$OUT/build.txt" 2>&1; tail -1 "$OUT/build.txt"
OLD="--set v41.kernels.side_stream.ENABLED=0"
SIDE="--set v41.kernels.side_stream.ENABLED=1"
ASYNC="--set v41.kernels.side_stream.ENABLED=1 --async-output-proc"
for v in ASYNC SIDE OLD; do
  timeout 140 python3 benches/gpu/flash_slice.py --slice v41 --cells 1x2048,64x2048 --prefill , --kv-cache-dtype fp8 \
    ${!v} --out "$OUT/fs_$v" > "$OUT/fs_$v.txt" 2>&1
  echo "$v:"; tail -3 "$OUT/fs_$v.txt"
done
