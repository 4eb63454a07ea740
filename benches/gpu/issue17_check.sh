#!/usr/bin/env bash
# Device calls for issue 17's open checks (device tool; writes under $OUT):
#   1. builds v41._cuda from source (the device's nvcc, ~60 s);
#   2. TESTS_ONLY=1 (~5 min): programmatic dependent launch (tests/test_gpu_pdl.py: a chain of dependent launches
#      and the engine's logits with PDL = without, bit for bit, eager and in graph replays) and the kernels whose
#      launches changed (weight-streaming GEMM, sparse MQA, index scores, top-k); then stops;
#   3. otherwise (~4 min): the kernel checks on the GPU (Engram gate and rows, ordered SwiGLU, the collapse joined
#      with the RMSNorm among them), the engine's greedy tokens = the CPU engine's on tiny V4.1, no host
#      synchronisation in a decode forward or in the sampler (K1, T1: another -k and time limit); PROFILE=1 then
#      profiles a B = 1 step (benches/gpu/profile_step.py); TESTS_ONLY=2 stops here;
#   4. flash-slice-v41 decode at C = 2,048, fp8 records (~110 s each), interleaved: 1 PDL on, 2 off, 3 on at B = 1
#      and 64, then 4 B = 1 with the collapse and the RMSNorm in two launches (mhc.FUSED_NORM=0); RUNS="1 2"
#      runs only those.
# carry: ["python/v41/_native.abi3.so"].   run: [TESTS_ONLY=1|2] [RUNS="1 2"] bash benches/gpu/issue17_check.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/python:$PWD/tests:$PWD/benches/gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
rm -f python/v41/_cuda.so
timeout 100 python3 cuda/build.py > "$OUT/build.txt" 2>&1; tail -1 "$OUT/build.txt"
if [ "${TESTS_ONLY:-0}" = 1 ]; then
  PT="python3 -m pytest -q -p no:cacheprovider --durations=8"
  timeout 90 $PT tests/test_gpu_pdl.py > "$OUT/tests0.txt" 2>&1
  tail -8 "$OUT/tests0.txt"
  timeout 240 $PT tests/test_gpu_cuda.py tests/test_gpu_cuda_attention.py tests/test_gpu_cuda_topk.py \
    tests/test_gpu_cuda_indexer.py > "$OUT/tests2.txt" 2>&1
  tail -12 "$OUT/tests2.txt"
  exit 0
fi
# the kernel checks (Engram gate and rows, ordered SwiGLU, collapse + RMSNorm among them), the engine's greedy
# tokens = the CPU engine's on tiny V4.1 (eager and graph replays), no host synchronisation; ~4 min
timeout "${T1:-250}" python3 -m pytest -q -p no:cacheprovider --durations=8 tests/test_gpu_fast.py \
  -k "${K1:-triton_kernel_equals or (greedy and deepseek_v41) or host_synchronisation}" > "$OUT/tests1.txt" 2>&1
tail -12 "$OUT/tests1.txt"
if [ "${PROFILE:-0}" = 1 ]; then  # where a B = 1 step goes (torch.profiler over graph replays; ~100 s)
  timeout 150 python3 benches/gpu/profile_step.py --slice v41 --batch 1 --context 2048 --prefill 0 \
    --kv-cache-dtype fp8 --top 60 > "$OUT/profile_b1.txt" 2>&1
  grep -A12 "== decode" "$OUT/profile_b1.txt"
fi
[ "${TESTS_ONLY:-0}" = 2 ] && exit 0
i=0
for v in "pdl_on|1|1|1x2048,64x2048" "pdl_off|0|1|1x2048,64x2048" "pdl_on|1|1|1x2048,64x2048" "fused_off|1|0|1x2048"; do
  IFS='|' read -r name pdl fused cells <<< "$v"
  i=$((i + 1))
  [ -n "${RUNS:-}" ] && [[ ! " $RUNS " == *" $i "* ]] && continue
  timeout 135 python3 benches/gpu/flash_slice.py --slice v41 --cells "$cells" --prefill , --kv-cache-dtype fp8 \
    --set "v41.kernels.pdl.ENABLED=$pdl" --set "v41.kernels.mhc.FUSED_NORM=$fused" \
    --out "$OUT/fs${i}_$name" > "$OUT/fs${i}_$name.txt" 2>&1
  echo "$i $name:"; tail -3 "$OUT/fs${i}_$name.txt"
done
