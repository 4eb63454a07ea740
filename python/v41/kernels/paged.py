"""Paged cache reads and writes by flat slot index (slot = block · rows_per_block + row in block), and the slots
of logical rows through a block table (one Triton launch each on the GPU: :func:`scatter_rows`, :func:`table_slots`)."""

from __future__ import annotations

import torch

from .dispatch import triton, use_triton
from .pdl import triton_kw


def write_slots(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Store ``rows`` [T, *row_shape] at ``slots`` [T] int64 of ``cache`` [num_slots, *row_shape] in place;
    slots < 0 are skipped. Raises IndexError for slots past the cache."""
    keep = slots >= 0
    if bool(keep.any()):
        cache.index_copy_(0, slots[keep], rows[keep].to(cache.dtype))


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows of ``cache`` [num_slots, *row_shape] at ``slots`` [...] int64 → [..., *row_shape]; slots < 0 give
    zero rows (callers mask them)."""
    safe = slots.clamp(min=0)
    rows = cache[safe.flatten()].view(*slots.shape, *cache.shape[1:])
    return rows.masked_fill((slots < 0).view(*slots.shape, *([1] * (cache.dim() - 1))), 0)


def block_slots(block_table: torch.Tensor, index: torch.Tensor, rows_per_block: int) -> torch.Tensor:
    """Flat slots of logical rows ``index`` [R, K] (−1 = none) through ``block_table`` [R, max_blocks]
    (−1 = no block) → [R, K] int64, −1 where the row or its block is absent."""
    if block_table.shape[1] == 0:
        return torch.full_like(index, -1)
    blk = torch.div(index.clamp(min=0), rows_per_block, rounding_mode="floor")
    inside = (index >= 0) & (blk < block_table.shape[1])
    phys = torch.gather(block_table, 1, blk.clamp(max=block_table.shape[1] - 1))
    slots = phys * rows_per_block + index.clamp(min=0) % rows_per_block
    return torch.where(inside & (phys >= 0), slots, torch.full_like(slots, -1))


def scatter_rows_ref(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, dummy_slot: int) -> None:
    """Reference of :func:`scatter_rows` (``slots`` already selected)."""
    safe = torch.where(slots >= 0, slots, torch.full_like(slots, dummy_slot))
    cache.index_copy_(0, safe, rows.to(cache.dtype))


def scatter_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, dummy_slot: int,
                 index: torch.Tensor | None = None) -> None:
    """Store ``rows`` [n, *row_shape] at ``slots`` [n] int64 (or at ``slots[index]`` for ``index`` [n]) of ``cache``
    [num_slots, *row_shape] in place, converted to the cache's dtype, without reading anything back to the host:
    slots < 0 (and index entries < 0) write nothing (the reference sends them to ``dummy_slot``, a reserved row
    nothing reads; which of several writes lands there is unspecified). One Triton launch where
    :func:`.dispatch.use_triton` says so."""
    n = rows.shape[0]
    width = rows[0].numel() if n else 0
    if (n == 0 or width == 0 or not use_triton(cache, rows) or not cache[0].is_contiguous()
            or cache[0].numel() != width):
        scatter_rows_ref(cache, slots if index is None else indexed_slots(slots, index), rows, dummy_slot)
        return
    src = rows.reshape(n, width).contiguous()
    block = min(1024, triton.next_power_of_2(width))
    _scatter_kernel[(n, triton.cdiv(width, block))](cache, slots, slots if index is None else index, src, width,
                                                  cache.stride(0), INDEXED=index is not None, BLOCK=block,
                                                  **triton_kw(cache.device))


