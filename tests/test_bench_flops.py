"""The prefill roofline's FLOP count (benches/gpu/layer_times.py ``gemm_flops_per_token``, used by
flash_slice.py): each routed expert a token takes adds its two GEMMs, the LM head and the vocabulary add nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from v41.models.fast import load_fast
from v41.testing.tiny import make_tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches" / "gpu"))
from layer_times import gemm_flops_per_token  # noqa: E402


def test_flops_grow_by_one_experts_gemms_per_routed_expert_and_ignore_the_head(tmp_path):
    model = load_fast(make_tiny(tmp_path / "m", "deepseek_v41"), torch.float32, "cpu")
    k = model.cfg.num_experts_per_tok
    experts = [m for n, m in model.named_modules() if n.endswith(".ffn.w13") or n.endswith(".ffn.w2")]
    per_expert = sum(2 * m.shape[1] * m.shape[2] for m in experts)  # one expert of every MoE layer
    assert per_expert > 0
    assert gemm_flops_per_token(model, k + 1) - gemm_flops_per_token(model, k) == per_expert
    shared = sum(2 * m.shape[0] * m.shape[1] for n, m in model.named_modules() if n.endswith("shared_w13"))
    assert shared > 0 and gemm_flops_per_token(model, 0) > shared  # dense projections and the shared expert
    bigger = load_fast(make_tiny(tmp_path / "v", "deepseek_v41", vocab_size=2 * model.cfg.vocab_size),
                       torch.float32, "cpu")
    assert gemm_flops_per_token(bigger, k) == gemm_flops_per_token(model, k)
