#!/usr/bin/env bash
# One device call for issue 17's open checks (device tool; writes under $OUT, prints the tables last):
#   1. builds v41._cuda from source (the device's nvcc, ~60 s);
#   2. the weight-streaming GEMM's GPU tests (tests/test_gpu_cuda.py);
#   3. kernel_bench.py: the weight-streaming GEMM at V4.1 / V4 decode shapes, B = 1, 8, 64;
#   4. with NCU=1: Nsight Compute on one expert GEMM launch at B = 64 (if ncu reads the counters there);
#   5. flash-slice-v41 decode at C = 2,048, B = 1 and 64, fp8 records.
# carry: ["python/v41/_native.abi3.so"].   run: NCU=1 bash benches/gpu/issue17_check.sh   (~8 min)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/python:$PWD/tests:$PWD/benches/gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
rm -f python/v41/_cuda.so
timeout 100 python3 cuda/build.py > "$OUT/build.txt" 2>&1; tail -1 "$OUT/build.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_cuda.py > "$OUT/tests.txt" 2>&1
tail -3 "$OUT/tests.txt"
timeout 120 python3 benches/gpu/kernel_bench.py --ops linears,experts --batches 1,8,64 > "$OUT/kb.txt" 2>&1
NCU=$([ "${NCU:-0}" = 1 ] && { command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -1; })
if [ -n "$NCU" ]; then
  timeout 60 "$NCU" --clock-control none --kernel-name regex:wstream --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
    --section MemoryWorkloadAnalysis --section InstructionStats \
    python3 benches/gpu/expert_launches.py --batch 64 > "$OUT/ncu64.txt" 2>&1
  grep -E "Duration|DRAM Throughput|Issued Warp|Eligible Warps|Registers Per|Warp Cycles Per Issued|Executed Instructions " \
    "$OUT/ncu64.txt" | head -10
fi
timeout 130 python3 benches/gpu/flash_slice.py --slice v41 --cells 1x2048,64x2048 --prefill , \
  --kv-cache-dtype fp8 --out "$OUT/fs" > "$OUT/fs.txt" 2>&1
tail -4 "$OUT/fs.txt"
tail -32 "$OUT/kb.txt"
