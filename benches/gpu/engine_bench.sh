#!/usr/bin/env bash
# Engine benchmark on the GPU machine (device tool). Carry the abi3 wheel built here:
#   (cd /work/main && .venv/bin/maturin build --release -o .whl)   # .whl/ is git-ignored locally
#   run: bash benches/gpu/engine_bench.sh    carry: [".whl"]
# 1) correctness: the tiny V4.1 model on CUDA gives the CPU engine's greedy tokens;
# 2) throughput: nano-vllm-style offline workload on the v41-mid config (DESIGN.md §5), dummy weights.
set -euo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site V41_CACHE_DIR=/tmp/v41cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 - <<'PY' 2>&1 | tee "$OUT/correctness.txt"
import torch
from v41 import LLM, SamplingParams
from v41.testing.tiny import make_tiny
p = make_tiny("/tmp/tiny41", "deepseek_v41")
sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
prompts = [[0] + list(range(5, 5 + n)) for n in (3, 17, 40, 63)]
cpu = [o.outputs[0].token_ids for o in LLM(str(p), block_size=16).generate(prompts, sp, use_tqdm=False)]
gpu = [o.outputs[0].token_ids for o in LLM(str(p), block_size=16, device="cuda").generate(prompts, sp, use_tqdm=False)]
print("cuda greedy tokens equal cpu:", cpu == gpu)
PY
python3 - <<'PY'
from v41.testing.tiny import make_tiny
# v41-mid (DESIGN.md §5): 12 layers covering every role, hidden 2048, 64 heads x 512, window 128,
# 64 experts x 1024 top-6 + shared, index 32 x 128 top-512.
make_tiny("/tmp/mid41", "deepseek_v41", weights=False, hidden_size=2048, num_attention_heads=64, head_dim=512,
          qk_rope_head_dim=64, q_lora_rank=1024, o_lora_rank=1024, o_groups=8, moe_intermediate_size=1024,
          n_routed_experts=64, num_experts_per_tok=6, sliding_window=128, index_n_heads=32, index_head_dim=128,
          index_topk=512, candidate_topk_blocks=2048, candidate_block_size=8, engram_n_heads=8,
          engram_head_dim=256, engram_vocab_size=4001, dspark_markov_rank=256, dspark_n_routed_experts=16,
          dspark_num_experts_per_tok=3)
PY
for cfg in "64 100 256 100 256" "256 100 1024 100 1024"; do
  set -- $cfg
  timeout 280 python3 benches/engine_throughput.py --model /tmp/mid41 --load-format dummy --device cuda \
    --num-requests "$1" --min-input "$2" --max-input "$3" --min-output "$4" --max-output "$5" \
    --max-num-seqs 64 --max-num-batched-tokens 4096 2>&1 | tee -a "$OUT/throughput.txt" || echo "run timed out" | tee -a "$OUT/throughput.txt"
done
