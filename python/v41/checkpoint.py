"""Loading sharded safetensors checkpoints (v41-architecture.md §5).

Shards are read one tensor at a time through ``model.safetensors.index.json`` (or a single
``model.safetensors``), so peak memory is about one tensor plus the model. Names may be bare (V4.1, V4) or
transformers-style; V4's ``mtp.*`` and V4.1's vision tensors are read past and ignored. Quantized weights
are dequantized to the requested dtype: FP8 E4M3 with E8M0 block scales, MXFP4 experts (I8 reinterpreted
as uint8, low nibble = even element, one E8M0 scale per 32 inputs).

Stored dtypes are checked against :func:`~v41.checkpoint_names.storage_format`: ``f32`` tensors must be F32;
``bf16`` tensors BF16 or F32 (dequantized exports); ``fp8`` weights F8_E4M3 with a ``.scale``, or BF16/F32
without one; ``mxfp4`` weights I8 (or U8) with a ``.scale``, or BF16/F32; ``i64`` tensors I64 or I32. Scales
must be F8_E8M0 (or U8 raw exponent bytes).

Errors: :class:`CheckpointError` (a ``ValueError``) naming the tensor(s) or file: missing tensors, unexpected
tensors (listed: unknown names, a ``.scale`` beside an unquantized weight, tensors a shard holds but the index
does not list), shape or dtype mismatches (tensor, stored dtype, expected format), bad scales, unreadable or
truncated shards, a malformed index.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from . import quant
from .checkpoint_names import IGNORED_PREFIXES_V41, fp8_block, hf_to_bare, storage_format
from .config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.int8, torch.uint8)
_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8)
# storage format -> stored dtypes accepted (quantized ones need a .scale sibling)
_ALLOWED_DTYPES = {
    "f32": (torch.float32,),
    "bf16": (torch.bfloat16, torch.float32),
    "fp8": (torch.float8_e4m3fn, torch.bfloat16, torch.float32),
    "mxfp4": (torch.int8, torch.uint8, torch.bfloat16, torch.float32),
    "i64": (torch.int64, torch.int32),
}
_ST_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
             torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.float8_e8m0fnu: "F8_E8M0",
             torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
             torch.bool: "BOOL"}


def _dtype_name(dtype: torch.dtype) -> str:
    """The safetensors spelling of a torch dtype (``F8_E4M3``, ``BF16``, ...)."""
    return _ST_NAMES.get(dtype, str(dtype).removeprefix("torch."))


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names the tensors or file."""


def shard_files(path: str | Path) -> dict[str, list[str]]:
    """Shard file name -> tensor names, from the index (or the single file). Raises CheckpointError."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.exists():
        weight_map = _read_weight_map(index)
        files: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            files.setdefault(fname, []).append(name)
        return files
    if (path / SINGLE_FILE).exists():
        return {SINGLE_FILE: _open(path / SINGLE_FILE).keys()}
    raise CheckpointError(f"{path}: neither {INDEX_FILE} nor {SINGLE_FILE} found")


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{index}: not valid JSON ({e})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: no 'weight_map' object (tensor name -> shard file)")
    bad = sorted(k for k, v in weight_map.items() if not isinstance(v, str) or not v)
    if bad:
        raise CheckpointError(f"{index}: weight_map entries without a shard file name: {bad[:20]}")
    return weight_map


def _open(file: Path):
    if not file.is_file():
        raise CheckpointError(f"{file.name}: shard file not found in {file.parent}")
    try:
        return safe_open(str(file), framework="pt")
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
        raise CheckpointError(f"{file.name}: unreadable or truncated safetensors file ({e})") from None


def iter_raw(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name as stored, tensor)`` shard by shard, in shard order."""
    path = Path(path)
    for fname, names in shard_files(path).items():
        f = _open(path / fname)
        stored = set(f.keys())
        unindexed = sorted(stored - set(names))
        if unindexed:
            raise CheckpointError(f"{fname}: unexpected tensors not listed in {INDEX_FILE} (unindexed, "
                                  f"{len(unindexed)}): {unindexed[:20]}")
        for name in names:
            if name not in stored:
                raise CheckpointError(f"{fname}: index lists {name!r} but the shard does not hold it")
            try:
                yield name, f.get_tensor(name)
            except Exception as e:
                raise CheckpointError(f"{fname}: tensor {name!r} could not be read ({e}); file truncated?") \
                    from None


def _ignored(name: str, cfg: ModelConfig) -> bool:
    if not cfg.is_v41:
        return name.startswith("mtp.")
    return name.startswith(IGNORED_PREFIXES_V41) or (name.startswith("mtp.") and not cfg.has_dspark)


def _check_dtype(name: str, weight: torch.Tensor, fmt: str) -> None:
    if weight.dtype not in _ALLOWED_DTYPES[fmt]:
        allowed = "/".join(_dtype_name(d) for d in _ALLOWED_DTYPES[fmt])
        raise CheckpointError(f"{name}: stored as {_dtype_name(weight.dtype)}, but its format is {fmt} "
                              f"(expected {allowed})")


