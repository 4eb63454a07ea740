""":class:`TorchDistGroup`: the TP group over an initialised ``torch.distributed`` process group (gloo on CPU,
NCCL on CUDA; docs/architecture.md §6).

Rendezvous is the caller's: ``torch.distributed.init_process_group(backend, init_method=..., rank=...,
world_size=...)`` first, then ``TorchDistGroup()``. Ring all-reduce (gloo, NCCL) reduces each element on one
rank and then broadcasts it, so results are bitwise identical on every rank, as :class:`TPGroup` requires.
The process group belongs to whoever initialised it: :meth:`TorchDistGroup.close` does not destroy it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .group import TPGroup


class TorchDistGroup(TPGroup):
    """A :class:`TPGroup` over ``group`` (None = the default process group); rank and world size come from
    ``torch.distributed``. Tensors must live on the backend's device (CPU for gloo, the rank's GPU for NCCL).

    Raises RuntimeError when ``torch.distributed`` is not initialised, and from any collective after
    :meth:`close`.
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("TorchDistGroup needs an initialised torch.distributed process group "
                               "(call torch.distributed.init_process_group first)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.name = f"torch-{self.backend}"
        self._closed = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (``dist.all_reduce`` SUM), in place on ``x`` when it is contiguous."""
        self._check_open()
        if self.world_size == 1:
            return x
        y = x if x.is_contiguous() else x.contiguous()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.group)
        return y

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Rank-ordered concatenation along ``dim``: ``all_gather_into_tensor`` for dim 0, else
        ``all_gather`` into a list + ``torch.cat``."""
        self._check_open()
        if self.world_size == 1:
            return x
        x = x.contiguous()
        dim = dim % x.dim()
        if dim == 0:
            out = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))
            dist.all_gather_into_tensor(out, x, group=self.group)
            return out
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def barrier(self) -> None:
        self._check_open()
        dist.barrier(group=self.group)

    def close(self) -> None:
        """Stop using the group (idempotent). The process group itself stays: its owner destroys it with
        ``torch.distributed.destroy_process_group``."""
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name} group (rank {self.rank}) is closed")
