"""One rank's model runner: loads the step model (the fast model, or the paged parity bridge), owns its cache and
the persistent input buffers, and runs each :class:`~.host_step.HostStep` (DESIGN.md §2 ``engine/model_runner``).

Rank 0 (:mod:`.executor`) and every tensor-parallel worker (:mod:`.tp_worker`) build the same runner from the same
:class:`~.args.EngineArgs`, so every rank fills its own buffers from the same host plan.
"""

from __future__ import annotations

import torch

from ..distributed.group import TPGroup
from ..models.protocol import StepModel
from .args import EngineArgs
from .host_step import HostStep
from .input_buffers import InputBuffers


def load_model(args: EngineArgs, device: str, tp: TPGroup | None = None) -> StepModel:
    """The step model ``args`` describe (this rank's shard with ``tp``) on ``device``."""
    dtype = args.torch_dtype()
    if args.resolved_model_impl() == "paged":
        from ..models.paged import PagedModel
        from ..models.reference import load

        ref = load(args.model, dtype=dtype, device=device, numerics=args.numerics, load_format=args.load_format,
                   tp=tp)
        return PagedModel(ref, args.index_scratch_bytes)
    from ..models.fast import load_fast

    model = load_fast(args.model, dtype=dtype, device=device, quantization=args.quantization,
                      load_format=args.load_format, tp=tp)
    model.index_scratch_bytes = args.index_scratch_bytes
    return model


class ModelRunner:
    """The model of one rank plus its cache and input buffers. ``execute(step)`` → float32 logits [N, vocab] of
    ``step.logits_rows`` (and the DSpark aux states with ``step.return_aux``)."""

    def __init__(self, args: EngineArgs, device: str, tp: TPGroup | None = None):
        self.args, self.device = args, device
        self.model = load_model(args, device, tp)
        self.cfg = self.model.cfg
        self.buffers: InputBuffers | None = None

    def cache_layout(self, block_tokens: int | None = None):
        return self.model.cache_layout(block_tokens)

    def init_cache(self, num_blocks: int, num_state_rows: int, block_tokens: int, max_model_len: int) -> None:
        """Allocate the cache (``num_blocks`` per kind, ``num_state_rows`` state rows) and the input buffers for
        requests up to ``max_model_len`` tokens. Raises on allocation failure."""
        self.model.init_cache(num_blocks, num_state_rows, block_tokens)
        layout = self.model.cache_layout(block_tokens)
        max_blocks = -(-max_model_len // block_tokens) + 1
        cols = (self.cfg.engram_max_ngram_size - 1) * self.cfg.engram_n_heads
        self.buffers = InputBuffers(self.device, self.args.max_num_batched_tokens, self.args.max_num_seqs,
                                    {k.name: max_blocks for k in layout.kinds}, self.model.segment_ratios,
                                    {lid: cols for lid in self.cfg.engram_layer_ids})

    @torch.no_grad()
    def execute(self, step: HostStep):
        return self.model.forward(self.buffers.load(step), step.return_aux)
