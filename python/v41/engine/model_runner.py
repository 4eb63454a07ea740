"""One rank's model runner: loads the step model (the fast model, or the paged parity bridge), owns its cache,
the persistent input buffers and the decode CUDA graphs, and runs each :class:`~.host_step.HostStep` (docs/architecture.md §2
``engine/model_runner``): a step whose requests each compute at most ``1 + K`` tokens (``K`` speculative tokens, 0
without speculation) and that fits a captured size replays its graph, anything else runs eager.

Rank 0 (:mod:`.executor`) and every tensor-parallel worker (:mod:`.tp_worker`) build the same runner from the same
:class:`~.args.EngineArgs`, so every rank fills its own buffers from the same host plan.
"""

from __future__ import annotations

import logging
import uuid

import numpy as np
import torch
from torch import Tensor

from ..distributed.group import SINGLE, TPGroup
from ..kernels.dispatch import describe_paths
from ..models.protocol import StepModel
from .args import EngineArgs
from .block_tables import DeviceBlockTables, one_allocation_tables
from .adaptive_verify import VerifyCosts, measure_costs
from .cuda_graph import CudaGraphRunner, capture_sizes
from .draft_graph import DraftGraphs, draft_pass
from .engram_pager import EngramPager
from .graph_inputs import GraphInputs
from .host_step import HostStep
from .input_buffers import InputBuffers
from .pending import PendingResolver, PendingRows

log = logging.getLogger("v41.engine")
CAPTURABLE_GROUPS = ("single", "torch-nccl")  # host shared memory and PCIe pull run host code in a collective


def load_model(args: EngineArgs, device: str, tp: TPGroup | None = None, session: str | None = None) -> StepModel:
    """The step model ``args`` describe (this rank's shard with ``tp``) on ``device``. ``session``: a name shared
    by the engine's ranks (Engram offload's ``/dev/shm`` files). Raises ValueError for speculative decoding or
    Engram offload on the paged bridge (the drafter and the pager live with the fast model)."""
    dtype = args.torch_dtype()
    lookahead = args.lookahead_tokens()
    offload = args.engram_offload()
    if args.resolved_model_impl() == "paged":
        if lookahead:
            raise ValueError("speculative decoding runs on the fast model: use model_impl 'fast' (--model-impl fast)")
        if offload:
            raise ValueError("Engram offload runs on the fast model: use model_impl 'fast' (--model-impl fast)")
        from ..models.paged import PagedModel
        from ..models.reference import load

        ref = load(args.model, dtype=dtype, device=device, numerics=args.numerics, load_format=args.load_format,
                   tp=tp, config_overrides=args.hf_overrides)
        return PagedModel(ref, args.index_scratch_bytes)
    from ..models.fast import load_fast

    spec, world = args.speculative_config, (tp or SINGLE).world_size
    model = load_fast(args.model, dtype=dtype, device=device, quantization=args.quantization,
                      load_format=args.load_format, tp=tp, config_overrides=args.hf_overrides,
                      lookahead_tokens=lookahead, draft_sharded=spec is None or spec.draft_tp(world) == world,
                      engram_shm_prefix=f"v41-engram-{session or uuid.uuid4().hex[:12]}" if offload else None,
                      engram_pin=offload and str(device).startswith("cuda")
                      and args.engram_config.resolved_transfer() == "uva")
    model.index_scratch_bytes = args.index_scratch_bytes
    model.kv_cache_dtype = args.resolved_kv_cache_dtype()
    model.set_numerics(args.numerics)
    return model


def graph_sizes(max_capture_tokens: int, max_num_seqs: int, query_tokens: int) -> list[int]:
    """Batch sizes (requests) to capture: :func:`~.cuda_graph.capture_sizes` up to ``max_num_seqs`` whose
    ``size · query_tokens`` rows fit ``max_capture_tokens`` (vLLM counts capture sizes in tokens too; at least
    size 1). Verify graphs (``query_tokens = 1 + K``) return logits for every row, hence the token cap."""
    sizes = [s for s in capture_sizes(min(max_capture_tokens, max_num_seqs)) if s * query_tokens <= max_capture_tokens]
    return sizes or [1]


