"""Where the model runs: in this process (:class:`LocalExecutor`, TP=1) or across tensor-parallel worker
processes (:class:`TPExecutor`, rank 0 here; DESIGN.md §3).

Both load the model (rank 0's shard), size nothing themselves, build the paged cache when the engine core
has chosen the block count, and run one :class:`~.step.StepBatch` per ``execute`` call. The TP executor first
broadcasts the step's metadata through the step channel, so every rank runs the same step on its shard.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import socket
import threading
import time
import uuid

import msgpack
import torch

from ..cache import PagedCache, build_layout
from ..config import load_config
from ..distributed.group import TPGroup, check_tp
from ..distributed.runtime import RankInfo, Runtime
from ..models.reference import load
from ..models.reference.model import Transformer
from .args import EngineArgs
from .model_runner import ModelRunner
from .step import StepBatch, encode_step

log = logging.getLogger("v41.engine")
WORKER_JOIN_TIMEOUT_S = 10.0
KEEPALIVE_IDLE_S = 600.0  # an idle multi-host engine sends a no-op step message this often
KEEPALIVE_CHECK_S = 30.0


def load_model(args: EngineArgs, device: str, tp: TPGroup | None = None) -> Transformer:
    """The model (this rank's shard with ``tp``) as ``args`` describe it, on ``device``."""
    return load(args.model, dtype=args.torch_dtype(), device=device, numerics=args.numerics,
                load_format=args.load_format, tp=tp)


def paged_runner(args: EngineArgs, model: Transformer, num_blocks: int, num_state_rows: int, block_tokens: int,
                 device: str) -> ModelRunner:
    """A runner over a new paged cache: ``num_blocks`` blocks of ``block_tokens`` tokens per kind and
    ``num_state_rows`` compressor-state rows, in the compute dtype on ``device`` (raises on allocation failure)."""
    cache = PagedCache(build_layout(model.cfg, block_tokens), num_blocks, num_state_rows, args.torch_dtype(), device)
    return ModelRunner(model, cache, args.index_scratch_bytes)


class LocalExecutor:
    """TP=1: model, paged cache and runner in this process. ``device``: the torch device of the model."""

    def __init__(self, args: EngineArgs):
        self.args, self.device = args, args.device
        self.model = load_model(args, args.device)
        self.cfg = self.model.cfg
        self.runner: ModelRunner | None = None

    def init_cache(self, num_blocks: int, num_state_rows: int, block_tokens: int) -> PagedCache:
        """Allocate the paged cache (``num_blocks`` per kind) and the runner over it."""
        self.runner = paged_runner(self.args, self.model, num_blocks, num_state_rows, block_tokens, self.device)
        return self.runner.cache

    def execute(self, batch: StepBatch, return_aux: bool = False):
        """Logits [N, vocab] of ``batch.logits_rows`` (with ``return_aux``: and the DSpark aux states)."""
        return self.runner.execute(batch, return_aux)

    def shutdown(self) -> None:
        pass


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
    from .tp_worker import worker_main

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


class TPExecutor:
    """Rank 0 of a tensor-parallel engine: spawns this node's other ranks, joins the rendezvous, loads its
    shard; ``execute`` broadcasts the step then runs rank 0's part (logits are full on every rank).

    Raises ValueError when the config cannot be split ``tensor_parallel_size`` ways, RuntimeError when a
    worker process has exited (naming its rank and exit code), and ``v41._native.CommError`` when a peer dies
    or lags inside a collective.
    """

    def __init__(self, args: EngineArgs):
        if args.device not in ("cpu", "cuda"):
            raise ValueError(f"tensor parallelism places rank r on cuda:r or the CPU: device must be 'cpu' or "
                             f"'cuda', got {args.device!r}")
        check_tp(load_config(args.model), args.tensor_parallel_size)
        self.args = args
        infos = rank_infos(args, uuid.uuid4().hex[:12], args.master_port or free_port())
        self.info = infos[0]
        self.device = self.info.torch_device
        if self.info.device == "cuda" and len(infos) > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size {args.tensor_parallel_size} needs {len(infos)} GPUs on this "
                             f"host, {torch.cuda.device_count()} visible")
        self.procs = spawn_workers(args, infos[1:])
        self.runtime: Runtime | None = None
        try:
            self.runtime = Runtime.start(self.info, args.all_reduce_backend, self._dead_worker)
            self.model = load_model(args, self.device, self.runtime.group)
        except BaseException:
            self.shutdown()
            raise
        self.cfg = self.model.cfg
        self.backend = self.runtime.backend
        self.runner: ModelRunner | None = None
        self._lock = threading.Lock()  # one message + step at a time (the keep-alive thread sends too)
        self._last_send = time.monotonic()
        atexit.register(self.shutdown)
        if args.nnodes > 1:  # gloo broadcasts time out after TORCH_TIMEOUT: never let remote ranks idle that long
            threading.Thread(target=self._keepalive, name="v41-tp-keepalive", daemon=True).start()
        log.info("tensor parallel: %d ranks (%d per node), backend %s", args.tensor_parallel_size,
                 len(infos), self.backend)

    def _dead_worker(self) -> str | None:
        for p in self.procs:
            if not p.is_alive():
                return f"tensor-parallel worker {p.name} (pid {p.pid}) exited with code {p.exitcode}"
        return None

    def _send(self, *msg) -> None:
        problem = self._dead_worker()
        if problem:
            raise RuntimeError(problem)
        self.runtime.channel.send(msgpack.packb(list(msg), use_bin_type=True))
        self._last_send = time.monotonic()

    def _keepalive(self) -> None:
        while self.runtime is not None:
            time.sleep(KEEPALIVE_CHECK_S)
            with self._lock:
                if self.runtime is not None and time.monotonic() - self._last_send > KEEPALIVE_IDLE_S:
                    try:
                        self._send("noop")
                    except Exception as e:  # the next step reports it to the engine
                        log.warning("tensor-parallel keep-alive: %s", e)
                        return

    def init_cache(self, num_blocks: int, num_state_rows: int, block_tokens: int) -> PagedCache:
        """Allocate the paged cache on every rank (same block count everywhere; KV is replicated). Raises
        RuntimeError naming the ranks that could not allocate it (their log says why)."""
        with self._lock:
            self._send("cache", num_blocks, num_state_rows, block_tokens)
            failure = None
            try:
                self.runner = paged_runner(self.args, self.model, num_blocks, num_state_rows, block_tokens,
                                           self.device)
            except Exception as e:
                failure = e
            bad = self.runtime.failed_ranks(failure is None)
            if failure is not None:
                raise failure
            if bad:
                raise RuntimeError(f"tensor-parallel rank(s) {bad} could not allocate the KV cache ({num_blocks} "
                                   "blocks per kind); their log says why")
        return self.runner.cache

    def execute(self, batch: StepBatch, return_aux: bool = False):
        """Broadcast ``batch`` to every rank, run rank 0's shard; returns what :class:`ModelRunner` does."""
        with self._lock:
            self._send("step", encode_step(batch), return_aux)
            return self.runner.execute(batch, return_aux)

    def shutdown(self) -> None:
        """Tell the workers to exit, join (kill after a timeout), close the runtime. Safe to call twice; also
        runs at interpreter exit."""
        if self.runtime is not None and all(p.is_alive() for p in self.procs):
            try:
                self._send("shutdown")
            except Exception as e:  # a dead peer: fall through to killing the rest
                log.warning("tensor-parallel shutdown: %s", e)
        stop_workers(self.procs)
        self.procs = []
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None


def make_executor(args: EngineArgs):
    """LocalExecutor for TP=1 on one node, else TPExecutor (this process is rank 0 on node 0)."""
    if args.tensor_parallel_size == 1:
        return LocalExecutor(args)
    if args.node_rank != 0:
        raise ValueError(f"node_rank {args.node_rank} runs workers only: use v41-serve --headless there")
    return TPExecutor(args)
