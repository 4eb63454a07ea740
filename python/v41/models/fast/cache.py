"""The fast model's paged cache: kinds and row shapes (docs/cache.md names), tensors with one reserved padding block
per kind and one padding state row (targets of CUDA-graph padding rows and of writes a token does not make).

Kinds are those of :func:`v41.cache.layout.build_layout` (the scheduler sees the same pools); the fast model keeps
compressor state as online-softmax triples (:mod:`.compress`), so its ``cstate`` rows and V4's ``cov{r}`` entries
are ``[3, C]`` float32: V4.1 ratio-2 sources and V4 HCA layers ``C = head_dim`` (the open window); V4 CSA layers
``C = 2·(head_dim + index_head_dim)`` (A and B halves of the main and index compressors) and ``cov{r}`` holds the A
triple ``[3, head_dim + index_head_dim]`` of every closed window.
"""

from __future__ import annotations

import torch

from ...cache.layout import CacheLayout, KindSpec, StateSpec, build_layout, with_kv_cache_dtype
from ...cache.records import RecordFormat
from ...config import ModelConfig
from ...kernels.paged import scatter_rows
from ...kernels.record_store import prepare_rows, store_records


def fast_layout(cfg: ModelConfig, block_tokens: int | None = None, lookahead_tokens: int = 0,
                kv_cache_dtype: str = "auto") -> CacheLayout:
    """The fast model's layout: the bridge's kinds with the fast row shapes of ``cov{r}`` and the state rows, stored
    as ``kv_cache_dtype`` says (:func:`~v41.cache.layout.with_kv_cache_dtype`; raises its ValueError).

    ``lookahead_tokens`` k > 0 (speculative decoding, :func:`build_layout`): a V4.1 ratio-2 state row becomes a
    ring of :func:`state_ring_size` triples ``[R, 3, head_dim]``, slot ``window mod R`` holding the open-window
    triple of that window's even position, so that a verify step that is rolled back to any position of its
    window can resume from the ring (docs/speculative-decoding.md §2 "Rollback copies nothing")."""
    base = build_layout(cfg, block_tokens, lookahead_tokens)
    hd, di = cfg.head_dim, cfg.index_head_dim
    kinds = tuple(KindSpec(k.name, k.tokens_per_entry, k.window_tokens, (3, hd + di), k.layers)
                  if k.name.startswith("cov") else k for k in base.kinds)
    states = []
    for s in base.states:
        plan = cfg.plan[s.layer]
        csa_v4 = not cfg.is_v41 and plan.attn_type == "csa"
        row = (3, 2 * (hd + di) if csa_v4 else hd)
        states.append(StateSpec(s.layer, (state_ring_size(lookahead_tokens), *row) if lookahead_tokens else row))
    return with_kv_cache_dtype(CacheLayout(base.block_tokens, kinds, tuple(states)), cfg, kv_cache_dtype)


def state_ring_size(lookahead_tokens: int) -> int:
    """Ring slots of a ratio-2 state row for verify steps of ``1 + lookahead_tokens`` tokens: a power of two
    above the windows such a step touches (vLLM sizes it ``2^ceil(log2(K + 2))``; a ring that is too short lets a
    later window of the same step overwrite the one a rollback resumes from)."""
    return 1 << (lookahead_tokens + 2 - 1).bit_length()


class FastCache:
    """``tensors[kind][layer]`` [(num_blocks + 1)·rows_per_block, *row_shape] in the compute dtype (float32 for
    ``cov``), or uint8 [.., record bytes] for a kind stored as records (``records[kind]``, ``--kv-cache-dtype
    fp8``); ``state[layer]`` [num_state_rows + 1, *row_shape] float32; the last block / row is padding."""

    def __init__(self, layout: CacheLayout, num_blocks: int, num_state_rows: int, dtype: torch.dtype,
                 device: torch.device | str):
        self.layout, self.num_blocks, self.num_state_rows = layout, num_blocks, num_state_rows
        self.tensors: dict[str, dict[int, torch.Tensor]] = {}
        self.records: dict[str, RecordFormat | None] = {k.name: k.record for k in layout.kinds}
        state_dtype = torch.promote_types(dtype, torch.float32)
        for k in layout.kinds:
            n = (num_blocks + 1) * (layout.block_tokens // k.tokens_per_entry)
            if k.record is not None:
                shape, kdt = (n, k.record.nbytes), torch.uint8
            else:
                shape, kdt = (n, *k.row_shape), state_dtype if k.name.startswith("cov") else dtype
            self.tensors[k.name] = {lid: torch.zeros(shape, dtype=kdt, device=device) for lid in k.layers}
        self.state = {s.layer: torch.zeros(num_state_rows + 1, *s.row_shape, dtype=state_dtype, device=device)
                      for s in layout.states}

    def store(self, kind: str, layer: int, slots: torch.Tensor, rows: torch.Tensor,
              index: torch.Tensor | None = None, norm: tuple[torch.Tensor, float] | None = None,
              rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Write ``rows`` [n, *row_shape] — RMS-normed with ``norm`` = (weight, eps) and rotated with ``rope`` =
        (cos, sin) [n, rd/2] first where given (:func:`~v41.kernels.record_store.prepare_rows`) — at ``slots`` [n]
        (or ``slots[index]``) of ``layer``'s cache, encoded into ``kind``'s records when it has them (the norm and
        rotation then in the same launch: :func:`~v41.kernels.record_store.store_records`); slot −1 writes nothing
        (:func:`~v41.kernels.paged.scatter_rows`)."""
        fmt = self.records[kind]
        if fmt is not None:
            store_records(self.tensors[kind][layer], slots, rows, fmt, self.dummy_slot(kind), index=index,
                          norm=norm, rope=rope)
        else:
            scatter_rows(self.tensors[kind][layer], slots, prepare_rows(rows, norm, rope), self.dummy_slot(kind),
                         index=index)

    def rows_per_block(self, kind: str) -> int:
        return self.layout.block_tokens // self.layout.kind(kind).tokens_per_entry

    def dummy_slot(self, kind: str) -> int:
        """First slot of the reserved padding block of ``kind``."""
        return self.num_blocks * self.rows_per_block(kind)

    @property
    def dummy_block(self) -> int:
        return self.num_blocks

    @property
    def dummy_state_row(self) -> int:
        return self.num_state_rows

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for kind in self.tensors.values() for t in kind.values()) + \
            sum(t.numel() * t.element_size() for t in self.state.values())
