"""Engram miss fill: copy host table records into the GPU slot cache (docs/engram.md §5; house rules for kernels:
docs/kernels.md §1).

An Engram table lives in pinned host memory as ``host`` uint8 [R, B]: one record per row, B = ``record_bytes``
(an FP8 table's record is the row's ``hd`` E4M3 bytes followed by its ``hd/32`` E8M0 scale bytes: 256 + 8 = 264 B
for V4.1, 32 + 1 = 33 B for the tiny test model). The GPU caches rows in ``slots`` uint8 [S, B]. Each step a copy
list of misses, ``copy_rows`` / ``copy_slots`` int64 [M] on ``slots``' device, asks for

    slots[copy_slots[i]] = host[copy_rows[i]]    for every i with copy_slots[i] >= 0

(slot −1 is padding: its row is never read and may hold anything, −1 included). Live slots are distinct (a fill
never writes one slot twice; if it did, which record lands is unspecified).

Two transfers (``fill_slots(..., transfer=)``):

- ``"uva"``: :func:`fill_slots_uva`, one Triton launch that reads the pinned rows directly over UVA (the pinned
  allocation is mapped into the device's address space; Triton's launcher turns the CPU tensor's address into its
  device pointer with ``cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER)``, which succeeds for pinned /
  ``cudaHostRegister``-ed memory and fails for pageable memory, hence the ``is_pinned`` check before the launch).
  A persistent grid (≈ one program per SM) strides over the copy list, ``ROWS`` entries per iteration; records
  whose width is a multiple of 4 move as 32-bit words, others byte by byte. No host work, a grid fixed by M:
  CUDA-graph capturable with a capacity-sized copy list padded with slot −1. Live entries whose row or slot is out
  of range are skipped rather than read (an out-of-range host read over PCIe would kill the context).
- :func:`fill_slots_reference`: the PyTorch reference (and the CPU fill of the engine's in-forward path), which
  gathers the live rows on the host (``index_select`` into a pinned staging buffer) and copies them in one
  ``non_blocking`` transfer. It reads the copy list on the host (a sync): not for capture. (The engine's ``copy``
  transfer does the same from host copy lists: ``engine/engram_pager.py``.)
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from .dispatch import interpreting, sm_count, triton, use_triton

ROWS = 8  # copy entries per program iteration
CPU_PROGRAMS = 4  # the interpreter's default grid: a few programs, each striding over several entries


def _check(host: Tensor, copy_rows: Tensor, copy_slots: Tensor, slots: Tensor) -> None:
    """Raise ValueError unless the operands have the shapes, dtypes and devices the module docstring gives."""
    if host.dtype != torch.uint8 or slots.dtype != torch.uint8 or host.dim() != 2 or slots.dim() != 2:
        raise ValueError(f"host and slots must be 2-D uint8, got {host.dtype} {tuple(host.shape)} and "
                         f"{slots.dtype} {tuple(slots.shape)}")
    if host.shape[1] != slots.shape[1]:
        raise ValueError(f"record widths differ: host rows of {host.shape[1]} B, slots of {slots.shape[1]} B")
    if host.device.type != "cpu":
        raise ValueError(f"host must be a CPU tensor (pinned for transfer='uva'), got {host.device}")
    if (copy_rows.dim() != 1 or copy_rows.shape != copy_slots.shape or copy_rows.dtype != torch.int64
            or copy_slots.dtype != torch.int64):
        raise ValueError(f"copy_rows and copy_slots must be int64 [M], got {copy_rows.dtype} "
                         f"{tuple(copy_rows.shape)} and {copy_slots.dtype} {tuple(copy_slots.shape)}")
    if copy_rows.device != slots.device or copy_slots.device != slots.device:
        raise ValueError(f"the copy list must be on slots' device {slots.device}, got {copy_rows.device} / "
                         f"{copy_slots.device}")
    if host.stride(1) != 1 or slots.stride(1) != 1:
        raise ValueError("host and slots rows must be contiguous (stride 1 along the record)")


def fill_slots_reference(host: Tensor, copy_rows: Tensor, copy_slots: Tensor, slots: Tensor) -> None:
    """``slots[copy_slots[i]] = host[copy_rows[i]]`` for every i with ``copy_slots[i] >= 0``, in place.

    host uint8 [R, B] on the CPU (pinned or not); copy_rows, copy_slots int64 [M] on slots' device; slots uint8
    [S, B]. Raises ValueError for mismatched widths, dtypes, shapes or devices, and for a live entry whose row or
    slot is out of range. On CUDA the live rows are gathered into a pinned staging buffer and copied with
    ``non_blocking=True`` (the copy list is read on the host: a sync, not capturable)."""
    _check(host, copy_rows, copy_slots, slots)
    live = copy_slots >= 0
    dst = copy_slots[live]
    rows = copy_rows[live].cpu()
    if rows.numel() == 0:
        return
    if int(rows.min()) < 0 or int(rows.max()) >= host.shape[0] or int(dst.max()) >= slots.shape[0]:
        raise ValueError(f"a live copy entry is out of range (host rows {host.shape[0]}, slots {slots.shape[0]})")
    staged = torch.empty((rows.numel(), host.shape[1]), dtype=torch.uint8, pin_memory=slots.is_cuda)
    torch.index_select(host, 0, rows, out=staged)
    slots.index_copy_(0, dst, staged.to(slots.device, non_blocking=True))


def fill_slots_uva(host: Tensor, copy_rows: Tensor, copy_slots: Tensor, slots: Tensor,
                   num_programs: int | None = None, check_pinned: bool = True) -> None:
    """:func:`fill_slots_reference` as one Triton launch reading ``host`` over UVA (module docstring).

    On CUDA, ``host`` must be pinned (``pin_memory()`` or ``cudaHostRegister``): a pageable tensor raises
    ValueError before the launch. Under Triton's interpreter (``TRITON_INTERPRET=1``) every tensor is on the CPU.
    ``num_programs``: the persistent grid (default: the device's SM count; ``CPU_PROGRAMS`` on the CPU), never more
    than the copy list needs. M = 0 launches nothing. Live entries out of range are skipped, not raised.
    ``check_pinned=False`` skips the pinned check (a caller that checked once, e.g. inside a CUDA-graph capture)."""
    _check(host, copy_rows, copy_slots, slots)
    if triton is None:
        raise RuntimeError("fill_slots_uva needs Triton")
    if slots.is_cuda:
        if check_pinned and not host.is_pinned():
            raise ValueError("transfer='uva' needs a pinned host table (pin_memory() or cudaHostRegister): "
                             "a pageable tensor has no device mapping")
    elif not interpreting():
        raise ValueError("fill_slots_uva needs slots on a CUDA device, or Triton's interpreter (TRITON_INTERPRET=1)")
    m, width = copy_rows.shape[0], host.shape[1]
    if m == 0 or slots.shape[0] == 0:
        return
    src, dst, unit = host, slots, 1
    if width % 4 == 0 and host.stride(0) % 4 == 0 and slots.stride(0) % 4 == 0:
        try:  # 32-bit words: a quarter of the transactions (fails for a misaligned view: bytes then)
            src, dst, unit = host.view(torch.int32), slots.view(torch.int32), 4
        except RuntimeError:
            src, dst, unit = host, slots, 1
    words = width // unit
    block = min(triton.next_power_of_2(words), 1024)
    if num_programs is None:
        num_programs = sm_count(slots.device) if slots.is_cuda else CPU_PROGRAMS
    grid = (max(1, min(num_programs, triton.cdiv(m, ROWS))),)
    with torch.cuda.device(slots.device) if slots.is_cuda else contextlib.nullcontext():
        _fill_kernel[grid](src, copy_rows, copy_slots, dst, m, host.shape[0], slots.shape[0], words,
                           src.stride(0), dst.stride(0), ROWS=ROWS, BLOCK=block)


def fill_slots(host: Tensor, copy_rows: Tensor, copy_slots: Tensor, slots: Tensor, transfer: str) -> None:
    """Fill the slots of one step's misses (module docstring): ``transfer="uva"`` with CUDA slots runs
    :func:`fill_slots_uva` (unless ``$V41_KERNELS=torch``, docs/kernels.md §1); ``"copy"``, or slots on the CPU,
    :func:`fill_slots_reference`. Raises ValueError for another ``transfer``."""
    if transfer not in ("uva", "copy"):
        raise ValueError(f"transfer must be 'uva' or 'copy', got {transfer!r}")
    if transfer == "uva" and slots.is_cuda and use_triton(slots):
        fill_slots_uva(host, copy_rows, copy_slots, slots)
    else:
        fill_slots_reference(host, copy_rows, copy_slots, slots)


if triton is not None:
    import triton.language as tl

    @triton.jit(do_not_specialize=["M", "R", "S"])  # one compile for every copy-list size and table
    def _fill_kernel(host_ptr, rows_ptr, slots_ptr, out_ptr, M, R, S, W, host_stride, out_stride,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """Program p copies entries [p·ROWS, (p+1)·ROWS), then strides by the grid; W words per record."""
        pid, nprog = tl.program_id(0), tl.num_programs(0)
        lane = tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        for base in range(pid * ROWS, M, nprog * ROWS):
            idx = base + lane
            slot = tl.load(slots_ptr + idx, mask=idx < M, other=-1).to(tl.int64)
            live = (slot >= 0) & (slot < S)
            row = tl.load(rows_ptr + idx, mask=live, other=0).to(tl.int64)
            live = live & (row >= 0) & (row < R)
            src = host_ptr + row[:, None] * host_stride
            dst = out_ptr + slot[:, None] * out_stride
            for off in range(0, W, BLOCK):
                c = off + cols[None, :]
                m = live[:, None] & (c < W)
                tl.store(dst + c, tl.load(src + c, mask=m), mask=m)
