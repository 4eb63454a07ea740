"""Model configuration for DeepSeek-V4 (``deepseek_v4``) and DeepSeek-V4.1 (``deepseek_v41``).

One validated, frozen object (:class:`ModelConfig`) is built from a checkpoint's ``config.json`` whatever
spelling it uses, and the per-layer plan of docs/model.md §1.4 is derived from it, never from
hard-coded layer numbers.

Accepted spellings (docs/model.md §1.1, §1.2):

* V4.1: nested ``text_config`` (or flat), HF names or the official reference names (``dim``,
  ``n_layers``, ``kv_source_layers``, ...); ``rope_scaling`` with ``rope_type`` or ``type``.
* V4: flat; the checkpoint's own fields (``compress_ratios``, ``num_hash_layers``, ``rope_scaling``) or the
  transformers-normalized ones (``layer_types``, ``mlp_layer_types``, ``compress_rates``,
  ``rope_parameters`` with ``main``/``compress``, ``partial_rotary_factor``).

Every field is read through one typed reader (:func:`_get`): integers must be JSON integers (or integral
floats such as ``64.0``; ``64.5`` and ``"64"`` are rejected, never truncated), floats must be finite numbers,
booleans JSON booleans, id lists lists of integers.

Defaults worth knowing: ``num_nextn_predict_layers`` is 0 unless the config gives it, for both archs and both
V4 spellings (transformers' ``DeepseekV4Config`` default is 1, but its ``to_dict`` always writes the value, so
only hand-written configs see the difference; it only decides how many trailing SWA entries a
``layer_types``-derived ``compress_ratios`` gets). V4 layer types: taken from ``layer_types`` when present;
from ``compress_ratios`` otherwise, where with two distinct nonzero rates the smaller is CSA and the larger
HCA, and a single rate means HCA if it is 128 or more, else CSA.

Errors: :class:`ConfigError` (a ``ValueError``) whose message names the offending field;
:func:`load_config` also raises ``FileNotFoundError`` for a missing ``config.json`` and ConfigError naming
the file for unreadable JSON.

Overrides (``v41-serve --hf-overrides``, vLLM's flag): a JSON object merged into ``config.json`` before it is
read (into ``text_config`` for keys it holds; objects merge key by key), then validated like the file itself.
A key the reader never looks at is a ConfigError: an override is never dropped silently.
"""

from __future__ import annotations

import errno
import json
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

ARCH_V4 = "deepseek_v4"
ARCH_V41 = "deepseek_v41"

# Official-reference field names -> HF names (docs/model.md §1.1 table).
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
# transformers `layer_types` -> v41 attention type; default `compress_rates` (§1.2).
_HF_LAYER_TYPES = {
    "sliding_attention": "swa",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}
_HF_DEFAULT_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
EXPERT_DTYPES = ("fp4", "fp8", "bf16")