class ModelRunner:
    """The model of one rank plus its cache and input buffers. ``execute(step)`` → float32 logits [N, vocab] of
    ``step.logits_rows``."""

    def __init__(self, args: EngineArgs, device: str, tp: TPGroup | None = None, session: str | None = None):
        self.args, self.device, self.tp = args, device, tp or SINGLE
        self.model = load_model(args, device, tp, session)
        log.info("kernels: %s", describe_paths(str(device)))
        self.cfg = self.model.cfg
        self.engram: EngramPager | None = None
        if args.engram_offload():
            self.engram = EngramPager(self.model, args.engram_config, args.max_num_batched_tokens, device)
        self.buffers: InputBuffers | None = None
        self.graphs: CudaGraphRunner | None = None  # 1 + K query tokens per request
        self.narrow_graphs: list[CudaGraphRunner] = []  # adaptive verification: 1 .. K query tokens
        self.draft_graphs: DraftGraphs | None = None
        self.verify_costs: VerifyCosts | None = None
        self._static: dict[str, Tensor] | None = None
        self.resolver: PendingResolver | None = None  # set by an engine core that schedules asynchronously

    def close(self) -> None:
        """Release what outlives a step: the Engram pager's threads and host tables (idempotent)."""
        if self.engram is not None:
            self.engram.close()

    def cache_layout(self, block_tokens: int | None = None):
        return self.model.cache_layout(block_tokens)

    def init_cache(self, num_blocks: int, num_state_rows: int, block_tokens: int, max_model_len: int) -> None:
        """Allocate the cache (``num_blocks`` per kind, ``num_state_rows`` state rows) and the input buffers for
        requests up to ``max_model_len`` tokens. Raises on allocation failure."""
        self.model.init_cache(num_blocks, num_state_rows, block_tokens)
        layout = self.model.cache_layout(block_tokens)
        widths = {k.name: -(-max_model_len // block_tokens) + 1 for k in layout.kinds}
        cols = (self.cfg.engram_max_ngram_size - 1) * self.cfg.engram_n_heads
        engram = self.engram.local_columns() if self.engram else {lid: cols for lid in self.cfg.engram_layer_ids}
        self.tables = DeviceBlockTables(widths, self.args.max_num_seqs, self.device)
        self.buffers = InputBuffers(self.device, self.args.max_num_batched_tokens, self.args.max_num_seqs,
                                    self.tables, self.model.segment_ratios, engram)
        self.max_model_len = max_model_len
        k = self.args.lookahead_tokens()
        if self._capture_wanted():
            sizes = self._sizes(1 + k)
            self.graphs = self.make_graphs(sizes, 1 + k)
            if self._adaptive():  # a graph set per query-token count, one memory pool
                self.narrow_graphs = [self.make_graphs(self._sizes(q), q, pool=self.graphs.pool)
                                      for q in range(k, 0, -1)][::-1]
            if k:
                self.draft_graphs = DraftGraphs(self.model, self.tables, sizes, k, torch.device(self.device))
        if self._adaptive():
            self.verify_costs = measure_costs(self, k)

    def graph_output_bytes(self) -> int:
        """Bytes of the float32 logits the verify / decode graphs keep ([size·q, V] per captured graph, every q of
        adaptive verification), 0 when this runner will not capture; the engine leaves them out of the KV budget."""
        if not self._capture_wanted():
            return 0
        k = self.args.lookahead_tokens()
        qs = range(1, k + 2) if self._adaptive() else [1 + k]
        return sum(size * q * self.cfg.vocab_size * 4 for q in qs for size in self._sizes(q))

    def _sizes(self, query_tokens: int) -> list[int]:
        return graph_sizes(self.args.max_cudagraph_capture_size or 512, self.args.max_num_seqs, query_tokens)

    def _adaptive(self) -> bool:
        spec = self.args.speculative_config
        return spec is not None and spec.enable_adaptive_verification

    def verify_graph_sets(self, k: int) -> list[CudaGraphRunner]:
        """The verify steps' graph sets for q = 1..K+1 query tokens per request, ascending: the captured ones, or
        (eager runner) static inputs run eagerly, every q at the sizes of q = K + 1 (the cost profile's steps)."""
        if self.graphs is not None and len(self.narrow_graphs) == k:
            return [*self.narrow_graphs, self.graphs]
        sizes = self._sizes(1 + k)
        return [self.make_graphs(sizes, q, capture=False) for q in range(1, k + 2)]

    def make_graphs(self, sizes: list[int], query_tokens: int, capture: bool = True, pool=None) -> CudaGraphRunner:
        """Graphs (``capture`` False: their static inputs run eagerly) of ``sizes`` requests × ``query_tokens``
        rows over this runner's cache and tables (after :meth:`init_cache`), captured into ``pool``."""
        if self._static is None or min(t.shape[0] for t in self._static.values()) < sizes[-1]:
            # one gather target for every graph set (graphs replay one at a time)
            rows = max(sizes[-1], min(self.args.max_cudagraph_capture_size or 512, self.args.max_num_seqs))
            self._static = one_allocation_tables(self.tables.widths, rows, self.device)
        static = self._static
        engram = self.buffers.engram_cols
        return CudaGraphRunner(self.model, sizes, lambda size: GraphInputs(
            size, self.tables, static, engram, self.model.segment_ratios, self.max_model_len,
            self.model.cache.dummy_state_row, torch.device(self.device), query_tokens=query_tokens,
            engram_copies=self.engram is not None and self.engram.in_forward), capture, pool)

    def _capture_wanted(self) -> bool:
        if self.args.enforce_eager or not str(self.device).startswith("cuda"):
            return False
        if self.args.resolved_model_impl() != "fast":
            log.info("the paged bridge runs eager: no CUDA graphs")
            return False
        if self.tp.name not in CAPTURABLE_GROUPS:
            log.warning("the %s all-reduce cannot run inside a CUDA graph: decode runs eager", self.tp.name)
            return False
        return True

    @torch.no_grad()
    def execute(self, step: HostStep, pending: PendingRows | None = None):
        """Run ``step``: float32 logits [N, vocab] of ``step.logits_rows``. ``pending``: async scheduling's input
        rows that take the previous step's sampled ids on the device (:mod:`.pending`; needs :attr:`resolver`)."""
        if self.engram is not None:
            step = self.engram.prepare(step)
        fill = None
        if pending is not None:
            fill = lambda ids, engram: self.resolver.resolve(pending, ids, engram)  # noqa: E731
        for graphs in (*self.narrow_graphs, self.graphs):
            if graphs is not None and graphs.fits(step):
                return graphs.run(step, fill)
        batch = self.buffers.load(step)
        if fill is not None:
            fill(batch.token_ids, batch.engram_rows)
        return self.model.forward(batch)

    @torch.no_grad()
    def draft(self, table_rows: np.ndarray, anchors: np.ndarray, positions: np.ndarray
              ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One DSpark draft pass for B requests (their block-table rows, anchor tokens and anchor positions n,
        int64 [B] each): base logits [B, K, V] float32, the confidence head's hidden input [B, K, D], greedy
        drafts [B, k] int64 and their confidence logits [B, k] (:func:`.draft_graph.draft_pass`), replayed from a
        graph when one fits."""
        if self.draft_graphs is not None and self.draft_graphs.fits(anchors.shape[0]):
            return self.draft_graphs.run(table_rows, anchors, positions)
        dev = torch.device(self.device)
        rows, ids, pos = (torch.from_numpy(np.asarray(a, dtype=np.int64)).to(dev)
                          for a in (table_rows, anchors, positions))
        return draft_pass(self.model, self.tables, rows, ids, pos, self.args.lookahead_tokens())
