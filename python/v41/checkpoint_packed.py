"""Reading checkpoint tensors in their storage formats for the fast model (docs/model.md §5; docs/architecture.md §3a:
weights stay FP8 / MXFP4 on the device).

:class:`PackedReader` serves a model tensor by its bare checkpoint name: :meth:`~PackedReader.dense` for
unquantized tensors (BF16, F32, I64), :meth:`~PackedReader.packed` for weights in the ``fp8`` / ``mxfp4`` formats
(a :class:`~v41.kernels.packed.PackedWeight`; kept packed, or dequantized with ``keep_packed=False``).
Tensor-parallel shards are read as slices: a quantized weight whose shard is aligned to its scale tiles stays
packed; a cut through a tile is read dequantized (:func:`v41.checkpoint.read_quantized_shard`) and held dense.
Checks are those of :mod:`v41.checkpoint` (dtype per format, full shapes, scale grids); :meth:`~PackedReader.finish`
refuses tensors nobody asked for. :class:`DummyReader` serves random weights by role in the same formats
(``load_format="dummy"``, benchmarks), made on the target device.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import torch

from . import quant
from .checkpoint import (CheckpointError, StoredTensor, check_dtype, check_full_shape, check_scale_dtype, is_ignored,
                         iter_stored, read_quantized_shard, slice_index)
from .checkpoint_names import fp8_block, hf_to_bare, storage_format
from .config import ModelConfig
from .distributed.group import Shard
from .kernels.packed import MX_BLOCK, PackedWeight, from_dense
from .models.random_init import init_tensor

_QUANTIZED = (torch.float8_e4m3fn, torch.int8, torch.uint8)
TABLE_BLOCK_ROWS = 1 << 16  # DummyReader: rows of an Engram table drawn per generator
_FUSED = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")


def _full(local_shape: tuple[int, ...], shard: Shard | None) -> tuple[int, ...]:
    return local_shape if shard is None else shard.full_shape(local_shape)


def _param_dtype(fmt: str, dtype: torch.dtype) -> torch.dtype:
    """float32 tensors stay ≥ float32; BF16 ones take the compute dtype; int64 stays int64."""
    return torch.int64 if fmt == "i64" else torch.promote_types(dtype, torch.float32) if fmt == "f32" else dtype


class PackedReader:
    """Tensors of the checkpoint at ``path`` by bare name (module docstring). Raises CheckpointError naming the
    tensor for anything that does not fit the config."""

    def __init__(self, path: str | Path, cfg: ModelConfig):
        self.cfg = cfg
        self.tensors: dict[str, tuple[str, StoredTensor]] = {}
        for stored, st in iter_stored(path):
            name = hf_to_bare(stored)
            if is_ignored(name, cfg):
                continue
            if name in self.tensors:
                raise CheckpointError(f"{name}: appears twice in the checkpoint")
            self.tensors[name] = (stored, st)
        self.used: set[str] = set()
        self._fused: dict[str, torch.Tensor] = {}

    def _get(self, name: str) -> tuple[str, StoredTensor]:
        if name not in self.tensors:
            raise CheckpointError(f"missing tensors (1): [{name!r}]")
        self.used.add(name)
        return self.tensors[name]

    def dense(self, name: str, local_shape: tuple[int, ...], shard: Shard | None, dtype: torch.dtype) -> torch.Tensor:
        """An unquantized tensor (its shard), in the parameter dtype of its format and ``dtype``."""
        fmt = storage_format(name, self.cfg.expert_dtype)
        stored, st = self._get(name)
        check_dtype(stored, st.dtype, fmt)
        check_full_shape(stored, st.shape, _full(local_shape, shard))
        t = st.read() if shard is None or shard.is_full else st.read(slice_index(shard.dim, shard.start, shard.stop))
        return t.to(_param_dtype(fmt, dtype))

    def packed(self, name: str, local_shape: tuple[int, int], shard: Shard | None, dtype: torch.dtype,
               keep_packed: bool = True) -> PackedWeight:
        """A weight ``name`` (``*.weight``) with its ``.scale`` sibling when quantized; dense weights in ``dtype``."""
        if name not in self.tensors and _FUSED.match(name):
            return from_dense(self._from_fused(name, local_shape, shard).to(dtype))
        fmt = storage_format(name, self.cfg.expert_dtype)
        stored, st = self._get(name)
        check_dtype(stored, st.dtype, fmt)
        scale_name = name.removesuffix(".weight") + ".scale"
        full = _full(local_shape, shard)
        if st.dtype not in _QUANTIZED or fmt not in ("fp8", "mxfp4"):
            if scale_name in self.tensors:
                raise CheckpointError(f"unexpected tensors (1): [{self.tensors[scale_name][0]!r}] (a scale, but "
                                      f"{name} is stored unquantized)")
            return from_dense(self.dense(name, local_shape, shard, dtype))
        if scale_name not in self.tensors:
            raise CheckpointError(f"{name}: quantized weight ({st.dtype}) without its .scale tensor")
        sc_stored, sc = self._get(scale_name)
        check_scale_dtype(sc_stored, sc.dtype)
        pw = self._read_packed(name, st, sc, sc_stored, fmt, full, shard, dtype)
        return pw if keep_packed or pw.fmt == "dense" else from_dense(pw.dequantize(dtype))

    def _read_packed(self, name, st, sc, sc_stored, fmt, full, shard, dtype) -> PackedWeight:
        per_byte = 2 if fmt == "mxfp4" else 1
        if len(st.shape) != 2 or (st.shape[0], st.shape[1] * per_byte) != tuple(full):
            raise CheckpointError(f"{name}: shape {st.shape} in checkpoint, expected {tuple(full)}")
        block = fp8_block(name, self.cfg.weight_block_size) if fmt == "fp8" else (1, MX_BLOCK)
        grid = tuple(-(-n // b) for n, b in zip(full, block))
        if tuple(sc.shape) != grid:
            raise CheckpointError(f"{name}: cannot dequantize {fmt} weight {st.shape} with scale {sc_stored} "
                                  f"{sc.shape}: expected a scale grid of shape {grid}")
        if shard is None or shard.is_full:
            data, scale = st.read(), sc.read()
        else:
            d, b = shard.dim, block[shard.dim]
            if shard.start % b or (shard.stop % b and shard.stop != full[d]):
                value = read_quantized_shard(name, st, sc, sc_stored, shard, full, self.cfg, torch.float32)
                return from_dense(value.to(dtype))
            per = per_byte if d == 1 else 1
            data = st.read(slice_index(d, shard.start // per, shard.stop // per))
            scale = sc.read(slice_index(d, shard.start // b, -(-shard.stop // b)))
        if fmt == "mxfp4":
            data = data.view(torch.uint8)
        return PackedWeight(data, scale.view(torch.uint8), fmt, block).check()

    def _from_fused(self, name: str, local_shape, shard: Shard | None) -> torch.Tensor:
        """An expert's w1/w3/w2 from transformers' fused ``gate_up_proj [E, 2I, D]`` / ``down_proj [E, D, I]``
        (dequantized exports only)."""
        prefix, e, which = _FUSED.match(name).groups()
        fused = f"{prefix}.{'down_proj' if which == 'w2' else 'gate_up_proj'}"
        if fused not in self._fused:
            stored, st = self._get(fused)
            check_dtype(stored, st.dtype, "bf16")
            self._fused[fused] = st.read()
        t = self._fused[fused][int(e)]
        if which != "w2":
            t = t.chunk(2, dim=0)[0 if which == "w1" else 1]
        check_full_shape(name, tuple(t.shape), _full(local_shape, shard))
        return t if shard is None else shard.cut(t)

    def finish(self) -> None:
        """Raise CheckpointError listing the checkpoint tensors no model tensor took."""
        extra = sorted(self.tensors[n][0] for n in set(self.tensors) - self.used)
        if extra:
            raise CheckpointError(f"unexpected tensors ({len(extra)}): {extra[:20]}")


class DummyReader:
    """Random weights by role (:func:`v41.models.random_init.init_tensor`) in the checkpoint formats, drawn at full
    shape on ``device`` from ``seed`` and cut to the shard (so every rank draws the same full tensors)."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str, seed: int = 0):
        self.cfg, self.seed = cfg, seed
        self.g = torch.Generator(device=torch.device(device)).manual_seed(seed)

    def dense(self, name: str, local_shape, shard: Shard | None, dtype: torch.dtype) -> torch.Tensor:
        fmt = storage_format(name, self.cfg.expert_dtype)
        t = init_tensor(name, _full(local_shape, shard), self.g, self.cfg)
        return (t if shard is None else shard.cut(t)).to(_param_dtype(fmt, dtype))

    def packed(self, name: str, local_shape, shard: Shard | None, dtype: torch.dtype,
               keep_packed: bool = True) -> PackedWeight:
        fmt = storage_format(name, self.cfg.expert_dtype)
        if name.endswith("engram.embed.weight") and fmt == "fp8":
            pw = self._table_rows(name, _full(local_shape, shard), shard)
            return pw if keep_packed else from_dense(pw.dequantize(dtype))
        w = init_tensor(name, _full(local_shape, shard), self.g, self.cfg)
        if fmt == "fp8":
            block = fp8_block(name, self.cfg.weight_block_size)
            q, s = quant.quant_fp8_block(w, block)
            pw = PackedWeight(q, s.view(torch.uint8), "fp8", block)
        elif fmt == "mxfp4" and w.shape[-1] % MX_BLOCK == 0:
            q, s = quant.quant_mxfp4(w)
            pw = PackedWeight(q.view(torch.uint8), s.view(torch.uint8), "mxfp4", (1, MX_BLOCK))
        else:
            pw = from_dense(w.to(dtype))
        if shard is not None and not shard.is_full:
            pw = pw.narrow(shard.dim, shard.start, shard.stop)
        if pw.fmt == "dense":
            return from_dense(pw.data.to(dtype))
        return pw if keep_packed else from_dense(pw.dequantize(dtype))

    def _table_rows(self, name: str, full: tuple[int, int], shard: Shard | None) -> PackedWeight:
        """Rows of an Engram table (FP8): drawn in blocks of :data:`TABLE_BLOCK_ROWS` rows, each from its own
        generator, so any row range (a TP shard, an offload chunk) is the same without drawing the whole table
        (V4.1's is 101 GB) and without moving the shared generator."""
        a, b = (0, full[0]) if shard is None else (shard.start, shard.stop)
        block = fp8_block(name, self.cfg.weight_block_size)
        dev = self.g.device
        data = torch.empty(b - a, full[1], dtype=torch.float8_e4m3fn, device=dev)
        scale = torch.empty(b - a, -(-full[1] // block[1]), dtype=torch.uint8, device=dev)
        for k in range(a // TABLE_BLOCK_ROWS, -(-b // TABLE_BLOCK_ROWS)):
            key = hashlib.sha256(f"{self.seed}:{name}:{k}".encode()).digest()
            g = torch.Generator(device=dev).manual_seed(int.from_bytes(key[:8], "little") >> 1)
            r0 = k * TABLE_BLOCK_ROWS
            rows = min(TABLE_BLOCK_ROWS, full[0] - r0)
            q, sc = quant.quant_fp8_block(torch.randn(rows, full[1], generator=g, device=dev), block)
            lo, hi = max(a, r0), min(b, r0 + rows)
            data[lo - a:hi - a] = q[lo - r0:hi - r0]
            scale[lo - a:hi - a] = sc.view(torch.uint8)[lo - r0:hi - r0]
        return PackedWeight(data, scale, "fp8", block).check()

    def finish(self) -> None:
        pass