class ConfigError(ValueError):
    """An inconsistent or unsupported model config; the message names the field."""


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (docs/model.md §2), applied only on layers with ``compress_ratio > 0``."""

    factor: float
    beta_fast: float
    beta_slow: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LayerPlan:
    """What one layer does, derived from the config (docs/model.md §1.4, §4).

    ``ratio``: 0 = sliding-window only, r > 0 = the layer reads a compressed cache at ratio r.
    V4.1: ``kv_src``/``idx_src`` are the layers whose compressed KV / top-k list this layer reads;
    ``owns_compressor`` (a KV source), ``is_index_source`` (runs an indexer), ``owns_index_keys`` (KV source:
    owns ``indexer.wk``), ``is_candidate_source``, ``uses_candidate_filter``.
    V4: ``attn_type`` in {swa, csa, hca} (from ``ModelConfig.layer_types``); every compressed layer owns its
    compressor; CSA layers own an indexer with its own compressor. ``hash_moe``: V4 hash-routed MoE layer.
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
    backbone layer followed by one per MTP/DSpark stage. ``layer_types`` (V4 only, empty for V4.1): "swa" /
    "csa" / "hca" per backbone layer, from HF ``layer_types`` or derived from ``compress_ratios`` (module
    docstring). ``plan`` is derived (see :class:`LayerPlan`).
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
    layer_types: tuple[str, ...] = ()  # "swa" | "csa" | "hca" per backbone layer
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
        """RoPE base and YaRN scaling for a layer of this compress ratio (docs/model.md §2)."""
        if ratio > 0:
            return self.compress_rope_theta, self.rope_scaling
        return self.rope_theta, None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Parse a ``config.json`` dict (any accepted spelling). Raises :class:`ConfigError`."""
        return _parse(raw)


def load_config(path: str | Path, overrides: Mapping[str, Any] | None = None) -> ModelConfig:
    """Read ``config.json`` from a checkpoint directory (or the file itself) and validate it.

    ``generation_config.json`` beside it, when present, contributes its ``eos_token_id`` list (several EOS
    ids are common). ``overrides``: fields to replace first (module docstring, :func:`with_overrides`).
    Raises ``FileNotFoundError`` naming the path when ``config.json`` is missing, :class:`ConfigError` naming
    the file when it (or ``generation_config.json``) is not a JSON object, and :class:`ConfigError` naming
    the field for bad contents or an override no field reads.
    """
    path = Path(path)
    cfg_file = path / "config.json" if path.is_dir() else path
    if not cfg_file.is_file():
        raise FileNotFoundError(errno.ENOENT, "model config not found", str(cfg_file))
    raw = _read_json_object(cfg_file)
    gen_file = cfg_file.parent / "generation_config.json"
    if gen_file.is_file():
        gen = _read_json_object(gen_file)
        if gen.get("eos_token_id") is not None:
            raw = {**raw, "_generation_eos_token_id": gen["eos_token_id"]}
    return ModelConfig.from_dict(raw) if overrides is None else with_overrides(raw, overrides)


def with_overrides(raw: dict[str, Any], overrides: Mapping[str, Any]) -> ModelConfig:
    """``raw`` (a ``config.json`` dict) with ``overrides`` merged in, parsed and validated. Raises
    :class:`ConfigError` for a bad result (naming the field) or an override key that no field reads."""
    if not isinstance(overrides, Mapping):
        raise ConfigError(f"hf_overrides: expected a JSON object, got {overrides!r}")
    merged = dict(raw)
    text = merged.get("text_config")
    if isinstance(text, dict):
        merged["text_config"] = text = dict(text)
    for key, value in overrides.items():
        key = _REFERENCE_ALIASES.get(key, key)  # `dim` overrides hidden_size whichever spelling the file uses
        target = text if isinstance(text, dict) and key in text else merged
        old = target.get(key)
        target[key] = {**old, **value} if isinstance(old, dict) and isinstance(value, Mapping) else value
    cfg, read = _parse_tracked(merged)
    unread = [k for k in overrides if _REFERENCE_ALIASES.get(k, k) not in read]
    if unread:
        raise ConfigError(f"hf_overrides: {unread[0]!r} is not a config field v41 reads (docs/model.md §1), so "
                          f"overriding it would change nothing")
    return cfg


def _read_json_object(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


# --------------------------------------------------------------------------------------------------
class _Tracked(dict):
    """The flattened config; records every key the reader looks at (``read``), so overrides that nothing
    reads are caught (:func:`with_overrides`)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.read: set[str] = {"model_type", "text_config"}

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(key)  # type: ignore[arg-type]
        return super().__contains__(key)


def _flatten(raw: dict[str, Any]) -> tuple[str, _Tracked]:
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type not in (ARCH_V4, ARCH_V41):
        raise ConfigError(f"model_type: expected {ARCH_V4!r} or {ARCH_V41!r}, got {model_type!r}")
    flat = _Tracked(raw)
    text = raw.get("text_config")
    if isinstance(text, dict):
        # Top-level token ids apply unless the text config repeats them.
        flat = _Tracked({**{k: v for k, v in raw.items() if k != "text_config"}, **text})
    elif text is not None:
        raise ConfigError(f"text_config: expected an object, got {text!r}")
    aliases = {}
    for ref_name, hf_name in _REFERENCE_ALIASES.items():
        if ref_name in flat and hf_name not in flat:
            flat[hf_name] = flat[ref_name]
            aliases[hf_name] = ref_name
    flat["_aliases"] = aliases
    return model_type, flat


