"""Attention of the fast model, shared by V4.1 and V4 (docs/model.md §3.5, §4 "Attention"): low-rank q,
one K = V latent per token in a paged sliding window, sink softmax over the window plus selected compressed
entries in one sparse kernel, inverse RoPE, grouped output projection.

:class:`StepContext` is what :meth:`FastModel.prepare` builds once per step for every layer: the batch, the
cache, RoPE angles per variant, the window slots of every query, the compressor segments per ratio, and the
top-k lists / candidate mask published by index sources during the forward. Nothing in it is per layer or per
request on the host.

Tensor parallelism: a rank holds its heads' rows of ``wq_b``/``attn_sink`` and its output groups of ``wo_a`` /
columns of ``wo_b`` (:mod:`v41.models.sharding`); the ``wo_b`` partial sums are all-reduced.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ...config import LayerPlan, ModelConfig
from ...distributed.group import SINGLE, TPGroup
from ...kernels.paged import table_slots, window_slots as paged_window_slots
from ...kernels.side_stream import beside
from ...kernels.sparse_attention import sparse_mqa_sink
from ..protocol import StepBatch
from ..sharding import group_range, head_range
from .cache import FastCache
from .compress import Segments
from ...kernels.norm import rms_norm
from ...kernels.rope import rope_
from .fused import SiblingLinears
from .layers import PackedLinear, RMSNorm, Rope


@dataclass
class StepContext:
    """Per-step state shared by the layers (module docstring). ``ropes[key]``: the :class:`Rope` of a variant
    (``"base"`` or ``"compress"``); ``rope[key]`` = (cos, sin) [T, rd/2] at the token
    positions; ``window_slots`` [T, W] swa slots of
    each query's window, oldest first (−1 = none); ``segments[r]``; ``n_max[r]`` = max_seq_len // r;
    ``n_visible[r]`` [T] = (pos + 1) // r; ``topk[layer]`` [T, k] entry ids (−1 = none); ``cand`` [T, N / block]
    bool, the level-1 candidate blocks (``candidate_block_size`` entries each) of the candidate source;
    ``index_scratch_bytes`` bounds the indexer's per-layer scratch (:func:`index_row_chunks`)."""

    batch: StepBatch
    cache: FastCache
    ropes: dict[str, Rope]
    rope: dict[str, tuple[Tensor, Tensor]]
    window_slots: Tensor
    segments: dict[int, Segments]
    n_max: dict[int, int]
    n_visible: dict[int, Tensor]
    index_scratch_bytes: int
    topk: dict[int, Tensor] = field(default_factory=dict)
    cand: Tensor | None = None
    _closed_rope: dict[tuple[str, int], tuple[Tensor, Tensor]] = field(default_factory=dict)

    def closed_rope(self, key: str, ratio: int) -> tuple[Tensor, Tensor]:
        """(cos, sin) [S, rd/2] of rope variant ``key`` at the positions ``j·ratio`` of the entries that the ratio's
        segments close (``segments[ratio].window``); computed once per step, shared by the layers of that ratio."""
        got = self._closed_rope.get((key, ratio))
        if got is None:
            got = self.ropes[key].cos_sin(self.segments[ratio].window, ratio)
            self._closed_rope[(key, ratio)] = got
        return got

    def entry_slots(self, kind: str, entry_ids: Tensor) -> Tensor:
        """Cache slots [T, K] of per-query entry ids [T, K] (−1 = none) of ``kind`` through the requests' tables."""
        b = self.batch
        return table_slots(b.block_tables[kind], b.req_index, entry_ids, self.cache.rows_per_block(kind))

    def write(self, kind: str, layer: int, values: Tensor, **prep) -> None:
        """Write ``values`` [T, *row] (one per token of the step) at the slots the tokens close in ``kind``'s cache
        of ``layer`` (slot −1 = nothing written); ``prep``: :meth:`FastCache.store`'s ``norm`` / ``rope``."""
        self.cache.store(kind, layer, self.batch.slot_mapping[kind], values, **prep)

    def write_closed(self, kind: str, layer: int, seg: Segments, values: Tensor, **prep) -> None:
        """Write ``values`` [S, *row] of the segments ``seg`` at the slots their last tokens close in ``kind``'s
        cache of ``layer`` (through ``seg.closed_row``); padding segments (no valid row: CUDA-graph padding) write
        nothing. ``prep``: :meth:`FastCache.store`'s ``norm`` / ``rope``."""
        self.cache.store(kind, layer, self.batch.slot_mapping[kind], values, index=seg.closed_row, **prep)


