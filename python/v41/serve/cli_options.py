"""The flags of ``v41-serve``: v41's own, and those of the vLLM / SGLang / Aphrodite launch commands users bring
(README.md "Serving"; what each peer flag does in v41 is decided in ``compat.py``).

Names and meanings follow vLLM's ``vllm serve`` where a flag exists there: the model as a positional argument
(or ``--model``), ``--served-model-name``, ``--max-model-len``, ``--tensor-parallel-size``, ... Flags are only
parsed here; values that need the model, the device or each other are checked by ``cli.py`` / ``compat.py``.
"""

from __future__ import annotations

import argparse
import json
import os

PROG = "v41-serve"
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's spellings
DTYPES = ("auto", "bfloat16", "float16", "float32", "float64", *DTYPE_ALIASES)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def json_object(text: str) -> dict:
    """argparse type of the JSON flags: a JSON object, else a usage error naming what was wrong."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``v41-serve`` argument parser."""
    from ..distributed.runtime import BACKENDS
    from ..engine.params import DEFAULT_MAX_N

    p = argparse.ArgumentParser(prog=PROG, description="Serve a DeepSeek-V4.1 / V4 checkpoint over OpenAI-"
                                "compatible HTTP (default) or gRPC (--grpc).")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint directory or Hugging Face repo id, as in `vllm serve MODEL` (or --model)")
    p.add_argument("--model", default=None, metavar="DIR|REPO_ID",
                   help="checkpoint directory or Hugging Face repo id (default: the embedded tiny V4.1 model, "
                        "trained for an hour on Python code: no assistant)")
    p.add_argument("--grpc", action="store_true", help="serve the gRPC API (proto/v41/v1/engine.proto) instead "
                   "of OpenAI HTTP")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="model name clients use (default: the model as given, or v41-tiny)")
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
                        "path); auto = fast")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (decode runs eager)")
    p.add_argument("--async-output-proc", action=argparse.BooleanOptionalAction, default=True,
                   help="detokenize and report a step's tokens while the GPU runs the next step (default; outputs "
                        "one step later; ignored with --speculative-config)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="plan and launch each step while the previous one runs on the GPU (default; needs "
                        "--async-output-proc; one process without Engram offload; outputs one step later)")
    p.add_argument("--max-cudagraph-capture-size", type=int, default=None, metavar="N",
                   help="largest decode batch replayed from a CUDA graph (default min(--max-num-seqs, 512))")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                   help="auto: the compute dtype; fp8: the deployed cache records (V4.1: FP8 window rows, FP4 "
                        "compressed KV, MXFP4 index keys; V4: 584 B FP8 rows; fast model only)")
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
    _add_peer_flags(p)
    return p


def _add_peer_flags(p: argparse.ArgumentParser) -> None:
    """Flags of the vLLM / SGLang / Aphrodite launch commands (``compat.py`` says what each does in v41)."""
    g = p.add_argument_group("compatibility with vLLM / SGLang / Aphrodite launch commands")
    g.add_argument("--tokenizer-mode", default=None, metavar="NAME",
                   help="chat format of the prompts: deepseek_v41 or deepseek_v4 (default auto: the model's)")
    g.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="DSML tool-call parser: deepseek_v41 or deepseek_v4 (default: the model's format)")
    g.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="reasoning parser: deepseek_v41 or deepseek_v4 (default: the model's format)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="allow tool_choice 'auto' (also the default when a request brings tools), as in vLLM")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted; v41 never runs code from a model repository")
    g.add_argument("--hf-overrides", type=json_object, default=None, metavar="JSON",
                   help="config.json fields to replace, e.g. '{\"head_dtype\": \"float32\"}'; checked like the file")
    g.add_argument("--attention-config", type=json_object, default=None, metavar="JSON",
                   help="attention options: indexer_tp_shard_min_rows")
    g.add_argument("--moe-backend", default=None, metavar="NAME",
                   help="MoE kernel path: auto, triton, torch (other engines' names select auto)")
    g.add_argument("--attention-backend", default=None, metavar="NAME",
                   help="attention kernel path: auto, triton, torch (other engines' names select auto)")
    g.add_argument("--enable-flashinfer-autotune", action=argparse.BooleanOptionalAction, default=None,
                   help="no meaning for v41 (no FlashInfer): accepted with a warning")
    g.add_argument("--mm-encoder-tp-mode", choices=("weights", "data"), default=None,
                   help="no meaning for v41 until vision exists: accepted with a warning")
    g.add_argument("--speculative-config", type=json_object, default=None, metavar="JSON",
                   help="speculative decoding with the checkpoint's DSpark drafter, e.g. '{\"method\": \"dspark\", "
                        "\"num_speculative_tokens\": 5}'; keys: draft_tensor_parallel_size, draft_sample_method, "
                        "rejection_sample_method, enable_adaptive_verification (docs/speculative-decoding.md)")
    g.add_argument("--engram-config", type=json_object, default=None, metavar="JSON",
                   help="Engram offload, e.g. '{\"cpu_offload\": true}': tables in pinned host memory, rows paged into "
                        "a device cache; keys hot_rows (slots per layer per rank), transfer (copy | uva) "
                        "(docs/engram.md)")