_REQUIRED = object()
_KIND_NAMES = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string",
               list: "a list of integers", dict: "an object"}


def _convert(value: Any, kind: type, name: str, note: str = "") -> Any:
    """``value`` as ``kind`` (int, float, bool, str, dict, or list = tuple of ints), else ConfigError starting
    with ``name``. Integral floats count as integers (``64.0``; ``64.5`` is rejected); bools are never numbers."""
    ok = False
    if kind is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            value, ok = int(value), True
        elif isinstance(value, float) and value.is_integer():
            value, ok = int(value), True
    elif kind is float:
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
            value, ok = float(value), True
    elif kind is list:
        if isinstance(value, (list, tuple)):
            return tuple(_convert(x, int, f"{name}[{i}]", note) for i, x in enumerate(value))
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ConfigError(f"{name}: expected {_KIND_NAMES[kind]}, got {value!r}" + (f" {note}" if note else ""))
    return value


def _get(flat: dict[str, Any], name: str, kind: type, default: Any = _REQUIRED) -> Any:
    """The one typed field read: ``flat[name]`` converted to ``kind`` (see :func:`_convert`).

    ``null`` counts as absent; an absent field gives ``default``, or ConfigError when it is required. Error
    messages start with ``name`` (and mention the reference spelling when the config used it).
    """
    value = flat.get(name)
    if value is None:
        if default is _REQUIRED:
            raise ConfigError(f"{name}: required field missing")
        return default
    alias = flat.get("_aliases", {}).get(name)
    return _convert(value, kind, name, "" if alias is None else f"(given as {alias!r})")


