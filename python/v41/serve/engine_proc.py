"""The engine-core process: :class:`~v41.engine.core.EngineCore` in a loop behind two ZMQ sockets.

Started by :class:`~v41.serve.engine_client.EngineClient` as ``python -m v41.serve.engine_proc --input ADDR
--output ADDR --args JSON --parent-pid PID``. It connects a PULL socket to ``--input`` (requests in) and a
PUSH socket to ``--output`` (results out), loads the model, sends :class:`~v41.serve.messages.Ready` (or
:class:`~v41.serve.messages.StartupFailed` and exits 1), then loops:

1. drain the inbox (``AddRequest`` → ``EngineCore.add_request``, refused input answered by ``Error``; ``Abort``
   → the terminal delta; ``StatsRequest`` → ``StatsReply``; ``Shutdown`` → stop);
2. run one ``EngineCore.step`` when a request is unfinished, else wait up to 50 ms for input;
3. send one :class:`~v41.serve.messages.Outputs` with the step's per-request deltas (the engine core's own
   delta outputs, converted to wire dicts).

Liveness: a heartbeat thread sends :class:`~v41.serve.messages.Heartbeat` every 0.5 s on a socket of its own,
so the front end sees the process alive through a long prefill. It stops beating when the loop is *wedged*:
one loop iteration (inbox drain + one step) running longer than ``V41_STEP_TIMEOUT_S`` seconds (default 600),
which the front end then treats as a dead engine. It also exits the process when the parent process is gone
(checked every beat), so an engine core never outlives its server.

Signals: SIGTERM stops the loop after the current step (every request is aborted, its terminal delta sent),
exit status 0. SIGINT is ignored: a Ctrl-C reaches the server, which shuts the engine down in order.
A failing step is an engine bug: it is logged and the process exits 1 (the front end fails the in-flight
requests with ``EngineDeadError``). Torch runs ``--threads`` threads (default 1).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import zmq

from ..engine.info import engine_info
from . import messages as m

log = logging.getLogger("v41.engine_proc")
STEP_TIMEOUT_ENV = "V41_STEP_TIMEOUT_S"
DEFAULT_STEP_TIMEOUT_S = 600.0
IDLE_POLL_MS = 50
STATS_REFRESH_S = 0.25


def step_timeout_s() -> float:
    """``$V41_STEP_TIMEOUT_S`` (default 600): the longest one loop iteration may take before the engine counts
    as wedged. Raises ValueError for a value that is not a positive number."""
    return m.env_seconds(STEP_TIMEOUT_ENV, DEFAULT_STEP_TIMEOUT_S)


class EngineLoop:
    """The loop of the engine-core process (module doc). ``core``: a loaded EngineCore; ``out``: the PUSH
    socket to the front end; ``inbox``: the PULL socket."""

    def __init__(self, core, inbox: zmq.Socket, out: zmq.Socket):
        self.core = core
        self.inbox = inbox
        self.out = out
        self.stopping = False
        self.num_steps = 0
        self.busy_since: float | None = None  # monotonic start of the running loop iteration
        self.started_s = time.monotonic()
        self._stats_at = 0.0
        self.stats_snapshot: dict = self.stats()

    # -- the loop --------------------------------------------------------------------------------------------
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        core = self.core
        while not self.stopping:
            if poller.poll(0 if core.has_unfinished() else IDLE_POLL_MS):
                self.busy_since = time.monotonic()
                self._drain()
            if core.has_unfinished() and not self.stopping:
                self.busy_since = self.busy_since or time.monotonic()
                outs = core.step()
                self.num_steps += 1
                deltas = [self._delta(o) for o in outs]
                if deltas:
                    self._send(m.Outputs(deltas))
            self.busy_since = None
            now = time.monotonic()
            if now - self._stats_at >= STATS_REFRESH_S:
                self.stats_snapshot = self.stats()
                self._stats_at = now
        self.abort_all()

    def abort_all(self) -> None:
        """Abort every unfinished request and send the terminal deltas."""
        deltas = []
        for rid in list(self.core.requests):
            out = self.core.abort_request(rid)
            if out is not None:
                deltas.append(self._delta(out))
        if deltas:
            self._send(m.Outputs(deltas))

    def _drain(self) -> None:
        for msg in m.drain(self.inbox, log, "the front end"):
            if isinstance(msg, m.AddRequest):
                self._add(msg)
            elif isinstance(msg, m.Abort):
                out = self.core.abort_request(msg.request_id)
                if out is not None:
                    self._send(m.Outputs([self._delta(out)]))
            elif isinstance(msg, m.StatsRequest):
                self._send(m.StatsReply(msg.token, self.stats()))
            elif isinstance(msg, m.Shutdown):
                log.info("shutdown requested")
                self.stopping = True
            else:
                log.error("ignoring unexpected message %s", type(msg).__name__)

    def _add(self, msg: m.AddRequest) -> None:
        try:
            params = m.params_from_dict(msg.params)
            self.core.add_request(msg.request_id, msg.prompt_token_ids, params, prompt=msg.prompt,
                                  priority=msg.priority, cache_salt=msg.cache_salt)
        except (ValueError, TypeError) as e:
            self._send(m.Error(msg.request_id, "invalid", str(e) or type(e).__name__))
        except Exception as e:  # noqa: BLE001 - a bug in add_request must not kill the engine
            log.exception("add_request(%r) failed", msg.request_id)
            self._send(m.Error(msg.request_id, "internal", f"{type(e).__name__}: {e}"))

    def _send(self, msg) -> None:
        self.out.send(m.encode(msg))

    # -- deltas ------------------------------------------------------------------------------------------------
    @staticmethod
    def _delta(out) -> dict:
        """A delta RequestOutput of the engine core → its wire dict (:mod:`v41.serve.messages`)."""
        return m.output_to_dict(out, with_prompt=False)

    # -- stats ---------------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Scheduler stats (running, waiting, blocks per kind, prefix cache) + ``engine``: process info."""
        stats = dict(self.core.stats())
        stats["engine"] = {
            "pid": os.getpid(), "model_dir": str(self.core.args.model), "max_model_len": self.core.max_model_len,
            "num_steps": self.num_steps, "num_requests": len(self.core.requests),
            "uptime_s": time.monotonic() - self.started_s, "stale": False}
        return stats

    def busy_s(self) -> float:
        since = self.busy_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)