def indexed_slots(slots: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``slots[index]`` with −1 where ``index`` is negative (a row that writes nothing)."""
    return torch.where(index >= 0, slots[index.clamp(min=0)], torch.full_like(index, -1))


def table_slots(block_table: torch.Tensor, req: torch.Tensor, index: torch.Tensor, rows_per_block: int) -> torch.Tensor:
    """Flat slots [T, K] of logical rows ``index`` [T, K] (−1 = none) of requests ``req`` [T] through
    ``block_table`` [R, max_blocks] (−1 = no block): :func:`block_slots` of ``block_table[req]`` without building
    that [T, max_blocks] copy. One Triton launch where :func:`.dispatch.use_triton` says so."""
    if index.numel() == 0 or not use_triton(index, block_table):
        return block_slots(block_table[req], index, rows_per_block)
    out = torch.empty_like(index, dtype=torch.int64)
    t, k = index.shape
    bt = block_table.contiguous()
    idx = index.contiguous()
    block = min(1024, triton.next_power_of_2(k))
    _table_slots_kernel[(t, triton.cdiv(k, block))](bt, req.contiguous(), idx, out, k, bt.shape[1], bt.stride(0),
                                                   rows_per_block, MODE=0, BLOCK=block, **triton_kw(bt.device))
    return out


def window_slots(block_table: torch.Tensor, req: torch.Tensor, positions: torch.Tensor, window: int,
                 rows_per_block: int) -> torch.Tensor:
    """[T, W] slots of the positions ``pos − W + 1 .. pos`` of each query (``positions`` [T] int64; oldest first; −1
    before position 0 or where the block is absent) through ``block_table`` [R, max_blocks] rows ``req`` [T]:
    :func:`table_slots` of those rows, in one Triton launch where :func:`.dispatch.use_triton` says so (the rows
    formed in it; five PyTorch launches before it otherwise)."""
    t = positions.shape[0]
    if t == 0 or window == 0 or not use_triton(positions, block_table):
        offs = torch.arange(window - 1, -1, -1, device=positions.device)
        win = positions[:, None] - offs[None, :]
        return table_slots(block_table, req, torch.where(win >= 0, win, torch.full_like(win, -1)), rows_per_block)
    out = torch.empty(t, window, dtype=torch.int64, device=positions.device)
    bt = block_table.contiguous()
    block = min(1024, triton.next_power_of_2(window))
    _table_slots_kernel[(t, triton.cdiv(window, block))](bt, req.contiguous(), positions.contiguous(), out, window,
                                                        bt.shape[1], bt.stride(0), rows_per_block, MODE=1,
                                                        BLOCK=block, **triton_kw(bt.device))
    return out


def visible_slots(block_table: torch.Tensor, req: torch.Tensor, n_visible: torch.Tensor, n: int,
                  rows_per_block: int) -> torch.Tensor:
    """[T, n] slots of the entries ``0 .. n − 1`` of each query's request, −1 from ``n_visible`` [T] int64 on (and where
    the block is absent): :func:`table_slots` of those rows, in one Triton launch where :func:`.dispatch.use_triton`
    says so (V4's HCA layers attend to every visible compressed entry; four PyTorch launches before it otherwise)."""
    t = n_visible.shape[0]
    if t == 0 or n == 0 or not use_triton(n_visible, block_table):
        ent = torch.arange(n, device=n_visible.device)[None, :]
        ids = torch.where(ent < n_visible[:, None], ent, torch.full_like(ent, -1))
        return table_slots(block_table, req, ids, rows_per_block)
    out = torch.empty(t, n, dtype=torch.int64, device=n_visible.device)
    bt = block_table.contiguous()
    block = min(1024, triton.next_power_of_2(n))
    _table_slots_kernel[(t, triton.cdiv(n, block))](bt, req.contiguous(), n_visible.contiguous(), out, n,
                                                   bt.shape[1], bt.stride(0), rows_per_block, MODE=2, BLOCK=block,
                                                   **triton_kw(bt.device))
    return out


if triton is not None:
    import triton.language as tl
    from .pdl import prologue

    @triton.jit
    def _scatter_kernel(cache_ptr, slots_ptr, index_ptr, src_ptr, W, stride_c, INDEXED: tl.constexpr,
                        BLOCK: tl.constexpr, PDL: tl.constexpr):
        prologue(PDL)
        i, cb = tl.program_id(0), tl.program_id(1)
        j = tl.load(index_ptr + i) if INDEXED else i
        slot = tl.load(slots_ptr + j, mask=j >= 0, other=-1)
        if slot >= 0:
            cols = cb * BLOCK + tl.arange(0, BLOCK)
            mask = cols < W
            v = tl.load(src_ptr + i.to(tl.int64) * W + cols, mask=mask)
            tl.store(cache_ptr + slot * stride_c + cols, v.to(cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _table_slots_kernel(bt_ptr, req_ptr, idx_ptr, out_ptr, K, NB, stride_bt, RPB, MODE: tl.constexpr,
                            BLOCK: tl.constexpr, PDL: tl.constexpr):
        """Program (row t, BLOCK columns): the slot of logical row idx[t, k] (MODE 0); of row pos[t] − (K − 1) + k
        (MODE 1, idx_ptr: the positions [T]; −1 before row 0); of row k while k < n_visible[t] (MODE 2, idx_ptr:
        n_visible [T]; −1 after)."""
        prologue(PDL)
        t, kb = tl.program_id(0), tl.program_id(1)
        cols = kb * BLOCK + tl.arange(0, BLOCK)
        mask = cols < K
        if MODE == 1:
            idx = tl.load(idx_ptr + t) - (K - 1) + cols
            idx = tl.where(mask & (idx >= 0), idx, -1)
        elif MODE == 2:
            idx = tl.where(mask & (cols < tl.load(idx_ptr + t)), cols, -1)
        else:
            idx = tl.load(idx_ptr + t * K + cols, mask=mask, other=-1)
        blk = tl.maximum(idx, 0) // RPB
        inside = (idx >= 0) & (blk < NB) & mask
        phys = tl.load(bt_ptr + tl.load(req_ptr + t) * stride_bt + blk, mask=inside, other=-1)
        slot = tl.where(inside & (phys >= 0), phys.to(tl.int64) * RPB + tl.maximum(idx, 0) % RPB, -1)
        tl.store(out_ptr + t * K + cols, slot, mask=mask)
