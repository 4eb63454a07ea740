"""Tensor names and on-disk formats of DeepSeek-V4 / V4.1 checkpoints (docs/model.md §2, §5).

v41 uses the **bare** names of the official checkpoints internally (``layers.3.attn.wq_a.weight``). This
module maps transformers-style names (``model.layers.3.self_attn.q_a_proj.weight``) onto them and says
which storage format each tensor has: ``fp8`` (E4M3 + E8M0 block scales), ``mxfp4`` (E2M1 packed in I8 +
E8M0 per 32), ``bf16``, ``f32`` or ``i64``.
"""

from __future__ import annotations

import functools
import re

# transformers `deepseek_v4` names -> bare names (conversion_mapping.py renames only; §5.2).
_HF_RULES: list[tuple[str, str]] = [
    (r"^model\.embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^model\.norm\.weight$", "norm.weight"),
    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"layers.\1.attn_norm."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.ffn_norm."),
    (r"^model\.layers\.(\d+)\.attn_hc\.(fn|base|scale)$", r"layers.\1.hc_attn_\2"),
    (r"^model\.layers\.(\d+)\.ffn_hc\.(fn|base|scale)$", r"layers.\1.hc_ffn_\2"),
    (r"^model\.layers\.(\d+)\.self_attn\.sinks$", r"layers.\1.attn.attn_sink"),
    (r"^model\.layers\.(\d+)\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.",
     r"layers.\1.attn.indexer.weights_proj."),
    (r"^model\.layers\.(\d+)\.self_attn\.compressor\.indexer\.q_b_proj\.", r"layers.\1.attn.indexer.wq_b."),
    (r"^model\.layers\.(\d+)\.self_attn\.compressor\.indexer\.", r"layers.\1.attn.indexer.compressor."),
    (r"^model\.layers\.(\d+)\.self_attn\.compressor\.", r"layers.\1.attn.compressor."),
    (r"^model\.layers\.(\d+)\.self_attn\.q_a_proj\.", r"layers.\1.attn.wq_a."),
    (r"^model\.layers\.(\d+)\.self_attn\.q_a_norm\.", r"layers.\1.attn.q_norm."),
    (r"^model\.layers\.(\d+)\.self_attn\.q_b_proj\.", r"layers.\1.attn.wq_b."),
    (r"^model\.layers\.(\d+)\.self_attn\.kv_proj\.", r"layers.\1.attn.wkv."),
    (r"^model\.layers\.(\d+)\.self_attn\.kv_norm\.", r"layers.\1.attn.kv_norm."),
    (r"^model\.layers\.(\d+)\.self_attn\.o_a_proj\.", r"layers.\1.attn.wo_a."),
    (r"^model\.layers\.(\d+)\.self_attn\.o_b_proj\.", r"layers.\1.attn.wo_b."),
    (r"^model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias$", r"layers.\1.ffn.gate.bias"),
    (r"^model\.layers\.(\d+)\.mlp\.gate\.", r"layers.\1.ffn.gate."),
    (r"^model\.layers\.(\d+)\.mlp\.shared_experts\.gate_proj\.", r"layers.\1.ffn.shared_experts.w1."),
    (r"^model\.layers\.(\d+)\.mlp\.shared_experts\.up_proj\.", r"layers.\1.ffn.shared_experts.w3."),
    (r"^model\.layers\.(\d+)\.mlp\.shared_experts\.down_proj\.", r"layers.\1.ffn.shared_experts.w2."),
    (r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", r"layers.\1.ffn.experts.\2"),
]
# Leaf renames inside compressors (HF -> bare), applied to the part after the last "compressor.".
_HF_LEAF = {"kv_proj": "wkv", "gate_proj": "wgate", "kv_norm": "norm", "position_bias": "ape"}

IGNORED_PREFIXES_V41 = ("vision.", "aligner.", "image_start", "image_end", "image_newline")


def _map_leaf(name: str, table: dict[str, str]) -> str:
    parts = name.split(".")
    if "compressor" not in parts:
        return name
    i = len(parts) - 2 if parts[-1] in ("weight", "scale") else len(parts) - 1
    parts[i] = table.get(parts[i], parts[i])
    return ".".join(parts)


@functools.lru_cache(maxsize=1 << 16)  # the same names come back on every load of a checkpoint
def hf_to_bare(name: str) -> str:
    """Map one transformers-style name to the bare name (already-bare names pass through unchanged).

    ``.weight_scale_inv`` becomes ``.scale``; a ``model.`` prefix on otherwise bare names (V4-0731) is
    dropped. Fused HF expert tensors map to ``layers.L.ffn.experts.gate_up_proj`` / ``down_proj`` and are
    split by the loader.
    """
    name = name.replace(".weight_scale_inv", ".scale")
    for pat, rep in _HF_RULES:
        new, n = re.subn(pat, rep, name)
        if n:
            return _map_leaf(new, _HF_LEAF)
    if name.startswith("model.") and not name.startswith("model.layers.") or \
            re.match(r"^model\.layers\.\d+\.(attn|ffn|hc_)", name):
        return name[len("model."):]
    return name


def bare_to_hf(name: str) -> str:
    """Inverse of :func:`hf_to_bare` for unfused tensors (tests hand weights to transformers with it).
    Raises KeyError for names transformers does not have (V4.1-only tensors, experts)."""
    for pat, rep in _HF_RULES:
        bare_pat = _bare_pattern(rep)
        if bare_pat is None:
            continue
        m = re.match(bare_pat, name)
        if m:
            hf = _hf_template(pat).format(*m.groups())
            hf = hf + name[m.end():]
            return _map_leaf(hf, {v: k for k, v in _HF_LEAF.items()})
    raise KeyError(f"no transformers name for {name!r}")


def _bare_pattern(rep: str) -> str | None:
    """Turn a replacement like ``layers.\\1.attn.wq_a.`` into a regex matching bare names."""
    if "gate_up_proj" in rep or "\\2" in rep and "experts" in rep:
        return None
    if rep.startswith("hc_head_"):
        return r"^hc_head_(fn|base|scale)$"
    out = re.escape(rep)
    out = out.replace(re.escape("\\1"), r"(\d+)").replace(re.escape("\\2"), r"(fn|base|scale)")
    return "^" + out + ("" if rep.endswith(".") else "$")


def _hf_template(pat: str) -> str:
    t = pat.strip("^$").replace(r"\.", ".").replace(r"(\d+)", "{}").replace("(fn|base|scale)", "{}")
    return t


_FP8_LEAVES = re.compile(
    r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123]|engram\.wkv"
    r"|main_proj|e_proj|h_proj)\.weight$")
