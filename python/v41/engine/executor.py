"""Where the model runs: in this process (:class:`LocalExecutor`, TP=1) or across tensor-parallel worker
processes (:class:`TPExecutor`, rank 0 here; docs/architecture.md §3).

Both hold rank 0's :class:`~.model_runner.ModelRunner`, size nothing themselves, allocate the cache when the
engine core has chosen the block count, and run one :class:`~.host_step.HostStep` per ``execute`` call. The TP
executor first broadcasts the step's host plan through the step channel, so every rank runs the same step on its
shard from its own buffers.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import uuid
import weakref

import msgpack
import torch
import torch.distributed as dist

from ..config import load_config
from ..distributed.group import check_tp
from ..distributed.runtime import Runtime
from .args import EngineArgs
from .host_step import HostStep
from .model_runner import ModelRunner
from .workers import free_port, rank_infos, spawn_workers, stop_workers

log = logging.getLogger("v41.engine")
KEEPALIVE_IDLE_S = 600.0  # an idle multi-host engine sends a no-op step message this often
KEEPALIVE_CHECK_S = 30.0


class LocalExecutor:
    """TP=1: model, paged cache and input buffers in this process. ``device``: the torch device of the model."""

    def __init__(self, args: EngineArgs):
        self.args, self.device = args, args.device
        self.runner = ModelRunner(args, args.device)
        self.cfg = self.runner.cfg

    def cache_layout(self, block_tokens: int | None = None):
        return self.runner.cache_layout(block_tokens)

    def init_cache(self, num_blocks: int, num_state_rows: int, block_tokens: int, max_model_len: int) -> None:
        """Allocate the paged cache (``num_blocks`` per kind) and the input buffers."""
        self.runner.init_cache(num_blocks, num_state_rows, block_tokens, max_model_len)

    def execute(self, step: HostStep, pending=None):
        """Logits [N, vocab] of ``step.logits_rows`` (``pending``: :meth:`ModelRunner.execute`)."""
        return self.runner.execute(step, pending)

    def draft(self, table_rows, anchors, positions):
        """One DSpark draft pass (:meth:`ModelRunner.draft`)."""
        return self.runner.draft(table_rows, anchors, positions)

    def shutdown(self) -> None:
        self.runner.close()


class _Ranks:
    """What a tensor-parallel engine must give back: this node's worker processes and rank 0's runtime (its
    share of the default ``torch.distributed`` process group, the step channel, the collective backend).

    Owned by the executor's ``weakref.finalize``, so :meth:`release` runs exactly once: at ``shutdown()``, when
    the executor is garbage-collected, or at interpreter exit, whichever comes first. It holds no reference to
    the executor (that would keep it alive)."""

    def __init__(self, procs: list):
        self.procs = procs
        self.runtime: Runtime | None = None

    def dead_worker(self) -> str | None:
        """Why a worker process is gone (its name, pid and exit code), None while all live."""
        for p in self.procs:
            if not p.is_alive():
                return f"tensor-parallel worker {p.name} (pid {p.pid}) exited with code {p.exitcode}"
        return None

    def send(self, *msg) -> None:
        """Broadcast one step-channel message. Raises RuntimeError naming a worker that has exited."""
        problem = self.dead_worker()
        if problem:
            raise RuntimeError(problem)
        self.runtime.channel.send(msgpack.packb(list(msg), use_bin_type=True))

    def release(self) -> None:
        """Tell the workers to exit, join them (kill after a timeout), close the runtime (leaving the process
        group, so another engine can start in this process). Safe to call twice."""
        if self.runtime is not None and self.procs and all(p.is_alive() for p in self.procs):
            try:
                self.send("shutdown")
            except Exception as e:  # a dead peer: fall through to killing the rest
                log.warning("tensor-parallel shutdown: %s", e)
        stop_workers(self.procs)
        self.procs = []
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None


class TPExecutor:
    """Rank 0 of a tensor-parallel engine: spawns this node's other ranks, joins the rendezvous, loads its
    shard; ``execute`` broadcasts the step then runs rank 0's part (logits are full on every rank).

    The workers and the process group are released by :meth:`shutdown`, or when the executor is
    garbage-collected, or at interpreter exit (``weakref.finalize``). One tensor-parallel engine at a time can
    live in a process (ranks join ``torch.distributed``'s default process group).

    Raises ValueError when the config cannot be split ``tensor_parallel_size`` ways, RuntimeError when a
    worker process has exited (naming its rank and exit code) or another tensor-parallel engine of this
    process is still alive, and ``v41._native.CommError`` when a peer dies or lags inside a collective.
    """

    def __init__(self, args: EngineArgs):
        if args.device not in ("cpu", "cuda"):
            raise ValueError(f"tensor parallelism places rank r on cuda:r or the CPU: device must be 'cpu' or "
                             f"'cuda', got {args.device!r}")
        check_tp(load_config(args.model, args.hf_overrides), args.tensor_parallel_size)
        _check_no_live_engine()
        self.args = args
        infos = rank_infos(args, uuid.uuid4().hex[:12], args.master_port or free_port())
        self.info = infos[0]
        self.device = self.info.torch_device
        if self.info.device == "cuda" and len(infos) > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size {args.tensor_parallel_size} needs {len(infos)} GPUs on this "
                             f"host, {torch.cuda.device_count()} visible")
        self._ranks = _Ranks(spawn_workers(args, infos[1:]))
        self._release = weakref.finalize(self, _Ranks.release, self._ranks)  # also runs at interpreter exit
        try:
            self._ranks.runtime = Runtime.start(self.info, args.all_reduce_backend, self._ranks.dead_worker)
            self.runner = ModelRunner(args, self.device, self.runtime.group, self.info.session)
        except BaseException:
            self.shutdown()
            raise
        self.cfg = self.runner.cfg
        self.backend = self.runtime.backend
        self._lock = threading.Lock()  # one message + step at a time (the keep-alive thread sends too)
        self._last_send = time.monotonic()
        if args.nnodes > 1:  # gloo broadcasts time out after TORCH_TIMEOUT: never let remote ranks idle that long
            threading.Thread(target=_keepalive, args=(weakref.ref(self),), name="v41-tp-keepalive",
                             daemon=True).start()
        log.info("tensor parallel: %d ranks (%d per node), backend %s", args.tensor_parallel_size,
                 len(infos), self.backend)

    @property
    def procs(self) -> list:
        """This node's worker processes (``multiprocessing.Process``; [] once released)."""
        return self._ranks.procs

    @property
    def runtime(self) -> Runtime | None:
        """Rank 0's runtime; None once released."""
        return self._ranks.runtime

    def _send(self, *msg) -> None:
        self._ranks.send(*msg)
        self._last_send = time.monotonic()

    def cache_layout(self, block_tokens: int | None = None):
        return self.runner.cache_layout(block_tokens)

    def init_cache(self, num_blocks: int, num_state_rows: int, block_tokens: int, max_model_len: int) -> None:
        """Allocate the paged cache on every rank (same block count everywhere; KV is replicated). Raises
        RuntimeError naming the ranks that could not allocate it (their log says why)."""
        with self._lock:
            self._send("cache", num_blocks, num_state_rows, block_tokens, max_model_len)
            failure = None
            try:
                self.runner.init_cache(num_blocks, num_state_rows, block_tokens, max_model_len)
            except Exception as e:
                failure = e
            bad = self.runtime.failed_ranks(failure is None)
            if failure is not None:
                raise failure
            if bad:
                raise RuntimeError(f"tensor-parallel rank(s) {bad} could not allocate the KV cache ({num_blocks} "
                                   "blocks per kind); their log says why")

    def execute(self, step: HostStep):
        """Broadcast the host plan to every rank, run rank 0's shard; returns what :class:`ModelRunner` does."""
        with self._lock:
            self._send("step", step.encode())
            return self.runner.execute(step)

    def draft(self, table_rows, anchors, positions):
        """Broadcast a DSpark draft pass (every rank runs its shard of the stages), run rank 0's part; returns
        what :meth:`ModelRunner.draft` does."""
        with self._lock:
            self._send("draft", *(a.astype("<i8").tobytes() for a in (table_rows, anchors, positions)))
            return self.runner.draft(table_rows, anchors, positions)

    def shutdown(self) -> None:
        """Tell the workers to exit, join (kill after a timeout), close the runtime. Safe to call twice; also
        runs when the executor is garbage-collected and at interpreter exit."""
        if getattr(self, "runner", None) is not None:
            self.runner.close()
        self._release()


def _check_no_live_engine() -> None:
    """Raise RuntimeError when this process's default ``torch.distributed`` group is taken (another
    tensor-parallel engine lives), after collecting garbage (an unreachable engine is released by it)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    gc.collect()
    if dist.is_initialized():
        raise RuntimeError("another tensor-parallel engine is alive in this process (torch.distributed's default "
                           "process group is in use): call its shutdown() (or leave its `with` block, or drop "
                           "every reference to it) before starting a new one")


def _keepalive(ref: weakref.ref) -> None:
    """Multi-host engines: send a no-op step message when the executor behind ``ref`` has sent nothing for
    ``KEEPALIVE_IDLE_S``; ends when it is released or collected (holds it only while sending)."""
    while True:
        time.sleep(KEEPALIVE_CHECK_S)
        ex = ref()
        if ex is None or ex.runtime is None:
            return
        with ex._lock:
            if ex.runtime is not None and time.monotonic() - ex._last_send > KEEPALIVE_IDLE_S:
                try:
                    ex._send("noop")
                except Exception as e:  # the next step reports it to the engine
                    log.warning("tensor-parallel keep-alive: %s", e)
                    return
        del ex


def make_executor(args: EngineArgs):
    """LocalExecutor for TP=1 on one node, else TPExecutor (this process is rank 0 on node 0)."""
    if args.tensor_parallel_size == 1:
        return LocalExecutor(args)
    if args.node_rank != 0:
        raise ValueError(f"node_rank {args.node_rank} runs workers only: use v41-serve --headless there")
    return TPExecutor(args)
