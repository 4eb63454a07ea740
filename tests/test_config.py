"""Tests for v41.config (docs/model.md §1.1 V4.1 config, §1.2 V4 config, §1.4 layer plan, §2 YaRN).

The expected layer plan is written out from the §1.4 table, not derived with the code's own rule; the YaRN
frequencies are recomputed here from the §2 formula.
"""

from __future__ import annotations

import copy
import json
import math

import pytest

from v41.config import ConfigError, LayerPlan, ModelConfig, RopeScaling, load_config, yarn_inv_freq, yarn_low_high

# --------------------------------------------------------------------------------------------------
# V4.1-Flash config.json (§1.1), nested like the real checkpoint
# --------------------------------------------------------------------------------------------------

V41_FLASH_RATIOS = [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]

V41_FLASH_TEXT = dict(
    model_type="deepseek_v41_text",
    vocab_size=129280,
    hidden_size=5120,
    moe_intermediate_size=2304,
    num_hidden_layers=40,
    num_attention_heads=64,
    num_key_value_heads=1,
    head_dim=512,
    qk_rope_head_dim=64,
    q_lora_rank=1280,
    o_lora_rank=1024,
    o_groups=8,
    hidden_act="silu",
    swiglu_limit=10.0,
    rms_norm_eps=1e-20,
    max_position_embeddings=1048576,
    rope_theta=10000,
    rope_scaling=dict(rope_type="yarn", factor=16, beta_fast=32, beta_slow=1,
                      original_max_position_embeddings=65536),
    compress_rope_theta=160000,
    n_routed_experts=384,
    n_shared_experts=1,
    num_experts_per_tok=6,
    scoring_func="sqrtsoftplus",
    topk_method="noaux_tc",
    norm_topk_prob=True,
    routed_scaling_factor=1.5,
    sliding_window=128,
    compress_ratios=V41_FLASH_RATIOS,
    kv_source_layer_ids=[2, 8, 14, 20],
    index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36],
    index_n_heads=32,
    index_head_dim=128,
    index_topk=512,
    candidate_source_layer_id=20,
    candidate_topk_blocks=2048,
    candidate_block_size=8,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    engram_layer_ids=[1, 14],
    engram_num_embeddings=[384006168, 384016682],
    engram_max_ngram_size=4,
    engram_vocab_size=16000000,
    engram_n_heads=8,
    engram_head_dim=256,
    engram_pad_token_id=2,
    engram_compressed_vocab_size=99092,
    num_nextn_predict_layers=3,
    dspark_block_size=5,
    dspark_noise_token_id=128799,
    dspark_target_layer_ids=[37, 38, 39],
    dspark_markov_rank=256,
    dspark_n_routed_experts=128,
    dspark_num_experts_per_tok=3,
    tie_word_embeddings=False,
)


def v41_flash() -> dict:
    return dict(
        architectures=["DeepseekV41ForCausalLM"],
        model_type="deepseek_v41",
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        image_token_id=129264,
        dtype="bfloat16",
        quantization_config=dict(quant_method="fp8", activation_scheme="dynamic", weight_block_size=[32, 32],
                                 scale_fmt="ue8m0", expert_dtype="fp4"),
        text_config=copy.deepcopy(V41_FLASH_TEXT),
        vision_config=dict(model_type="deepseek_v41_vision", num_hidden_layers=32, hidden_size=1024,
                           num_attention_heads=16, intermediate_size=2816, patch_size=14, rope_theta=10000,
                           downsample_ratio=3, max_image_tokens=1024, min_pixels=295936, max_wh_ratio=None),
    )


# HF name -> official reference name (§1.1 "reference name in parentheses").
REFERENCE_NAMES = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "moe_intermediate_size": "moe_inter_dim",
    "num_experts_per_tok": "n_activated_experts",
    "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale",
    "qk_rope_head_dim": "rope_head_dim",
    "rms_norm_eps": "norm_eps",
    "sliding_window": "window_size",
    "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers",
    "candidate_source_layer_id": "candidate_source_layer",
    "engram_pad_token_id": "engram_pad_id",
    "num_nextn_predict_layers": "n_mtp_layers",
    "dspark_num_experts_per_tok": "dspark_n_activated_experts",
}