def _rope_scaling(flat: dict[str, Any]) -> RopeScaling | None:
    rp = flat.get("rope_parameters")
    if rp is not None and not isinstance(rp, dict):
        raise ConfigError(f"rope_parameters: expected an object, got {rp!r}")
    if isinstance(rp, dict) and isinstance(rp.get("compress"), dict):
        rs = rp["compress"]
        flat.setdefault("compress_rope_theta", rs.get("rope_theta"))
        if isinstance(rp.get("main"), dict):
            flat.setdefault("rope_theta", rp["main"].get("rope_theta"))
    else:
        rs = flat.get("rope_scaling") or rp
    if not rs and flat.get("rope_factor") is not None:
        # Official reference spelling (§1.1): flat rope_factor / original_seq_len / beta_fast / beta_slow.
        rs = {"rope_type": "yarn", "factor": flat["rope_factor"],
              "beta_fast": flat.get("beta_fast", 32), "beta_slow": flat.get("beta_slow", 1)}
        if flat.get("original_seq_len") is not None:
            rs["original_max_position_embeddings"] = flat["original_seq_len"]
    if not rs:
        return None
    if not isinstance(rs, dict):
        raise ConfigError(f"rope_scaling: expected an object, got {rs!r}")
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ConfigError(f"rope_scaling.rope_type: only 'yarn' is supported, got {kind!r}")
    if rs.get("attention_factor", 1.0) not in (1, 1.0, None):
        raise ConfigError("rope_scaling.attention_factor: DeepSeek-V4/V4.1 use no mscale (must be 1.0)")
    sub = {k: rs.get(k) for k in ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings")}

    def get(name: str, kind: type, default: Any = _REQUIRED) -> Any:
        try:
            return _get(sub, name, kind, default)
        except ConfigError as e:
            raise ConfigError(f"rope_scaling.{e}" + (" for yarn" if default is _REQUIRED and sub.get(name) is None
                                                     else "")) from None

    scaling = RopeScaling(factor=get("factor", float), beta_fast=get("beta_fast", float, 32.0),
                          beta_slow=get("beta_slow", float, 1.0),
                          original_max_position_embeddings=get("original_max_position_embeddings", int))
    _check(scaling.factor > 0, "rope_scaling.factor", f"must be positive, got {scaling.factor}")
    _check(scaling.original_max_position_embeddings > 0, "rope_scaling.original_max_position_embeddings",
           f"must be positive, got {scaling.original_max_position_embeddings}")
    return scaling


def _v4_types_from_ratios(backbone: tuple[int, ...]) -> tuple[str, ...]:
    """V4 attention type per layer from bare ``compress_ratios``: with two distinct nonzero rates the smaller is
    CSA and the larger HCA; a single rate is HCA when it is 128 or more (V4's HCA rate), else CSA."""
    nonzero = sorted({r for r in backbone if r > 0})
    _check(len(nonzero) <= 2, "compress_ratios", f"V4 has at most two compressed rates (CSA, HCA), got {nonzero}")
    csa = min(nonzero) if len(nonzero) == 2 else (nonzero[0] if nonzero and nonzero[0] < 128 else None)
    return tuple("swa" if r == 0 else ("csa" if r == csa else "hca") for r in backbone)


def _v4_layers(flat: dict[str, Any], n_layers: int, n_mtp: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(compress_ratios, layer_types) of a V4 config from ``compress_ratios`` and/or HF ``layer_types``."""
    ratios = _get(flat, "compress_ratios", list, None)
    hf_types = flat.get("layer_types")
    if hf_types is None:
        if ratios is None:
            raise ConfigError("compress_ratios: required field missing (and no layer_types to derive it from)")
        _check(len(ratios) >= n_layers, "compress_ratios",
               f"has {len(ratios)} entries, fewer than num_hidden_layers={n_layers}")
        return ratios, _v4_types_from_ratios(ratios[:n_layers])
    _check(isinstance(hf_types, (list, tuple)) and all(isinstance(t, str) for t in hf_types), "layer_types",
           f"expected a list of strings, got {hf_types!r}")
    _check(len(hf_types) >= n_layers, "layer_types",
           f"has {len(hf_types)} entries, fewer than num_hidden_layers={n_layers}")
    hf_types = list(hf_types[:n_layers])  # transformers keeps the first num_hidden_layers entries
    for t in hf_types:
        _check(t in _HF_LAYER_TYPES, "layer_types", f"unknown layer type {t!r}")
    rates_raw = _get(flat, "compress_rates", dict, {})
    rates = {**_HF_DEFAULT_COMPRESS_RATES}
    for key, value in rates_raw.items():
        _check(key in _HF_DEFAULT_COMPRESS_RATES, "compress_rates", f"unknown layer type {key!r}")
        rates[key] = _convert(value, int, f"compress_rates.{key}")
        _check(rates[key] > 0, f"compress_rates.{key}", f"must be positive, got {rates[key]}")
    derived = tuple(0 if t == "sliding_attention" else rates[t] for t in hf_types)
    if ratios is None:
        ratios = derived + (0,) * n_mtp
    else:
        _check(len(ratios) >= n_layers, "compress_ratios",
               f"has {len(ratios)} entries, fewer than num_hidden_layers={n_layers}")
        for i, (r, d) in enumerate(zip(ratios, derived)):
            _check(r == d, "layer_types", f"layer {i} is {hf_types[i]} (rate {d}) but compress_ratios says {r}")
    return ratios, tuple(_HF_LAYER_TYPES[t] for t in hf_types)


def _v4_hash_layers(flat: dict[str, Any], n_layers: int) -> int:
    mlp_types = flat.get("mlp_layer_types")
    if mlp_types is None:
        return _get(flat, "num_hash_layers", int, 3)
    _check(isinstance(mlp_types, (list, tuple)) and all(t in ("hash_moe", "moe") for t in mlp_types),
           "mlp_layer_types", f"expected a list of 'hash_moe' / 'moe', got {mlp_types!r}")
    _check(len(mlp_types) >= n_layers, "mlp_layer_types",
           f"has {len(mlp_types)} entries, fewer than num_hidden_layers={n_layers}")
    mlp_types = list(mlp_types[:n_layers])
    n_hash = sum(t == "hash_moe" for t in mlp_types)
    _check(mlp_types == ["hash_moe"] * n_hash + ["moe"] * (n_layers - n_hash), "mlp_layer_types",
           "hash_moe layers must come first")
    return n_hash


def _eos_ids(flat: dict[str, Any]) -> tuple[int, ...]:
    if flat.get("_generation_eos_token_id") is not None:
        eos, note = flat["_generation_eos_token_id"], "(in generation_config.json)"
    else:
        eos, note = flat.get("eos_token_id", 1), ""
    if eos is None:
        eos = 1
    ids = _convert(eos, list if isinstance(eos, (list, tuple)) else int, "eos_token_id", note)
    ids = (ids,) if isinstance(ids, int) else ids
    _check(len(ids) > 0, "eos_token_id", "must not be an empty list")
    return tuple(dict.fromkeys(ids))


def _parse(raw: dict[str, Any]) -> ModelConfig:
    return _parse_tracked(raw)[0]


def _parse_tracked(raw: dict[str, Any]) -> tuple[ModelConfig, set[str]]:
    """The config and the top-level (flattened) keys its reader looked at."""
    arch, flat = _flatten(raw)

    def get(name: str, kind: type, default: Any = _REQUIRED) -> Any:
        return _get(flat, name, kind, default)

    n_layers = get("num_hidden_layers", int)
    head_dim = get("head_dim", int)
    if flat.get("qk_rope_head_dim") is not None:
        rope_dim = get("qk_rope_head_dim", int)
    elif flat.get("partial_rotary_factor") is not None:
        prf = get("partial_rotary_factor", float)
        rope_dim = round(head_dim * prf)
        _check(abs(head_dim * prf - rope_dim) < 1e-6, "partial_rotary_factor",
               f"head_dim={head_dim} x {prf} is not a whole number of dims")
    else:
        rope_dim = 64
    kv_heads = get("num_key_value_heads", int, 1)
    _check(kv_heads == 1, "num_key_value_heads", f"DeepSeek-V4/V4.1 attention is MQA (1), got {kv_heads}")
    rope_scaling = _rope_scaling(flat)
    quant = get("quantization_config", dict, {})
    block = _get(quant, "weight_block_size", list, (128, 128))
    _check(len(block) == 2 and all(b > 0 for b in block), "weight_block_size",
           f"expected two positive integers [rows, cols], got {list(block)}")
    expert_dtype = _get(quant, "expert_dtype", str, None) or get("expert_dtype", str, "fp4")
    n_mtp = get("num_nextn_predict_layers", int, 0)
    if arch == ARCH_V4:
        ratios, layer_types = _v4_layers(flat, n_layers, n_mtp)
        n_hash = _v4_hash_layers(flat, n_layers)
    else:
        ratios, layer_types = get("compress_ratios", list), ()
        n_hash = 0

    cfg = ModelConfig(
        arch=arch,
        vocab_size=get("vocab_size", int),
        hidden_size=get("hidden_size", int),
        moe_intermediate_size=get("moe_intermediate_size", int),
        num_hidden_layers=n_layers,
        num_attention_heads=get("num_attention_heads", int),
        head_dim=head_dim,
        qk_rope_head_dim=rope_dim,
        q_lora_rank=get("q_lora_rank", int),
        o_lora_rank=get("o_lora_rank", int),
        o_groups=get("o_groups", int),
        n_routed_experts=get("n_routed_experts", int),
        n_shared_experts=get("n_shared_experts", int, 1),
        num_experts_per_tok=get("num_experts_per_tok", int),
        scoring_func=get("scoring_func", str, "sqrtsoftplus"),
        norm_topk_prob=get("norm_topk_prob", bool, True),
        routed_scaling_factor=get("routed_scaling_factor", float, 1.5),
        swiglu_limit=get("swiglu_limit", float, 10.0),
        rms_norm_eps=get("rms_norm_eps", float, 1e-6),
        rope_theta=get("rope_theta", float, 10000.0),
        compress_rope_theta=get("compress_rope_theta", float, 160000.0),
        rope_scaling=rope_scaling,
        sliding_window=get("sliding_window", int),
        compress_ratios=ratios,
        hc_mult=get("hc_mult", int, 4),
        hc_sinkhorn_iters=get("hc_sinkhorn_iters", int, 20),
        hc_eps=get("hc_eps", float, 1e-6),
        index_n_heads=get("index_n_heads", int, 64),
        index_head_dim=get("index_head_dim", int, 128),
        index_topk=get("index_topk", int, 512),
        max_position_embeddings=get("max_position_embeddings", int, 1 << 20),
        bos_token_id=get("bos_token_id", int, 0),
        eos_token_ids=_eos_ids(flat),
        pad_token_id=get("pad_token_id", int, None),
        gate_temp=get("gate_temp", float, 1.0),
        num_nextn_predict_layers=n_mtp,
        weight_block_size=(block[0], block[1]),
        expert_dtype=expert_dtype,
        num_hash_layers=n_hash,
        layer_types=layer_types,
        kv_source_layer_ids=get("kv_source_layer_ids", list, ()),
        index_source_layer_ids=get("index_source_layer_ids", list, ()),
        candidate_source_layer_id=get("candidate_source_layer_id", int, -1),
        candidate_topk_blocks=get("candidate_topk_blocks", int, 0),
        candidate_block_size=get("candidate_block_size", int, 1),
        engram_layer_ids=get("engram_layer_ids", list, ()),
        engram_num_embeddings=get("engram_num_embeddings", list, ()),
        engram_max_ngram_size=get("engram_max_ngram_size", int, 0),
        engram_vocab_size=get("engram_vocab_size", int, 0),
        engram_n_heads=get("engram_n_heads", int, 0),
        engram_head_dim=get("engram_head_dim", int, 0),
        engram_pad_token_id=get("engram_pad_token_id", int, 2),
        engram_compressed_vocab_size=get("engram_compressed_vocab_size", int, 0),
        dspark_block_size=get("dspark_block_size", int, 0),
        dspark_noise_token_id=get("dspark_noise_token_id", int, -1),
        dspark_target_layer_ids=get("dspark_target_layer_ids", list, ()),
        dspark_markov_rank=get("dspark_markov_rank", int, 0),
        dspark_n_routed_experts=get("dspark_n_routed_experts", int, 0),
        dspark_num_experts_per_tok=get("dspark_num_experts_per_tok", int, 0),
        image_token_id=get("image_token_id", int, None),
    )
    # The LM head computes float32 logits (float64 in a float64 model), as the reference upcasts (docs/model.md
    # §1.1 head_dtype, §2); a config asking for another head dtype (Aphrodite's field) cannot be honoured.
    head_dtype = get("head_dtype", str, "float32")
    _check(head_dtype == "float32", "head_dtype", f"v41 computes the LM head in float32, got {head_dtype!r}")
    _validate_common(cfg)
    plan = _plan_v41(cfg) if cfg.is_v41 else _plan_v4(cfg)
    object.__setattr__(cfg, "plan", tuple(plan))
    return cfg, flat.read


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {msg}")


def _check_token_id(c: ModelConfig, name: str, value: int) -> None:
    _check(0 <= value < c.vocab_size, name, f"{value} outside the vocabulary [0, vocab_size={c.vocab_size})")


def _validate_common(c: ModelConfig) -> None:
    for f in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
              "num_attention_heads", "head_dim", "q_lora_rank", "o_lora_rank", "o_groups",
              "n_routed_experts", "num_experts_per_tok", "sliding_window", "hc_mult", "hc_sinkhorn_iters",
              "index_n_heads", "index_head_dim"):
        _check(getattr(c, f) > 0, f, f"must be positive, got {getattr(c, f)}")
    _check(c.num_nextn_predict_layers >= 0, "num_nextn_predict_layers",
           f"must not be negative, got {c.num_nextn_predict_layers}")
    _check(c.scoring_func == "sqrtsoftplus", "scoring_func", f"only sqrtsoftplus is supported, got {c.scoring_func!r}")
    _check(c.expert_dtype in EXPERT_DTYPES, "expert_dtype", f"expected one of {EXPERT_DTYPES}, got {c.expert_dtype!r}")
    _check(c.head_dim % 2 == 0, "head_dim", f"must be even, got {c.head_dim}")
    _check(0 < c.qk_rope_head_dim <= c.head_dim and c.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim",
           f"must be even and in (0, head_dim={c.head_dim}], got {c.qk_rope_head_dim}")
    _check(c.num_attention_heads % c.o_groups == 0, "o_groups",
           f"num_attention_heads={c.num_attention_heads} is not divisible by o_groups={c.o_groups}")
    _check(c.num_experts_per_tok <= c.n_routed_experts, "num_experts_per_tok",
           f"{c.num_experts_per_tok} exceeds n_routed_experts={c.n_routed_experts}")
    _check(c.n_shared_experts in (0, 1), "n_shared_experts", f"0 or 1 supported, got {c.n_shared_experts}")
    _check(len(c.compress_ratios) >= c.num_hidden_layers, "compress_ratios",
           f"has {len(c.compress_ratios)} entries, fewer than num_hidden_layers={c.num_hidden_layers}")
    _check(all(r >= 0 for r in c.compress_ratios), "compress_ratios",
           f"ratios must not be negative, got {list(c.compress_ratios)}")
    _check(c.index_head_dim >= c.qk_rope_head_dim, "index_head_dim",
           f"{c.index_head_dim} is smaller than qk_rope_head_dim={c.qk_rope_head_dim}")
    _check(c.gate_temp > 0, "gate_temp", f"must be positive, got {c.gate_temp}")
    _check(c.index_topk > 0, "index_topk", f"must be positive, got {c.index_topk}")
    _check_token_id(c, "bos_token_id", c.bos_token_id)
    for eos in c.eos_token_ids:
        _check_token_id(c, "eos_token_id", eos)
    if c.pad_token_id is not None:
        _check_token_id(c, "pad_token_id", c.pad_token_id)
    _check_token_id(c, "engram_pad_token_id", c.engram_pad_token_id)
    if c.has_dspark or c.dspark_noise_token_id != -1:
        _check_token_id(c, "dspark_noise_token_id", c.dspark_noise_token_id)


def _plan_v4(c: ModelConfig) -> list[LayerPlan]:
    _check(c.num_hash_layers <= c.num_hidden_layers, "num_hash_layers",
           f"{c.num_hash_layers} exceeds num_hidden_layers={c.num_hidden_layers}")
    _check(c.num_hash_layers >= 0, "num_hash_layers", f"must not be negative, got {c.num_hash_layers}")
    plan = []
    for i, (r, kind) in enumerate(zip(c.compress_ratios[: c.num_hidden_layers], c.layer_types)):
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
        # §3.7: the kept blocks must always hold index_topk reachable positions, counting the pinned newest
        # block as a single entry; else a filtered layer's top-k would pick masked (-inf) positions.
        kept = c.candidate_topk_blocks * c.candidate_block_size - (c.candidate_block_size - 1)
        _check(kept >= c.index_topk, "candidate_topk_blocks",
               f"candidate_topk_blocks={c.candidate_topk_blocks} x candidate_block_size={c.candidate_block_size} "
               f"guarantees only {kept} positions (the pinned newest block may hold one), fewer than "
               f"index_topk={c.index_topk}")
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
        stages = list(c.compress_ratios[n:n + c.num_nextn_predict_layers])
        _check(all(r == 0 for r in stages), "compress_ratios",
               f"DSpark stages attend over their sliding window only (docs/model.md §1.4): the entries "
               f"after the {n} backbone layers must be 0, got {stages}")
        _check(0 <= c.dspark_noise_token_id < c.vocab_size, "dspark_noise_token_id",
               f"{c.dspark_noise_token_id} outside the vocabulary")
        _check(0 < c.dspark_num_experts_per_tok <= c.dspark_n_routed_experts, "dspark_num_experts_per_tok",
               "must be in (0, dspark_n_routed_experts]")
        _check(c.dspark_markov_rank > 0, "dspark_markov_rank", "must be positive")
    return plan


def yarn_inv_freq(rope_dim: int, base: float, scaling: RopeScaling | None) -> list[float]:
    """Inverse frequencies ``f_i`` (i = 0..rope_dim/2-1) with the YaRN correction of docs/model.md §2.

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
