"""Model configuration for DeepSeek-V4 (``deepseek_v4``) and DeepSeek-V4.1 (``deepseek_v41``).

One validated, frozen object (:class:`ModelConfig`) is built from a checkpoint's ``config.json`` whatever
spelling it uses, and the per-layer plan of v41-architecture.md §1.4 is derived from it, never from
hard-coded layer numbers.

Accepted spellings (v41-architecture.md §1.1, §1.2):

* V4.1: nested ``text_config`` (or flat), HF names or the official reference names (``dim``,
  ``n_layers``, ``kv_source_layers``, ...); ``rope_scaling`` with ``rope_type`` or ``type``.
* V4: flat; the checkpoint's own fields (``compress_ratios``, ``num_hash_layers``, ``rope_scaling``) or the
  transformers-normalized ones (``layer_types``, ``mlp_layer_types``, ``compress_rates``,
  ``rope_parameters`` with ``main``/``compress``, ``partial_rotary_factor``).

Errors: :class:`ConfigError` (a ``ValueError``) whose message names the offending field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

ARCH_V4 = "deepseek_v4"
ARCH_V41 = "deepseek_v41"

# Official-reference field names -> HF names (v41-architecture.md §1.1 table).
_REFERENCE_ALIASES = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "moe_inter_dim": "moe_intermediate_size",
    "n_activated_experts": "num_experts_per_tok",
    "score_func": "scoring_func",
    "route_scale": "routed_scaling_factor",
    "rope_head_dim": "qk_rope_head_dim",
    "norm_eps": "rms_norm_eps",
    "window_size": "sliding_window",
    "kv_source_layers": "kv_source_layer_ids",
    "index_source_layers": "index_source_layer_ids",
    "candidate_source_layer": "candidate_source_layer_id",
    "engram_pad_id": "engram_pad_token_id",
    "n_mtp_layers": "num_nextn_predict_layers",
    "dspark_n_activated_experts": "dspark_num_experts_per_tok",
}
_HF_LAYER_TYPE_RATIO_KEY = {
    "sliding_attention": None,
    "compressed_sparse_attention": "compressed_sparse_attention",
    "heavily_compressed_attention": "heavily_compressed_attention",
}


class ConfigError(ValueError):
    """An inconsistent or unsupported model config; the message names the field."""


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (v41-architecture.md §2), applied only on layers with ``compress_ratio > 0``."""

    factor: float
    beta_fast: float
    beta_slow: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LayerPlan:
    """What one layer does, derived from the config (v41-architecture.md §1.4, §4).

    ``ratio``: 0 = sliding-window only, r > 0 = the layer reads a compressed cache at ratio r.
    V4.1: ``kv_src``/``idx_src`` are the layers whose compressed KV / top-k list this layer reads;
    ``owns_compressor`` (a KV source), ``is_index_source`` (runs an indexer), ``owns_index_keys`` (KV source:
    owns ``indexer.wk``), ``is_candidate_source``, ``uses_candidate_filter``.
    V4: ``attn_type`` in {swa, csa, hca}; every compressed layer owns its compressor; CSA layers own an
    indexer with its own compressor. ``hash_moe``: V4 hash-routed MoE layer.
    """

    layer_id: int
    ratio: int
    attn_type: str  # "swa" | "csa" | "hca" (V4) | "csa2" (V4.1)
    kv_src: int | None = None
    idx_src: int | None = None
    owns_compressor: bool = False
    is_index_source: bool = False
    owns_index_keys: bool = False
    is_candidate_source: bool = False
    uses_candidate_filter: bool = False
    engram: bool = False
    dspark_target: bool = False
    hash_moe: bool = False


