#!/usr/bin/env bash
# Engine benchmark on the GPU machine (device tool). Carry the abi3 wheel built here:
#   (.venv/bin/maturin build --release -o .whl, from the repository root)   # .whl/ is git-ignored locally
#   run: bash benches/gpu/engine_bench.sh    carry: [".whl"]
# 1) correctness: the tiny V4.1 model on CUDA gives the CPU engine's greedy tokens;
# 2) throughput: nano-vllm-style offline workload on the v41-mid config (docs/benchmarking.md "Workloads"), dummy weights.
set -euo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 benches/gpu/make_models.py /tmp
python3 - <<'PY' 2>&1 | tee "$OUT/correctness.txt"
import torch
from v41 import LLM, SamplingParams
p = "/tmp/tiny41"
sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
prompts = [[0] + list(range(5, 5 + n)) for n in (3, 17, 40, 63)]
cpu = [o.outputs[0].token_ids for o in LLM(str(p), block_size=16).generate(prompts, sp, use_tqdm=False)]
gpu = [o.outputs[0].token_ids for o in LLM(str(p), block_size=16, device="cuda").generate(prompts, sp, use_tqdm=False)]
print("cuda greedy tokens equal cpu:", cpu == gpu)
PY
for cfg in "64 100 256 100 256" "256 100 1024 100 1024"; do
  set -- $cfg
  timeout 280 python3 benches/engine_throughput.py --model /tmp/mid41 --load-format dummy --device cuda \
    --num-requests "$1" --min-input "$2" --max-input "$3" --min-output "$4" --max-output "$5" \
    --max-num-seqs 64 --max-num-batched-tokens 4096 2>&1 | tee -a "$OUT/throughput.txt" || echo "run timed out" | tee -a "$OUT/throughput.txt"
done
