"""Write the GPU scripts' checkpoints: ``tiny41`` (the tiny V4.1 checkpoint, real weights) and ``mid41``
(v41-mid, docs/benchmarking.md "Workloads": 12 layers covering every role, hidden 2048, 64 heads × 512, o_groups 8, window 128,
64 experts × 1024 top-6 + shared, index 32 × 128 top-512; config only, for ``--load-format dummy``).

Usage: ``python3 benches/gpu/make_models.py [DIR]`` (default /tmp) → DIR/tiny41, DIR/mid41.
"""

from __future__ import annotations

import sys
from pathlib import Path

from v41.testing.tiny import make_tiny

MID41 = dict(hidden_size=2048, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024,
             o_lora_rank=1024, o_groups=8, moe_intermediate_size=1024, n_routed_experts=64, num_experts_per_tok=6,
             sliding_window=128, index_n_heads=32, index_head_dim=128, index_topk=512, candidate_topk_blocks=2048,
             candidate_block_size=8, engram_n_heads=8, engram_head_dim=256, engram_vocab_size=4001,
             dspark_markov_rank=256, dspark_n_routed_experts=16, dspark_num_experts_per_tok=3)

if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp")
    make_tiny(root / "tiny41", "deepseek_v41")
    make_tiny(root / "mid41", "deepseek_v41", weights=False, **MID41)
