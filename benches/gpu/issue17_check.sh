#!/usr/bin/env bash
# One device call for issue 17's open switches (device tool; writes under $OUT, prints the tables last):
#   1. builds v41._cuda from source (the device's nvcc, ~60 s);
#   2. GPU tests: the CUDA scorer's dispatch, the Triton linear (split-K in one launch) and the engines' greedy
#      tokens with the CUDA kernels;
#   3. the index scorer at every cell, with --cuda-sweep (queries × entries per CTA);
#   4. flash-slice-v41 at C = 1,048,320 (recency prefill) plus a real 16k prefill, with the CUDA scorer on and off;
#   5. the Triton linear at other tilings (kernel_bench.py --linear-tiles) at 1–64 rows;
#   6. with NCU=1: Nsight Compute on one expert GEMM launch at B = 64 (if ncu reads the counters there).
# carry: ["python/v41/_native.abi3.so"].   run: bash benches/gpu/issue17_check.sh   (~7 min)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/python:$PWD/tests:$PWD/benches/gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
rm -f python/v41/_cuda.so
timeout 120 python3 cuda/build.py > "$OUT/build.txt" 2>&1; tail -1 "$OUT/build.txt"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_cuda_indexer.py tests/test_gpu_fast.py \
  tests/test_gpu_cuda_attention.py -k "dispatch or check_linear or greedy" > "$OUT/tests.txt" 2>&1
tail -3 "$OUT/tests.txt"
timeout 80 python3 benches/gpu/topk_bench.py --cuda-sweep > "$OUT/scores.txt" 2>&1
for s in 1 0; do
  timeout 100 python3 benches/gpu/flash_slice.py --slice v41 --cells 1x1048320 --prefill 16384 --budget 8192 \
    --kv-cache-dtype fp8 --recent-index-prefill --set "v41.kernels.indexer.CUDA_SCORER=$s" --out "$OUT/fs$s" \
    > "$OUT/fs$s.txt" 2>&1
  echo "CUDA_SCORER=$s:"; grep -E "prefill|decode" "$OUT/fs$s.txt" | tail -3
done
timeout 90 python3 benches/gpu/kernel_bench.py --ops linears --batches 1,16,32,64 --reps 16 \
  --linear-tiles 16:256:4:3,32:128:4:4,64:128:4:3,64:128:8:3,64:256:8:3 > "$OUT/lin.txt" 2>&1
NCU=$([ "${NCU:-0}" = 1 ] && { command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1; })
if [ -n "$NCU" ]; then
  timeout 90 "$NCU" --clock-control none --kernel-name regex:wstream --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
    python3 benches/gpu/expert_launches.py --batch 64 > "$OUT/ncu.txt" 2>&1
  grep -E "Throughput|Issue|Warp Cycles|Occupancy|Eligible|Registers|Duration|Stall" "$OUT/ncu.txt" | head -30
fi
tail -14 "$OUT/scores.txt"
tail -38 "$OUT/lin.txt"
