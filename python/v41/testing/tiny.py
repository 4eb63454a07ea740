"""Tiny checkpoints with the real tensor names, dtypes, quantization layouts and sharding (docs/architecture.md §1).

``make_tiny(path, arch, seed=0, **overrides)`` writes ``config.json``, ``generation_config.json``, the tiny
tokenizer and ≥ 2 safetensors shards + ``model.safetensors.index.json``. Same seed and overrides, same
bytes. The default V4.1 config exercises every layer role within a 40-token prompt (see
:data:`V41_LAYER_ROLES`); sizes divide for TP = 1, 2, 4 and respect the 32-wide quantization blocks.
Weights are random: the model writes gibberish.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from .. import quant
from ..checkpoint_names import fp8_block, storage_format
from ..config import LayerPlan, ModelConfig
from ..models.engram_hash import build_compressed_token_map, engram_table_rows
from ..models.reference.attention import Attention
from ..models.reference.block import Block
from ..models.reference.moe import MoE
from ..models.reference.loader import build
from ..models.random_init import init_tensor
from .tokenizer_files import TOKENIZER_DIR, load_tiny_tokenizer

GENERATOR_VERSION = 2
ARCHES = ("deepseek_v41", "deepseek_v4")

# Layer roles of the default V4.1 config (docs/model.md §1.4, scaled down):
V41_LAYER_ROLES = {
    0: "SWA only", 1: "SWA only, Engram", 2: "ratio-2 kv + index source", 3: "consumer of 2",
    4: "ratio-2 kv + index source and Engram (like real layer 14)", 5: "consumer of 4",
    6: "ratio-1 kv + index source + candidate source", 7: "consumer of 6",
    8: "index-only source, candidate-filtered", 9: "consumer of 8 (DSpark target)",
    10: "index-only source, candidate-filtered (DSpark target)", 11: "consumer of 10 (DSpark target)",
}


def _special_id(text: str) -> int:
    tid = load_tiny_tokenizer().token_to_id(text)
    if tid is None:
        raise ValueError(f"tiny tokenizer lacks {text!r}")
    return tid


def default_config(arch: str) -> dict:
    """The default tiny ``config.json`` dict for ``arch`` (V4.1 nested like the real one, V4 flat)."""
    common = dict(
        vocab_size=1024, hidden_size=64, moe_intermediate_size=64, num_attention_heads=8,
        num_key_value_heads=1, head_dim=64, qk_rope_head_dim=16, q_lora_rank=64, o_lora_rank=32, o_groups=4,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, scoring_func="sqrtsoftplus",
        topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=1.5, swiglu_limit=10.0,
        hidden_act="silu", max_position_embeddings=4096, rope_theta=10000.0, compress_rope_theta=160000.0,
        sliding_window=8, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, index_n_heads=4, index_head_dim=32,
        tie_word_embeddings=False,
    )
    if arch == "deepseek_v4":
        return dict(
            common, architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", num_hidden_layers=6,
            compress_ratios=[0, 0, 4, 8, 4, 8, 0], num_hash_layers=2, index_topk=3, rms_norm_eps=1e-6,
            num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=1, expert_dtype="fp4",
            rope_scaling=dict(type="yarn", factor=16, beta_fast=32, beta_slow=1,
                              original_max_position_embeddings=65536),
            quantization_config=dict(quant_method="fp8", fmt="e4m3", scale_fmt="ue8m0",
                                     activation_scheme="dynamic", weight_block_size=[128, 128]),
        )
    if arch != "deepseek_v41":
        raise ValueError(f"arch must be one of {ARCHES}, got {arch!r}")
    system_id = _special_id("<｜System｜>")
    text = dict(
        common, model_type="deepseek_v41_text", num_hidden_layers=12, rms_norm_eps=1e-20,
        compress_ratios=[0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0],
        kv_source_layer_ids=[2, 4, 6], index_source_layer_ids=[2, 4, 6, 8, 10], candidate_source_layer_id=6,
        candidate_topk_blocks=3, candidate_block_size=4, index_topk=6,
        rope_scaling=dict(rope_type="yarn", factor=16, beta_fast=32, beta_slow=1,
                          original_max_position_embeddings=65536),
        engram_layer_ids=[1, 4], engram_max_ngram_size=4, engram_vocab_size=101, engram_n_heads=2,
        engram_head_dim=32, engram_pad_token_id=2,
        num_nextn_predict_layers=3, dspark_block_size=5, dspark_noise_token_id=system_id,
        dspark_target_layer_ids=[9, 10, 11], dspark_markov_rank=32, dspark_n_routed_experts=4,
        dspark_num_experts_per_tok=2,
    )
    return dict(
        architectures=["DeepseekV41ForCausalLM"], model_type="deepseek_v41", bos_token_id=0, eos_token_id=1,
        pad_token_id=2, image_token_id=_special_id("<｜deepseek_image｜>"), dtype="bfloat16",
        quantization_config=dict(quant_method="fp8", activation_scheme="dynamic", weight_block_size=[32, 32],
                                 scale_fmt="ue8m0", expert_dtype="fp4"),
        text_config=text,
    )


def _apply_overrides(raw: dict, overrides: dict) -> dict:
    raw = json.loads(json.dumps(raw))
    target = raw.get("text_config", raw)
    for k, v in overrides.items():
        (raw if k in ("quantization_config",) else target)[k] = v
    return raw


def _finish_engram(raw: dict) -> None:
    """Fill ``engram_compressed_vocab_size`` and ``engram_num_embeddings`` from the tokenizer and primes."""
    text = raw.get("text_config", raw)
    if not text.get("engram_layer_ids"):
        return
    token_map = build_compressed_token_map(load_tiny_tokenizer())
    text["engram_compressed_vocab_size"] = int(token_map.max()) + 1
    text["engram_num_embeddings"] = engram_table_rows(
        text["engram_layer_ids"], text["engram_max_ngram_size"], text["engram_n_heads"], text["engram_vocab_size"])


def _encode(name: str, value: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    fmt = storage_format(name, cfg.expert_dtype)
    if fmt == "fp8":
        w, s = quant.quant_fp8_block(value, fp8_block(name, cfg.weight_block_size))
        return {name: w, name[: -len(".weight")] + ".scale": s}
    if fmt == "mxfp4":
        w, s = quant.quant_mxfp4(value)
        return {name: w, name[: -len(".weight")] + ".scale": s}
    if fmt == "i64":
        return {name: value.long()}
    return {name: value.to(torch.float32 if fmt == "f32" else torch.bfloat16).contiguous()}


def _v4_mtp_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of V4's single MTP layer ``mtp.0.*`` (loaded and ignored; §4 "MTP")."""
    d = cfg.hidden_size
    plan = LayerPlan(layer_id=cfg.num_hidden_layers, ratio=0, attn_type="swa")
    ffn = MoE(d, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok, 1, 10.0,
              gate_temp=1.0, norm_topk_prob=True, scaling=1.0)
    block = Block(cfg, Attention(cfg, plan, q_head_norm=True), ffn, delayed=False)
    shapes = {f"mtp.0.{k}": tuple(v.shape) for k, v in block.state_dict().items()}
    shapes.update({"mtp.0.e_proj.weight": (d, d), "mtp.0.h_proj.weight": (d, d), "mtp.0.enorm.weight": (d,),
                   "mtp.0.hnorm.weight": (d,), "mtp.0.norm.weight": (d,),
                   "mtp.0.hc_head_fn": (cfg.hc_mult, cfg.hc_mult * d), "mtp.0.hc_head_base": (cfg.hc_mult,),
                   "mtp.0.hc_head_scale": (1,)})
    return shapes


