"""The transformers model of flash_slice.py's same-call comparison (benches/gpu/flash_slice.py ``hf_from_v41``):
v41's weights exported by name into transformers' DeepseekV4ForCausalLM. Built in float32 from a float32 fast
model it must reproduce the oracle (docs/DESIGN.md §4: V4 = transformers), so the timed model is V4 itself; built in
bf16 it keeps in float32 what transformers' own bf16 loading keeps there."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from v41.models.fast import load_fast
from v41.models.reference import load
from v41.testing.tiny import make_tiny

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("this transformers has no DeepseekV4ForCausalLM", allow_module_level=True)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches" / "gpu"))
from flash_slice import hf_from_v41  # noqa: E402


def test_the_exported_transformers_model_reproduces_the_oracle(tmp_path):
    path = make_tiny(tmp_path / "m", "deepseek_v4")
    fast = load_fast(path, torch.float32, "cpu")
    core = SimpleNamespace(cfg=fast.cfg, executor=SimpleNamespace(runner=SimpleNamespace(model=fast)))
    ids = torch.randint(3, 1000, (1, 17), generator=torch.Generator().manual_seed(0))
    hf = hf_from_v41(path, core, torch.float32)
    with torch.no_grad():
        got, want = hf(input_ids=ids).logits[0].double(), load(path)(ids)[0].double()
    assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 1e-5
    hf = hf_from_v41(path, core)  # bf16, the timed build
    kept = [(n, t.dtype) for n, t in [*hf.named_parameters(), *hf.named_buffers()]
            if n.endswith(("sinks", "e_score_correction_bias", "input_layernorm.weight"))]
    assert kept and all(d == torch.float32 for _, d in kept), kept
    assert hf.model.layers[0].self_attn.q_a_proj.weight.dtype == torch.bfloat16