def v41_flash_reference_spelling() -> dict:
    """The same config with every field the official reference names differently renamed, including the
    flat YaRN fields (``rope_factor``, ``original_seq_len``, ``beta_fast``, ``beta_slow``)."""
    raw = v41_flash()
    text = raw["text_config"]
    for hf, ref in REFERENCE_NAMES.items():
        text[ref] = text.pop(hf)
    rs = text.pop("rope_scaling")
    text.update(rope_factor=rs["factor"], original_seq_len=rs["original_max_position_embeddings"],
                beta_fast=rs["beta_fast"], beta_slow=rs["beta_slow"])
    return raw


# --------------------------------------------------------------------------------------------------
# §1.4 table, written out row by row
# --------------------------------------------------------------------------------------------------

SRC = {"owns_compressor", "is_index_source", "owns_index_keys"}  # kv source (+ its index keys)
IDX_ONLY = {"is_index_source", "uses_candidate_filter"}  # "re-index" layers 24, 28, 32, 36


def _flash_plan_table() -> dict[int, tuple[int, int | None, int | None, set[str]]]:
    """layer -> (ratio, kv_src, idx_src, roles) from the §1.4 table."""
    t: dict[int, tuple[int, int | None, int | None, set[str]]] = {}
    t[0] = (0, None, None, set())
    t[1] = (0, None, None, {"engram"})
    t[2] = (2, 2, 2, set(SRC))
    for layer in range(3, 8):
        t[layer] = (2, 2, 2, set())
    t[8] = (2, 8, 8, set(SRC))
    for layer in range(9, 14):
        t[layer] = (2, 8, 8, set())
    t[14] = (2, 14, 14, SRC | {"engram"})
    for layer in range(15, 20):
        t[layer] = (2, 14, 14, set())
    t[20] = (1, 20, 20, SRC | {"is_candidate_source"})
    for layer in range(21, 24):
        t[layer] = (1, 20, 20, set())
    for src in (24, 28, 32, 36):
        t[src] = (1, 20, src, set(IDX_ONLY))
        for layer in range(src + 1, src + 4):
            t[layer] = (1, 20, src, set())
    for layer in (37, 38, 39):
        t[layer][3].add("dspark_target")
    return t


ROLE_FIELDS = ("owns_compressor", "is_index_source", "owns_index_keys", "is_candidate_source",
               "uses_candidate_filter", "engram", "dspark_target", "hash_moe")


def _roles(p: LayerPlan) -> set[str]:
    return {f for f in ROLE_FIELDS if getattr(p, f)}


# --------------------------------------------------------------------------------------------------
# V4.1
# --------------------------------------------------------------------------------------------------


def test_v41_flash_config_parses_every_field():
    cfg = ModelConfig.from_dict(v41_flash())
    assert cfg.arch == "deepseek_v41" and cfg.is_v41
    assert (cfg.vocab_size, cfg.hidden_size, cfg.moe_intermediate_size) == (129280, 5120, 2304)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim) == (40, 64, 512, 64)
    assert cfg.nope_head_dim == 448
    assert (cfg.q_lora_rank, cfg.o_lora_rank, cfg.o_groups) == (1280, 1024, 8)
    assert (cfg.n_routed_experts, cfg.n_shared_experts, cfg.num_experts_per_tok) == (384, 1, 6)
    assert cfg.scoring_func == "sqrtsoftplus" and cfg.norm_topk_prob is True
    assert cfg.routed_scaling_factor == 1.5 and cfg.swiglu_limit == 10.0 and cfg.gate_temp == 1.0
    assert cfg.rms_norm_eps == 1e-20
    assert cfg.max_position_embeddings == 1048576
    assert cfg.rope_theta == 10000 and cfg.compress_rope_theta == 160000
    assert cfg.rope_scaling == RopeScaling(factor=16, beta_fast=32, beta_slow=1,
                                           original_max_position_embeddings=65536)
    assert cfg.sliding_window == 128
    assert len(cfg.compress_ratios) == 43 and cfg.compress_ratios == tuple(V41_FLASH_RATIOS)
    assert cfg.compress_ratios[40:] == (0, 0, 0)  # DSpark stages are SWA only
    assert cfg.kv_source_layer_ids == (2, 8, 14, 20)
    assert cfg.index_source_layer_ids == (2, 8, 14, 20, 24, 28, 32, 36)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (32, 128, 512)
    assert (cfg.candidate_source_layer_id, cfg.candidate_topk_blocks, cfg.candidate_block_size) == (20, 2048, 8)
    assert (cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps) == (4, 20, 1e-6)
    assert cfg.engram_layer_ids == (1, 14)
    assert cfg.engram_num_embeddings == (384006168, 384016682)
    assert (cfg.engram_max_ngram_size, cfg.engram_vocab_size, cfg.engram_n_heads, cfg.engram_head_dim) == \
        (4, 16000000, 8, 256)
    assert cfg.engram_pad_token_id == 2 and cfg.engram_compressed_vocab_size == 99092
    assert cfg.num_nextn_predict_layers == 3 and cfg.has_dspark
    assert (cfg.dspark_block_size, cfg.dspark_noise_token_id, cfg.dspark_markov_rank) == (5, 128799, 256)
    assert cfg.dspark_target_layer_ids == (37, 38, 39)
    assert (cfg.dspark_n_routed_experts, cfg.dspark_num_experts_per_tok) == (128, 3)
    assert cfg.weight_block_size == (32, 32) and cfg.expert_dtype == "fp4"
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id, cfg.image_token_id) == (0, (1,), 2, 129264)
    assert cfg.num_hash_layers == 0


