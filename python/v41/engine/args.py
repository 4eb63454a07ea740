"""Engine configuration: one validated object (vLLM's flag names where they exist)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.layout import KV_CACHE_DTYPES
from ..distributed.runtime import check_backend
from .params import DEFAULT_MAX_N
from .engram_config import EngramConfig
from .spec_config import SpeculativeConfig

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
           "float64": torch.float64}
DTYPES = ("auto", *_DTYPES)
MODEL_IMPLS = ("auto", "fast", "paged")
QUANTIZATIONS = ("auto", "none")
PAGED_DTYPES = ("float32", "float64")


@dataclass(frozen=True)
class EngineArgs:
    """Options of :class:`v41.LLM` / the engine core.

    model: checkpoint directory. max_model_len: context limit in tokens (default: min(config, 8192), capped to
    what one request can hold in the KV cache; an explicit value above that is refused with ValueError).
    max_num_seqs: running requests per step. max_num_batched_tokens: token budget per step.
    long_prefill_token_threshold: cap on one request's prefill chunk (tokens). block_size: tokens per
    KV block (default: 64 rounded to every compression ratio). kv_cache_bytes: cache budget on CPU;
    gpu_memory_utilization: fraction of GPU memory for weights + cache on CUDA. dtype: compute dtype
    (``auto``: bfloat16 for the fast model on CUDA, else float32; the paged bridge takes float32 | float64).
    num_kv_blocks: override the block count per kind (tests, tuning). kv_cache_dtype: ``auto`` (the compute dtype)
    or ``fp8`` (the deployed records: V4.1 FP8 window rows, FP4 compressed KV, MXFP4 index keys, 2–3.6× smaller;
    V4 584 B rows; fast model only; :func:`v41.cache.layout.with_kv_cache_dtype`). numerics: exact | deployed
    (docs/numerics.md §4; ``deployed`` on the fast model stores the records whatever kv_cache_dtype says).
    model_impl: ``fast`` (the production model, ``models/fast``), ``paged`` (the reference modules over the
    paged caches, ``models/paged``) or ``auto`` (fast). quantization: ``auto`` keeps the checkpoint's FP8 / MXFP4 weights packed on the device (what its
    ``quantization_config`` says), ``none`` dequantizes them once at load (fast model only). index_scratch_bytes:
    cap on an indexer's per-layer score scratch in bytes (fast model: a step's queries are scored and ranked in row
    chunks within it, models/fast/attention.py ``index_row_chunks``; paged model: its score chunks). enforce_eager: no CUDA graphs.
    async_output_proc (default True): detokenize and report a step's tokens while the GPU runs the next step (vLLM
    V0's async output processing; :meth:`EngineCore.step`): each output arrives from the next step call, and a
    sequence that a stop string ends computes one more token, which is dropped; ignored while speculating. False:
    the synchronous step, whose call returns its own tokens. async_scheduling (default True; vLLM's
    ``--async-scheduling``, SGLang's overlap scheduler): with async_output_proc, plan and launch each step while
    the previous one still runs on the GPU, its sampled ids filled in on the device (:mod:`.pending`), so the GPU
    does not wait for the host between steps; a step returns the outputs of the step before it, and a sequence
    that stops computes one more token, which is dropped. Applies at tensor_parallel_size 1 without Engram
    offload; a step whose requests use repetition, frequency or presence penalties waits for the previous step's
    ids. max_cudagraph_capture_size: the largest
    decode batch replayed from a CUDA graph (default min(max_num_seqs, 512); graphs are captured for the padded
    sizes 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, ... up to it). seed: seed of the generator that draws the sampling
    seed of requests that bring none. max_n: the most completions (``SamplingParams.n``) one request may ask
    for; a larger ``n`` is refused with ValueError (HTTP 400 / gRPC INVALID_ARGUMENT) before anything is queued.
    load_format: ``auto`` (safetensors) or ``dummy`` (random weights made on the device; benchmarks).
    hf_overrides: fields replacing those of the checkpoint's ``config.json`` (vLLM's ``--hf-overrides``), checked
    and applied wherever the config is read (:func:`v41.config.load_config`); None = the file as it is.
    speculative_config: speculative decoding with the checkpoint's DSpark drafter, as a
    :class:`~v41.engine.spec_config.SpeculativeConfig`, a dict or a JSON object string (vLLM's
    ``speculative_config``); parsed into a SpeculativeConfig when the EngineArgs is made (ValueError naming the
    key), checked against the checkpoint by ``EngineCore`` (:meth:`SpeculativeConfig.check`); None = no
    speculation. engram_config: Engram offload (:class:`~v41.engine.engram_config.EngramConfig`, a dict or a JSON
    object string, the seed's ``--engram-config``): ``{"cpu_offload": true}`` keeps the Engram tables in host memory
    and pages the rows each step needs into a device cache (docs/engram.md); None = tables on the device.

    Tensor parallelism (one worker process per rank; rank 0 is this process): tensor_parallel_size: ranks
    (1, 2, 4, 8; must divide the heads and ``o_groups``). all_reduce_backend: ``auto`` | ``nccl`` | ``gloo`` |
    ``host`` | ``pcie-pull`` (:mod:`v41.distributed.runtime`). nnodes / node_rank / master_addr / master_port:
    the ``torch.distributed`` env rendezvous when ranks span hosts (node 0 runs the engine, the others run
    ``v41-serve --headless``); master_port None picks a free port (one host only). threads: torch threads per
    worker process (CPU ranks).
    """

    model: str
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int | None = None
    enable_prefix_caching: bool = True
    block_size: int | None = None
    kv_cache_bytes: int = 512 << 20
    num_kv_blocks: int | None = None
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"
    device: str = "cpu"
    numerics: str = "exact"
    model_impl: str = "auto"
    quantization: str = "auto"
    enforce_eager: bool = False
    async_output_proc: bool = True
    async_scheduling: bool = True
    max_cudagraph_capture_size: int | None = None
    index_scratch_bytes: int = 1 << 30
    seed: int | None = 0
    load_format: str = "auto"
    tensor_parallel_size: int = 1
    all_reduce_backend: str = "auto"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    threads: int = 1
    max_n: int = DEFAULT_MAX_N
    hf_overrides: dict | None = None
    speculative_config: SpeculativeConfig | None = None
    engram_config: EngramConfig | None = None

    def __post_init__(self) -> None:
        # dict / JSON text (keyword callers, asdict + JSON across the engine-process boundary) → the typed object
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        object.__setattr__(self, "engram_config", EngramConfig.parse(self.engram_config))

    def engram_offload(self) -> bool:
        """True when ``engram_config`` asks for the Engram tables in host memory (``cpu_offload``)."""
        return self.engram_config is not None and self.engram_config.cpu_offload

    def lookahead_tokens(self) -> int:
        """Draft tokens a verify step computes beyond the committed length (speculative decoding), else 0."""
        spec = self.speculative_config
        return spec.num_speculative_tokens if spec is not None else 0

    def resolved_model_impl(self) -> str:
        """``fast`` or ``paged`` (``auto`` = ``fast``)."""
        return "fast" if self.model_impl == "auto" else self.model_impl

    def resolved_kv_cache_dtype(self) -> str:
        """What the caches store: on the fast model ``fp8`` records when asked or under ``deployed`` numerics (the
        cache half of it); else ``auto`` (the compute dtype; the paged bridge round-trips its rows instead)."""
        if self.resolved_model_impl() == "paged":
            return "auto"
        return "fp8" if self.kv_cache_dtype == "fp8" or self.numerics == "deployed" else "auto"

    def torch_dtype(self) -> torch.dtype:
        """The compute dtype (``auto`` resolved). Raises ValueError for an unsupported name."""
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.dtype == "auto":
            fast_gpu = str(self.device).startswith("cuda") and self.resolved_model_impl() == "fast"
            return torch.bfloat16 if fast_gpu else torch.float32
        return _DTYPES[self.dtype]

    def validate(self) -> None:
        """Raises ValueError naming the first bad option."""
        self.torch_dtype()
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_bytes", "index_scratch_bytes", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.tensor_parallel_size < 1 or self.nnodes < 1 or self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size ({self.tensor_parallel_size}) must be a positive multiple of "
                             f"nnodes ({self.nnodes})")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("master_port is required when nnodes > 1 (every node must use the same one)")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {self.master_port}")
        check_backend(self.all_reduce_backend, self.device)
        if self.max_cudagraph_capture_size is not None and self.max_cudagraph_capture_size < 1:
            raise ValueError(f"max_cudagraph_capture_size must be positive, got {self.max_cudagraph_capture_size}")
        if self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a JSON object, got {self.hf_overrides!r}")
        if self.numerics not in ("exact", "deployed"):
            raise ValueError(f"numerics must be 'exact' or 'deployed', got {self.numerics!r}")
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        impl = self.resolved_model_impl()
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if impl == "paged" and self.kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} runs on the fast model (model_impl='fast'); "
                             "the paged bridge keeps its caches in the compute dtype")
        if impl == "paged" and self.dtype not in ("auto", *PAGED_DTYPES):
            raise ValueError(f"the paged bridge (model_impl='paged') computes in {PAGED_DTYPES}, got dtype "
                             f"{self.dtype!r}")
