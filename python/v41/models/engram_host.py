"""Engram tables in host memory for offload (docs/engram.md §3).

A layer's table is kept as **records**, one per row: the row's ``hd`` FP8-E4M3 bytes followed by its ``hd/32`` E8M0
scale bytes (264 B for V4.1: one record, one transaction; split data / scale regions would cost two), or for a table
stored unquantized its ``hd`` values' raw bytes. :class:`RecordFormat` encodes / decodes them.

:class:`HostTable` holds the rows ``[row0, row1)`` of the hash columns this rank owns (docs/model.md §8 "TP") as
``uint8 [row1 − row0, record_bytes]``: in one ``/dev/shm`` file per layer that every rank of the node maps (each
writes and pins only its own rows), or, when ``/dev/shm`` has too little room, a private buffer. With ``pin`` (CUDA, the
``uva`` transfer, which reads the records over the bus) the rank's range is page-locked with ``cudaHostRegister``
(checked with ``is_pinned``) and unregistered before it is unmapped (:meth:`HostTable.close`); otherwise nothing is
pinned (the ``copy`` transfer gathers on the host into a small pinned staging buffer). Rows are read from the checkpoint's safetensors in
chunks straight into the records (:func:`load_records`), never through a whole pageable copy of the table.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from ..distributed.group import Shard
from ..kernels.packed import PackedWeight

log = logging.getLogger("v41.engine")
SHM_DIR = "/dev/shm"
CHUNK_ROWS = 1 << 18  # rows read per safetensors slice (64 MiB of V4.1 records)
_PAGE = 4096


@dataclass(frozen=True)
class RecordFormat:
    """How a table row is laid out in a record: ``fmt`` ``fp8`` (``hd`` E4M3 bytes + ``hd/block`` E8M0 bytes; the
    scale block must be one row tall) or ``dense`` (``hd`` values of ``dtype``)."""

    fmt: str
    head_dim: int
    dtype: torch.dtype = torch.float8_e4m3fn
    block: int = 32

    @classmethod
    def of(cls, w: PackedWeight) -> "RecordFormat":
        """The format of weight ``w`` [rows, hd]. Raises ValueError for formats a record cannot hold."""
        hd = w.shape[-1]
        if w.fmt == "dense":
            return cls("dense", hd, w.data.dtype, 1)
        if w.fmt != "fp8" or w.block[0] != 1:
            raise ValueError(f"an Engram table in format {w.fmt} with scale block {w.block} cannot be offloaded "
                             "(records hold FP8 rows with per-row scale blocks, or unquantized rows)")
        return cls("fp8", hd, torch.float8_e4m3fn, w.block[1])

    @property
    def data_bytes(self) -> int:
        return self.head_dim * torch.empty(0, dtype=self.dtype).element_size()

    @property
    def record_bytes(self) -> int:
        return self.data_bytes + (-(-self.head_dim // self.block) if self.fmt == "fp8" else 0)

    def encode(self, w: PackedWeight, out: Tensor) -> None:
        """Write ``w`` [n, hd] into records ``out`` uint8 [n, record_bytes]."""
        data = w.data.contiguous().view(torch.uint8).reshape(w.data.shape[0], -1)
        rec = torch.empty(out.shape, dtype=torch.uint8, device=data.device)  # whole records: one contiguous copy
        rec[:, : self.data_bytes] = data
        if self.fmt == "fp8":
            rec[:, self.data_bytes:] = w.scale
        out.copy_(rec)

    def decode(self, records: Tensor) -> PackedWeight:
        """Records uint8 [n, record_bytes] → the rows as a PackedWeight [n, hd] (views where possible)."""
        data = records[:, : self.data_bytes].contiguous().view(self.dtype)
        if self.fmt == "dense":
            return PackedWeight(data, None, "dense")
        return PackedWeight(data, records[:, self.data_bytes:].contiguous(), "fp8", (1, self.block))


class HostTable:
    """Rows ``[row0, row1)`` of one Engram layer's table (``full_rows`` rows) as records ``uint8 [rows, B]``
    (module docstring). ``shm_name``: the node-wide file name (None = a private buffer); ``pin``: page-lock the
    rank's rows (CUDA). Raises RuntimeError when pinning fails."""

    def __init__(self, fmt: RecordFormat, full_rows: int, row0: int, row1: int, pin: bool, shm_name: str | None):
        self.fmt, self.row0, self.row1 = fmt, row0, row1
        b = fmt.record_bytes
        self.path, self._registered = None, None
        need = full_rows * b
        self._mapping = self._map_shared(shm_name, need, row0 * b, (row1 - row0) * b) if shm_name else None
        if self._mapping is not None:
            self.records = self._mapping[row0 * b: row1 * b].view(row1 - row0, b)
        else:
            self.records = torch.empty(row1 - row0, b, dtype=torch.uint8, pin_memory=pin)
        if pin and self._mapping is not None:
            self._register()

    def _map_shared(self, name: str, size: int, start: int, length: int) -> Tensor | None:
        """The node-wide file ``name`` (``size`` bytes) mapped shared, with this rank's bytes ``[start, start +
        length)`` allocated up front (``posix_fallocate``: a full /dev/shm is a warning and a private buffer now,
        not a SIGBUS at the first write); None when that fails."""
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size < size:
                    os.ftruncate(fd, size)
                os.posix_fallocate(fd, start, length)
            finally:
                os.close(fd)
        except OSError as e:
            log.warning("Engram offload: cannot place %.1f GiB in %s (%s); using a private host buffer",
                        length / 2**30, path, e)
            return None
        self.path = path
        return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)

    def _register(self) -> None:
        ptr, size = self.records.data_ptr(), self.records.numel()
        start, end = ptr // _PAGE * _PAGE, -(-(ptr + size) // _PAGE) * _PAGE
        err = torch.cuda.cudart().cudaHostRegister(start, end - start, 0)
        if int(err) != 0 or not self.records.is_pinned():
            raise RuntimeError(f"Engram offload: cudaHostRegister of {(end - start) / 2**30:.1f} GiB failed ({err}); "
                               "raise the locked-memory limit (ulimit -l) or use a smaller table")
        # unregister before the mapping goes: at close(), or when this table is collected (the model holds it,
        # and whoever reads the records holds the model)
        self._registered = weakref.finalize(self, torch.cuda.cudart().cudaHostUnregister, start)

    def unlink(self) -> None:
        """Remove the ``/dev/shm`` name (every rank has mapped it; the memory stays until unmapped)."""
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unregister (CUDA), then unmap; idempotent."""
        if self._registered is not None:
            self._registered()
            self._registered = None
        self.unlink()
        self.records = self._mapping = None


def load_records(reader, name: str, table: HostTable, full_rows: int, dtype: torch.dtype,
                 chunk_rows: int = CHUNK_ROWS) -> None:
    """Fill ``table`` with rows ``[row0, row1)`` of checkpoint weight ``name`` ([full_rows, hd]), read in slices of
    ``chunk_rows`` rows (a :class:`~v41.checkpoint_packed.PackedReader` or ``DummyReader``). Raises the reader's
    CheckpointError when the stored table's shape or dtype disagrees with the config, ValueError when a chunk's
    format differs from the table's."""
    hd = table.fmt.head_dim
    for a in range(table.row0, table.row1, chunk_rows):
        b = min(a + chunk_rows, table.row1)
        w = reader.packed(name, (b - a, hd), Shard(0, a, b, full_rows), dtype)
        if RecordFormat.of(w) != table.fmt:
            raise ValueError(f"{name}: rows {a}..{b} are stored as {RecordFormat.of(w)}, expected {table.fmt}")
        table.fmt.encode(w, table.records[a - table.row0: b - table.row0])