def test_v41_flash_plan_equals_section_1_4_table():
    cfg = ModelConfig.from_dict(v41_flash())
    table = _flash_plan_table()
    assert len(cfg.plan) == 40 and sorted(table) == list(range(40))
    for p in cfg.plan:
        ratio, kv_src, idx_src, roles = table[p.layer_id]
        got = (p.ratio, p.attn_type, p.kv_src, p.idx_src, _roles(p))
        want = (ratio, "csa2" if ratio else "swa", kv_src, idx_src, roles)
        assert got == want, f"layer {p.layer_id}: got {got}, want {want}"


def test_v41_flash_candidate_filter_only_on_24_28_32_36():
    cfg = ModelConfig.from_dict(v41_flash())
    assert [p.layer_id for p in cfg.plan if p.uses_candidate_filter] == [24, 28, 32, 36]
    assert [p.layer_id for p in cfg.plan if p.is_candidate_source] == [20]
    assert [p.layer_id for p in cfg.plan if p.engram] == [1, 14]
    assert [p.layer_id for p in cfg.plan if p.dspark_target] == [37, 38, 39]


def test_v41_layer_rope_uses_yarn_only_on_compressed_layers():
    cfg = ModelConfig.from_dict(v41_flash())
    assert cfg.layer_rope(0) == (10000, None)
    assert cfg.layer_rope(2) == (160000, cfg.rope_scaling) and cfg.rope_scaling is not None


def test_v41_reference_spelling_gives_equal_config():
    hf = ModelConfig.from_dict(v41_flash())
    ref = ModelConfig.from_dict(v41_flash_reference_spelling())
    assert ref == hf
    assert ref.plan == hf.plan


def test_v41_flat_text_config_equals_nested():
    raw = v41_flash()
    text = raw.pop("text_config")
    flat = {**raw, **{k: v for k, v in text.items() if k != "model_type"}}
    assert ModelConfig.from_dict(flat) == ModelConfig.from_dict(v41_flash())


@pytest.mark.parametrize("key", ["rope_type", "type"])
def test_rope_scaling_accepts_rope_type_and_type(key):
    raw = v41_flash()
    rs = raw["text_config"]["rope_scaling"]
    rs[key] = rs.pop("rope_type")
    cfg = ModelConfig.from_dict(raw)
    assert cfg.rope_scaling == RopeScaling(16.0, 32.0, 1.0, 65536)


def test_load_config_reads_dir_and_generation_eos(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(v41_flash()))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 128803]}))
    cfg = load_config(tmp_path)
    assert cfg.eos_token_ids == (1, 128803)
    assert cfg == load_config(tmp_path / "config.json")


# --------------------------------------------------------------------------------------------------
# V4 (§1.2): checkpoint spelling and the transformers-normalized spelling
# --------------------------------------------------------------------------------------------------

V4_FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4, 0]  # 44 entries, last = MTP


