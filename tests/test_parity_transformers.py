"""Parity of the V4 reference forward with transformers 5.23 ``DeepseekV4ForCausalLM`` (docs/numerics.md §4).

Like with like: v41's whole-sequence forward against transformers with ``use_cache=False``, float32, relative
L2 per position ≤ 1e-4, same tiny config and (dequantized) weights. Every config is checked for a tie at
the indexer's k-th place, which transformers would break by accident of tensor length.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")
DeepseekV4Config = transformers.DeepseekV4Config
DeepseekV4ForCausalLM = transformers.DeepseekV4ForCausalLM

from v41.checkpoint_names import bare_to_hf  # noqa: E402
from v41.models.reference import load  # noqa: E402
from v41.testing.tiny import make_tiny  # noqa: E402

TOL = 1e-4


def hf_model(ckpt, ref) -> torch.nn.Module:
    """transformers' model built from the same config.json and the reference's dequantized weights."""
    raw = json.loads((ckpt / "config.json").read_text())
    drop = ("architectures", "model_type", "compress_ratios", "num_hash_layers")
    kw = {k: v for k, v in raw.items() if k not in drop}
    # transformers' legacy `compress_ratios` only knows {0, 4, 128}: hand it the normalized fields.
    names = {"swa": "sliding_attention", "csa": "compressed_sparse_attention",
             "hca": "heavily_compressed_attention"}
    plan = ref.cfg.plan
    kw["layer_types"] = [names[p.attn_type] for p in plan]
    kw["compress_rates"] = {names[p.attn_type]: p.ratio for p in plan if p.ratio}
    kw["mlp_layer_types"] = ["hash_moe" if p.hash_moe else "moe" for p in plan]
    cfg = DeepseekV4Config(**kw)
    cfg._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(cfg).eval().float()
    sd = {}
    experts: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in ref.state_dict().items():
        parts = name.split(".")
        if ".ffn.experts." in name:
            layer, e, w = int(parts[1]), int(parts[4]), parts[5]
            experts.setdefault(layer, {}).setdefault(e, {})[w] = t
            continue
        sd[bare_to_hf(name)] = t
    for layer, per in experts.items():
        n = len(per)
        sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([per[e]["w1"], per[e]["w3"]]) for e in range(n)])
        sd[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([per[e]["w2"] for e in range(n)])
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if "rotary_emb" not in m]
    assert not missing and not unexpected, (missing, unexpected)
    return model


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


def kth_ties(ref, ids: torch.Tensor) -> list[float]:
    """Scores tied at any CSA indexer's k-th place for this prompt (docs/numerics.md §4)."""
    cfg = ref.cfg
    ties = []

    def hook(mod, args, out):
        scores = args[0]
        k = min(cfg.index_topk, scores.shape[1])
        for row in scores:
            finite = row[torch.isfinite(row)]
            if k < finite.numel():
                srt = torch.sort(finite, descending=True).values
                if srt[k - 1] == srt[k]:
                    ties.append(float(srt[k]))

    import v41.models.reference.compress_v4 as cv4

    orig = cv4.select_topk

    def spy(scores, k_max):
        hook(None, (scores,), None)
        return orig(scores, k_max)

    cv4.select_topk = spy
    try:
        ref(ids)
    finally:
        cv4.select_topk = orig
    return ties


def untied_prompt(ref, t: int, gen: torch.Generator) -> torch.Tensor:
    """A random prompt of length t whose indexer k-th places have no tie (asserted)."""
    for _ in range(20):
        ids = torch.randint(3, 1000, (1, t), generator=gen)
        if not kth_ties(ref, ids):
            return ids
    raise AssertionError(f"no prompt of length {t} without an indexer k-th place tie in 20 draws")


def random_overrides(seed: int) -> dict:
    rng = random.Random(seed)
    csa, hca = rng.choice([2, 4]), rng.choice([8, 16])
    n_layers = rng.choice([4, 5, 6])
    types = [0, 0] + [rng.choice([csa, hca]) for _ in range(n_layers - 2)]
    types[2] = csa
    types[-1] = hca
    return dict(
        num_hidden_layers=n_layers, compress_ratios=types + [0], num_hash_layers=rng.choice([1, 2, 3]),
        sliding_window=rng.choice([4, 8, 12]), index_topk=rng.choice([2, 3, 64]),
        num_experts_per_tok=rng.choice([1, 2, 3]), hidden_size=rng.choice([64, 96]),
        num_attention_heads=rng.choice([4, 8]), o_groups=rng.choice([2, 4]), index_n_heads=rng.choice([4, 8]),
    )


def check_parity(ckpt, lengths) -> None:
    ref = load(ckpt)
    hf = hf_model(ckpt, ref)
    gen = torch.Generator().manual_seed(1)
    for t in lengths:
        ids = untied_prompt(ref, t, gen)
        ours = ref(ids)[0]
        with torch.no_grad():
            theirs = hf(input_ids=ids, use_cache=False).logits[0].float()
        err = rel_l2(ours, theirs)
        assert err.max() <= TOL, f"T={t}: max rel L2 {err.max():.2e} at position {int(err.argmax())}"


def test_v4_parity_default_tiny_config_across_window_and_compression_boundaries(tmp_path):
    ckpt = make_tiny(tmp_path / "v4", "deepseek_v4")
    w, csa, hca = 8, 4, 8
    lengths = sorted({1, w - 1, w, w + 1, csa * 3 - 1, csa * 3, csa * 3 + 1, hca * 3 - 1, hca * 3,
                      hca * 3 + 1, 40})
    check_parity(ckpt, lengths)


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_v4_parity_random_configs(tmp_path, seed):
    ov = random_overrides(seed)
    ckpt = make_tiny(tmp_path / f"v4_{seed}", "deepseek_v4", seed=seed, **ov)
    w = ov["sliding_window"]
    ratios = sorted({r for r in ov["compress_ratios"] if r})
    lengths = {1, w - 1, w, w + 1, 37}
    for r in ratios:
        lengths |= {2 * r - 1, 2 * r, 2 * r + 1}
    check_parity(ckpt, sorted(x for x in lengths if x >= 1))


def test_v4_parity_covers_hash_and_topk_moe_and_every_layer_type(tmp_path):
    ckpt = make_tiny(tmp_path / "v4", "deepseek_v4")
    ref = load(ckpt)
    kinds = {p.attn_type for p in ref.cfg.plan}
    assert kinds == {"swa", "csa", "hca"}
    assert any(p.hash_moe for p in ref.cfg.plan) and not all(p.hash_moe for p in ref.cfg.plan)
