#!/usr/bin/env bash
# One device call for issue 17's open checks (device tool; writes under $OUT, prints the tables last):
#   1. builds v41._cuda from source (the device's nvcc, ~60 s);
#   2. GPU tests: the CUDA scorer's dispatch, the Triton linear (split-K in one launch) and the engines' greedy
#      tokens with the CUDA kernels (~4 min);
#   3. with NCU=1: Nsight Compute on one expert GEMM launch at B = 8 and B = 64 (if ncu reads the counters there);
#   4. flash-slice-v41 decode at C = 2,048, B = 1 and 64, fp8 records (the whole step after the host-path work).
# carry: ["python/v41/_native.abi3.so"].   run: NCU=1 bash benches/gpu/issue17_check.sh   (~9 min)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/python:$PWD/tests:$PWD/benches/gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
rm -f python/v41/_cuda.so
timeout 100 python3 cuda/build.py > "$OUT/build.txt" 2>&1; tail -1 "$OUT/build.txt"
timeout 250 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_cuda_indexer.py tests/test_gpu_fast.py \
  tests/test_gpu_cuda_attention.py -k "dispatch or check_linear or greedy" > "$OUT/tests.txt" 2>&1
tail -3 "$OUT/tests.txt"
NCU=$([ "${NCU:-0}" = 1 ] && { command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -1; })
if [ -n "$NCU" ]; then
  for b in 8 64; do
    timeout 60 "$NCU" --clock-control none --kernel-name regex:wstream --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
      --section MemoryWorkloadAnalysis --section InstructionStats --section LaunchStats \
      python3 benches/gpu/expert_launches.py --batch $b > "$OUT/ncu$b.txt" 2>&1
    echo "ncu B=$b:"; grep -E "Duration|DRAM Throughput|Issue Slots Busy|Eligible Warps|Achieved Occupancy|Registers Per|Warp Cycles Per Issued" "$OUT/ncu$b.txt" | head -12
  done
else
  echo "no ncu"
fi
timeout 150 python3 benches/gpu/flash_slice.py --slice v41 --cells 1x2048,64x2048 --prefill , \
  --kv-cache-dtype fp8 --out "$OUT/fs" > "$OUT/fs.txt" 2>&1
tail -12 "$OUT/fs.txt"
