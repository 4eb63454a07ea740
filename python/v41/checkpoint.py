"""Loading sharded safetensors checkpoints (docs/model.md §5).

Shards are read one tensor at a time through ``model.safetensors.index.json`` (or a single
``model.safetensors``), so peak memory is about one tensor plus the model. Names may be bare (V4.1, V4) or
transformers-style; V4's ``mtp.*`` and V4.1's vision tensors are read past and ignored. Quantized weights
are dequantized to the requested dtype: FP8 E4M3 with E8M0 block scales, MXFP4 experts (I8 reinterpreted
as uint8, low nibble = even element, one E8M0 scale per 32 inputs).

Stored dtypes are checked against :func:`~v41.checkpoint_names.storage_format`: ``f32`` tensors must be F32;
``bf16`` tensors BF16 or F32 (dequantized exports); ``fp8`` weights F8_E4M3 with a ``.scale``, or BF16/F32
without one; ``mxfp4`` weights I8 (or U8) with a ``.scale``, or BF16/F32; ``i64`` tensors I64 or I32. Scales
must be F8_E8M0 (or U8 raw exponent bytes).

Tensor parallelism: given a rank's shard plan (bare name → :class:`~v41.distributed.group.Shard`,
:func:`v41.models.reference.sharding.shard_plan`), sharded tensors are read as slices (``safe_open(...)
.get_slice``), never whole. A quantized weight is read over the quantization-block-aligned range enclosing the
slice together with the matching rows/columns of its ``.scale`` (FP8: the tensor's scale-grid block along the
sharded dim; MXFP4 along the input dim: two values per packed byte, one scale per 32 inputs), dequantized,
then cut to the exact slice. Shape checks compare the stored tensor with the full (unsharded) shape.

Errors: :class:`CheckpointError` (a ``ValueError``) naming the tensor(s) or file: missing tensors, unexpected
tensors (listed: unknown names, a ``.scale`` beside an unquantized weight, tensors a shard holds but the index
does not list), shape or dtype mismatches (tensor, stored dtype, expected format), bad scales, unreadable or
truncated shards, a malformed index.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from . import quant
from .checkpoint_names import IGNORED_PREFIXES_V41, fp8_block, hf_to_bare, storage_format
from .config import ModelConfig
from .distributed.group import Shard

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
_ST_DTYPES = {v: k for k, v in _ST_NAMES.items()}
_MX_BLOCK = 32  # MXFP4: inputs per E8M0 scale (two per packed byte)


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


class StoredTensor:
    """One tensor of an open shard, read on demand: whole (:meth:`read`) or a slice (``read(index)``).

    ``shape`` and ``dtype`` come from the shard header (no data read). Read errors become CheckpointError
    naming the file and the tensor.
    """

    def __init__(self, f, fname: str, name: str):
        self.f, self.fname, self.name = f, fname, name
        try:
            meta = f.get_slice(name)
            self.shape = tuple(int(n) for n in meta.get_shape())
            self._dtype = _ST_DTYPES.get(meta.get_dtype())
        except Exception as e:
            raise self._error(e) from None

    @property
    def dtype(self) -> torch.dtype:
        if self._dtype is None:  # a dtype without a torch spelling in _ST_NAMES: ask torch
            self._dtype = self.read().dtype
        return self._dtype

    def read(self, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The whole tensor, or ``tensor[index]`` read through ``get_slice`` (contiguous)."""
        try:
            if index is None:
                return self.f.get_tensor(self.name)
            return self.f.get_slice(self.name)[index].contiguous()
        except Exception as e:
            raise self._error(e) from None

    def _error(self, e: Exception) -> CheckpointError:
        return CheckpointError(f"{self.fname}: tensor {self.name!r} could not be read ({e}); file truncated?")


def iter_stored(path: str | Path) -> Iterator[tuple[str, StoredTensor]]:
    """Yield ``(name as stored, StoredTensor)`` shard by shard, in shard order, without reading data."""
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
            yield name, StoredTensor(f, fname, name)