def make_tiny(path: str | Path, arch: str = "deepseek_v41", seed: int = 0, n_shards: int = 2,
              weights: bool = True, **overrides) -> Path:
    """Write a tiny random checkpoint of ``arch`` to ``path`` and return the path.

    overrides: config fields (text-config level for V4.1) replacing the defaults. ``weights=False`` writes
    only the config, generation config and tokenizer (for ``load_format="dummy"``: random weights made on
    the target device, e.g. large benchmark configs). Raises ValueError (ConfigError) for an inconsistent
    result.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = _apply_overrides(default_config(arch), overrides)
    _finish_engram(raw)
    cfg = ModelConfig.from_dict(raw)
    for fname in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER_DIR / fname, path / fname)
    if weights:
        model = build(cfg, path / "tokenizer.json")
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        if not cfg.is_v41:
            shapes.update(_v4_mtp_tensors(cfg))
        g = torch.Generator().manual_seed(seed)
        save_weights(path, cfg, {name: init_tensor(name, shapes[name], g, cfg) for name in sorted(shapes)},
                     n_shards)
    (path / "config.json").write_text(json.dumps(raw, indent=2, ensure_ascii=False) + "\n")
    eos = [cfg.eos_token_ids[0], _special_id("<｜User｜>")]
    gen = dict(bos_token_id=cfg.bos_token_id, eos_token_id=eos, do_sample=False,
               _v41_generator=dict(version=GENERATOR_VERSION, seed=seed))
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return path


def save_weights(path: str | Path, cfg: ModelConfig, state: dict[str, torch.Tensor], n_shards: int = 2) -> None:
    """Write ``state`` (bare checkpoint names → float tensors, e.g. a reference model's ``state_dict()``) in the
    checkpoint formats (FP8 block-scaled dense, MXFP4 experts, BF16 / F32 others: ``storage_format``) as
    ``n_shards`` safetensors shards plus ``model.safetensors.index.json`` in ``path``."""
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(state):
        tensors.update(_encode(name, state[name].detach(), cfg))
    _write_shards(Path(path), tensors, n_shards)


def _write_shards(path: Path, tensors: dict[str, torch.Tensor], n_shards: int) -> None:
    names = sorted(tensors)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    per_shard = -(-total // n_shards)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in names:
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if size and size + nbytes > per_shard and len(shards) < n_shards:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name].contiguous()
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