class Heartbeat(threading.Thread):
    """Sends a Heartbeat every ``HEARTBEAT_INTERVAL_S`` on its own PUSH socket while the loop is not wedged;
    exits the process when the parent is gone."""

    def __init__(self, ctx: zmq.Context, output: str, parent_pid: int, timeout_s: float):
        super().__init__(name="v41-heartbeat", daemon=True)
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(output)
        self.output = output
        self.parent_pid = parent_pid
        self.timeout_s = timeout_s
        self.loop: EngineLoop | None = None  # set once the model is loaded
        self.stop = threading.Event()
        self._wedged_logged = False

    def run(self) -> None:
        while not self.stop.wait(m.HEARTBEAT_INTERVAL_S):
            if os.getppid() != self.parent_pid:
                log.error("the server process %d is gone: exiting", self.parent_pid)
                if self.output.startswith("ipc://"):  # the server could not clean up its socket directory
                    shutil.rmtree(Path(self.output[len("ipc://"):]).parent, ignore_errors=True)
                os._exit(1)
            loop = self.loop
            busy = 0.0 if loop is None else loop.busy_s()
            if busy > self.timeout_s:
                if not self._wedged_logged:
                    log.error("one engine step has run %.0f s (> %s = %.0f s): wedged, heartbeats stop",
                              busy, STEP_TIMEOUT_ENV, self.timeout_s)
                    self._wedged_logged = True
                continue
            self._wedged_logged = False
            beat = m.Heartbeat(0, 0.0, {}) if loop is None else m.Heartbeat(loop.num_steps, busy,
                                                                             loop.stats_snapshot)
            self.sock.send(m.encode(beat))
        self.sock.close()


def _ready(core) -> m.Ready:
    model_dir = str(Path(core.args.model).resolve())
    return m.Ready(os.getpid(), model_dir, str(Path(model_dir) / "tokenizer.json"), core.max_model_len,
                   engine_info(core))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m v41.serve.engine_proc", description=__doc__.split("\n")[0])
    p.add_argument("--input", required=True, help="ZMQ address of the front end's request socket")
    p.add_argument("--output", required=True, help="ZMQ address of the front end's result socket")
    p.add_argument("--args", required=True, help="EngineArgs fields as a JSON object")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    return p


def main(argv: list[str] | None = None) -> int:
    opts = _parser().parse_args(argv)
    logging.basicConfig(level=os.environ.get("V41_LOG_LEVEL", "INFO").upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s engine[%(process)d] %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 5000)  # flush the last outputs at exit
    out.setsockopt(zmq.SNDHWM, 0)  # never block a step on a slow reader
    out.connect(opts.output)
    inbox = ctx.socket(zmq.PULL)
    inbox.setsockopt(zmq.LINGER, 0)
    inbox.connect(opts.input)
    beat = None
    try:
        beat = Heartbeat(ctx, opts.output, opts.parent_pid or os.getppid(), step_timeout_s())
        beat.start()
        import torch

        torch.set_num_threads(max(1, opts.threads))
        from ..engine.args import EngineArgs
        from ..engine.core import EngineCore
        core = EngineCore(EngineArgs(**json.loads(opts.args)))
    except BaseException as e:  # noqa: BLE001 - the parent must learn why, whatever it is
        log.error("engine start-up failed: %s: %s", type(e).__name__, e)
        out.send(m.encode(m.StartupFailed(type(e).__name__, str(e))))
        _close(ctx, out, inbox, beat)
        return 1
    loop = EngineLoop(core, inbox, out)
    signal.signal(signal.SIGTERM, lambda *_: setattr(loop, "stopping", True))
    beat.loop = loop
    out.send(m.encode(_ready(core)))
    try:
        loop.run()
    except BaseException:  # noqa: BLE001
        log.exception("engine loop failed: the engine core exits")
        _close(ctx, out, inbox, beat)
        return 1
    log.info("engine core stopped after %d steps", loop.num_steps)
    core.shutdown()
    _close(ctx, out, inbox, beat)
    return 0


def _close(ctx: zmq.Context, out: zmq.Socket, inbox: zmq.Socket, beat: Heartbeat | None) -> None:
    if beat is not None:
        beat.stop.set()
        beat.join(timeout=2)
    inbox.close()
    out.close()  # lingers up to 5 s to deliver what is queued
    ctx.term()


if __name__ == "__main__":
    sys.exit(main())
