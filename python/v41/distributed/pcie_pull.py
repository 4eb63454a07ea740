"""The opt-in ``pcie-pull`` all-reduce for GPUs of one host with peer access (docs/architecture.md §3; seed
"paired PCIe collectives").

Each rank owns one CUDA buffer shared with its peers through CUDA IPC: an input half and a reduced half.
All-reduce of x (bf16 or fp32, at most ``buffer_bytes``):

1. copy x into my input half; synchronize; flag barrier (v41-comm);
2. pull my shard (element range ``split_range(n, W, rank)``) from every peer's input half, in rank order
   0..W−1, accumulating in FP32; round once into my reduced half; synchronize; flag barrier;
3. pull every peer's reduced shard back into x (queued; the next call's first synchronize covers it).

Steps 2 and 3 are one kernel each (:mod:`v41.kernels.peer_pull`, reading peer memory directly). Two barriers
per call suffice: a rank overwrites its input half (step 1 of call n+1) only after every peer passed call n's
second barrier (so finished reading it), and its reduced half (step 2 of n+1) only after every peer passed
call n+1's first barrier, which each peer reaches only after synchronizing its stream, i.e. after its step 3
of call n completed. IPC handles are exchanged with v41-comm's
byte all-gather. Larger messages, other dtypes and all-gather go to the fallback group (NCCL).
"""

from __future__ import annotations

import msgpack
import torch

from ..kernels.peer_pull import pull_gather, pull_reduce
from .group import TPGroup, split_range

DEFAULT_BUFFER_BYTES = 32 << 20
HANDLE_BYTES = 4096  # room for one packed IPC handle tuple
_DTYPES = (torch.float32, torch.bfloat16)


def share_handle(buf: torch.Tensor) -> bytes:
    """CUDA IPC handle of ``buf``'s storage, packed to a fixed ``HANDLE_BYTES`` record."""
    packed = msgpack.packb(list(buf.untyped_storage()._share_cuda_()), use_bin_type=True)
    if len(packed) > HANDLE_BYTES:
        raise RuntimeError(f"CUDA IPC handle record of {len(packed)} bytes exceeds {HANDLE_BYTES}")
    return packed + b"\0" * (HANDLE_BYTES - len(packed))


def open_handle(record: bytes, device: int) -> torch.Tensor:
    """A peer's buffer from its :func:`share_handle` record, mapped into ``device``'s address space (CUDA
    enables peer access lazily, cudaIpcMemLazyEnablePeerAccess): a uint8 tensor that torch sees on
    ``cuda:device`` whose memory lives on the peer's GPU, so kernels on ``device`` read it directly."""
    fields = msgpack.Unpacker(raw=False)
    fields.feed(record)
    args = next(fields)
    args[0] = device
    storage = torch.UntypedStorage._new_shared_cuda(*args)
    return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", device)).set_(storage)


class PciePullGroup(TPGroup):
    """Tensor-parallel group whose all-reduce pulls over peer links (see the module docstring).

    comm: a joined ``v41._native.HostComm`` (flags, handle exchange); bufs: every rank's buffer, mine at
    ``rank``; fallback: the NCCL group for what does not fit. Raises ``v41._native.CommError`` naming the rank
    when a peer dies or lags.
    """

    name = "pcie-pull"

    def __init__(self, comm, bufs: list[torch.Tensor], fallback: TPGroup):
        self.comm, self.bufs, self.fallback = comm, bufs, fallback
        self.rank, self.world_size = comm.rank, comm.world_size
        self.half = bufs[self.rank].numel() // 2
        self.device = bufs[self.rank].device

    @classmethod
    def create(cls, info, fallback: TPGroup, buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> "PciePullGroup":
        """Allocate and exchange the IPC buffers. Raises RuntimeError without CUDA peer access between every pair
        of this host's GPUs (checked, not assumed)."""
        w, me = info.world_size, info.local_rank
        if not torch.cuda.is_available():
            raise RuntimeError("pcie-pull needs CUDA")
        # Join first: a rank that then fails a check leaves, and its peers' next collective fails at once
        # (instead of waiting out the join deadline).
        comm = info.join_segment("pcie", HANDLE_BYTES)
        no_peer = [k for k in range(w) if k != me and not torch.cuda.can_device_access_peer(me, k)]
        if no_peer:
            comm.close()
            raise RuntimeError(f"GPU {me} has no peer access to GPU(s) {no_peer}")
        mine = torch.zeros(2 * buffer_bytes, dtype=torch.uint8, device=torch.device("cuda", me))
        torch.cuda.synchronize(me)
        records = torch.empty(w * HANDLE_BYTES, dtype=torch.uint8)
        comm.all_gather(torch.frombuffer(bytearray(share_handle(mine)), dtype=torch.uint8).numpy(),
                        records.numpy())
        raw = records.numpy().tobytes()
        bufs = [mine if k == me else open_handle(raw[k * HANDLE_BYTES:(k + 1) * HANDLE_BYTES], me)
                for k in range(w)]
        return cls(comm, bufs, fallback)

    def _halves(self, k: int, dtype: torch.dtype, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.bufs[k]
        return b[: self.half].view(dtype)[:n], b[self.half:].view(dtype)[:n]

    def _sync_barrier(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()
        self.comm.barrier()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks of x (CUDA, bf16/fp32, ≤ half the buffer), FP32-accumulated in rank order and rounded
        once; identical bytes on every rank. Anything else goes to the fallback. Returns x, reduced in place
        (the last pull is queued on the current stream, not waited for)."""
        n = x.numel()
        if x.dtype not in _DTYPES or x.device != self.device or n * x.element_size() > self.half:
            return self.fallback.all_reduce(x)
        flat = x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)
        halves = [self._halves(k, x.dtype, n) for k in range(self.world_size)]
        halves[self.rank][0].copy_(flat)
        self._sync_barrier()
        a, e = split_range(n, self.world_size, self.rank)
        pull_reduce([h[0] for h in halves], halves[self.rank][1], a, e)
        self._sync_barrier()
        pull_gather([h[1] for h in halves], flat)
        if flat.data_ptr() != x.data_ptr():
            x.copy_(flat.view(x.shape))
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return self.fallback.all_gather(x, dim)

    def barrier(self) -> None:
        self.comm.barrier()

    def close(self) -> None:
        self.bufs = []
        self.comm.close()
