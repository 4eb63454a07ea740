"""``v41-serve``: the OpenAI-compatible HTTP server (default) or the gRPC server (``--grpc``) in front of an
engine-core process.

``v41-serve [--model DIR|HF_REPO_ID] [--grpc] [--host 127.0.0.1] [--port 8000] ...`` (vLLM's flag names).
``--model`` is a local checkpoint directory, else a Hugging Face repo id fetched with
``huggingface_hub.snapshot_download`` (``HF_HUB_OFFLINE=1`` uses only the local HF cache); without it the
embedded tiny V4.1 checkpoint (random weights) is served. Start-up: resolve the model, import the front end,
start the engine core (:class:`~v41.serve.engine_client.EngineClient`, which waits for the model to load),
then serve. SIGTERM / SIGINT: stop accepting connections and start draining the engine at once: in-flight
requests may finish for up to ``--shutdown-timeout`` seconds (default 30), then the rest are aborted, so every
open response still ends properly (an SSE stream with a finish_reason "abort" chunk and ``data: [DONE]``, a
gRPC call with its ``Complete``) within ``ABORT_FLUSH_S`` more; then the engine process stops and the server
exits 0. A second signal skips the wait (aborts at once). Exit status: 0 after a signal, 2 for bad arguments
or an unusable model, 1 when the engine fails to start or the server fails.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Sequence

PROG = "v41-serve"
log = logging.getLogger("v41.serve")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's spellings
DTYPES = ("auto", "bfloat16", "float16", "float32", "float64", *DTYPE_ALIASES)
EMBEDDED_NAME = "v41-tiny"
# After the aborts at the end of the shutdown timeout: how long open responses get to send their terminal
# events before the front end cancels what is left.
ABORT_FLUSH_S = 5.0


class CliError(Exception):
    """A user-facing error: printed as ``v41-serve: error: <message>``, exit status 2."""


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def _parser() -> argparse.ArgumentParser:
    from ..distributed.runtime import BACKENDS
    from ..engine.params import DEFAULT_MAX_N

    p = argparse.ArgumentParser(prog=PROG, description="Serve a DeepSeek-V4.1 / V4 checkpoint over OpenAI-"
                                "compatible HTTP (default) or gRPC (--grpc).")
    p.add_argument("--model", default=None, metavar="DIR|REPO_ID",
                   help="checkpoint directory or Hugging Face repo id (default: the embedded tiny V4.1 model, "
                        "random weights)")
    p.add_argument("--grpc", action="store_true", help="serve the gRPC API (proto/v41/v1/engine.proto) instead "
                   "of OpenAI HTTP")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="model name clients use (default: --model as given, or v41-tiny)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N", help="context limit in tokens")
    p.add_argument("--max-num-seqs", type=int, default=64, metavar="N", help="running requests per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, metavar="N", help="token budget per step")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="compute dtype (auto = bfloat16 for the fast model on CUDA, else float32)")
    p.add_argument("--quantization", "-q", choices=("auto", "none"), default="auto",
                   help="auto: keep the checkpoint's FP8 / MXFP4 weights packed on the GPU, dequantized in the "
                        "kernels; none: dequantize them once at load")
    p.add_argument("--model-impl", choices=("auto", "fast", "paged"), default="auto",
                   help="fast (production model) or paged (reference modules over the paged cache, CPU parity "
                        "path); auto = fast, paged for --numerics deployed")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (decode runs eager)")
    p.add_argument("--max-cudagraph-capture-size", type=int, default=None, metavar="N",
                   help="largest decode batch replayed from a CUDA graph (default min(--max-num-seqs, 512))")
    p.add_argument("--kv-cache-dtype", default="auto", help="only 'auto' (the compute dtype) for now")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks, one process each (GPU r = cuda:r; CPU ranks need --device cpu)")
    p.add_argument("--all-reduce-backend", default="auto", choices=BACKENDS,
                   help="collectives between ranks: auto = nccl on CUDA, host shared memory on CPU (gloo across "
                        "hosts); host and pcie-pull fall back to torch.distributed when their self-test fails")
    p.add_argument("--nnodes", type=int, default=int(os.environ.get("NNODES", 1)), metavar="N",
                   help="hosts the tensor-parallel ranks span (env NNODES)")
    p.add_argument("--node-rank", type=int, default=int(os.environ.get("NODE_RANK", 0)), metavar="R",
                   help="this host's index; node 0 serves, the others run --headless (env NODE_RANK)")
    p.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"), metavar="HOST",
                   help="address of node 0 for the torch.distributed rendezvous (env MASTER_ADDR)")
    p.add_argument("--master-port", type=int, default=_env_int("MASTER_PORT"), metavar="PORT",
                   help="rendezvous port, required with --nnodes > 1 (env MASTER_PORT; default: a free port)")
    p.add_argument("--headless", action="store_true",
                   help="run this node's tensor-parallel ranks only (node_rank > 0 of a multi-host engine)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda when available)")
    p.add_argument("--max-queue-len", type=int, default=None, metavar="N",
                   help="requests allowed beyond --max-num-seqs before 429 / RESOURCE_EXHAUSTED (default: no limit)")
    p.add_argument("--max-n", type=int, default=DEFAULT_MAX_N, metavar="N",
                   help=f"most completions (n) one request may ask for; more is a 400 / INVALID_ARGUMENT "
                        f"(default {DEFAULT_MAX_N})")
    p.add_argument("--numerics", choices=("exact", "deployed"), default="exact")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto")
    p.add_argument("--kv-cache-bytes", type=int, default=None, metavar="N", help="KV cache budget on CPU")
    p.add_argument("--block-size", type=int, default=None, metavar="N", help="tokens per KV block")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, metavar="N", help="torch CPU threads of the engine process")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="seconds in-flight requests may take to finish after SIGTERM (default 30)")
    p.add_argument("--startup-timeout", type=float, default=600.0, metavar="S",
                   help="seconds the engine may take to load the model (default 600)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


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


def engine_args(opts: argparse.Namespace, model_dir: Path):
    """EngineArgs from the flags. Raises CliError for values the engine does not support."""
    from ..engine.args import EngineArgs

    if opts.kv_cache_dtype != "auto":
        raise CliError(f"--kv-cache-dtype {opts.kv_cache_dtype!r}: only 'auto' is supported for now")
    if not 0 < opts.port < 65536:
        raise CliError(f"--port must be in 1..65535, got {opts.port}")
    if opts.max_queue_len is not None and opts.max_queue_len < 0:
        raise CliError(f"--max-queue-len must be >= 0, got {opts.max_queue_len}")
    if opts.threads < 1:
        raise CliError(f"--threads must be at least 1, got {opts.threads}")
    if not opts.shutdown_timeout >= 0:
        raise CliError(f"--shutdown-timeout must be >= 0, got {opts.shutdown_timeout}")
    device = opts.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    kw = dict(model=str(model_dir), max_model_len=opts.max_model_len, max_num_seqs=opts.max_num_seqs,
              max_num_batched_tokens=opts.max_num_batched_tokens, enable_prefix_caching=opts.enable_prefix_caching,
              gpu_memory_utilization=opts.gpu_memory_utilization,
              dtype=DTYPE_ALIASES.get(opts.dtype, opts.dtype), device=device, numerics=opts.numerics,
              quantization=opts.quantization, model_impl=opts.model_impl, enforce_eager=opts.enforce_eager,
              max_cudagraph_capture_size=opts.max_cudagraph_capture_size,
              load_format=opts.load_format, block_size=opts.block_size, seed=opts.seed,
              tensor_parallel_size=opts.tensor_parallel_size, all_reduce_backend=opts.all_reduce_backend,
              nnodes=opts.nnodes, node_rank=opts.node_rank, master_addr=opts.master_addr,
              master_port=opts.master_port, threads=opts.threads, max_n=opts.max_n)
    if opts.kv_cache_bytes is not None:
        kw["kv_cache_bytes"] = opts.kv_cache_bytes
    args = EngineArgs(**kw)
    try:
        args.validate()
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


async def _serve_http(engine, opts: argparse.Namespace, name: str) -> None:
    import uvicorn

    build_app = _front_end(False)
    app = build_app(engine, name)

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


async def _serve_grpc(engine, opts: argparse.Namespace, name: str) -> None:
    serve_grpc = _front_end(True)
    server = await serve_grpc(engine, opts.host, opts.port, name)
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


async def _serve(engine, opts: argparse.Namespace, name: str) -> None:
    scheme = "grpc" if opts.grpc else "http"
    info = engine.info
    log.info("serving %s (%s) as %r on %s://%s:%d; max_model_len %d; kinds %s, %s blocks of %d tokens each",
             engine.model_dir, info["arch"], name, scheme, opts.host, opts.port, engine.max_model_len,
             info["kinds"], info["num_blocks"].get("swa"), info["block_tokens"])
    await (_serve_grpc(engine, opts, name) if opts.grpc else _serve_http(engine, opts, name))


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
    opts = _parser().parse_args(argv)
    logging.basicConfig(level=opts.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .engine_client import EngineClient, EngineStartupError

    try:
        _front_end(opts.grpc)  # fail before loading a model
        model_dir, default_name = resolve_model(opts.model)
        args = engine_args(opts, model_dir)
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
                              max_queue_len=opts.max_queue_len)
    except EngineStartupError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    try:
        asyncio.run(_serve(engine, opts, name))
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
