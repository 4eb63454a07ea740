"""One rank's model runner: loads the step model (the fast model, or the paged parity bridge), owns its cache,
the persistent input buffers and the decode CUDA graphs, and runs each :class:`~.host_step.HostStep` (docs/architecture.md §2
``engine/model_runner``): a decode-only step that fits a captured size replays its graph, anything else runs eager.

Rank 0 (:mod:`.executor`) and every tensor-parallel worker (:mod:`.tp_worker`) build the same runner from the same
:class:`~.args.EngineArgs`, so every rank fills its own buffers from the same host plan.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from ..distributed.group import SINGLE, TPGroup
from ..models.fast.dspark import DraftBatch
from ..models.protocol import StepModel
from .args import EngineArgs
from .block_tables import DeviceBlockTables
from .cuda_graph import CudaGraphRunner, GraphInputs, capture_sizes
from .host_step import HostStep
from .input_buffers import InputBuffers

log = logging.getLogger("v41.engine")
CAPTURABLE_GROUPS = ("single", "torch-nccl")  # host shared memory and PCIe pull run host code in a collective


def load_model(args: EngineArgs, device: str, tp: TPGroup | None = None) -> StepModel:
    """The step model ``args`` describe (this rank's shard with ``tp``) on ``device``. Raises ValueError for
    speculative decoding on the paged bridge (the drafter lives in the fast model)."""
    dtype = args.torch_dtype()
    lookahead = args.lookahead_tokens()
    if args.resolved_model_impl() == "paged":
        if lookahead:
            raise ValueError("speculative decoding runs on the fast model: use model_impl 'fast' (--model-impl fast)")
        from ..models.paged import PagedModel
        from ..models.reference import load

        ref = load(args.model, dtype=dtype, device=device, numerics=args.numerics, load_format=args.load_format,
                   tp=tp, config_overrides=args.hf_overrides)
        return PagedModel(ref, args.index_scratch_bytes)
    from ..models.fast import load_fast

    model = load_fast(args.model, dtype=dtype, device=device, quantization=args.quantization,
                      load_format=args.load_format, tp=tp, config_overrides=args.hf_overrides,
                      lookahead_tokens=lookahead)
    model.index_scratch_bytes = args.index_scratch_bytes
    return model


class ModelRunner:
    """The model of one rank plus its cache and input buffers. ``execute(step)`` → float32 logits [N, vocab] of
    ``step.logits_rows`` (and the DSpark aux states with ``step.return_aux``)."""

    def __init__(self, args: EngineArgs, device: str, tp: TPGroup | None = None):
        self.args, self.device, self.tp = args, device, tp or SINGLE
        self.model = load_model(args, device, tp)
        self.cfg = self.model.cfg
        self.buffers: InputBuffers | None = None
        self.graphs: CudaGraphRunner | None = None

    def cache_layout(self, block_tokens: int | None = None):
        return self.model.cache_layout(block_tokens)

    def init_cache(self, num_blocks: int, num_state_rows: int, block_tokens: int, max_model_len: int) -> None:
        """Allocate the cache (``num_blocks`` per kind, ``num_state_rows`` state rows) and the input buffers for
        requests up to ``max_model_len`` tokens. Raises on allocation failure."""
        self.model.init_cache(num_blocks, num_state_rows, block_tokens)
        layout = self.model.cache_layout(block_tokens)
        widths = {k.name: -(-max_model_len // block_tokens) + 1 for k in layout.kinds}
        cols = (self.cfg.engram_max_ngram_size - 1) * self.cfg.engram_n_heads
        engram = {lid: cols for lid in self.cfg.engram_layer_ids}
        self.tables = DeviceBlockTables(widths, self.args.max_num_seqs, self.device)
        self.buffers = InputBuffers(self.device, self.args.max_num_batched_tokens, self.args.max_num_seqs,
                                    self.tables, self.model.segment_ratios, engram)
        if self._capture_wanted():
            cap = min(self.args.max_cudagraph_capture_size or 512, self.args.max_num_seqs)
            sizes = capture_sizes(cap)
            static = {k: torch.full((sizes[-1], w), -1, dtype=torch.int64, device=self.device)
                      for k, w in widths.items()}
            self.graphs = CudaGraphRunner(self.model, sizes, lambda size: GraphInputs(
                size, self.tables, static, engram, self.model.segment_ratios, max_model_len,
                self.model.cache.dummy_state_row, torch.device(self.device)))

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
    def execute(self, step: HostStep):
        if self.graphs is not None and self.graphs.fits(step):
            return self.graphs.run(step)
        return self.model.forward(self.buffers.load(step), step.return_aux)

    @torch.no_grad()
    def draft(self, table_rows: np.ndarray, anchors: np.ndarray, positions: np.ndarray):
        """One DSpark draft pass for B requests (their block-table rows, anchor tokens and anchor positions n,
        int64 [B] each): the base logits [B·K, V] float32 of the blocks
        ``[anchor, noise × (K − 1)]`` at ``n .. n + K − 1`` (:meth:`v41.models.fast.model.FastModel.draft`)."""
        k = self.cfg.dspark_block_size
        b = anchors.shape[0]
        ids = np.full((b, k), self.cfg.dspark_noise_token_id, dtype=np.int64)
        ids[:, 0] = anchors
        pos = positions.astype(np.int64)[:, None] + np.arange(k, dtype=np.int64)[None, :]
        dev = torch.device(self.device)
        rows = torch.from_numpy(table_rows.astype(np.int64)).to(dev)
        batch = DraftBatch(token_ids=torch.from_numpy(ids.reshape(-1)).to(dev),
                           positions=torch.from_numpy(pos.reshape(-1)).to(dev),
                           req_index=torch.arange(b, device=dev).repeat_interleave(k),
                           block_table=self.tables.tables["dspark"].index_select(0, rows))
        return self.model.draft(batch)
