"""Runs one flattened variable-length batch through the V4 / V4.1 layers over the paged caches.

Weights and every token-wise computation (embedding, Engram, mHC, norms, projections, MoE, heads) are the
reference model's modules; attention reads and writes the paged caches through :mod:`.paged_v41` /
:mod:`.paged_v4`. The result must equal the reference (DESIGN.md §4: paged vs dense, batched vs alone,
chunked vs whole).
"""

from __future__ import annotations

import numpy as np
import torch

from ..cache import PagedCache
from ..models.reference.model import Transformer
from ..models.reference.ops import hc_collapse
from .paged_v4 import attention_v4
from .paged_v41 import StepState, attention_v41
from .step import StepBatch

DEFAULT_INDEX_SCRATCH_BYTES = 64 << 20


class ModelRunner:
    """``execute(batch)`` → logits [N, vocab] for ``batch.logits_rows`` (and, with ``return_aux``, the DSpark
    aux hidden states [T, n_targets·D]: the mean of the copies entering each ``dspark_target_layer_ids``).

    index_scratch_bytes: cap on an indexer's score scratch per query chunk (bytes), whatever the context.
    """

    def __init__(self, model: Transformer, cache: PagedCache,
                 index_scratch_bytes: int = DEFAULT_INDEX_SCRATCH_BYTES):
        self.model, self.cache, self.cfg = model, cache, model.cfg
        self.index_scratch_bytes = index_scratch_bytes
        self.attention = attention_v41 if self.cfg.is_v41 else attention_v4

    @torch.no_grad()
    def execute(self, batch: StepBatch, return_aux: bool = False):
        cfg, m = self.cfg, self.model
        st = StepState(batch, self.cache, cfg.sliding_window, self.index_scratch_bytes)
        t = batch.num_tokens
        h = m.embed(batch.token_ids).unsqueeze(1).repeat(1, cfg.hc_mult, 1)
        pre_mix = torch.zeros(t, cfg.hc_mult, dtype=h.dtype, device=h.device)
        pre_mix[:, 0] = 1
        rows = self._engram_rows(batch)
        aux = []
        for plan, layer in zip(cfg.plan, m.layers):
            if plan.engram:
                h = layer.engram(h, rows[plan.layer_id])
            if plan.dspark_target:
                aux.append(h.mean(dim=1))
            h, pre_mix = layer(h, pre_mix, batch.token_ids, lambda x, a=layer.attn: self.attention(a, x, st))
        sel = batch.logits_rows
        x = hc_collapse(h[sel], pre_mix[sel]) if cfg.is_v41 else m._hc_head(h[sel])
        logits = m.head(m.norm(x))
        if return_aux:
            return logits, (torch.cat(aux, dim=-1) if aux else None)
        return logits

    def _engram_rows(self, batch: StepBatch) -> dict[int, torch.Tensor]:
        cfg, hasher = self.cfg, self.model.hasher
        if not cfg.engram_layer_ids:
            return {}
        ids = batch.token_ids.cpu().numpy().astype(np.int64)
        out = {}
        for lid in cfg.engram_layer_ids:
            parts = [hasher.hash_ids(lid, ids[row0:row0 + n], history=list(batch.engram_history[r]))
                     for r, (row0, n, _) in enumerate(batch.starts)]
            out[lid] = torch.from_numpy(np.concatenate(parts)).to(batch.token_ids.device)
        return out
