"""Deployed KV-cache records of V4.1 (docs/model.md §6.1; issue 17 item 3): the byte layouts that
``--kv-cache-dtype fp8`` stores and the kernels read, with their encoders and decoders.

Each record holds one cache row (one token of the window, one compressed entry, one index key):

Layouts (V4.1-Flash sizes; :class:`RecordFormat` takes other row widths):

* :data:`SWA_FP8` — window (``swa``, ``dspark``) rows, 512 dims after RoPE: 512 FP8 E4M3 codes, then 16 E8M0
  scale bytes (one per 32 dims) = **528 B** (bf16: 1,024 B).
* :data:`CKV_FP4` — compressed KV (``ckv{r}``) entries, 512 dims: 256 bytes of FP4 E2M1 codes (two per byte,
  the even dim in the low nibble), then 32 E4M3 scale bytes (one per 16 dims) = **288 B**.
* :data:`IDX_MXFP4` — index keys (``idx{r}``), 128 dims: 64 bytes of E2M1 codes, then 4 E8M0 scale bytes (one
  per 32 dims) = **68 B**.

Decoding a record gives exactly what the deployed-numerics quantize-dequantize of :mod:`v41.quant` gives
(:func:`~v41.quant.fp8_act_qdq`, :func:`~v41.quant.fp4_e4m3_qdq`, :func:`~v41.quant.mxfp4_qdq`): the scale
formulas live there once, and ``tests/test_cache_records.py`` checks ``decode(encode(x)) == qdq(x)`` bit for
bit. Codes first and scales last keeps a record's data 16-byte aligned for vector loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import quant

_FP8 = torch.float8_e4m3fn


# kind → (codes, scale byte, dims per scale, the scale formula of v41.quant)
KINDS = {"swa_fp8": ("fp8", "e8m0", 32, quant.fp8_act_scale),
         "ckv_fp4": ("fp4", "e4m3", 16, quant.fp4_e4m3_scale),
         "idx_mxfp4": ("fp4", "e8m0", 32, quant.mxfp4_scale)}


@dataclass(frozen=True)
class RecordFormat:
    """One record layout of ``kind`` (a key of :data:`KINDS`) for rows of ``dims`` values: ``nbytes`` bytes,
    the codes (``fp8``: one E4M3 byte per value; ``fp4``: two E2M1 codes per byte, low nibble first), then one
    scale byte per ``block`` dims (``e8m0``: byte ``k + 127`` for ``2^k``; ``e4m3``: an FP8 value). Raises
    ValueError for an unknown kind or ``dims`` not a multiple of the block."""

    kind: str
    dims: int

    def __post_init__(self):
        if self.kind not in KINDS or self.dims <= 0 or self.dims % KINDS[self.kind][2]:
            raise ValueError(f"record kind {self.kind!r} of {self.dims} dims: kinds {sorted(KINDS)}, dims a "
                             "multiple of the scale block")

    @property
    def codes(self) -> str:
        return KINDS[self.kind][0]

    @property
    def scale(self) -> str:
        return KINDS[self.kind][1]

    @property
    def block(self) -> int:
        return KINDS[self.kind][2]

    @property
    def code_bytes(self) -> int:
        return self.dims if self.codes == "fp8" else self.dims // 2

    @property
    def nbytes(self) -> int:
        return self.code_bytes + self.dims // self.block

    def encode(self, x: Tensor) -> Tensor:
        """x ``[..., dims]`` float (computed in float32) → uint8 ``[..., nbytes]``. Raises ValueError for
        another last dimension, TypeError for a non-float tensor."""
        quant._check_float(x, "x")
        if x.shape[-1] != self.dims:
            raise ValueError(f"{self.kind}: rows of {self.dims} values, got {tuple(x.shape)}")
        xb = x.to(torch.float32).reshape(*x.shape[:-1], self.dims // self.block, self.block)
        s = KINDS[self.kind][3](xb)
        q = xb / s
        if self.codes == "fp8":
            codes = q.to(_FP8).view(torch.uint8).reshape(*x.shape[:-1], self.dims)
        else:
            nib = quant.e2m1_codes(q).reshape(*x.shape[:-1], self.dims)
            codes = nib[..., 0::2] | (nib[..., 1::2] << 4)
        if self.scale == "e8m0":
            sb = quant.float_to_e8m0(s.squeeze(-1)).view(torch.uint8)
        else:
            sb = s.squeeze(-1).to(_FP8).view(torch.uint8)
        return torch.cat([codes, sb], dim=-1).contiguous()

    def decode(self, rec: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """uint8 ``[..., nbytes]`` → ``[..., dims]`` in ``dtype`` (exact in float32; bf16 is exact for the FP4
        formats and rounds nothing either for FP8 codes times power-of-two scales in range)."""
        if rec.dtype != torch.uint8 or rec.shape[-1] != self.nbytes:
            raise ValueError(f"{self.kind}: uint8 records of {self.nbytes} bytes, got {rec.dtype} "
                             f"{tuple(rec.shape)}")
        lead = rec.shape[:-1]
        codes, sb = rec[..., : self.code_bytes], rec[..., self.code_bytes:]
        if self.codes == "fp8":
            v = codes.view(_FP8).to(torch.float32)
        else:
            nib = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(*lead, self.dims)
            v = quant.e2m1_values(nib)
        s = quant.e8m0_to_float(sb) if self.scale == "e8m0" else sb.view(_FP8).to(torch.float32)
        y = v.reshape(*lead, self.dims // self.block, self.block) * s.unsqueeze(-1)
        return y.reshape(*lead, self.dims).to(dtype)


# V4.1-Flash's rows (head_dim 512, index_head_dim 128); smaller models use their own dims
SWA_FP8 = RecordFormat("swa_fp8", 512)
CKV_FP4 = RecordFormat("ckv_fp4", 512)
IDX_MXFP4 = RecordFormat("idx_mxfp4", 128)