def iter_raw(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name as stored, tensor)`` shard by shard, in shard order."""
    for name, st in iter_stored(path):
        yield name, st.read()


def is_ignored(name: str, cfg: ModelConfig) -> bool:
    if not cfg.is_v41:
        return name.startswith("mtp.")
    return name.startswith(IGNORED_PREFIXES_V41) or (name.startswith("mtp.") and not cfg.has_dspark)


def check_dtype(name: str, dtype: torch.dtype, fmt: str) -> None:
    if dtype not in _ALLOWED_DTYPES[fmt]:
        allowed = "/".join(_dtype_name(d) for d in _ALLOWED_DTYPES[fmt])
        raise CheckpointError(f"{name}: stored as {_dtype_name(dtype)}, but its format is {fmt} "
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
    check_dtype(name, weight.dtype, fmt)
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
    check_scale_dtype(scale_name, scale.dtype)
    try:
        if fmt == "fp8":
            out = quant.dequant_fp8_block(weight, scale, fp8_block(name, cfg.weight_block_size))
        else:
            out = quant.dequant_mxfp4(weight, scale)
    except (ValueError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"{name}: cannot dequantize {fmt} weight {tuple(weight.shape)} with scale "
                              f"{scale_name} {tuple(scale.shape)}: {e}") from None
    return out.to(dtype)


def check_scale_dtype(scale_name: str, dtype: torch.dtype) -> None:
    if dtype not in _SCALE_DTYPES:
        raise CheckpointError(f"{scale_name}: scale stored as {_dtype_name(dtype)}, expected F8_E8M0 "
                              "(or U8 exponent bytes)")


def slice_index(dim: int, start: int, stop: int) -> tuple[slice, ...]:
    return (slice(None),) * dim + (slice(start, stop),)


def check_full_shape(name: str, stored: tuple[int, ...], full: tuple[int, ...]) -> None:
    if stored != full:
        raise CheckpointError(f"{name}: shape {stored} in checkpoint, expected {full}")


def read_plain_shard(name: str, st: StoredTensor, shard: Shard, full_shape: tuple[int, ...], cfg: ModelConfig,
                     dtype: torch.dtype) -> torch.Tensor:
    """The ``shard`` of an unquantized stored tensor whose full shape must be ``full_shape``, read as a slice
    and converted like :func:`dequantize`. Raises CheckpointError (dtype, shape, read errors)."""
    check_dtype(name, st.dtype, storage_format(name, cfg.expert_dtype))
    check_full_shape(name, st.shape, full_shape)
    return dequantize(name, st.read(slice_index(shard.dim, shard.start, shard.stop)), None, cfg, dtype)


def read_quantized_shard(name: str, weight: StoredTensor, scale: StoredTensor, scale_name: str, shard: Shard,
                         full_shape: tuple[int, ...], cfg: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
    """The ``shard`` of a quantized weight (FP8 block-scaled or MXFP4) of full dequantized shape ``full_shape``.

    Reads only the quantization-block-aligned range ``[a0, a1)`` enclosing ``[start, stop)`` along the sharded
    dim and the matching scale rows/columns (FP8: the scale grid's block along that dim; MXFP4 rows: one
    row each; MXFP4 input columns: blocks of 32 inputs = 16 packed bytes = 1 scale), dequantizes, and cuts the
    exact slice. Raises CheckpointError naming the tensor for a wrong dtype, a wrong full shape, a scale grid
    that does not fit the weight, or a read error.
    """
    fmt = storage_format(name, cfg.expert_dtype)
    check_dtype(name, weight.dtype, fmt)
    check_scale_dtype(scale_name, scale.dtype)
    if len(weight.shape) != 2:
        raise CheckpointError(f"{name}: shape {weight.shape} in checkpoint, expected {full_shape}")
    out, packed_in = weight.shape
    if fmt == "fp8":
        logical = (out, packed_in)
        blocks = fp8_block(name, cfg.weight_block_size)
    else:  # mxfp4: two inputs per byte, one scale per 32 inputs
        logical = (out, 2 * packed_in)
        blocks = (1, _MX_BLOCK)
    check_full_shape(name, logical, full_shape)
    grid = tuple(-(-n // b) for n, b in zip(logical, blocks))
    if scale.shape != grid:
        raise CheckpointError(f"{name}: cannot dequantize {fmt} weight {weight.shape} with scale {scale_name} "
                              f"{scale.shape}: expected a scale grid of shape {grid}")
    d, b = shard.dim, blocks[shard.dim]
    a0 = shard.start // b * b
    a1 = min(-(-shard.stop // b) * b, logical[d])
    per_byte = 2 if fmt == "mxfp4" and d == 1 else 1  # a0 is a multiple of 32 and a1 is, or is the (even) end
    w = weight.read(slice_index(d, a0 // per_byte, a1 // per_byte))
    s = scale.read(slice_index(d, a0 // b, -(-a1 // b)))
    return dequantize(name, w, s, cfg, dtype, scale_name).narrow(d, shard.start - a0, shard.size)


def load_into(model: torch.nn.Module, path: str | Path, cfg: ModelConfig, dtype: torch.dtype,
              shards: Mapping[str, Shard] | None = None) -> None:
    """Fill ``model``'s parameters and buffers (named by bare checkpoint names) from ``path`` in place.

    Every expected tensor must appear exactly once; extra tensors are an error unless ignored for the
    architecture. shards: bare name → the slice of that tensor ``model`` holds (tensor parallelism); those are
    read as slices and their stored shapes checked against the full shape. Raises CheckpointError.
    """
    shards = {k: v for k, v in (shards or {}).items() if not v.is_full}
    targets = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    loaded: set[str] = set()
    unexpected: list[str] = []
    # base weight name -> {"weight"/"scale": (name as stored, StoredTensor)}; a weight waits here only when stored
    # in a quantized dtype, a scale until its weight arrives
    pending: dict[str, dict[str, tuple[str, StoredTensor]]] = {}
    for stored_name, st in iter_stored(path):
        name = hf_to_bare(stored_name)
        if is_ignored(name, cfg):
            continue
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            check_dtype(stored_name, st.dtype, "bf16")  # HF fused experts: dequantized exports only
            for sub, t in _split_fused(name, st, shards):
                _assign(targets, sub, t.to(dtype), loaded)
            continue
        is_scale = name.endswith(".scale")
        if is_scale or (st.dtype in _QUANTIZED_DTYPES and not name.endswith("tid2eid")):
            base = name.removesuffix(".scale") + ".weight" if is_scale else name
            slot = pending.setdefault(base, {})
            slot["scale" if is_scale else "weight"] = (stored_name, st)
            if len(slot) < 2:
                continue
            del pending[base]
            if base not in targets:
                unexpected.extend(n for n, _ in slot.values())
                continue
            (_, weight), (scale_stored, scale) = slot["weight"], slot["scale"]
            shard = shards.get(base)
            if shard is None:
                value = dequantize(base, weight.read(), scale.read(), cfg, dtype, scale_stored)
            else:
                full = shard.full_shape(tuple(targets[base].shape))
                value = read_quantized_shard(base, weight, scale, scale_stored, shard, full, cfg, dtype)
            _assign(targets, base, value, loaded)
            continue
        if name not in targets:
            unexpected.append(stored_name)
            continue
        shard = shards.get(name)
        if shard is None:
            value = dequantize(name, st.read(), None, cfg, dtype)
        else:
            value = read_plain_shard(name, st, shard, shard.full_shape(tuple(targets[name].shape)), cfg, dtype)
        _assign(targets, name, value, loaded)
    for base, slot in pending.items():
        if "weight" in slot:
            if base not in targets:
                unexpected.append(slot["weight"][0])
            else:  # dtype error (e.g. F8 where bf16 is expected) or a quantized weight without its scale
                dequantize(base, slot["weight"][1].read(), None, cfg, dtype)
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


def _split_fused(name: str, st: StoredTensor, shards: Mapping[str, Shard]):
    """HF fused experts ``gate_up_proj [E, 2I, D]`` / ``down_proj [E, D, I]`` → per-expert bare names; under
    TP only the rank's ``[i0, i1)`` of I is read (of both halves of ``gate_up_proj``)."""
    prefix = name.rsplit(".", 1)[0]
    gate_up = name.endswith("gate_up_proj")
    shard = shards.get(f"{prefix}.0.w1.weight")  # every expert (w1, w3 rows; w2 columns) shares the range
    if shard is None:
        t = st.read()
        w1, w3 = t.chunk(2, dim=1) if gate_up else (None, None)
    else:
        inter, (i0, i1) = shard.full, (shard.start, shard.stop)
        dim, want = (1, 2 * inter) if gate_up else (2, inter)
        if len(st.shape) != 3 or st.shape[dim] != want:
            what = "[E, 2·I, D]" if gate_up else "[E, D, I]"
            raise CheckpointError(f"{name}: shape {st.shape} in checkpoint, expected {what} with "
                                  f"I = moe_intermediate_size = {inter}")
        if gate_up:
            w1, w3 = st.read(slice_index(1, i0, i1)), st.read(slice_index(1, inter + i0, inter + i1))
        else:
            t = st.read(slice_index(2, i0, i1))
    for e in range(st.shape[0]):
        if gate_up:
            yield f"{prefix}.{e}.w1.weight", w1[e]
            yield f"{prefix}.{e}.w3.weight", w3[e]
        else:
            yield f"{prefix}.{e}.w2.weight", t[e]
