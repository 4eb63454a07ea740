#!/usr/bin/env bash
# DSpark speculation on one H200 (device tool), one call: the GPU speculation tests, then spec_check.py (embedded
# tiny model: fixed K vs adaptive verification vs plain), optionally on v41-mid (random weights), then
# spec_slice.py (flash-slice-v41 + the drafter at real dims: draft / verify steps against their floors). Tables last.
# run: bash benches/gpu/spec_gpu.sh        carry: ["python/v41/_native.abi3.so"]
# STAGES="tests tiny mid slice" (default all) picks what runs.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/python:$PWD/tests:$PWD/benches/gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGES=${STAGES:-"tests tiny mid slice"}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
for stage in $STAGES; do
  case $stage in
    tests) timeout 240 python3 -m pytest -q -x --timeout 200 -p no:cacheprovider tests/test_gpu_fast.py \
             -k "${TESTS_K:-speculation or adaptive}" 2>&1 | tee "$OUT/gpu_tests.txt" | tail -5 ;;
    tiny) timeout 200 python3 benches/gpu/spec_check.py --batches 1 8 32 --ks 5 --adaptive-k 5 ${TINY_ARGS:-} \
            2>&1 | grep -v "^INFO" | tee "$OUT/spec_tiny.txt" ;;
    mid) python3 benches/gpu/make_models.py /tmp >/dev/null && timeout 200 python3 benches/gpu/spec_check.py \
           --model /tmp/mid41 --load-format dummy --dtype float32 --batches 1 8 32 --ks 3 --adaptive-k 3 \
           --tokens 64 --mem 0.3 0.6 2>&1 | grep -v "^INFO" | tee "$OUT/spec_mid.txt" ;;
    slice) timeout 300 python3 benches/gpu/spec_slice.py --out "$OUT" ${SLICE_ARGS:-} 2>&1 | grep -v "^INFO" \
             | tee "$OUT/spec_slice.txt" ;;
  esac
done
