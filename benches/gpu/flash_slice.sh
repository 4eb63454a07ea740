#!/usr/bin/env bash
# The fast path on one H200 (device tool), one call: GPU tests, then the flash-slice benchmark (table last).
# v41 runs from this source tree with the extension `make develop` built here (python/v41/_native.abi3.so,
# abi3: it loads under the device's Python 3.12); transformers 5.23 travels as a wheel:
#   .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 -d .whl "transformers==5.23.*"
# run: bash benches/gpu/flash_slice.sh [flash_slice.py args]
# carry: [".whl", "python/v41/_native.abi3.so"]   (SKIP_TESTS=1 skips tests/test_gpu_fast.py)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/transformers-*.whl || exit 1
export PYTHONPATH=$PWD/python:/tmp/site:$PWD/tests
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch; print("torch.cuda.mem_get_info:", torch.cuda.mem_get_info())' | tee -a "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 300 python3 -m pytest -q -x --timeout 280 -p no:cacheprovider tests/test_gpu_fast.py 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25
fi
if [ -n "${PROFILE:-}" ]; then  # e.g. PROFILE="--batch 1 --context 2048 --prefill 2048"
  timeout 240 python3 benches/gpu/profile_step.py $PROFILE 2>&1 | tee "$OUT/profile.txt"
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout "${BENCH_TIMEOUT:-420}" python3 benches/gpu/flash_slice.py --out "$OUT" "$@" 2>&1 | tee "$OUT/flash_slice.txt"
fi
