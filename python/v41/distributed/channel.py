"""The step channel: rank 0 broadcasts each step's metadata (msgpack bytes, never pickled tensors) to the other
tensor-parallel ranks (docs/architecture.md §3). Within one host it is a v41-comm shared-memory broadcast; when ranks
span hosts it is a ``torch.distributed`` broadcast over a gloo group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class HostChannel:
    """Broadcast through a v41-comm segment (``v41._native.HostComm``) shared by the ranks of one host.

    ``recv(None)`` waits without a deadline (an idle engine sends nothing for as long as it likes) but still
    fails with ``v41._native.CommError`` naming rank 0 if that process dies.
    """

    def __init__(self, comm):
        self.comm = comm

    def send(self, data: bytes) -> None:
        self.comm.broadcast(data, 0)

    def recv(self, timeout_s: float | None = None) -> bytes:
        return bytes(self.comm.broadcast(None, 0, timeout_s))

    def close(self) -> None:
        self.comm.close()


class TorchChannel:
    """Broadcast over a ``torch.distributed`` gloo group (ranks on several hosts): an int64 length, then the
    bytes as a uint8 tensor. Waits are bounded by the group's timeout."""

    def __init__(self, group=None):
        self.group = group

    def send(self, data: bytes) -> None:
        n = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(n, 0, group=self.group)
        if data:
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=self.group)

    def recv(self, timeout_s: float | None = None) -> bytes:
        n = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(n, 0, group=self.group)
        buf = torch.empty(int(n), dtype=torch.uint8)
        if buf.numel():
            dist.broadcast(buf, 0, group=self.group)
        return buf.numpy().tobytes()

    def close(self) -> None:
        pass
