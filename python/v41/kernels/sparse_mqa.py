"""The CUDA sparse MQA of ``cuda/attention/sparse_mqa.cu`` (docs/kernels.md §2 "Sparse MQA"): what
:func:`.sparse_attention.sparse_mqa_sink_ref` computes, for bf16 queries over bf16 cache rows or the deployed
records (``--kv-cache-dtype fp8``: ``swa_fp8``, ``ckv_fp4``, ``swa_v4``), decode and prefill alike.

Each key tile (32 listed keys) is gathered and, for records, decoded once per query token for up to 64 heads,
into shared memory, up to 4 tiles in flight; bf16 tensor-core MMAs with float32 accumulation and an online softmax, P rounded to bf16
for P·V as in the Triton kernel. Split-KV: when tokens × head blocks leave SMs idle (decode), a query's key tiles
are split over CTAs (at least :data:`MIN_TILES_PER_SPLIT` tiles each) whose float32 partials a second launch
merges in split order, so results do not depend on timing. Both launches make no host synchronisation (CUDA
graphs capture them; the partials are allocated per call from the caching allocator, inside a graph from its
pool).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cache.records import RecordFormat
from .dispatch import cuda_ext, sm_count
from .pdl import enabled as pdl_enabled
from .records import format_id

HEAD_DIMS = (64, 128, 256, 512)
KEYS_PER_TILE = 32
HEADS_PER_CTA = 64
MIN_TILES_PER_SPLIT = 1   # benches/RESULTS.md: 1 beat 2 and 4 at T = 1; no split at T = 1 is 5× slower
MAX_TILES_PER_SPLIT = 80  # cuda/attention/sparse_mqa.h kMqaMaxTilesPerCta: a CTA stages its slots
CUDA_FORMATS = (0, 1, 2, 4)  # records.FORMAT_IDS the kernel reads (not the index keys)


def _aligned(t: Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def _source_ok(q: Tensor, cache: Tensor, slots: Tensor, record: RecordFormat | None) -> bool:
    d = q.shape[-1]
    if cache.dim() != 2 or cache.stride(1) != 1 or not _aligned(cache) or slots.dtype != torch.int64:
        return False
    if slots.dim() != 2 or slots.shape[0] != q.shape[0] or cache.device != q.device or slots.device != q.device:
        return False
    if record is None:
        return cache.dtype == torch.bfloat16 and cache.shape[1] == d and cache.stride(0) % 8 == 0
    if format_id(record) not in CUDA_FORMATS or record.dims != d or cache.dtype != torch.uint8:
        return False
    if cache.shape[1] != record.nbytes:
        return False
    return not record.rope or record.coded % 8 == 0


def takes(q: Tensor, sources: list[tuple[Tensor, Tensor]], sink: Tensor, records: list[RecordFormat | None]) -> bool:
    """Whether the kernel reads these operands (cuda/bindings.cpp checks the same and raises): bf16 q [T, H, D]
    with D in :data:`HEAD_DIMS`, 16-byte aligned; one or two sources of bf16 rows [S, D] or records of a format
    it decodes; a bf16 or float32 sink."""
    if q.dtype != torch.bfloat16 or q.dim() != 3 or q.shape[-1] not in HEAD_DIMS or not 1 <= len(sources) <= 2:
        return False
    if q.stride(2) != 1 or q.stride(0) % 8 or q.stride(1) % 8 or not _aligned(q):
        return False
    if sink.dtype not in (torch.bfloat16, torch.float32) or sink.numel() != q.shape[1] or sink.device != q.device:
        return False
    return all(_source_ok(q, c, s, f) for (c, s), f in zip(sources, records))


def launch_shape(t: int, h: int, tiles: int, device: torch.device) -> tuple[int, int]:
    """(splits, tiles per split): split a query's key tiles until the CTAs (t × head blocks × splits) reach the
    SM count, each split holding at least :data:`MIN_TILES_PER_SPLIT` tiles and at most
    :data:`MAX_TILES_PER_SPLIT`."""
    ctas = max(1, t * -(-h // HEADS_PER_CTA))
    splits = max(1, min(-(-tiles // MIN_TILES_PER_SPLIT), sm_count(device) // ctas), -(-tiles // MAX_TILES_PER_SPLIT))
    per = -(-tiles // splits) if tiles else 0
    return (-(-tiles // per) if per else 1), per


def sparse_mqa(q: Tensor, sources: list[tuple[Tensor, Tensor]], sink: Tensor, scale: float,
               records: list[RecordFormat | None]) -> Tensor | None:
    """q [T, H, D] bf16, sources (cache, slots [T, K_i] int64, −1 = none), sink [H], per-source record format or
    None → [T, H, D] bf16 (:func:`.sparse_attention.sparse_mqa_sink_ref`); None when the kernel does not take the
    operands (:func:`takes`)."""
    if not takes(q, sources, sink, records):
        return None
    t, h, d = q.shape
    out = torch.empty_like(q)
    slots = [s.contiguous() for _, s in sources]
    tiles = sum(-(-s.shape[1] // KEYS_PER_TILE) for s in slots)
    splits, per = launch_shape(t, h, tiles, q.device)
    part_acc = part_ml = None
    if splits > 1:
        part_acc = torch.empty((splits, t, h, d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((splits, t, h, 2), dtype=torch.float32, device=q.device)
    (c0, _), f0 = sources[0], records[0]
    c1, f1 = (sources[1][0], records[1]) if len(sources) == 2 else (None, None)
    cuda_ext().sparse_mqa(q, out, sink.contiguous(), c0, slots[0], format_id(f0), f0.rope if f0 else 0, c1,
                          slots[1] if c1 is not None else None, format_id(f1), f1.rope if f1 else 0, float(scale),
                          splits, per, part_acc, part_ml, pdl_enabled(q.device))
    return out
