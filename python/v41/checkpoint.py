"""Loading sharded safetensors checkpoints (v41-architecture.md §5).

Shards are read one tensor at a time through ``model.safetensors.index.json`` (or a single
``model.safetensors``), so peak memory is about one tensor plus the model. Names may be bare (V4.1, V4) or
transformers-style; V4's ``mtp.*`` and V4.1's vision tensors are read past and ignored. Quantized weights
are dequantized to the requested dtype: FP8 E4M3 with E8M0 block scales, MXFP4 experts (I8 reinterpreted
as uint8, low nibble = even element, one E8M0 scale per 32 inputs).

Errors: :class:`CheckpointError` (a ``ValueError``) naming the tensor(s) or file: missing tensors, unexpected
tensors (listed), shape or dtype mismatches, unreadable or truncated shards.
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
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names the tensors or file."""


def shard_files(path: str | Path) -> dict[str, list[str]]:
    """Shard file name -> tensor names, from the index (or the single file). Raises CheckpointError."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            files.setdefault(fname, []).append(name)
        return files
    if (path / SINGLE_FILE).exists():
        return {SINGLE_FILE: _open(path / SINGLE_FILE).keys()}
    raise CheckpointError(f"{path}: neither {INDEX_FILE} nor {SINGLE_FILE} found")


def _open(file: Path):
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


def dequantize(name: str, weight: torch.Tensor, scale: torch.Tensor | None, cfg: ModelConfig,
               dtype: torch.dtype) -> torch.Tensor:
    """One stored tensor (+ its ``.scale`` sibling) → a dense tensor of ``dtype`` (int64 stays int64).

    Raises CheckpointError when the stored dtype does not fit the tensor's format (§2).
    """
    fmt = storage_format(name, cfg.expert_dtype)
    if weight.dtype == torch.float8_e4m3fn:
        if fmt != "fp8" or scale is None:
            raise CheckpointError(f"{name}: stored as F8_E4M3 but expected {fmt}"
                                  + ("" if scale is not None else " (or its .scale is missing)"))
        return quant.dequant_fp8_block(weight, scale, fp8_block(name, cfg.weight_block_size)).to(dtype)
    if weight.dtype in (torch.int8, torch.uint8):
        if fmt != "mxfp4" or scale is None:
            raise CheckpointError(f"{name}: stored as I8 (MXFP4) but expected {fmt}")
        return quant.dequant_mxfp4(weight, scale).to(dtype)
    if fmt == "i64":
        if weight.dtype not in (torch.int64, torch.int32):
            raise CheckpointError(f"{name}: expected an integer tensor, got {weight.dtype}")
        return weight.long()
    if weight.dtype not in _FLOAT_DTYPES:
        raise CheckpointError(f"{name}: unsupported dtype {weight.dtype} for format {fmt}")
    return weight.to(dtype)


def load_into(model: torch.nn.Module, path: str | Path, cfg: ModelConfig, dtype: torch.dtype) -> None:
    """Fill ``model``'s parameters and buffers (named by bare checkpoint names) from ``path`` in place.

    Every expected tensor must appear exactly once; extra tensors are an error unless ignored for the
    architecture. Raises CheckpointError.
    """
    targets = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    loaded: set[str] = set()
    unexpected: list[str] = []
    pending: dict[str, dict[str, torch.Tensor]] = {}  # base name -> {"weight"/"scale": tensor}
    for stored_name, tensor in iter_raw(path):
        name = hf_to_bare(stored_name)
        if _ignored(name, cfg):
            continue
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            for e, (sub, t) in enumerate(_split_fused(name, tensor)):
                _assign(targets, sub, t.to(dtype), loaded)
            continue
        if name.endswith(".scale") or (tensor.dtype in (torch.float8_e4m3fn, torch.int8, torch.uint8)
                                       and not name.endswith("tid2eid")):
            base = name[: -len(".scale")] + ".weight" if name.endswith(".scale") else name
            slot = pending.setdefault(base, {})
            slot["scale" if name.endswith(".scale") else "weight"] = tensor
            if len(slot) < 2:
                continue
            name, tensor, scale = base, slot["weight"], slot["scale"]
            del pending[base]
        else:
            scale = None
        if name not in targets:
            unexpected.append(stored_name)
            continue
        _assign(targets, name, dequantize(name, tensor, scale, cfg, dtype), loaded)
    for base, slot in pending.items():
        if "weight" not in slot:
            if base not in targets:  # else the weight itself is absent: reported as missing below
                unexpected.append(base[: -len(".weight")] + ".scale")
        else:
            raise CheckpointError(f"{base}: quantized weight without its .scale tensor")
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