@dataclass(frozen=True)
class ModelConfig:
    """Validated text-model config. Field names follow transformers; units are tokens unless stated.

    Build with :func:`load_config` / :meth:`from_dict`; never mutate. ``compress_ratios`` has one entry per
    backbone layer followed by one per MTP/DSpark stage. ``plan`` is derived (see :class:`LayerPlan`).
    """

    arch: str
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: RopeScaling | None
    sliding_window: int
    compress_ratios: tuple[int, ...]
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    max_position_embeddings: int
    bos_token_id: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    gate_temp: float = 1.0
    num_nextn_predict_layers: int = 0
    weight_block_size: tuple[int, int] = (128, 128)
    expert_dtype: str = "fp4"
    # V4 only
    num_hash_layers: int = 0
    # V4.1 only
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 1
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 0
    engram_vocab_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 0
    dspark_block_size: int = 0
    dspark_noise_token_id: int = -1
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 0
    dspark_n_routed_experts: int = 0
    dspark_num_experts_per_tok: int = 0
    image_token_id: int | None = None
    plan: tuple[LayerPlan, ...] = field(default=(), compare=False)

    # ----------------------------------------------------------------------------------------------
    @property
    def is_v41(self) -> bool:
        return self.arch == ARCH_V41

    @property
    def has_dspark(self) -> bool:
        """True when the checkpoint carries DSpark draft stages (``mtp.0..S-1``)."""
        return self.is_v41 and self.num_nextn_predict_layers > 0 and self.dspark_block_size > 0

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    def layer_rope(self, ratio: int) -> tuple[float, RopeScaling | None]:
        """RoPE base and YaRN scaling for a layer of this compress ratio (v41-architecture.md §2)."""
        if ratio > 0:
            return self.compress_rope_theta, self.rope_scaling
        return self.rope_theta, None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Parse a ``config.json`` dict (any accepted spelling). Raises :class:`ConfigError`."""
        return _parse(raw)


def load_config(path: str | Path) -> ModelConfig:
    """Read ``config.json`` from a checkpoint directory (or the file itself) and validate it.

    ``generation_config.json`` beside it, when present, contributes its ``eos_token_id`` list (several EOS
    ids are common). Raises :class:`ConfigError` or ``FileNotFoundError``.
    """
    path = Path(path)
    cfg_file = path / "config.json" if path.is_dir() else path
    raw = json.loads(cfg_file.read_text())
    gen_file = cfg_file.parent / "generation_config.json"
    if gen_file.exists():
        gen = json.loads(gen_file.read_text())
        if "eos_token_id" in gen:
            raw = {**raw, "_generation_eos_token_id": gen["eos_token_id"]}
    return ModelConfig.from_dict(raw)


# --------------------------------------------------------------------------------------------------
def _flatten(raw: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    model_type = raw.get("model_type")
    if model_type not in (ARCH_V4, ARCH_V41):
        raise ConfigError(f"model_type: expected {ARCH_V4!r} or {ARCH_V41!r}, got {model_type!r}")
    flat = dict(raw)
    text = raw.get("text_config")
    if isinstance(text, dict):
        # Top-level token ids apply unless the text config repeats them.
        flat = {**{k: v for k, v in raw.items() if k != "text_config"}, **text}
    for ref_name, hf_name in _REFERENCE_ALIASES.items():
        if ref_name in flat and hf_name not in flat:
            flat[hf_name] = flat[ref_name]
    return model_type, flat


def _req(flat: dict[str, Any], name: str) -> Any:
    if name not in flat or flat[name] is None:
        raise ConfigError(f"{name}: required field missing")
    return flat[name]


def _rope_scaling(flat: dict[str, Any]) -> RopeScaling | None:
    rp = flat.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("compress"), dict):
        rs = rp["compress"]
        flat.setdefault("compress_rope_theta", rs.get("rope_theta"))
        if isinstance(rp.get("main"), dict):
            flat.setdefault("rope_theta", rp["main"].get("rope_theta"))
    else:
        rs = flat.get("rope_scaling") or (rp if isinstance(rp, dict) else None)
    if not rs and flat.get("rope_factor") is not None:
        # Official reference spelling (§1.1): flat rope_factor / original_seq_len / beta_fast / beta_slow.
        rs = {"rope_type": "yarn", "factor": flat["rope_factor"],
              "beta_fast": flat.get("beta_fast", 32), "beta_slow": flat.get("beta_slow", 1)}
        if flat.get("original_seq_len") is not None:
            rs["original_max_position_embeddings"] = flat["original_seq_len"]
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ConfigError(f"rope_scaling.rope_type: only 'yarn' is supported, got {kind!r}")
    if rs.get("attention_factor", 1.0) not in (1, 1.0, None):
        raise ConfigError("rope_scaling.attention_factor: DeepSeek-V4/V4.1 use no mscale (must be 1.0)")
    try:
        return RopeScaling(
            factor=float(rs["factor"]),
            beta_fast=float(rs.get("beta_fast", 32)),
            beta_slow=float(rs.get("beta_slow", 1)),
            original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ConfigError(f"rope_scaling.{e.args[0]}: required for yarn") from None


def _v4_ratios(flat: dict[str, Any], n_layers: int) -> list[int]:
    if "compress_ratios" in flat:
        return [int(r) for r in flat["compress_ratios"]]
    types = flat.get("layer_types")
    if types is None:
        raise ConfigError("compress_ratios: missing (and no layer_types to derive it from)")
    rates = flat.get("compress_rates") or {
        "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    out = []
    for t in types:
        if t not in _HF_LAYER_TYPE_RATIO_KEY:
            raise ConfigError(f"layer_types: unknown layer type {t!r}")
        key = _HF_LAYER_TYPE_RATIO_KEY[t]
        out.append(0 if key is None else int(rates[key]))
    return out + [0] * int(flat.get("num_nextn_predict_layers", 1))


def _eos_ids(flat: dict[str, Any]) -> tuple[int, ...]:
    eos = flat.get("_generation_eos_token_id", flat.get("eos_token_id", 1))
    ids = [eos] if isinstance(eos, int) else list(eos)
    return tuple(dict.fromkeys(int(i) for i in ids))


def _parse(raw: dict[str, Any]) -> ModelConfig:
    arch, flat = _flatten(raw)
    n_layers = int(_req(flat, "num_hidden_layers"))
    head_dim = int(_req(flat, "head_dim"))
    if "qk_rope_head_dim" in flat:
        rope_dim = int(flat["qk_rope_head_dim"])
    elif flat.get("partial_rotary_factor"):
        rope_dim = int(round(head_dim * float(flat["partial_rotary_factor"])))
    else:
        rope_dim = 64
    rope_scaling = _rope_scaling(flat)
    quant = flat.get("quantization_config") or {}
    block = tuple(int(b) for b in quant.get("weight_block_size", (128, 128)))
    expert_dtype = quant.get("expert_dtype", flat.get("expert_dtype", "fp4"))
    n_mtp = int(flat.get("num_nextn_predict_layers", 0))
    if arch == ARCH_V4:
        ratios = _v4_ratios(flat, n_layers)
        mlp_types = flat.get("mlp_layer_types")
        n_hash = (sum(t == "hash_moe" for t in mlp_types) if mlp_types is not None
                  else int(flat.get("num_hash_layers", 3)))
        if mlp_types is not None and list(mlp_types) != ["hash_moe"] * n_hash + ["moe"] * (n_layers - n_hash):
            raise ConfigError("mlp_layer_types: hash_moe layers must come first")
    else:
        ratios = [int(r) for r in _req(flat, "compress_ratios")]
        n_hash = 0

    def ints(name: str) -> tuple[int, ...]:
        return tuple(int(x) for x in flat.get(name, ()) or ())

    cfg = ModelConfig(
        arch=arch,
        vocab_size=int(_req(flat, "vocab_size")),
        hidden_size=int(_req(flat, "hidden_size")),
        moe_intermediate_size=int(_req(flat, "moe_intermediate_size")),
        num_hidden_layers=n_layers,
        num_attention_heads=int(_req(flat, "num_attention_heads")),
        head_dim=head_dim,
        qk_rope_head_dim=rope_dim,
        q_lora_rank=int(_req(flat, "q_lora_rank")),
        o_lora_rank=int(_req(flat, "o_lora_rank")),
        o_groups=int(_req(flat, "o_groups")),
        n_routed_experts=int(_req(flat, "n_routed_experts")),
        n_shared_experts=int(flat.get("n_shared_experts", 1)),
        num_experts_per_tok=int(_req(flat, "num_experts_per_tok")),
        scoring_func=str(flat.get("scoring_func", "sqrtsoftplus")),
        norm_topk_prob=bool(flat.get("norm_topk_prob", True)),
        routed_scaling_factor=float(flat.get("routed_scaling_factor", 1.5)),
        swiglu_limit=float(flat.get("swiglu_limit", 10.0)),
        rms_norm_eps=float(flat.get("rms_norm_eps", 1e-6)),
        rope_theta=float(flat.get("rope_theta", 10000.0)),
        compress_rope_theta=float(flat.get("compress_rope_theta", 160000.0)),
        rope_scaling=rope_scaling,
        sliding_window=int(_req(flat, "sliding_window")),
        compress_ratios=tuple(ratios),
        hc_mult=int(flat.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(flat.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(flat.get("hc_eps", 1e-6)),
        index_n_heads=int(flat.get("index_n_heads", 64)),
        index_head_dim=int(flat.get("index_head_dim", 128)),
        index_topk=int(flat.get("index_topk", 512)),
        max_position_embeddings=int(flat.get("max_position_embeddings", 1 << 20)),
        bos_token_id=int(flat.get("bos_token_id", 0)),
        eos_token_ids=_eos_ids(flat),
        pad_token_id=None if flat.get("pad_token_id") is None else int(flat["pad_token_id"]),
        gate_temp=float(flat.get("gate_temp", 1.0)),
        num_nextn_predict_layers=n_mtp,
        weight_block_size=(block[0], block[1]),
        expert_dtype=str(expert_dtype),
        num_hash_layers=n_hash,
        kv_source_layer_ids=ints("kv_source_layer_ids"),
        index_source_layer_ids=ints("index_source_layer_ids"),
        candidate_source_layer_id=int(flat.get("candidate_source_layer_id", -1)),
        candidate_topk_blocks=int(flat.get("candidate_topk_blocks", 0)),
        candidate_block_size=int(flat.get("candidate_block_size", 1)),
        engram_layer_ids=ints("engram_layer_ids"),
        engram_num_embeddings=ints("engram_num_embeddings"),
        engram_max_ngram_size=int(flat.get("engram_max_ngram_size", 0)),
        engram_vocab_size=int(flat.get("engram_vocab_size", 0)),
        engram_n_heads=int(flat.get("engram_n_heads", 0)),
        engram_head_dim=int(flat.get("engram_head_dim", 0)),
        engram_pad_token_id=int(flat.get("engram_pad_token_id", 2)),
        engram_compressed_vocab_size=int(flat.get("engram_compressed_vocab_size", 0)),
        dspark_block_size=int(flat.get("dspark_block_size", 0)),
        dspark_noise_token_id=int(flat.get("dspark_noise_token_id", -1)),
        dspark_target_layer_ids=ints("dspark_target_layer_ids"),
        dspark_markov_rank=int(flat.get("dspark_markov_rank", 0)),
        dspark_n_routed_experts=int(flat.get("dspark_n_routed_experts", 0)),
        dspark_num_experts_per_tok=int(flat.get("dspark_num_experts_per_tok", 0)),
        image_token_id=flat.get("image_token_id"),
    )
    _validate_common(cfg)
    plan = _plan_v41(cfg) if cfg.is_v41 else _plan_v4(cfg)
    object.__setattr__(cfg, "plan", tuple(plan))
    return cfg


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {msg}")


def _validate_common(c: ModelConfig) -> None:
    for f in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
              "num_attention_heads", "head_dim", "q_lora_rank", "o_lora_rank", "o_groups",
              "n_routed_experts", "num_experts_per_tok", "sliding_window", "hc_mult", "hc_sinkhorn_iters"):
        _check(getattr(c, f) > 0, f, f"must be positive, got {getattr(c, f)}")
    _check(c.scoring_func == "sqrtsoftplus", "scoring_func", f"only sqrtsoftplus is supported, got {c.scoring_func!r}")
    _check(0 < c.qk_rope_head_dim <= c.head_dim and c.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim",
           f"must be even and in (0, head_dim={c.head_dim}], got {c.qk_rope_head_dim}")
    _check(c.num_attention_heads % c.o_groups == 0, "o_groups",
           f"num_attention_heads={c.num_attention_heads} is not divisible by o_groups={c.o_groups}")
    _check(c.num_experts_per_tok <= c.n_routed_experts, "num_experts_per_tok",
           f"{c.num_experts_per_tok} exceeds n_routed_experts={c.n_routed_experts}")
    _check(c.n_shared_experts in (0, 1), "n_shared_experts", f"0 or 1 supported, got {c.n_shared_experts}")
    _check(len(c.compress_ratios) >= c.num_hidden_layers, "compress_ratios",
           f"has {len(c.compress_ratios)} entries, fewer than num_hidden_layers={c.num_hidden_layers}")
    _check(c.index_head_dim >= c.qk_rope_head_dim, "index_head_dim",
           f"{c.index_head_dim} is smaller than qk_rope_head_dim={c.qk_rope_head_dim}")
    _check(c.gate_temp > 0, "gate_temp", f"must be positive, got {c.gate_temp}")
    _check(c.index_topk > 0, "index_topk", f"must be positive, got {c.index_topk}")


def _plan_v4(c: ModelConfig) -> list[LayerPlan]:
    _check(c.num_hash_layers <= c.num_hidden_layers, "num_hash_layers",
           f"{c.num_hash_layers} exceeds num_hidden_layers={c.num_hidden_layers}")
    backbone = c.compress_ratios[: c.num_hidden_layers]
    nonzero = sorted({r for r in backbone if r > 0})
    _check(len(nonzero) <= 2, "compress_ratios", f"V4 has at most two compressed rates (CSA, HCA), got {nonzero}")
    csa = min(nonzero) if len(nonzero) == 2 else (nonzero[0] if nonzero and nonzero[0] < 128 else None)
    plan = []
    for i, r in enumerate(backbone):
        kind = "swa" if r == 0 else ("csa" if r == csa else "hca")
        plan.append(LayerPlan(layer_id=i, ratio=r, attn_type=kind, owns_compressor=r > 0,
                              is_index_source=kind == "csa", owns_index_keys=kind == "csa",
                              kv_src=i if r > 0 else None, idx_src=i if kind == "csa" else None,
                              hash_moe=i < c.num_hash_layers))
    return plan


def _plan_v41(c: ModelConfig) -> list[LayerPlan]:
    n = c.num_hidden_layers
    kv_srcs, idx_srcs, cand = c.kv_source_layer_ids, c.index_source_layer_ids, c.candidate_source_layer_id
    for name, ids in (("kv_source_layer_ids", kv_srcs), ("index_source_layer_ids", idx_srcs),
                      ("engram_layer_ids", c.engram_layer_ids),
                      ("dspark_target_layer_ids", c.dspark_target_layer_ids)):
        _check(list(ids) == sorted(set(ids)), name, f"must be strictly increasing, got {list(ids)}")
        _check(all(0 <= i < n for i in ids), name, f"ids must lie in [0, {n}), got {list(ids)}")
    _check(set(kv_srcs) <= set(idx_srcs), "index_source_layer_ids",
           f"every kv source must also be an index source (kv sources {list(kv_srcs)})")
    _check(cand == -1 or cand in kv_srcs, "candidate_source_layer_id",
           f"{cand} is not a kv source {list(kv_srcs)}")
    if cand != -1:
        _check(c.candidate_topk_blocks > 0 and c.candidate_block_size > 0, "candidate_topk_blocks",
               "candidate_topk_blocks and candidate_block_size must be positive with a candidate source")
    plan = []
    for i in range(n):
        r = c.compress_ratios[i]
        _check(r in (0, 1, 2), "compress_ratios", f"V4.1 ratios are 0, 1 or 2; layer {i} has {r}")
        kv_src = idx_src = None
        if r > 0:
            earlier = [s for s in kv_srcs if s <= i]
            _check(bool(earlier), "kv_source_layer_ids", f"layer {i} (ratio {r}) has no kv source at or before it")
            kv_src = earlier[-1]
            _check(c.compress_ratios[kv_src] == r, "compress_ratios",
                   f"layer {i} has ratio {r} but its kv source {kv_src} has ratio {c.compress_ratios[kv_src]}")
            idx_src = [s for s in idx_srcs if s <= i][-1]
            _check(idx_src >= kv_src, "index_source_layer_ids",
                   f"layer {i}: index source {idx_src} precedes its kv source {kv_src}")
        elif i in kv_srcs or i in idx_srcs:
            raise ConfigError(f"compress_ratios: source layer {i} has ratio 0")
        filt = cand != -1 and i in idx_srcs and i > cand
        if filt:
            _check(kv_src == cand, "candidate_source_layer_id",
                   f"filtered index source {i} reads kv source {kv_src}, not the candidate source {cand}")
        plan.append(LayerPlan(
            layer_id=i, ratio=r, attn_type="csa2" if r > 0 else "swa", kv_src=kv_src, idx_src=idx_src,
            owns_compressor=i in kv_srcs, is_index_source=i in idx_srcs, owns_index_keys=i in kv_srcs,
            is_candidate_source=i == cand, uses_candidate_filter=filt, engram=i in c.engram_layer_ids,
            dspark_target=i in c.dspark_target_layer_ids))
    if c.engram_layer_ids:
        for name in ("engram_max_ngram_size", "engram_n_heads", "engram_head_dim", "engram_vocab_size"):
            _check(getattr(c, name) > 0, name, "must be positive when engram_layer_ids is set")
        _check(c.engram_max_ngram_size >= 2, "engram_max_ngram_size", "must be at least 2")
        _check(len(c.engram_num_embeddings) == len(c.engram_layer_ids), "engram_num_embeddings",
               f"needs one entry per engram layer ({len(c.engram_layer_ids)})")
    if c.has_dspark:
        _check(len(c.dspark_target_layer_ids) > 0, "dspark_target_layer_ids", "required with DSpark stages")
        _check(len(c.compress_ratios) >= n + c.num_nextn_predict_layers, "compress_ratios",
               "needs one entry per DSpark stage after the backbone layers")
        _check(0 <= c.dspark_noise_token_id < c.vocab_size, "dspark_noise_token_id",
               f"{c.dspark_noise_token_id} outside the vocabulary")
        _check(0 < c.dspark_num_experts_per_tok <= c.dspark_n_routed_experts, "dspark_num_experts_per_tok",
               "must be in (0, dspark_n_routed_experts]")
        _check(c.dspark_markov_rank > 0, "dspark_markov_rank", "must be positive")
    return plan


def yarn_inv_freq(rope_dim: int, base: float, scaling: RopeScaling | None) -> list[float]:
    """Inverse frequencies ``f_i`` (i = 0..rope_dim/2-1) with the YaRN correction of v41-architecture.md §2.

    ``corr(r) = rope_dim·ln(orig/(2πr)) / (2·ln base)``, ``low = floor(corr(beta_fast))``,
    ``high = ceil(corr(beta_slow))`` clamped to [0, rope_dim-1]; ``f' = f/factor·ramp + f·(1-ramp)``.
    Returned as Python floats (float64) so float32 and float64 models share them.
    """
    half = rope_dim // 2
    freqs = [base ** (-(2 * i) / rope_dim) for i in range(half)]
    if scaling is None:
        return freqs
    low, high = yarn_low_high(rope_dim, base, scaling)
    if low == high:
        high += 0.001
    out = []
    for i, f in enumerate(freqs):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(f / scaling.factor * ramp + f * (1 - ramp))
    return out


def yarn_low_high(rope_dim: int, base: float, scaling: RopeScaling) -> tuple[int, int]:
    """The YaRN correction range (15, 25 at V4.1-Flash dims: rope_dim 64, base 160000, orig 65536)."""
    def corr(rot: float) -> float:
        return rope_dim * math.log(scaling.original_max_position_embeddings / (2 * math.pi * rot)) / (2 * math.log(base))
    low = max(math.floor(corr(scaling.beta_fast)), 0)
    high = min(math.ceil(corr(scaling.beta_slow)), rope_dim - 1)
    return low, high


def config_field_names() -> list[str]:
    """Names of the :class:`ModelConfig` fields (for serialisers and tests)."""
    return [f.name for f in fields(ModelConfig) if f.name != "plan"]