def v4_flash() -> dict:
    return dict(
        architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4",
        vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43,
        num_attention_heads=64, num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024,
        o_lora_rank=1024, o_groups=8, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=6,
        num_hash_layers=3, scoring_func="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True,
        routed_scaling_factor=1.5, swiglu_limit=10.0, rms_norm_eps=1e-6, hc_mult=4, hc_sinkhorn_iters=20,
        hc_eps=1e-6, sliding_window=128, rope_theta=10000, compress_rope_theta=160000,
        rope_scaling=dict(type="yarn", factor=16, beta_fast=32, beta_slow=1, original_max_position_embeddings=65536),
        index_n_heads=64, index_head_dim=128, index_topk=512, num_nextn_predict_layers=1,
        max_position_embeddings=1048576, bos_token_id=0, eos_token_id=1, expert_dtype="fp4",
        quantization_config=dict(quant_method="fp8", fmt="e4m3", scale_fmt="ue8m0", activation_scheme="dynamic",
                                 weight_block_size=[128, 128]),
        compress_ratios=V4_FLASH_RATIOS,
    )


def v4_flash_hf_normalized() -> dict:
    """transformers 5.23 normalization (§1.2): no compress_ratios / num_hash_layers / qk_rope_head_dim /
    rope_scaling / top-level expert_dtype."""
    raw = v4_flash()
    for k in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_scaling", "expert_dtype"):
        raw.pop(k)
    names = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    raw["layer_types"] = [names[r] for r in V4_FLASH_RATIOS[:43]]
    raw["mlp_layer_types"] = ["hash_moe"] * 3 + ["moe"] * 40
    raw["compress_rates"] = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    raw["partial_rotary_factor"] = 64 / 512
    raw["rope_parameters"] = {
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125},
        "compress": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536, "rope_theta": 160000.0,
                     "partial_rotary_factor": 0.125, "attention_factor": 1.0},
    }
    raw["rope_theta"] = 10000.0
    raw.pop("compress_rope_theta")
    raw["quantization_config"] = {**raw["quantization_config"], "expert_dtype": "fp4"}
    return raw


def _v4_expected_plan() -> list[tuple[int, str, bool]]:
    """(ratio, attn_type, hash_moe) per layer from §1.2: layers 0,1 SWA; even 2..42 CSA ratio 4; odd 3..41
    HCA ratio 128; layers 0-2 hash-routed."""
    out = []
    for i in range(43):
        if i < 2:
            r, kind = 0, "swa"
        elif i % 2 == 0:
            r, kind = 4, "csa"
        else:
            r, kind = 128, "hca"
        out.append((r, kind, i < 3))
    return out


def test_v4_flash_config_parses_with_expected_plan():
    cfg = ModelConfig.from_dict(v4_flash())
    assert not cfg.is_v41 and cfg.arch == "deepseek_v4"
    assert len(cfg.compress_ratios) == 44 and cfg.num_hash_layers == 3
    assert cfg.weight_block_size == (128, 128) and cfg.rms_norm_eps == 1e-6
    assert cfg.rope_scaling == RopeScaling(16.0, 32.0, 1.0, 65536)
    assert not cfg.has_dspark
    got = [(p.ratio, p.attn_type, p.hash_moe) for p in cfg.plan]
    assert got == _v4_expected_plan()
    for p in cfg.plan:  # every compressed V4 layer owns its compressor; CSA layers own an indexer
        assert p.owns_compressor == (p.ratio > 0)
        assert p.is_index_source == (p.attn_type == "csa")
        assert p.kv_src == (p.layer_id if p.ratio else None)


def test_v4_hf_normalized_spelling_equals_checkpoint_spelling():
    a = ModelConfig.from_dict(v4_flash())
    b = ModelConfig.from_dict(v4_flash_hf_normalized())
    assert b == a
    assert b.plan == a.plan


def test_v4_transformers_to_dict_parses_to_same_plan():
    transformers = pytest.importorskip("transformers")
    raw = v4_flash()
    hf = transformers.DeepseekV4Config(**{k: v for k, v in raw.items() if k != "architectures"}).to_dict()
    hf.pop("qk_rope_head_dim", None)  # a runtime attribute; the normalized form carries partial_rotary_factor
    cfg = ModelConfig.from_dict(hf)
    ref = ModelConfig.from_dict(raw)
    assert cfg.plan == ref.plan
    assert cfg.rope_scaling == ref.rope_scaling and cfg.qk_rope_head_dim == 64
    assert (cfg.rope_theta, cfg.compress_rope_theta) == (10000, 160000)