def rope_key(plan: LayerPlan) -> str:
    """Layers with compressed KV use the compress base and YaRN (§2); the others the plain base."""
    return "compress" if plan.ratio > 0 else "base"


def make_rope(cfg: ModelConfig, key: str, device, dtype: torch.dtype) -> Rope:
    """The rope of variant ``key`` rotating in float32 (float64 for a float64 model)."""
    base, scaling = cfg.layer_rope(1 if key == "compress" else 0)
    return Rope(cfg.qk_rope_head_dim, base, scaling, device, torch.promote_types(dtype, torch.float32))


class FastAttention(nn.Module):
    """Sliding-window MQA with sinks; subclasses add the compressed entries (:meth:`compressed_source`).

    Tensors (this rank's shard): ``wq_a``, ``q_norm``, ``wq_b [H·hd, q_lora]``, ``wkv``, ``kv_norm``,
    ``wo_a [G·R, H·hd/G]`` (grouped), ``wo_b [D, G·R]``, ``attn_sink [H]`` float32. ``q_head_norm``: V4's
    unweighted per-head RMSNorm on q before RoPE."""

    def __init__(self, cfg: ModelConfig, plan: LayerPlan, q_head_norm: bool, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp or SINGLE
        d, hd = cfg.hidden_size, cfg.head_dim
        h0, h1 = head_range(cfg, self.tp.world_size, self.tp.rank)
        g0, g1 = group_range(cfg, self.tp.world_size, self.tp.rank)
        self.cfg, self.plan, self.q_head_norm = cfg, plan, q_head_norm
        self.n_heads, self.n_groups, self.head_dim = h1 - h0, g1 - g0, hd
        self.rope_key = rope_key(plan)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads), requires_grad=False)
        self.wq_a = PackedLinear(d, cfg.q_lora_rank, fp8_input=True)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = PackedLinear(cfg.q_lora_rank, self.n_heads * hd, fp8_input=True)
        self.wkv = PackedLinear(d, hd, fp8_input=True)
        self.kv_norm = RMSNorm(hd, cfg.rms_norm_eps)
        in_g = cfg.num_attention_heads * hd // cfg.o_groups
        self.wo_a = PackedLinear(in_g, self.n_groups * cfg.o_lora_rank, groups=self.n_groups)
        self.wo_b = PackedLinear(self.n_groups * cfg.o_lora_rank, d, fp8_input=True)
        # projections of x run as one GEMM per group (:mod:`.fused`; stacked by FastModel.fuse_siblings after loading)
        self.siblings = {"latents": SiblingLinears([self.wq_a, self.wkv])}
        self._wide: list[str] = []

    def forward(self, x: Tensor, ctx: StepContext) -> Tensor:
        """x [T, D] normalized sub-layer input → [T, D] (full on every rank)."""
        cos, sin = ctx.rope[self.rope_key]
        proj = self.project(x)
        qr = self.q_norm(proj["wq_a"])
        # the cache writes, then the compressed entries' selection (which reads what they wrote), beside the query
        # path (kernels/side_stream.py; inline unless enabled)
        side = beside(lambda: self._write_and_select(x, qr, proj, ctx), x, "cache_and_index")
        q = self.wq_b(qr).view(x.shape[0], self.n_heads, self.head_dim)
        if self.q_head_norm:
            q = rms_norm(q, self.cfg.rms_norm_eps)
        q = rope_(q, cos, sin)  # q is this step's own tensor: rotated in place
        extra = side.wait()
        lid = self.plan.layer_id
        sources = [(ctx.cache.tensors["swa"][lid], ctx.window_slots)]
        records = [ctx.cache.records["swa"]]
        if extra is not None:
            sources.append(extra)
            records.append(ctx.cache.records[f"ckv{self.plan.ratio}"])
        o = sparse_mqa_sink(q, sources, self.attn_sink, self.head_dim ** -0.5, records)
        o = rope_(o, cos, sin, inverse=True)
        return self.tp.all_reduce(self.wo_b(self.wo_a(o.reshape(x.shape[0], -1))))

    def add_wide_siblings(self, named: dict[str, PackedLinear]) -> None:
        """Subclasses' projections of x with float32 (≥ the compute dtype) outputs, by name: compressors and the
        indexer's weights; two or more run as one GEMM. :meth:`project` returns each under its name."""
        if named:
            self.siblings["float32"] = SiblingLinears(list(named.values()))
            self._wide = list(named)

    def project(self, x: Tensor) -> dict[str, Tensor]:
        """The projections of x by name (``wq_a``, ``wkv`` and those of :meth:`add_wide_siblings`), [T, out] each,
        computed by :attr:`siblings` (one GEMM per group once fused; each output may be a column view)."""
        q_lat, kv_lat = self.siblings["latents"](x)
        proj = {"wq_a": q_lat, "wkv": kv_lat}
        if self._wide:
            proj.update(zip(self._wide, self.siblings["float32"](x, torch.promote_types(x.dtype, torch.float32))))
        return proj

    def _write_and_select(self, x: Tensor, qr: Tensor, proj: dict[str, Tensor],
                          ctx: StepContext) -> tuple[Tensor, Tensor] | None:
        """:meth:`write_caches`, then :meth:`compressed_source`: the work of a layer that does not need its
        queries, queued on the side stream where :mod:`v41.kernels.side_stream` is enabled (site
        ``cache_and_index``), beside the query path (``wq_b``, the head norm, RoPE)."""
        self.write_caches(x, proj, ctx)
        return self.compressed_source(x, qr, proj, ctx)

    def write_caches(self, x: Tensor, proj: dict[str, Tensor], ctx: StepContext) -> None:
        """This step's cache entries from x and its projections: the window KV row of each token (``swa``) and, in
        subclasses, the compressed entries and index keys the step closes (:meth:`write_entries`). The
        projections themselves are computed before, by :meth:`project`."""
        ctx.cache.store("swa", self.plan.layer_id, ctx.batch.slot_mapping["swa"], proj["wkv"],
                        norm=self.kv_norm.params(), rope=ctx.rope[self.rope_key])
        self.write_entries(x, proj, ctx)

    def write_entries(self, x: Tensor, proj: dict[str, Tensor], ctx: StepContext) -> None:
        """Compressed entries closed in this step (none for window-only layers)."""

    def compressed_source(self, x: Tensor, qr: Tensor, proj: dict[str, Tensor],
                          ctx: StepContext) -> tuple[Tensor, Tensor] | None:
        """(cache, slots [T, K]) of the compressed entries each query attends to, after :meth:`write_caches`;
        None for window-only layers."""
        return None


