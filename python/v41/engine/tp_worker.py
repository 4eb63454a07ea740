"""A tensor-parallel worker process: joins the rendezvous, loads its shard, then runs every step rank 0
broadcasts until told to stop (DESIGN.md §3). ``run_headless`` starts all ranks of a non-zero node.
"""

from __future__ import annotations

import logging
import sys
import uuid

import msgpack
import torch

from ..distributed.runtime import RankInfo, Runtime
from .args import EngineArgs
from .executor import load_model, paged_runner
from .model_runner import ModelRunner
from .step import decode_step

log = logging.getLogger("v41.engine")


def worker_main(args: EngineArgs, info: RankInfo, log_level: int = logging.INFO) -> None:
    """Entry point of rank ``info.rank`` (not 0). Exits when rank 0 sends ``shutdown`` or closes its end;
    raises (exit code 1) when rank 0 dies or a collective fails. ``log_level``: rank 0's logging level."""
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s tp-rank{info.rank}: %(message)s")
    runtime = Runtime.start(info, args.all_reduce_backend)
    try:
        model = load_model(args, info.torch_device, runtime.group)
        runner = None
        while True:
            try:
                data = runtime.channel.recv(None)
            except Exception as e:  # noqa: BLE001 - rank 0 closed its end (exit without shutdown) or died
                if "rank 0" in str(e) and "left" in str(e):
                    log.info("rank 0 closed the engine; exiting")
                    return
                raise
            op, *rest = msgpack.unpackb(data, raw=False)
            if op == "step":
                runner.execute(decode_step(rest[0], info.torch_device), return_aux=rest[1])
            elif op == "cache":
                runner = _make_runner(args, model, runtime, rest, info.torch_device)
            elif op == "shutdown":
                return
            elif op != "noop":
                raise RuntimeError(f"unknown step-channel message {op!r}")
    finally:
        runtime.close()


def _make_runner(args: EngineArgs, model, runtime: Runtime, msg: list, device: str) -> ModelRunner:
    """Allocate this rank's paged cache as rank 0 asked and report success or failure to every rank."""
    num_blocks, num_state_rows, block_tokens = msg
    try:
        runner = paged_runner(args, model, num_blocks, num_state_rows, block_tokens, device)
    except Exception:
        log.exception("could not allocate the KV cache (%d blocks per kind)", num_blocks)
        runtime.failed_ranks(False)
        raise
    runtime.failed_ranks(True)
    return runner


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