# --------------------------------------------------------------------------------------------------
# consistency rules: one test per rule, the error names the field
# --------------------------------------------------------------------------------------------------


def _v41_with(**text_changes) -> dict:
    raw = v41_flash()
    raw["text_config"].update(text_changes)
    return raw


def test_kv_source_not_an_index_source_names_index_source_layer_ids():
    raw = _v41_with(index_source_layer_ids=[2, 14, 20, 24, 28, 32, 36])  # 8 missing
    with pytest.raises(ConfigError, match=r"^index_source_layer_ids:"):
        ModelConfig.from_dict(raw)


def test_candidate_not_a_kv_source_names_candidate_source_layer_id():
    raw = _v41_with(candidate_source_layer_id=24)  # an index-only source
    with pytest.raises(ConfigError, match=r"^candidate_source_layer_id:.*24"):
        ModelConfig.from_dict(raw)


def test_consumer_ratio_differs_from_its_source_names_compress_ratios():
    ratios = list(V41_FLASH_RATIOS)
    ratios[19] = 1  # reads kv source 14, which has ratio 2
    with pytest.raises(ConfigError, match=r"^compress_ratios:.*layer 19.*14"):
        ModelConfig.from_dict(_v41_with(compress_ratios=ratios))


def test_compressed_layer_before_any_kv_source_names_kv_source_layer_ids():
    ratios = list(V41_FLASH_RATIOS)
    ratios[1] = 2  # layer 1 reads a compressed cache, but the first kv source is layer 2
    with pytest.raises(ConfigError, match=r"^kv_source_layer_ids:.*layer 1"):
        ModelConfig.from_dict(_v41_with(compress_ratios=ratios))


def test_ratio_3_in_v41_names_compress_ratios():
    ratios = list(V41_FLASH_RATIOS)
    ratios[5] = 3
    with pytest.raises(ConfigError, match=r"^compress_ratios:.*layer 5.*3"):
        ModelConfig.from_dict(_v41_with(compress_ratios=ratios))


def test_compressed_dspark_stage_names_compress_ratios():
    ratios = list(V41_FLASH_RATIOS)
    ratios[41] = 2  # the second DSpark stage (layers 40..42 follow the 40 backbone layers)
    with pytest.raises(ConfigError, match=r"^compress_ratios:.*DSpark.*\[0, 2, 0\]"):
        ModelConfig.from_dict(_v41_with(compress_ratios=ratios))


def test_o_groups_not_dividing_heads_names_o_groups():
    with pytest.raises(ConfigError, match=r"^o_groups:"):
        ModelConfig.from_dict(_v41_with(o_groups=7))


@pytest.mark.parametrize("name", ["hidden_size", "compress_ratios", "num_hidden_layers"])
def test_missing_required_field_is_named(name):
    raw = v41_flash()
    del raw["text_config"][name]
    with pytest.raises(ConfigError, match=rf"^{name}:.*missing"):
        ModelConfig.from_dict(raw)


