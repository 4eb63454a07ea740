"""Tensor-parallel worker processes on this host: their rank descriptions, start (spawn) and stop, a free port
for the single-host rendezvous, and the headless mode of a non-zero node (all its ranks, no engine).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import socket
import uuid

from ..distributed.runtime import RankInfo
from .args import EngineArgs
from .tp_worker import worker_main

log = logging.getLogger("v41.engine")

WORKER_JOIN_TIMEOUT_S = 10.0


def free_port() -> int:
    """A TCP port free on this host now (for the single-host rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_infos(args: EngineArgs, session: str, port: int) -> list[RankInfo]:
    """The RankInfo of each rank on this node (``args.node_rank``), local rank order."""
    rpn = args.tensor_parallel_size // args.nnodes
    device = "cuda" if str(args.device).startswith("cuda") else "cpu"
    return [RankInfo(rank=args.node_rank * rpn + lr, world_size=args.tensor_parallel_size, local_rank=lr,
                     nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                     master_port=port, device=device, session=session) for lr in range(rpn)]


def spawn_workers(args: EngineArgs, infos: list[RankInfo]) -> list:
    """Start one daemon process per RankInfo (spawn context) running :func:`.tp_worker.worker_main`."""
    ctx = mp.get_context("spawn")
    level = logging.getLogger("v41").getEffectiveLevel()
    procs = [ctx.Process(target=worker_main, args=(args, info, level), name=f"v41-tp{info.rank}", daemon=True)
             for info in infos]
    for p in procs:
        p.start()
    return procs


def stop_workers(procs: list, timeout_s: float = WORKER_JOIN_TIMEOUT_S) -> None:
    """Join worker processes; kill those still alive after ``timeout_s``."""
    for p in procs:
        p.join(timeout_s)
        if p.is_alive():
            p.kill()
            p.join(2)


def run_headless(args: EngineArgs) -> int:
    """Run the ranks of node ``args.node_rank`` (> 0) of a multi-host engine until node 0 shuts it down.
    Returns 0 when every rank exited cleanly, else 1."""
    if args.node_rank == 0 or args.master_port is None:
        raise ValueError("headless mode is for node_rank > 0 with the master_addr/master_port of node 0")
    procs = spawn_workers(args, rank_infos(args, uuid.uuid4().hex[:12], args.master_port))
    try:
        for p in procs:
            p.join()
    finally:
        stop_workers(procs, timeout_s=0)
    bad = [(p.name, p.exitcode) for p in procs if p.exitcode != 0]
    for name, code in bad:
        log.error("%s exited with code %s", name, code)
    return 1 if bad else 0
