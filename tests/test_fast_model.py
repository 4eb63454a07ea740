"""The fast model against the reference oracle beyond float32 (docs/numerics.md §4 "Compute dtypes of the fast path"):
bfloat16 within a stated bound, float64 to rounding, ``--quantization none`` equal to packed weights, and its
checkpoint reader's errors. (float32 chunked / batched equality with the oracle: ``test_step_models.py``.)

The bf16 bound is measured on "smooth" tiny configs, where routing and the indexer take every expert / entry: a
random tiny model with discrete top-k choices is chaotic (measured: 2^-9 relative noise on its embeddings alone
moves the float32 V4.1 logits by 0.32 relative L2), so its bf16 error says nothing about the kernels.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_helpers import BF16_BOUND, BF16_MARGIN, StepDriver
from v41.checkpoint import CheckpointError
from v41.models.engram_loader import engram_hasher
from v41.models.fast import load_fast
from v41.models.reference import load
from v41.testing.tiny import make_tiny



def smooth(tmp, arch):
    extra = {"candidate_topk_blocks": 64} if arch == "deepseek_v41" else {}
    return make_tiny(tmp, arch, num_experts_per_tok=8, index_topk=64, **extra)


def run(model, path, ids, chunk=41):
    drv = StepDriver(model, engram_hasher(model.cfg, path / "tokenizer.json"), 16)
    return torch.cat([drv.execute([(0, ids[a:a + chunk], a, ids[:a])]) for a in range(0, len(ids), chunk)])


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()


@pytest.mark.parametrize("arch", ["deepseek_v41", "deepseek_v4"])
def test_bf16_logits_stay_within_the_stated_bound_and_greedy_tokens_agree(tmp_path, arch):
    path = smooth(tmp_path / arch, arch)
    ids = torch.randint(3, 1000, (41,), generator=torch.Generator().manual_seed(2)).tolist()
    want = load(path)(torch.tensor([ids]))[0]
    got = run(load_fast(path, torch.bfloat16, "cpu"), path, ids, chunk=7)
    err = rel_l2(got, want)
    print(f"{arch}: bf16 fast vs float32 oracle, max relative L2 {err:.3g} (bound {BF16_BOUND})")
    assert err <= BF16_BOUND
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) / want.norm(dim=-1) > BF16_MARGIN
    assert clear.sum() >= len(ids) // 4, "too few clear greedy choices to compare"
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


@pytest.mark.parametrize("arch", ["deepseek_v41", "deepseek_v4"])
def test_float64_fast_model_equals_the_float64_oracle(tmp_path, arch):
    path = make_tiny(tmp_path / arch, arch)
    ids = torch.randint(3, 1000, (29,), generator=torch.Generator().manual_seed(4)).tolist()
    want = load(path, dtype=torch.float64)(torch.tensor([ids]))[0]
    assert rel_l2(run(load_fast(path, torch.float64, "cpu"), path, ids, chunk=5), want) <= 1e-12


@pytest.mark.parametrize("arch", ["deepseek_v41", "deepseek_v4"])
def test_quantization_none_equals_packed_weights(tmp_path, arch):
    path = make_tiny(tmp_path / arch, arch)
    ids = torch.randint(3, 1000, (23,), generator=torch.Generator().manual_seed(5)).tolist()
    packed = load_fast(path, torch.float32, "cpu")
    dense = load_fast(path, torch.float32, "cpu", quantization="none")
    assert packed.layers[0].attn.wq_a.fmt == "fp8" and dense.layers[0].attn.wq_a.fmt == "dense"
    assert packed.layers[0].ffn.w13.fmt == "mxfp4"
    assert rel_l2(run(packed, path, ids), run(dense, path, ids)) <= 1e-6


def _rewrite(src, dst, edit, holder="embed.weight"):
    """Copy checkpoint ``src`` to ``dst`` with ``edit(tensors, index, shard)`` applied to the shard of ``holder``."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    fname = index["weight_map"][holder]
    tensors = load_file(str(dst / fname))
    edit(tensors, index, fname)
    save_file(tensors, str(dst / fname), metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))


def test_fast_loader_names_missing_and_unexpected_tensors(tmp_path):
    path = make_tiny(tmp_path / "m", "deepseek_v41")

    def drop(t, index, fname):
        del t["norm.weight"]
        index["weight_map"].pop("norm.weight")

    _rewrite(path, tmp_path / "missing", drop, holder="norm.weight")
    with pytest.raises(CheckpointError, match="missing tensors.*norm.weight"):
        load_fast(tmp_path / "missing", torch.float32, "cpu")

    def add(t, index, fname):
        t["layers.0.attn.bogus.weight"] = torch.zeros(2, 2, dtype=torch.bfloat16)
        index["weight_map"]["layers.0.attn.bogus.weight"] = fname

    _rewrite(path, tmp_path / "extra", add)
    with pytest.raises(CheckpointError, match="unexpected tensors.*bogus"):
        load_fast(tmp_path / "extra", torch.float32, "cpu")


def test_fast_loader_refuses_bad_options(tmp_path):
    path = make_tiny(tmp_path / "m", "deepseek_v4")
    with pytest.raises(ValueError, match="quantization"):
        load_fast(path, torch.float32, "cpu", quantization="int4")
    with pytest.raises(ValueError, match="dtype"):
        load_fast(path, torch.int32, "cpu")
    with pytest.raises(FileNotFoundError):
        load_fast(tmp_path / "nowhere", torch.float32, "cpu")


def test_loaded_fast_model_registers_each_tensor_once(tmp_path):
    """Derived tensors (V4's pooled gate bias) are buffers of their own, not second registrations of a parameter:
    every name of ``named_parameters`` is a checkpoint tensor's (the transformers export of
    benches/gpu/flash_slice.py), and a move or cast of the model moves them too."""
    model = load_fast(make_tiny(tmp_path, "deepseek_v4"), torch.float32, "cpu")
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert len(names) == len(dict(model.named_parameters()))
    assert not any(n.endswith("pool_ape") for n in names)
    model.to(torch.float64)  # the derived bias follows a move or cast of the model
    pooled = [m for m in model.modules() if getattr(m, "pool_ape", None) is not None]
    assert pooled and all(m.pool_ape.dtype == torch.float64 for m in pooled)