def test_unknown_model_type_names_model_type():
    raw = v41_flash()
    raw["model_type"] = "deepseek_v3"
    with pytest.raises(ConfigError, match=r"^model_type:.*deepseek_v3"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("key", ["rope_type", "type"])
def test_non_yarn_rope_type_names_rope_scaling(key):
    raw = v41_flash()
    raw["text_config"]["rope_scaling"] = {key: "linear", "factor": 16}
    with pytest.raises(ConfigError, match=r"^rope_scaling\.rope_type:.*linear"):
        ModelConfig.from_dict(raw)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# --------------------------------------------------------------------------------------------------
# YaRN (§2)
# --------------------------------------------------------------------------------------------------

FLASH_YARN = RopeScaling(factor=16, beta_fast=32, beta_slow=1, original_max_position_embeddings=65536)


def test_yarn_low_high_is_15_25_at_flash_dims():
    assert yarn_low_high(64, 160000, FLASH_YARN) == (15, 25)


def _independent_inv_freq(dim: int, base: float, factor: float, beta_fast: float, beta_slow: float,
                          orig: int) -> list[float]:
    """§2: f_i = base^(-2i/dim); corr(r) = dim·ln(orig/(2πr)) / (2·ln base); low = floor(corr(beta_fast)),
    high = ceil(corr(beta_slow)); ramp_i = clamp((i-low)/(high-low), 0, 1); f' = f/factor·ramp + f·(1-ramp)."""
    def corr(r: float) -> float:
        return dim * math.log(orig / (2 * math.pi * r)) / (2 * math.log(base))

    low, high = math.floor(corr(beta_fast)), math.ceil(corr(beta_slow))
    out = []
    for i in range(dim // 2):
        f = 1.0 / base ** (2 * i / dim)
        ramp = min(1.0, max(0.0, (i - low) / (high - low)))
        out.append(f / factor * ramp + f * (1 - ramp))
    return out


def test_yarn_inv_freq_matches_independent_formula():
    got = yarn_inv_freq(64, 160000, FLASH_YARN)
    want = _independent_inv_freq(64, 160000, 16, 32, 1, 65536)
    assert len(got) == 32
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == pytest.approx(w, rel=1e-12), i
    # below `low` the frequency is untouched, from `high` on it is divided by the factor
    assert got[15] == pytest.approx(160000 ** (-30 / 64), rel=1e-12)
    assert got[25] == pytest.approx(160000 ** (-50 / 64) / 16, rel=1e-12)


def test_yarn_inv_freq_without_scaling_is_plain_rope():
    got = yarn_inv_freq(64, 10000, None)
    assert got == pytest.approx([10000 ** (-2 * i / 64) for i in range(32)], rel=1e-12)


# --------------------------------------------------------------------------------------------------
# typed field reads: wrong JSON types are ConfigErrors naming the field, never truncated or coerced
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,value", [
    ("hidden_size", "abc"),
    ("hidden_size", 64.5),  # non-integral: rejected, not truncated to 64
    ("hidden_size", "5120"),
    ("hidden_size", True),
    ("num_hidden_layers", [40]),
    ("kv_source_layer_ids", 2),  # not a list
    ("kv_source_layer_ids", [2, "8", 14, 20]),
    ("compress_ratios", "0,0,2"),
    ("compress_ratios", V41_FLASH_RATIOS[:-1] + [0.5]),
    ("rms_norm_eps", "1e-20"),
    ("rms_norm_eps", float("nan")),
    ("norm_topk_prob", "false"),
    ("scoring_func", 3),
    ("index_topk", "512"),
    ("engram_num_embeddings", 384006168),
    ("candidate_source_layer_id", 20.5),
])
def test_wrong_field_type_names_the_field(name, value):
    with pytest.raises(ConfigError, match=rf"^{name}(\[\d+\])?:"):
        ModelConfig.from_dict(_v41_with(**{name: value}))


