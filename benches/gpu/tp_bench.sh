#!/usr/bin/env bash
# Tensor-parallel figures on nvidia-h200-x2 (or x4 with WORLD=4), one device call. Build and carry here:
#   .venv/bin/maturin build --release -o .whl                      # abi3 wheel (.whl/ is git-ignored)
#   cargo bench -p v41-comm --no-run && cp "$(ls -t target/release/deps/allreduce-* | grep -v '\.d$' | head -1)" .whl/allreduce_bench
#   run: bash benches/gpu/tp_bench.sh        carry: [".whl"]
# 1) probe (GPUs, peer access, pinned registration, /dev/shm) + nvidia-smi topology;
# 2) all-reduce latency of [1, 8, 64, 512, 4096] x 5120 bf16 per backend (nccl, host, pcie-pull);
# 3) engine: TP=WORLD vs TP=1 greedy tokens per backend on the tiny V4.1 checkpoint and on v41-mid (dummy
#    weights), decode step time at batch 1 and 8;
# 4) the Rust host all-reduce bench (criterion) on this machine's CPUs.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; WORLD=${WORLD:-2}
R="$OUT/tp_results.jsonl"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
nvidia-smi topo -m | tee -a "$OUT/gpu.txt"
df -h /dev/shm | tee -a "$OUT/gpu.txt"
python3 benches/gpu/tp_bench.py probe | tee -a "$R"
python3 -c "import sys, torch; sys.path.insert(0, 'tests'); import test_peer_pull as t
[t.test_triton_kernels_equal_the_references(w, d) for w in (1, 2, 5, 8) for d in (torch.float32, torch.bfloat16)]
print('peer_pull Triton kernels == PyTorch reference (W = 1, 2, 5, 8; fp32, bf16)')" 2>&1 | tail -3 | tee -a "$OUT/gpu.txt"
timeout 120 python3 benches/gpu/tp_bench.py allreduce --world "$WORLD" 2>"$OUT/allreduce.log" | tee -a "$R"
python3 benches/gpu/make_models.py /tmp
timeout 120 python3 benches/gpu/tp_bench.py engine --model /tmp/tiny41 --tp "$WORLD" --block-size 16 \
  2>"$OUT/engine_tiny.log" | tee -a "$R"
timeout 180 python3 benches/gpu/tp_bench.py engine --model /tmp/mid41 --load-format dummy --tp "$WORLD" \
  --max-tokens 8 --steps 8 2>"$OUT/engine_mid.log" | tee -a "$R"
if [ -x .whl/allreduce_bench ] && [ -z "${SKIP_RUST_BENCH:-}" ]; then
  timeout 100 .whl/allreduce_bench --bench --warm-up-time 1 --measurement-time 2 2>&1 | grep -E "allreduce|memcpy|time:|thrpt:" | tee "$OUT/host_allreduce_bench.txt"
fi
grep -h -E "backend|Error|error" "$OUT"/*.log | sort | uniq -c | head -40
