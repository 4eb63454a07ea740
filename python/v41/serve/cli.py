"""``v41-serve``: the OpenAI-compatible HTTP server (default) or the gRPC server (``--grpc``) in front of an
engine-core process.

``v41-serve [MODEL] [--grpc] [--host 127.0.0.1] [--port 8000] ...`` (vLLM's flag names; ``cli_options.py``).
The model (positional, as in ``vllm serve MODEL``, or ``--model``) is a local checkpoint directory, else a Hugging
Face repo id fetched with ``huggingface_hub.snapshot_download`` (``HF_HUB_OFFLINE=1`` uses only the local HF
cache); without one the embedded tiny V4.1 checkpoint (trained on Python code, :mod:`v41.testing.embedded`) is
served. The flags of other engines' launch commands are honoured, refused or warned about as ``compat.py`` says, so
a vLLM / SGLang / Aphrodite command line starts v41 (README.md "Serving"). Start-up: import the front end, check
the flags, resolve the model, check its config with ``--hf-overrides``, start the engine core
(:class:`~v41.serve.engine_client.EngineClient`, which waits for the model to load), then serve. SIGTERM / SIGINT:
stop accepting connections and start draining the engine at once: in-flight requests may finish for up to
``--shutdown-timeout`` seconds (default 30), then the rest are aborted, so every open response still ends properly
(an SSE stream with a finish_reason "abort" chunk and ``data: [DONE]``, a gRPC call with its ``Complete``) within
``ABORT_FLUSH_S`` more; then the engine process stops and the server exits 0. A second signal skips the wait
(aborts at once). Exit status: 0 after a signal, 2 for bad arguments or an unusable model, 1 when the engine fails
to start or the server fails. """

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import Sequence

from . import compat
from .cli_options import DTYPE_ALIASES, PROG, build_parser

log = logging.getLogger("v41.serve")
EMBEDDED_NAME = "v41-tiny"
# After the aborts at the end of the shutdown timeout: how long open responses get to send their terminal
# events before the front end cancels what is left.
ABORT_FLUSH_S = 5.0


class CliError(Exception):
    """A user-facing error: printed as ``v41-serve: error: <message>``, exit status 2."""


# -- model and options -----------------------------------------------------------------------------------------
def resolve_model(model: str | None) -> tuple[Path, str]:
    """(checkpoint directory, default served name). Raises CliError when ``model`` is neither a directory
    nor a downloadable Hugging Face repo id."""
    if model is None:
        from ..testing.embedded import embedded_model_dir

        return embedded_model_dir(), EMBEDDED_NAME
    path = Path(model).expanduser()
    if path.is_dir():
        return path, model
    if path.exists():
        raise CliError(f"--model {model}: not a directory")
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise CliError(f"model directory not found: {model}")
    try:
        from huggingface_hub import snapshot_download

        log.info("fetching %s from the Hugging Face Hub", model)
        local = snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, auth, disk: all end the same way
        raise CliError(f"--model {model}: not a local directory, and the Hugging Face download failed "
                       f"({type(e).__name__}: {e}); check the repo id and the network, or that HF_HUB_OFFLINE "
                       f"is unset / the model is in the local HF cache") from None
    return Path(local), model


def model_argument(opts: argparse.Namespace) -> str | None:
    """The model given positionally (``v41-serve MODEL``) or with ``--model``; CliError when both differ."""
    if opts.model_tag is not None and opts.model is not None and opts.model_tag != opts.model:
        raise CliError(f"the model is given twice ({opts.model_tag} and --model {opts.model}); give it once")
    return opts.model_tag if opts.model_tag is not None else opts.model


