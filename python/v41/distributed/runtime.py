"""One tensor-parallel rank's distributed runtime: the ``torch.distributed`` env rendezvous, the collective
backend chosen by flag behind its start-up self-test, and the step channel (docs/architecture.md §3, §6; KF-20).

Rank layout: ``rank = node_rank · ranks_per_node + local_rank``; rank 0 (node 0) runs the engine core; each
rank uses ``cuda:<local_rank>`` on CUDA. Backends:

* ``nccl`` / ``gloo``: ``torch.distributed`` (NCCL on CUDA, gloo on CPU); the only choice across hosts.
* ``host``: v41-comm shared memory (:mod:`.host_backend`); one host only, CPU or CUDA without P2P.
* ``pcie-pull``: paired pull all-reduce over CUDA IPC (:mod:`.pcie_pull`); one host, CUDA with peer access.
* ``auto``: ``nccl`` on CUDA; on CPU ``host`` on one host, ``gloo`` across hosts.

A custom backend (host, pcie-pull) that cannot be built or fails the self-test on any rank is replaced by
``torch.distributed`` on every rank, and the reason is logged (never a start-up hang across hosts).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .channel import HostChannel, TorchChannel
from .group import TPGroup
from .selftest import run_selftest
from .torch_backend import TorchDistGroup

log = logging.getLogger("v41.distributed")

BACKENDS = ("auto", "nccl", "gloo", "host", "pcie-pull")
CHANNEL_LANE_BYTES = 1 << 20
DEFAULT_COLLECTIVE_TIMEOUT_S = 120.0
# gloo/NCCL wait this long in a collective; idle workers of a multi-host engine wait in the step channel
TORCH_TIMEOUT = timedelta(hours=24)


def check_backend(backend: str, device: str) -> None:
    """Raises ValueError for an unknown backend name or one that cannot run on ``device`` (nccl on CPU, gloo
    on CUDA)."""
    if backend not in BACKENDS:
        raise ValueError(f"all-reduce backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    cuda = str(device).startswith("cuda")
    if backend == "nccl" and not cuda:
        raise ValueError("the nccl backend needs CUDA; use gloo or host on CPU")
    if backend == "gloo" and cuda:
        raise ValueError("the gloo backend is for CPU ranks; use nccl, host or pcie-pull on CUDA")


def collective_timeout_s() -> float:
    """Deadline of one v41-comm collective (seconds): env ``V41_COLLECTIVE_TIMEOUT_S``, default 120."""
    return float(os.environ.get("V41_COLLECTIVE_TIMEOUT_S", DEFAULT_COLLECTIVE_TIMEOUT_S))


def host_lane_bytes() -> int:
    """Lane size of the ``host`` backend's segment (bytes): env ``V41_HOST_LANE_BYTES``, default 1 MiB
    (cache-sized rounds measured faster than 16 MiB ones, crates/v41-comm/README.md)."""
    return int(os.environ.get("V41_HOST_LANE_BYTES", 1 << 20))


def selftest_max_bytes(device: str) -> int:
    """Largest self-test message: env ``V41_SELFTEST_MAX_BYTES``; default 64 MiB on CUDA, 4 MiB on CPU."""
    default = (64 << 20) if device.startswith("cuda") else (4 << 20)
    return int(os.environ.get("V41_SELFTEST_MAX_BYTES", default))


def segment_dir(need_bytes: int) -> str:
    """Where to put shared segments: /dev/shm when it has ``need_bytes`` free (×2 headroom), else the temp
    directory (file-backed segment; docs/numerics.md §4a)."""
    shm = "/dev/shm"
    try:
        if shutil.disk_usage(shm).free >= 2 * need_bytes:
            return shm
    except OSError:
        pass
    return tempfile.gettempdir()


@dataclass(frozen=True)
class RankInfo:
    """Where one rank sits. ``session``: a name unique to this engine, shared by all of its ranks (segment file
    names); ``device``: ``cpu`` or ``cuda``."""

    rank: int
    world_size: int
    local_rank: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    device: str
    session: str

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def torch_device(self) -> str:
        return f"cuda:{self.local_rank}" if self.device.startswith("cuda") else "cpu"

    def join_segment(self, what: str, lane_bytes: int):
        """This node's v41-comm segment ``what`` (one per engine session), joined as ``local_rank`` of the
        node's ranks: a ``v41._native.HostComm`` that returns once every rank has joined (rank 0 then removes
        the file name, so nothing outlives the engine). Deadline: :func:`collective_timeout_s`."""
        from .. import _native

        need = _native.HostComm.segment_bytes(self.ranks_per_node, lane_bytes)
        path = os.path.join(segment_dir(need), f"v41-{self.session}-n{self.node_rank}-{what}")
        return _native.HostComm(path, self.local_rank, self.ranks_per_node, lane_bytes, collective_timeout_s())


class Runtime:
    """The group (``group``: what the model's collectives run on), the step channel (``channel``) and the
    backend decision (``backend``, ``reason``) of one rank. Build with :meth:`start`; ``close()`` at exit."""

    def __init__(self, info: RankInfo, group: TPGroup, channel, backend: str, reason: str):
        self.info, self.group, self.channel, self.backend, self.reason = info, group, channel, backend, reason

    @classmethod
    def start(cls, info: RankInfo, backend: str = "auto",
              check_peers: Callable[[], str | None] | None = None) -> "Runtime":
        """Rendezvous, choose and self-test the backend, open the step channel. Every rank of the engine must
        call it. ``check_peers`` (rank 0): returns a reason when a local worker process has died, so start-up
        fails at once instead of waiting for it. Raises ValueError for a backend that cannot apply (nccl on
        CPU, gloo on CUDA, unknown name), RuntimeError when a peer died or even ``torch.distributed`` fails its
        self-test, TimeoutError when ranks did not join in time."""
        check_backend(backend, info.device)
        cuda = info.device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(info.local_rank)
        if info.local_rank == 0:
            from .probe import probe

            log.info("node %d topology: %s", info.node_rank, probe())
        store = rendezvous(info, check_peers)
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=info.rank,
                                world_size=info.world_size, timeout=TORCH_TIMEOUT)
        torch_group, torch_name = TorchDistGroup(), ("nccl" if cuda else "gloo")
        if backend == "auto":
            backend = "nccl" if cuda else ("host" if info.nnodes == 1 else "gloo")
        group, reason = cls._custom(info, backend, torch_group) if backend in ("host", "pcie-pull") \
            else (torch_group, "requested")
        chosen = backend if group is not torch_group else torch_name
        failure = run_selftest(group, info.torch_device, selftest_max_bytes(info.device))
        if group is not torch_group and not _agree(failure is None, torch_group, info):
            reason = f"self-test failed: {failure}" if failure else "self-test failed on another rank"
            group.close()
            group, chosen = torch_group, torch_name
            failure = run_selftest(group, info.torch_device, selftest_max_bytes(info.device))
        if failure is not None:
            raise RuntimeError(f"rank {info.rank}: the {chosen} backend failed its self-test: {failure}")
        if chosen != backend:
            log.warning("rank %d: all-reduce backend %s requested, using %s: %s", info.rank, backend, chosen, reason)
        else:
            log.info("rank %d: all-reduce backend %s (%s; self-test passed)", info.rank, chosen, reason)
        return cls(info, group, cls._channel(info), chosen, reason)

    @staticmethod
    def _custom(info: RankInfo, backend: str, torch_group: TorchDistGroup) -> tuple[TPGroup, str]:
        """Build host / pcie-pull; every rank agrees, or all use torch.distributed (returned with the reason)."""
        group, why = None, None
        if info.nnodes > 1:
            why = "ranks span hosts (custom collectives are single-host only)"
        else:
            try:
                group = _make_host(info, torch_group) if backend == "host" else _make_pcie(info, torch_group)
            except Exception as e:
                why = f"{type(e).__name__}: {e}"
        if not _agree(group is not None, torch_group, info):
            if group is not None:
                group.close()
            return torch_group, why or "another rank could not build it"
        return group, "all ranks on one host"

    @staticmethod
    def _channel(info: RankInfo):
        if info.nnodes > 1:
            return TorchChannel(dist.new_group(backend="gloo", timeout=TORCH_TIMEOUT)
                                if info.device.startswith("cuda") else None)
        return HostChannel(info.join_segment("channel", CHANNEL_LANE_BYTES))

    def failed_ranks(self, ok: bool) -> list[int]:
        """Every rank reports whether its last action succeeded (an all-gather over the group); returns the
        ranks that failed, the same list on every rank."""
        flags = self.group.all_gather(torch.tensor([1.0 if ok else 0.0], device=self.info.torch_device), dim=0)
        return [r for r, f in enumerate(flags.tolist()) if f == 0.0]

    def close(self) -> None:
        """Close the channel and the group, leave the process group. Safe to call twice."""
        for obj in (self.channel, self.group):
            try:
                obj.close()
            except Exception:  # closing after a peer died must not mask the original error
                pass
        if dist.is_initialized():
            dist.destroy_process_group()


def rendezvous_timeout_s() -> float:
    """How long rank 0 waits for every rank to join (seconds): env ``V41_RENDEZVOUS_TIMEOUT_S``, default 600
    (other hosts may start later; dead local workers are noticed at once)."""
    return float(os.environ.get("V41_RENDEZVOUS_TIMEOUT_S", 600))


def rendezvous(info: RankInfo, check_peers: Callable[[], str | None] | None = None) -> dist.TCPStore:
    """The torch.distributed env rendezvous (a TCPStore on ``master_addr:master_port`` served by rank 0).
    Rank 0 polls until every rank has checked in, so a worker that died first is reported within ~50 ms
    (``check_peers``) and a missing remote rank after :func:`rendezvous_timeout_s`, naming the ranks."""
    timeout = rendezvous_timeout_s()
    store = dist.TCPStore(info.master_addr, info.master_port, info.world_size, is_master=info.rank == 0,
                          timeout=timedelta(seconds=timeout), wait_for_workers=False)
    store.set(f"v41/joined/{info.rank}", "1")
    if info.rank != 0:
        return store
    keys = [f"v41/joined/{r}" for r in range(info.world_size)]
    deadline = time.monotonic() + timeout
    while not store.check(keys):
        problem = check_peers() if check_peers is not None else None
        if problem:
            raise RuntimeError(f"tensor-parallel start-up failed: {problem}")
        if time.monotonic() > deadline:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            raise TimeoutError(f"tensor-parallel rank(s) {missing} did not join {info.master_addr}:"
                               f"{info.master_port} within {timeout:.0f} s")
        time.sleep(0.05)
    return store


def _agree(ok: bool, torch_group: TorchDistGroup, info: RankInfo) -> bool:
    """True only when ``ok`` holds on every rank (a MIN all-reduce over torch.distributed)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=info.torch_device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _make_host(info: RankInfo, fallback: TPGroup) -> TPGroup:
    from .host_backend import HostGroup

    return HostGroup(info.join_segment("host", host_lane_bytes()), fallback)


def _make_pcie(info: RankInfo, fallback: TPGroup) -> TPGroup:
    from .pcie_pull import PciePullGroup

    return PciePullGroup.create(info, fallback)
