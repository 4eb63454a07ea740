"""The paged parity bridge: the reference model's modules run one flattened variable-length step over the paged
caches (eager, CPU-capable; docs/architecture.md §2 ``models/paged``).

Every token-wise computation (embedding, Engram, mHC, norms, projections, MoE, heads) is the reference model's
own; attention reads and writes the paged caches through :mod:`.v41` / :mod:`.v4`, request by request. It must
equal the reference (docs/numerics.md §4: paged vs dense, batched vs alone, chunked vs whole) in both numerics; it is
the CPU parity path (``--model-impl paged``). It is not capturable (host loops per request).
"""

from __future__ import annotations

import torch

from ...cache import PagedCache, build_layout
from ..protocol import StepBatch
from ..reference.model import Transformer
from ..reference.ops import hc_collapse
from .v4 import attention_v4
from .v41 import StepState, attention_v41

DEFAULT_INDEX_SCRATCH_BYTES = 64 << 20


class PagedModel:
    """:class:`~v41.models.protocol.StepModel` over a reference :class:`Transformer` (this rank's shard under TP).

    index_scratch_bytes: cap on an indexer's score scratch per query chunk (bytes), whatever the context.
    """

    def __init__(self, model: Transformer, index_scratch_bytes: int = DEFAULT_INDEX_SCRATCH_BYTES):
        self.model, self.cfg = model, model.cfg
        self.index_scratch_bytes = index_scratch_bytes
        self.attention = attention_v41 if self.cfg.is_v41 else attention_v4
        self.cache: PagedCache | None = None
        self.segment_ratios: list[int] = []  # the bridge pools request by request

    def cache_layout(self, block_tokens: int | None = None):
        return build_layout(self.cfg, block_tokens)

    def init_cache(self, num_blocks: int, num_state_rows: int, block_tokens: int) -> None:
        """Allocate the paged cache in the model's dtype and device (raises on allocation failure)."""
        p = next(self.model.parameters())
        self.cache = PagedCache(self.cache_layout(block_tokens), num_blocks, num_state_rows, p.dtype, p.device)

    @torch.no_grad()
    def forward(self, batch: StepBatch, return_aux: bool = False):
        """Logits [N, vocab] for ``batch.logits_rows`` (and, with ``return_aux``, the DSpark aux hidden states
        [T, n_targets·D]: the mean of the copies entering each ``dspark_target_layer_ids``). Needs
        ``batch.starts``."""
        cfg, m = self.cfg, self.model
        st = StepState(batch, self.cache, cfg.sliding_window, self.index_scratch_bytes)
        t = batch.num_tokens
        h = m.embed(batch.token_ids).unsqueeze(1).repeat(1, cfg.hc_mult, 1)
        pre_mix = torch.zeros(t, cfg.hc_mult, dtype=h.dtype, device=h.device)
        pre_mix[:, 0] = 1
        aux = []
        for plan, layer in zip(cfg.plan, m.layers):
            if plan.engram:
                h = layer.engram(h, batch.engram_rows[plan.layer_id])
            if plan.dspark_target:
                aux.append(h.mean(dim=1))
            h, pre_mix = layer(h, pre_mix, batch.token_ids, lambda x, a=layer.attn: self.attention(a, x, st))
        sel = batch.logits_rows
        x = hc_collapse(h[sel], pre_mix[sel]) if cfg.is_v41 else m._hc_head(h[sel])
        logits = m.head(m.norm(x))
        if return_aux:
            return logits, (torch.cat(aux, dim=-1) if aux else None)
        return logits

    __call__ = forward
