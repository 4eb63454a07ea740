"""A tensor-parallel worker process: joins the rendezvous, loads its shard, then runs every step rank 0
broadcasts until told to stop (DESIGN.md §3). ``run_headless`` starts all ranks of a non-zero node.
"""

from __future__ import annotations

import logging
import sys
import uuid

import msgpack
import torch

from ..cache import PagedCache, build_layout
from ..distributed.runtime import RankInfo, Runtime
from ..models.reference import load
from .args import EngineArgs
from .model_runner import ModelRunner
from .step import decode_step

log = logging.getLogger("v41.engine")


def worker_main(args: EngineArgs, info: RankInfo) -> None:
    """Entry point of rank ``info.rank`` (not 0). Exits when rank 0 sends ``shutdown``; raises (exit code 1)
    when rank 0 dies or a collective fails."""
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s tp-rank{info.rank}: %(message)s")
    runtime = Runtime.start(info, args.all_reduce_backend)
    try:
        dtype = args.torch_dtype()
        model = load(args.model, dtype=dtype, device=info.torch_device, numerics=args.numerics,
                     load_format=args.load_format, tp=runtime.group)
        runner = None
        while True:
            op, *rest = msgpack.unpackb(runtime.channel.recv(None), raw=False)
            if op == "step":
                runner.execute(decode_step(rest[0], info.torch_device), return_aux=rest[1])
            elif op == "cache":
                num_blocks, num_state_rows, block_tokens = rest
                cache = PagedCache(build_layout(model.cfg, block_tokens), num_blocks, num_state_rows, dtype,
                                   info.torch_device)
                runner = ModelRunner(model, cache, args.index_scratch_bytes)
            elif op == "shutdown":
                return
            else:
                raise RuntimeError(f"unknown step-channel message {op!r}")
    finally:
        runtime.close()


def run_headless(args: EngineArgs) -> int:
    """Run the ranks of node ``args.node_rank`` (> 0) of a multi-host engine until node 0 shuts it down.
    Returns 0 when every rank exited cleanly, else 1."""
    from .executor import rank_infos, spawn_workers, stop_workers

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