_F32 = re.compile(r"(hc_(attn|ffn|head)_(fn|base|scale)|attn_sink|ffn\.gate\.bias(_vl)?|\.ape)$")


_EXPERT_FORMATS = {"fp4": "mxfp4", "fp8": "fp8", "bf16": "bf16"}


def storage_format(name: str, expert_dtype: str = "fp4") -> str:
    """On-disk format of a bare tensor name: ``fp8`` | ``mxfp4`` | ``bf16`` | ``f32`` | ``i64`` (§2, §5).

    Routed experts follow ``expert_dtype``: ``fp4`` -> ``mxfp4``, ``fp8`` -> ``fp8``, ``bf16`` -> ``bf16``.
    """
    if name.endswith("tid2eid"):
        return "i64"
    if re.search(r"ffn\.experts\.\d+\.w[123]\.weight$", name):
        return _EXPERT_FORMATS.get(expert_dtype, "fp8")
    if _FP8_LEAVES.search(name) or name.endswith("engram.embed.weight"):
        return "fp8"
    if _F32.search(name):
        return "f32"
    return "bf16"


def fp8_block(name: str, weight_block_size: tuple[int, int]) -> tuple[int, int]:
    """Scale-grid block of an FP8 tensor: Engram tables carry one scale per 32 along a row; others use
    the config's ``weight_block_size``."""
    return (1, 32) if name.endswith("engram.embed.weight") else weight_block_size