def dequantize(name: str, weight: torch.Tensor, scale: torch.Tensor | None, cfg: ModelConfig,
               dtype: torch.dtype, scale_name: str | None = None) -> torch.Tensor:
    """One stored tensor (+ its ``.scale`` sibling) → a dense tensor of ``dtype`` (int64 stays int64).

    Raises CheckpointError naming the tensor when the stored dtype does not fit the tensor's format (§2), when
    a quantized weight lacks its scale or an unquantized one has one, when the scale is not E8M0, or when the
    codec rejects the pair (e.g. a scale of the wrong shape). ``scale_name`` names the scale in errors
    (default: ``name`` with ``.weight`` replaced by ``.scale``).
    """
    fmt = storage_format(name, cfg.expert_dtype)
    _check_dtype(name, weight, fmt)
    scale_name = scale_name or name.removesuffix(".weight") + ".scale"
    quantized = weight.dtype in _QUANTIZED_DTYPES and fmt in ("fp8", "mxfp4")
    if not quantized:
        if scale is not None:
            raise CheckpointError(f"unexpected tensors (1): [{scale_name!r}] (a scale, but {name} is stored "
                                  f"unquantized as {_dtype_name(weight.dtype)})")
        if fmt == "i64":
            return weight.long()
        return weight.to(dtype)
    if scale is None:
        raise CheckpointError(f"{name}: quantized weight ({_dtype_name(weight.dtype)}) without its .scale tensor")
    if scale.dtype not in _SCALE_DTYPES:
        raise CheckpointError(f"{scale_name}: scale stored as {_dtype_name(scale.dtype)}, expected F8_E8M0 "
                              "(or U8 exponent bytes)")
    try:
        if fmt == "fp8":
            out = quant.dequant_fp8_block(weight, scale, fp8_block(name, cfg.weight_block_size))
        else:
            out = quant.dequant_mxfp4(weight, scale)
    except (ValueError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"{name}: cannot dequantize {fmt} weight {tuple(weight.shape)} with scale "
                              f"{scale_name} {tuple(scale.shape)}: {e}") from None
    return out.to(dtype)


def load_into(model: torch.nn.Module, path: str | Path, cfg: ModelConfig, dtype: torch.dtype) -> None:
    """Fill ``model``'s parameters and buffers (named by bare checkpoint names) from ``path`` in place.

    Every expected tensor must appear exactly once; extra tensors are an error unless ignored for the
    architecture. Raises CheckpointError.
    """
    targets = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    loaded: set[str] = set()
    unexpected: list[str] = []
    # base weight name -> {"weight"/"scale": (name as stored, tensor)}; a weight waits here only when stored in a
    # quantized dtype, a scale until its weight arrives
    pending: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    for stored_name, tensor in iter_raw(path):
        name = hf_to_bare(stored_name)
        if _ignored(name, cfg):
            continue
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            _check_dtype(stored_name, tensor, "bf16")  # HF fused experts: dequantized exports only
            for sub, t in _split_fused(name, tensor):
                _assign(targets, sub, t.to(dtype), loaded)
            continue
        is_scale = name.endswith(".scale")
        if is_scale or (tensor.dtype in _QUANTIZED_DTYPES and not name.endswith("tid2eid")):
            base = name.removesuffix(".scale") + ".weight" if is_scale else name
            slot = pending.setdefault(base, {})
            slot["scale" if is_scale else "weight"] = (stored_name, tensor)
            if len(slot) < 2:
                continue
            del pending[base]
            if base not in targets:
                unexpected.extend(n for n, _ in slot.values())
                continue
            (_, weight), (scale_stored, scale) = slot["weight"], slot["scale"]
            _assign(targets, base, dequantize(base, weight, scale, cfg, dtype, scale_stored), loaded)
            continue
        if name not in targets:
            unexpected.append(stored_name)
            continue
        _assign(targets, name, dequantize(name, tensor, None, cfg, dtype), loaded)
    for base, slot in pending.items():
        if "weight" in slot:
            if base not in targets:
                unexpected.append(slot["weight"][0])
            else:  # dtype error (e.g. F8 where bf16 is expected) or a quantized weight without its scale
                dequantize(base, slot["weight"][1], None, cfg, dtype)
        elif base in loaded or base not in targets:
            # a scale beside an unquantized weight, or beside no known weight at all
            unexpected.append(slot["scale"][0])
        # else: the weight itself is absent, reported as missing below
    if unexpected:
        raise CheckpointError(f"unexpected tensors ({len(unexpected)}): {sorted(unexpected)[:20]}")
    missing = sorted(set(targets) - loaded)
    if missing:
        raise CheckpointError(f"missing tensors ({len(missing)}): {missing[:20]}")


def _assign(targets: dict[str, torch.Tensor], name: str, value: torch.Tensor, loaded: set[str]) -> None:
    if name not in targets:
        raise CheckpointError(f"unexpected tensors (1): [{name!r}]")
    dst = targets[name]
    if tuple(dst.shape) != tuple(value.shape):
        raise CheckpointError(f"{name}: shape {tuple(value.shape)} in checkpoint, expected {tuple(dst.shape)}")
    if name in loaded:
        raise CheckpointError(f"{name}: appears twice in the checkpoint")
    with torch.no_grad():
        dst.copy_(value.to(dst.dtype) if dst.dtype == torch.int64 else value)
    loaded.add(name)


def _split_fused(name: str, t: torch.Tensor):
    """HF fused experts ``gate_up_proj [E, 2I, D]`` / ``down_proj [E, D, I]`` → per-expert bare names."""
    prefix = name.rsplit(".", 1)[0]
    for e in range(t.shape[0]):
        if name.endswith("gate_up_proj"):
            w1, w3 = t[e].chunk(2, dim=0)
            yield f"{prefix}.{e}.w1.weight", w1
            yield f"{prefix}.{e}.w3.weight", w3
        else:
            yield f"{prefix}.{e}.w2.weight", t[e]