def window_slots(batch: StepBatch, cache: FastCache, window: int) -> Tensor:
    """[T, W] swa slots of positions ``pos − W + 1 .. pos`` of each query (oldest first, −1 before 0)."""
    return paged_window_slots(batch.block_tables["swa"], batch.req_index, batch.positions, window,
                              cache.rows_per_block("swa"))


INDEX_BYTES_PER_ENTRY = 32  # float32 score, int64 order key, the masked copy, the candidate expansion


def index_row_chunks(t: int, n: int, scratch_bytes: int) -> list[slice]:
    """Row ranges covering a step's ``t`` queries scored against ``n`` entries, each range's ``[rows, n]``
    indexer scratch within ``scratch_bytes`` (``EngineArgs.index_scratch_bytes``, default 1 GiB: at a 1M-token
    context, N = 1,048,576 entries of a ratio-1 source, 32 queries at a time instead of 32 GiB for a
    1,024-token chunk); one range when everything fits, ``[0:0]`` for an empty step. The ranges depend on
    shapes only, so a CUDA graph captures the same launches every replay."""
    rows = max(1, scratch_bytes // max(1, n * INDEX_BYTES_PER_ENTRY))
    return [slice(a, min(t, a + rows)) for a in range(0, t, rows)] or [slice(0, 0)]