def resolved_device(opts: argparse.Namespace) -> str:
    """``--device``, with ``auto`` resolved (cuda when available)."""
    if opts.device != "auto":
        return opts.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_args(opts: argparse.Namespace, model_dir: Path, device: str):
    """EngineArgs from the flags, with ``--hf-overrides`` and ``--speculative-config`` checked against the model's
    config. Raises CliError for values the engine does not support (a speculative config the checkpoint cannot
    serve included), ConfigError for a config they make invalid."""
    from ..config import load_config
    from ..engine.args import EngineArgs

    if not 0 < opts.port < 65536:
        raise CliError(f"--port must be in 1..65535, got {opts.port}")
    if opts.max_queue_len is not None and opts.max_queue_len < 0:
        raise CliError(f"--max-queue-len must be >= 0, got {opts.max_queue_len}")
    if opts.threads < 1:
        raise CliError(f"--threads must be at least 1, got {opts.threads}")
    if not opts.shutdown_timeout >= 0:
        raise CliError(f"--shutdown-timeout must be >= 0, got {opts.shutdown_timeout}")
    if opts.hf_overrides is not None:
        load_config(model_dir, opts.hf_overrides)  # fail before starting the engine, naming the field
    kw = dict(model=str(model_dir), max_model_len=opts.max_model_len, max_num_seqs=opts.max_num_seqs,
              max_num_batched_tokens=opts.max_num_batched_tokens, enable_prefix_caching=opts.enable_prefix_caching,
              gpu_memory_utilization=opts.gpu_memory_utilization,
              dtype=DTYPE_ALIASES.get(opts.dtype, opts.dtype), device=device, numerics=opts.numerics,
              quantization=opts.quantization, model_impl=opts.model_impl, enforce_eager=opts.enforce_eager,
              async_output_proc=opts.async_output_proc, async_scheduling=opts.async_scheduling,
              max_cudagraph_capture_size=opts.max_cudagraph_capture_size,
              kv_cache_dtype=opts.kv_cache_dtype,
              load_format=opts.load_format, block_size=opts.block_size, seed=opts.seed,
              tensor_parallel_size=opts.tensor_parallel_size, all_reduce_backend=opts.all_reduce_backend,
              nnodes=opts.nnodes, node_rank=opts.node_rank, master_addr=opts.master_addr,
              master_port=opts.master_port, threads=opts.threads, max_n=opts.max_n, hf_overrides=opts.hf_overrides,
              speculative_config=opts.speculative_config, engram_config=opts.engram_config)
    if opts.kv_cache_bytes is not None:
        kw["kv_cache_bytes"] = opts.kv_cache_bytes
    try:
        args = EngineArgs(**kw)
        args.validate()
        if args.speculative_config is not None:  # before the engine starts: K, the drafter, the draft TP size
            args.speculative_config.check(load_config(model_dir, opts.hf_overrides), args.tensor_parallel_size)
    except ValueError as e:
        raise CliError(str(e)) from None
    return args


def _front_end(use_grpc: bool):
    """The front end's entry point; CliError with a clear message when it is not installed."""
    module = "v41.serve.grpc_server" if use_grpc else "v41.serve.openai_app"
    name = "serve_grpc" if use_grpc else "build_app"
    try:
        mod = __import__(module, fromlist=[name])
        return getattr(mod, name)
    except (ImportError, AttributeError) as e:
        kind = "gRPC" if use_grpc else "OpenAI HTTP"
        raise CliError(f"the {kind} front end ({module}.{name}) is not available: {e}") from None


# -- serving -------------------------------------------------------------------------------------------------
def _install_signals(loop: asyncio.AbstractEventLoop, stop: asyncio.Event, force: asyncio.Event) -> None:
    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            log.warning("%s again: aborting in-flight requests now", sig.name)
            force.set()
        else:
            log.info("%s: shutting down (in-flight requests may finish)", sig.name)
            stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)


async def _drain(engine, grace_s: float, force: asyncio.Event) -> None:
    """Let in-flight requests finish for up to ``grace_s`` (or until ``force``), then abort the rest and wait
    up to ``ABORT_FLUSH_S`` until their streams have taken their terminal outputs (a request that reaches the
    engine meanwhile is aborted too)."""
    waiter = asyncio.ensure_future(engine.wait_idle(grace_s))
    forced = asyncio.ensure_future(force.wait())
    await asyncio.wait({waiter, forced}, return_when=asyncio.FIRST_COMPLETED)
    forced.cancel()
    waiter.cancel()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ABORT_FLUSH_S
    aborted = await engine.abort_all()
    if aborted:
        log.warning("aborting %d in-flight request(s) at shutdown", aborted)
    while engine.is_running and loop.time() < deadline:
        if await engine.wait_idle(min(0.2, max(0.0, deadline - loop.time()))):
            break
        await engine.abort_all()  # requests that reached the engine meanwhile (repeats are no-ops)


