"""Deployed KV-cache records of V4.1 and V4 (docs/model.md §6; docs/cache.md "FP8 / FP4 records"): the byte layouts that
``--kv-cache-dtype fp8`` stores and the kernels read, with their encoders and decoders.

Each record holds one cache row (one token of the window, one compressed entry, one index key):

Layouts (V4.1-Flash sizes; :class:`RecordFormat` takes other row widths):

* :data:`SWA_FP8` — window (``swa``, ``dspark``) rows, 512 dims after RoPE: 512 FP8 E4M3 codes, then 16 E8M0
  scale bytes (one per 32 dims) = **528 B** (bf16: 1,024 B).
* :data:`CKV_FP4` — compressed KV (``ckv{r}``) entries, 512 dims: 256 bytes of FP4 E2M1 codes (two per byte,
  the even dim in the low nibble), then 32 E4M3 scale bytes (one per 16 dims) = **288 B**.
* :data:`IDX_MXFP4` — index keys (``idx{r}``), 128 dims: 64 bytes of E2M1 codes, then 4 E8M0 scale bytes (one
  per 32 dims) = **68 B**.
* :data:`SWA_V4` — V4's window and compressed rows (docs/model.md §6.2, vLLM's ``fp8_ds_mla`` V4 row), 512 dims of
  which the last 64 are RoPE dims: 448 FP8 E4M3 codes of the other dims, the 64 RoPE dims as bf16 (128 B), then an
  E8M0 scale byte per 64 FP8 dims (a partial last block is its own block), zero-padded to a multiple of 8 bytes
  (7 + 1) = **584 B**.

Decoding a record gives exactly what the deployed-numerics quantize-dequantize of :mod:`v41.quant` gives
(:func:`~v41.quant.fp8_act_qdq`, :func:`~v41.quant.fp4_e4m3_qdq`, :func:`~v41.quant.mxfp4_qdq`; for V4 the
reference's FP8 of the non-RoPE dims and bf16 of the RoPE dims): the scale
formulas live there once, and ``tests/test_cache_records.py`` checks ``decode(encode(x)) == qdq(x)`` bit for
bit. Codes come first, so a record's codes start where the record does (16-byte aligned for the 528 B and 288 B
V4.1 rows; the 68 B index and 584 B V4 rows are 4- and 8-byte aligned).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import quant

_FP8 = torch.float8_e4m3fn


# kind → (codes, scale byte, dims per scale, the scale formula of v41.quant)
KINDS = {"swa_fp8": ("fp8", "e8m0", 32, quant.fp8_act_scale),
         "ckv_fp4": ("fp4", "e4m3", 16, quant.fp4_e4m3_scale),
         "idx_mxfp4": ("fp4", "e8m0", 32, quant.mxfp4_scale),
         "swa_v4": ("fp8", "e8m0", 64, quant.fp8_act_scale)}


@dataclass(frozen=True)
class RecordFormat:
    """One record layout of ``kind`` (a key of :data:`KINDS`) for rows of ``dims`` values: ``nbytes`` bytes,
    the codes (``fp8``: one E4M3 byte per value; ``fp4``: two E2M1 codes per byte, low nibble first), then one
    scale byte per ``block`` dims (``e8m0``: byte ``k + 127`` for ``2^k``; ``e4m3``: an FP8 value). ``swa_v4``
    only: the last ``rope`` dims are stored as bf16 between the codes and the scales, and the scale bytes are
    zero-padded to a multiple of 8. Raises ValueError for an unknown kind, ``dims`` not a multiple of the block
    (``swa_v4``: 0 < rope < dims instead; the other kinds take no rope dims)."""

    kind: str
    dims: int
    rope: int = 0

    def __post_init__(self):
        v4 = self.kind == "swa_v4"
        ok = self.kind in KINDS and self.dims > 0 and (
            0 < self.rope < self.dims if v4 else self.rope == 0 and self.dims % KINDS[self.kind][2] == 0)
        if not ok:
            raise ValueError(f"record kind {self.kind!r} of {self.dims} dims, {self.rope} RoPE dims: kinds "
                             f"{sorted(KINDS)}, dims a multiple of the scale block; RoPE dims for swa_v4 only")

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
    def coded(self) -> int:
        """Dims stored as codes (all but the bf16 RoPE dims)."""
        return self.dims - self.rope

    @property
    def code_bytes(self) -> int:
        return self.coded if self.codes == "fp8" else self.coded // 2

    @property
    def scale_bytes(self) -> int:
        n = -(-self.coded // self.block)
        return -(-n // 8) * 8 if self.rope else n

    @property
    def nbytes(self) -> int:
        return self.code_bytes + 2 * self.rope + self.scale_bytes

    def encode(self, x: Tensor) -> Tensor:
        """x ``[..., dims]`` float (computed in float32) → uint8 ``[..., nbytes]``, with device ops only (no host
        synchronisation: CUDA graphs capture it). Raises ValueError for another last dimension, TypeError for a
        non-float tensor."""
        quant._check_float(x, "x")
        if x.shape[-1] != self.dims:
            raise ValueError(f"{self.kind}: rows of {self.dims} values, got {tuple(x.shape)}")
        lead, n = x.shape[:-1], self.coded
        nb = -(-n // self.block)
        xf = F.pad(x[..., :n].to(torch.float32), (0, nb * self.block - n))  # zeros never raise a block's amax
        xb = xf.reshape(*lead, nb, self.block)
        s = KINDS[self.kind][3](xb)
        q = xb / s
        if self.codes == "fp8":
            codes = q.to(_FP8).view(torch.uint8).reshape(*lead, nb * self.block)[..., :n]
        else:
            nib = quant.e2m1_codes(q).reshape(*lead, n)
            codes = nib[..., 0::2] | (nib[..., 1::2] << 4)
        if self.scale == "e8m0":  # the scale formulas give powers of two >= 2^-126: the float32 exponent byte
            sb = torch.bitwise_right_shift(s.squeeze(-1).contiguous().view(torch.int32), 23).to(torch.uint8)
        else:
            sb = s.squeeze(-1).to(_FP8).view(torch.uint8)
        parts = [codes]
        if self.rope:
            parts.append(x[..., n:].to(torch.bfloat16).contiguous().view(torch.uint8))
            sb = F.pad(sb, (0, self.scale_bytes - nb))
        return torch.cat(parts + [sb], dim=-1).contiguous()

    def decode(self, rec: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """uint8 ``[..., nbytes]`` → ``[..., dims]`` in ``dtype`` (exact in float32; bf16 is exact for the FP4
        formats and rounds nothing either for FP8 codes times power-of-two scales in range)."""
        if rec.dtype != torch.uint8 or rec.shape[-1] != self.nbytes:
            raise ValueError(f"{self.kind}: uint8 records of {self.nbytes} bytes, got {rec.dtype} "
                             f"{tuple(rec.shape)}")
        lead, n, cb = rec.shape[:-1], self.coded, self.code_bytes
        nb = -(-n // self.block)
        codes, sb = rec[..., :cb], rec[..., cb + 2 * self.rope:][..., :nb]
        if self.codes == "fp8":
            v = codes.contiguous().view(_FP8).to(torch.float32)
        else:
            v = quant.e2m1_values(torch.stack([codes & 15, codes >> 4], dim=-1).reshape(*lead, n))
        s = quant.e8m0_to_float(sb) if self.scale == "e8m0" else sb.contiguous().view(_FP8).to(torch.float32)
        y = v * s.repeat_interleave(self.block, dim=-1)[..., :n]
        if self.rope:
            rope = rec[..., cb: cb + 2 * self.rope].contiguous().view(torch.bfloat16).to(torch.float32)
            y = torch.cat([y, rope], dim=-1)
        return y.to(dtype)


# V4.1-Flash's and V4-Flash's rows (head_dim 512, 64 RoPE dims, index_head_dim 128); smaller models use their own
SWA_FP8 = RecordFormat("swa_fp8", 512)
CKV_FP4 = RecordFormat("ckv_fp4", 512)
IDX_MXFP4 = RecordFormat("idx_mxfp4", 128)
SWA_V4 = RecordFormat("swa_v4", 512, rope=64)
