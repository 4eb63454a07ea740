"""A tensor-parallel worker process: joins the rendezvous, loads its shard, then runs every step rank 0
broadcasts until told to stop (docs/architecture.md §3). Each step arrives as the host plan (:class:`~.host_step.HostStep`
bytes); the worker fills its own input buffers from it.
"""

from __future__ import annotations

import logging
import sys

import msgpack
import numpy as np
import torch

from ..distributed.runtime import RankInfo, Runtime
from .args import EngineArgs
from .host_step import HostStep
from .model_runner import ModelRunner

log = logging.getLogger("v41.engine")


def worker_main(args: EngineArgs, info: RankInfo, log_level: int = logging.INFO) -> None:
    """Entry point of rank ``info.rank`` (not 0). Exits when rank 0 sends ``shutdown`` or closes its end;
    raises (exit code 1) when rank 0 dies or a collective fails. ``log_level``: rank 0's logging level."""
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s tp-rank{info.rank}: %(message)s")
    runtime = Runtime.start(info, args.all_reduce_backend)
    runner = None
    try:
        runner = ModelRunner(args, info.torch_device, runtime.group, info.session)
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
                runner.execute(HostStep.decode(rest[0]))
            elif op == "draft":
                runner.draft(*(np.frombuffer(b, dtype="<i8") for b in rest))
            elif op == "cache":
                _init_cache(runner, runtime, rest)
            elif op == "shutdown":
                return
            elif op != "noop":
                raise RuntimeError(f"unknown step-channel message {op!r}")
    finally:
        if runner is not None:
            runner.close()
        runtime.close()


def _init_cache(runner: ModelRunner, runtime: Runtime, msg: list) -> None:
    """Allocate this rank's paged cache as rank 0 asked and report success or failure to every rank."""
    num_blocks, num_state_rows, block_tokens, max_model_len = msg
    try:
        runner.init_cache(num_blocks, num_state_rows, block_tokens, max_model_len)
    except Exception:
        log.exception("could not allocate the KV cache (%d blocks per kind)", num_blocks)
        runtime.failed_ranks(False)
        raise
    runtime.failed_ranks(True)