async def _serve_http(engine, opts: argparse.Namespace, name: str, peer: compat.PeerSettings) -> None:
    import uvicorn

    build_app = _front_end(False)
    app = build_app(engine, name, chat_revision=peer.chat_revision,
                    enable_auto_tool_choice=peer.enable_auto_tool_choice)

    class Server(uvicorn.Server):
        def capture_signals(self):  # signals are ours (_install_signals): no re-raise at exit
            import contextlib

            return contextlib.nullcontext()

    # uvicorn's own graceful period outlasts the drain (shutdown timeout + the aborts' flush): it cancels
    # response tasks only if they still run after that (a client that stopped reading).
    config = uvicorn.Config(app, host=opts.host, port=opts.port, log_level=opts.log_level,
                            timeout_graceful_shutdown=opts.shutdown_timeout + ABORT_FLUSH_S, lifespan="auto")
    server = Server(config)
    loop = asyncio.get_running_loop()
    stop, force = asyncio.Event(), asyncio.Event()
    _install_signals(loop, stop, force)
    async def run() -> None:
        try:
            await server.serve()
        except SystemExit:  # uvicorn exits the process when it cannot start (e.g. the port is taken)
            raise CliError(f"the HTTP server could not start on {opts.host}:{opts.port} (see the log above)") \
                from None

    task = asyncio.ensure_future(run())
    while not (server.started or task.done() or stop.is_set()):
        await asyncio.sleep(0.05)
    if server.started:
        _print_example(opts, name)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():  # the server ended by itself (could not bind, or failed)
        stopped.cancel()
        task.result()
        return
    # Both at once: uvicorn closes the listeners and waits for open responses; the engine drains (requests
    # finish within the shutdown timeout, the rest are aborted), which ends every open response normally.
    server.should_exit = True
    drained = asyncio.ensure_future(_drain(engine, opts.shutdown_timeout, force))
    forced = asyncio.ensure_future(force.wait())
    done, _ = await asyncio.wait({task, forced}, return_when=asyncio.FIRST_COMPLETED)
    if forced in done:  # a second signal: the drain aborts now; give the aborts a moment to reach the clients
        await asyncio.wait({task, drained}, timeout=1.0, return_when=asyncio.ALL_COMPLETED)
        server.force_exit = True
    try:
        await asyncio.wait_for(asyncio.gather(task, drained), timeout=ABORT_FLUSH_S + 5.0)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        pass
    forced.cancel()


async def _serve_grpc(engine, opts: argparse.Namespace, name: str, peer: compat.PeerSettings) -> None:
    serve_grpc = _front_end(True)
    server = await serve_grpc(engine, opts.host, opts.port, name, chat_revision=peer.chat_revision)
    _print_example(opts, name)
    stop, force = asyncio.Event(), asyncio.Event()
    _install_signals(asyncio.get_running_loop(), stop, force)
    term = asyncio.ensure_future(server.wait_for_termination())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({term, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if term.done():
        stopped.cancel()
        return
    # stop(grace): new RPCs are refused at once; running ones end when the drain finishes or aborts their
    # requests (each gets its Complete), and are cancelled only if still running after the flush time.
    stopping = asyncio.ensure_future(server.stop(opts.shutdown_timeout + ABORT_FLUSH_S))
    drained = asyncio.ensure_future(_drain(engine, opts.shutdown_timeout, force))
    await asyncio.wait({stopping, drained})
    term.cancel()


async def _serve(engine, opts: argparse.Namespace, name: str, peer: compat.PeerSettings) -> None:
    scheme = "grpc" if opts.grpc else "http"
    info = engine.info
    log.info("serving %s (%s) as %r on %s://%s:%d; max_model_len %d; kinds %s, %s blocks of %d tokens each",
             engine.model_dir, info["arch"], name, scheme, opts.host, opts.port, engine.max_model_len,
             info["kinds"], info["num_blocks"].get("swa"), info["block_tokens"])
    await (_serve_grpc(engine, opts, name, peer) if opts.grpc else _serve_http(engine, opts, name, peer))


def _print_example(opts: argparse.Namespace, name: str) -> None:
    """One line on stdout showing how to call the server that just started listening."""
    if opts.grpc:
        example = (f"grpcurl -plaintext -d '{{\"request_id\": \"r1\", \"text\": \"Hello\"}}' "
                   f"{opts.host}:{opts.port} v41.v1.Engine/Generate")
    else:
        example = (f"curl http://{opts.host}:{opts.port}/v1/completions -H 'Content-Type: application/json' "
                   f"-d '{{\"model\": \"{name}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'")
    print(f"{PROG}: try: {example}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``v41-serve`` console script."""
    opts = build_parser().parse_args(argv)
    logging.basicConfig(level=opts.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .engine_client import EngineClient, EngineStartupError

    try:
        _front_end(opts.grpc)  # fail before loading a model
        device = resolved_device(opts)
        peer = compat.resolve(opts, device)
        model_dir, default_name = resolve_model(model_argument(opts))
        args = engine_args(opts, model_dir, device)
    except (CliError, ValueError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if opts.headless:
        from ..engine.workers import run_headless

        try:
            return run_headless(args)
        except ValueError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 2
    name = opts.served_model_name or default_name
    log.info("starting the engine core: model %s, device %s, dtype %s", model_dir, args.device, args.dtype)
    # Until the engine is up, a signal interrupts start-up (EngineClient kills the half-started process).
    try:
        engine = EngineClient(args, threads=opts.threads, startup_timeout_s=opts.startup_timeout,
                              max_queue_len=opts.max_queue_len, env=peer.kernel_env)
    except EngineStartupError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    try:
        asyncio.run(_serve(engine, opts, name, peer))
    except (CliError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except Exception:
        log.exception("the server failed")
        return 1
    finally:
        engine.shutdown()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
