"""The ``host`` collective backend: all-reduce and all-gather through a v41-comm shared-memory segment
(crates/v41-comm). Works without GPU peer access and on CPU; ranks must share one host (KF-20).

All-reduce accumulates in float32 in a fixed rank order and rounds once, so every rank holds identical bytes
and the result does not depend on how the message is chunked. CUDA tensors are staged through pinned host
memory. Dtypes v41-comm does not reduce (float64) go to the fallback group (``torch.distributed``).
"""

from __future__ import annotations

import torch

from .group import TPGroup

_COMM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def _as_numpy(flat: torch.Tensor):
    """A contiguous 1-D CPU float32/bfloat16 tensor → a numpy view of the same memory (bf16 as int16 bits)."""
    return flat.numpy() if flat.dtype == torch.float32 else flat.view(torch.int16).numpy()


class HostGroup(TPGroup):
    """Tensor-parallel group over ``v41._native.HostComm``.

    comm: a joined HostComm (its rank/world size are the group's); fallback: the group used for dtypes the
    segment does not reduce. Raises ``v41._native.CommError`` (naming the rank and the operation) when a peer
    dies or lags past the communicator's deadline.
    """

    name = "host"

    def __init__(self, comm, fallback: TPGroup):
        self.comm, self.fallback = comm, fallback
        self.rank, self.world_size = comm.rank, comm.world_size
        self._pinned = torch.empty(0, dtype=torch.uint8)

    def _staging(self, x: torch.Tensor) -> torch.Tensor:
        """A flat host tensor of x's dtype and size: pinned and reused for CUDA tensors (grown as needed)."""
        nbytes = x.numel() * x.element_size()
        if x.device.type != "cuda":
            return torch.empty(x.numel(), dtype=x.dtype)
        if self._pinned.numel() < nbytes:
            self._pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._pinned[:nbytes].view(x.dtype)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks of x (any shape, float32 or bfloat16; others via the fallback); returns x, reduced
        in place. CUDA tensors go through a pinned staging buffer (copy out, synchronize, reduce, copy back
        queued on the current stream, which orders it before the next call's copy out)."""
        if x.dtype not in _COMM_DTYPES:
            return self.fallback.all_reduce(x)
        if x.device.type == "cpu" and x.is_contiguous():
            self.comm.all_reduce(_as_numpy(x.view(-1)), _COMM_DTYPES[x.dtype])
            return x
        host = self._staging(x)
        host.copy_(x.reshape(-1), non_blocking=True)
        if x.device.type == "cuda":
            torch.cuda.current_stream(x.device).synchronize()
        self.comm.all_reduce(_as_numpy(host), _COMM_DTYPES[x.dtype])
        x.copy_(host.view(x.shape), non_blocking=True)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenation of every rank's x (same shape everywhere) along ``dim``, in rank order."""
        moved = x.detach().movedim(dim, 0).to("cpu").contiguous()
        src = moved.view(-1).view(torch.uint8)
        out = torch.empty(self.world_size * src.numel(), dtype=torch.uint8)
        self.comm.all_gather(src.numpy(), out.numpy())
        parts = out.view(x.dtype).view(self.world_size, *moved.shape)
        return torch.cat([p.movedim(0, dim) for p in parts.unbind(0)], dim=dim).to(x.device)

    def barrier(self) -> None:
        self.comm.barrier()

    def close(self) -> None:
        self.comm.close()