@pytest.mark.parametrize("value", ["x", ["1", 2], [1.5], {"id": 1}, True])
def test_wrong_eos_token_id_type_names_eos_token_id(value):
    raw = v41_flash()
    raw["eos_token_id"] = value
    with pytest.raises(ConfigError, match=r"^eos_token_id(\[\d+\])?:"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("block", [[32], 32, [32, 32, 32], [32, "32"], [0, 32], [32.5, 32]])
def test_bad_weight_block_size_names_weight_block_size(block):
    raw = v41_flash()
    raw["quantization_config"]["weight_block_size"] = block
    with pytest.raises(ConfigError, match=r"^weight_block_size(\[\d+\])?:"):
        ModelConfig.from_dict(raw)


def test_integral_floats_are_accepted_as_integers():
    cfg = ModelConfig.from_dict(_v41_with(hidden_size=5120.0, kv_source_layer_ids=[2.0, 8, 14, 20]))
    assert cfg.hidden_size == 5120 and type(cfg.hidden_size) is int
    assert cfg.kv_source_layer_ids == (2, 8, 14, 20) and all(type(i) is int for i in cfg.kv_source_layer_ids)
    assert cfg == ModelConfig.from_dict(v41_flash())


def test_wrong_type_under_reference_spelling_names_field_and_spelling():
    raw = v41_flash_reference_spelling()
    raw["text_config"]["dim"] = "abc"
    with pytest.raises(ConfigError, match=r"^hidden_size:.*'abc'.*'dim'"):
        ModelConfig.from_dict(raw)


def test_bad_rope_scaling_field_type_is_named():
    raw = v41_flash()
    raw["text_config"]["rope_scaling"]["factor"] = "16"
    with pytest.raises(ConfigError, match=r"^rope_scaling\.factor:"):
        ModelConfig.from_dict(raw)
    raw["text_config"]["rope_scaling"]["factor"] = 16
    raw["text_config"]["rope_scaling"]["original_max_position_embeddings"] = 65536.5
    with pytest.raises(ConfigError, match=r"^rope_scaling\.original_max_position_embeddings:"):
        ModelConfig.from_dict(raw)


def test_non_object_config_and_text_config_are_config_errors():
    with pytest.raises(ConfigError, match=r"^config:"):
        ModelConfig.from_dict([1, 2])
    raw = v41_flash()
    raw["text_config"] = "nope"
    with pytest.raises(ConfigError, match=r"^text_config:"):
        ModelConfig.from_dict(raw)


# --------------------------------------------------------------------------------------------------
# value checks added with the typed reads
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("changes,name", [
    (dict(head_dim=511), "head_dim"),  # odd
    (dict(head_dim=32), "qk_rope_head_dim"),  # < qk_rope_head_dim=64
    (dict(index_n_heads=0), "index_n_heads"),
    (dict(index_head_dim=0), "index_head_dim"),
    (dict(num_key_value_heads=8), "num_key_value_heads"),
    (dict(bos_token_id=129280), "bos_token_id"),
    (dict(bos_token_id=-1), "bos_token_id"),
    (dict(eos_token_id=[1, 129280]), "eos_token_id"),
    (dict(pad_token_id=200000), "pad_token_id"),
    (dict(engram_pad_token_id=129280), "engram_pad_token_id"),
    (dict(dspark_noise_token_id=129280), "dspark_noise_token_id"),
    (dict(num_nextn_predict_layers=-1), "num_nextn_predict_layers"),
])
def test_out_of_range_values_name_the_field(changes, name):
    with pytest.raises(ConfigError, match=rf"^{name}:"):
        ModelConfig.from_dict(_v41_with(**changes))


def test_num_key_value_heads_1_or_absent_is_accepted():
    raw = v41_flash()
    del raw["text_config"]["num_key_value_heads"]
    assert ModelConfig.from_dict(raw) == ModelConfig.from_dict(v41_flash())


@pytest.mark.parametrize("dtype", ["int4", "FP4", "mxfp4"])
def test_unknown_expert_dtype_names_expert_dtype(dtype):
    raw = v41_flash()
    raw["quantization_config"]["expert_dtype"] = dtype
    with pytest.raises(ConfigError, match=r"^expert_dtype:"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("dtype", ["fp4", "fp8", "bf16"])
def test_known_expert_dtypes_are_accepted(dtype):
    raw = v41_flash()
    raw["quantization_config"]["expert_dtype"] = dtype
    assert ModelConfig.from_dict(raw).expert_dtype == dtype


def test_candidate_filter_must_leave_index_topk_positions():
    """§3.7: kept blocks × block size, with the pinned newest block counted as one entry, must reach index_topk
    (Flash: 2048 × 8 - 7 >= 512). At block 8 and top-512: 64 blocks give 505 (rejected), 65 give 513."""
    with pytest.raises(ConfigError, match=r"^candidate_topk_blocks:.*505.*512"):
        ModelConfig.from_dict(_v41_with(candidate_topk_blocks=64))
    assert ModelConfig.from_dict(_v41_with(candidate_topk_blocks=65)).candidate_topk_blocks == 65
    # without a candidate source nothing is filtered: no constraint
    cfg = ModelConfig.from_dict(_v41_with(candidate_source_layer_id=-1, candidate_topk_blocks=1))
    assert not any(p.uses_candidate_filter for p in cfg.plan)


# --------------------------------------------------------------------------------------------------
# V4 layer types: kept from HF layer_types, derived from compress_ratios otherwise
# --------------------------------------------------------------------------------------------------


def test_v4_hca_only_layer_types_at_rate_16_plan_as_hca():
    raw = v4_flash_hf_normalized()
    raw["layer_types"] = ["sliding_attention"] * 2 + ["heavily_compressed_attention"] * 41
    raw["compress_rates"] = {"heavily_compressed_attention": 16}
    cfg = ModelConfig.from_dict(raw)
    assert cfg.layer_types == ("swa", "swa") + ("hca",) * 41
    assert [(p.ratio, p.attn_type) for p in cfg.plan] == [(0, "swa")] * 2 + [(16, "hca")] * 41
    assert not any(p.is_index_source for p in cfg.plan)


def test_v4_csa_only_layer_types_at_rate_128_plan_as_csa():
    raw = v4_flash_hf_normalized()
    raw["layer_types"] = ["sliding_attention"] * 2 + ["compressed_sparse_attention"] * 41
    raw["compress_rates"] = {"compressed_sparse_attention": 128}
    cfg = ModelConfig.from_dict(raw)
    assert {(p.ratio, p.attn_type) for p in cfg.plan[2:]} == {(128, "csa")}


def test_v4_layer_types_field_from_both_spellings():
    a, b = ModelConfig.from_dict(v4_flash()), ModelConfig.from_dict(v4_flash_hf_normalized())
    want = tuple(kind for _, kind, _ in _v4_expected_plan())
    assert a.layer_types == b.layer_types == want
    assert ModelConfig.from_dict(v41_flash()).layer_types == ()


@pytest.mark.parametrize("backbone,want", [
    ([0, 0, 4, 128, 4], ("swa", "swa", "csa", "hca", "csa")),
    ([0, 4, 8, 4, 8], ("swa", "csa", "hca", "csa", "hca")),  # two rates: the smaller is CSA
    ([0, 128, 128, 128, 128], ("swa",) + ("hca",) * 4),  # one rate of 128: HCA
    ([0, 16, 16, 16, 16], ("swa",) + ("csa",) * 4),  # one rate below 128: CSA
])
def test_v4_layer_types_from_compress_ratios(backbone, want):
    raw = v4_flash()
    raw.update(num_hidden_layers=5, num_hash_layers=1, compress_ratios=backbone + [0])
    assert ModelConfig.from_dict(raw).layer_types == want


def test_v4_layer_types_disagreeing_with_compress_ratios_names_layer_types():
    raw = v4_flash_hf_normalized()
    ratios = list(V4_FLASH_RATIOS)
    ratios[3] = 4  # layer_types says HCA (128)
    raw["compress_ratios"] = ratios
    with pytest.raises(ConfigError, match=r"^layer_types:.*layer 3"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("bad", [["sliding_attention"] * 42, "sliding_attention",
                                 ["sliding_attention"] * 42 + ["full_attention"]])
def test_v4_bad_layer_types_names_layer_types(bad):
    raw = v4_flash_hf_normalized()
    raw["layer_types"] = bad
    with pytest.raises(ConfigError, match=r"^layer_types:"):
        ModelConfig.from_dict(raw)


def test_num_nextn_predict_layers_defaults_to_0_in_both_v4_spellings():
    a, b = v4_flash(), v4_flash_hf_normalized()
    for raw in (a, b):
        del raw["num_nextn_predict_layers"]
    a["compress_ratios"] = V4_FLASH_RATIOS[:43]  # no MTP entry either
    ca, cb = ModelConfig.from_dict(a), ModelConfig.from_dict(b)
    assert ca.num_nextn_predict_layers == cb.num_nextn_predict_layers == 0
    assert ca == cb and len(cb.compress_ratios) == 43
    del a["compress_ratios"]  # removing it leaves nothing to derive from
    with pytest.raises(ConfigError, match=r"^compress_ratios:.*missing"):
        ModelConfig.from_dict(a)


# --------------------------------------------------------------------------------------------------
# load_config: files
# --------------------------------------------------------------------------------------------------


def test_load_config_missing_config_json_is_file_not_found_naming_path(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        load_config(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_config(tmp_path / "nowhere")


@pytest.mark.parametrize("text", ['{"model_type": "deepseek_v41",', "", "[1, 2]", "\xff\xfe"])
def test_load_config_corrupt_config_json_names_the_file(tmp_path, text):
    (tmp_path / "config.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)


def test_load_config_corrupt_generation_config_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(v41_flash()))
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [1, ')
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path)
    assert str(tmp_path / "generation_config.json") in str(e.value)


def test_load_config_bad_generation_eos_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(v41_flash()))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["x"]}))
    with pytest.raises(ConfigError, match=r"^eos_token_id\[0\]:.*generation_config"):
        load_config(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 129280]}))
    with pytest.raises(ConfigError, match=r"^eos_token_id:.*129280"):
        load_config(tmp_path)
