"""Cache kinds of a model (docs/cache.md names) and their sizes (docs/model.md §6).

Every token-indexed kind shares one page size ``block_tokens`` (the prefix cache's page), which every
compression ratio divides; a kind stores ``block_tokens / tokens_per_entry`` rows per block per owning
layer. Kinds:

* ``swa``: every backbone layer's sliding-window K=V rows (one per token).
* ``dspark`` (speculative decoding only): each DSpark stage's sliding-window context K=V rows (one per token).
* ``ckv{r}`` / ``idx{r}``: compressed KV and index keys at ratio r, owned by the layers that write them
  (V4.1 KV sources; V4 compressing / CSA layers).
* ``cov{r}`` (V4 CSA only): per closed window the A-half rows (kv and gated score, main and indexer
  compressor) that the next window's overlapping pool needs.
* ``cstate``: per-request compressor state rows (V4.1 ratio-2 pending token; V4 open-window rows).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from .records import RecordFormat


@dataclass(frozen=True)
class KindSpec:
    """One token-indexed cache kind: ``layers`` own a tensor [num_blocks, block_tokens / tokens_per_entry,
    *row_shape] each; ``window_tokens`` bounds what a request keeps (None = unbounded). ``record``: the deployed
    byte layout its rows are stored in (``--kv-cache-dtype fp8``, :mod:`.records`), None = the compute dtype."""

    name: str
    tokens_per_entry: int
    window_tokens: int | None
    row_shape: tuple[int, ...]
    layers: tuple[int, ...]
    record: RecordFormat | None = None

    def row_bytes(self, itemsize: int) -> int:
        """Bytes of one row: the record's size, else ``prod(row_shape) · itemsize``."""
        return self.record.nbytes if self.record is not None else math.prod(self.row_shape) * itemsize


@dataclass(frozen=True)
class StateSpec:
    """Per-request state rows of one layer: a tensor [rows, *row_shape] (float32 or the compute dtype)."""

    layer: int
    row_shape: tuple[int, ...]


@dataclass(frozen=True)
class CacheLayout:
    """All kinds of a model at a given page size (tokens per block)."""

    block_tokens: int
    kinds: tuple[KindSpec, ...]
    states: tuple[StateSpec, ...]

    def bytes_per_block(self, itemsize: int) -> int:
        """Bytes one block id costs across every kind and owning layer."""
        total = 0
        for k in self.kinds:
            rows = self.block_tokens // k.tokens_per_entry
            total += len(k.layers) * rows * k.row_bytes(itemsize)
        return total

    def bytes_per_state_row(self, itemsize: int) -> int:
        return sum(math.prod(s.row_shape) * itemsize for s in self.states)

    def bytes_per_token(self, itemsize: int) -> dict[str, float]:
        """Bytes one cached token costs in each kind, over every owning layer (a compressed kind stores one row
        per ``tokens_per_entry`` tokens)."""
        return {k.name: len(k.layers) * k.row_bytes(itemsize) / k.tokens_per_entry for k in self.kinds}

    def describe(self, itemsize: int) -> str:
        """Bytes per token per kind for the start-up log, e.g. ``swa 8192 B (window 128), ckv2 2048 B``; a kind
        stored as records names its format, e.g. ``ckv2 432 B (ckv_fp4 288 B)``."""
        parts = []
        for k in self.kinds:
            per = self.bytes_per_token(itemsize)[k.name]
            window = f" (window {k.window_tokens})" if k.window_tokens is not None else ""
            rec = f" ({k.record.kind} {k.record.nbytes} B)" if k.record is not None else ""
            parts.append(f"{k.name} {per:,.0f} B{window}{rec}")
        return ", ".join(parts)

    def kind(self, name: str) -> KindSpec:
        for k in self.kinds:
            if k.name == name:
                return k
        raise KeyError(name)

    def scheduler_layout(self, num_blocks: int) -> list[dict]:
        """The per-kind description v41-sched takes (name, tokens per block/entry, window, num_blocks)."""
        return [dict(name=k.name, tokens_per_block=self.block_tokens, tokens_per_entry=k.tokens_per_entry,
                     window_tokens=k.window_tokens, num_blocks=num_blocks) for k in self.kinds]


def default_block_tokens(cfg: ModelConfig) -> int:
    """64 tokens, rounded up to a multiple of every compression ratio (128 for V4's HCA)."""
    ratios = [r for r in cfg.compress_ratios[: cfg.num_hidden_layers] if r > 0] or [1]
    lcm = math.lcm(*ratios)
    return lcm * math.ceil(64 / lcm)


def build_layout(cfg: ModelConfig, block_tokens: int | None = None, lookahead_tokens: int = 0) -> CacheLayout:
    """The cache layout of ``cfg``. ``lookahead_tokens``: draft tokens a verify step computes beyond the committed
    length (speculative decoding; docs/speculative-decoding.md §2 "Plan"): the windowed kinds keep that many more
    positions, and the DSpark drafter's context rings join as kind ``dspark`` (one K=V row per position per
    stage, layers ``num_hidden_layers + s``). Raises ValueError if ``block_tokens`` is not a multiple of every
    ratio."""
    block_tokens = block_tokens or default_block_tokens(cfg)
    hd, di = cfg.head_dim, cfg.index_head_dim
    layers = range(cfg.num_hidden_layers)
    kinds = [KindSpec("swa", 1, cfg.sliding_window + lookahead_tokens, (hd,), tuple(layers))]
    if lookahead_tokens:
        stages = tuple(cfg.num_hidden_layers + s for s in range(cfg.num_nextn_predict_layers))
        kinds.append(KindSpec("dspark", 1, cfg.sliding_window + lookahead_tokens, (hd,), stages))
    states: list[StateSpec] = []
    for r in sorted({p.ratio for p in cfg.plan if p.ratio > 0}):
        if block_tokens % r:
            raise ValueError(f"block_tokens={block_tokens} is not a multiple of compression ratio {r}")
        owners = tuple(p.layer_id for p in cfg.plan if p.ratio == r and p.owns_compressor)
        idx_owners = tuple(p.layer_id for p in cfg.plan if p.ratio == r and p.owns_index_keys)
        kinds.append(KindSpec(f"ckv{r}", r, None, (hd,), owners))
        if idx_owners:
            kinds.append(KindSpec(f"idx{r}", r, None, (di,), idx_owners))
        if not cfg.is_v41 and idx_owners:  # V4 CSA overlap halves: kv|score main, kv|score indexer
            kinds.append(KindSpec(f"cov{r}", r, None, (r, 2 * hd + 2 * di), idx_owners))
        for lid in owners:
            if cfg.is_v41 and r == 2:
                states.append(StateSpec(lid, (2, hd)))  # pending (a, b) of an even-position token
            elif not cfg.is_v41:
                c = 2 if lid in idx_owners else 1
                width = 2 * c * hd + (4 * di if lid in idx_owners else 0)
                states.append(StateSpec(lid, (r - 1, width)))  # open-window rows: kv|score (+ indexer)
    return CacheLayout(block_tokens, tuple(kinds), tuple(states))


KV_CACHE_DTYPES = ("auto", "fp8")


def with_kv_cache_dtype(layout: CacheLayout, cfg: ModelConfig, kv_cache_dtype: str) -> CacheLayout:
    """``layout`` with its rows stored as ``kv_cache_dtype`` says (docs/model.md §6): ``auto`` keeps the compute
    dtype; ``fp8`` stores the deployed records (:mod:`.records`). V4.1: window rows (``swa``, ``dspark``) FP8 E4M3
    with E8M0 scales per 32 dims (528 B at head_dim 512), compressed KV (``ckv{r}``) FP4 E2M1 with E4M3 scales per
    16 (288 B), index keys (``idx{r}``) MXFP4 (68 B at 128 dims). V4: window and compressed rows FP8 per 64 with
    the RoPE dims in bf16 (584 B); its index keys and overlap rows stay in the compute dtype, as the reference
    keeps them. Raises ValueError for another value."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return layout
    hd, di = cfg.head_dim, cfg.index_head_dim
    if cfg.is_v41:
        window = RecordFormat("swa_fp8", hd)
        fmt = {"swa": window, "dspark": window, "ckv": RecordFormat("ckv_fp4", hd), "idx": RecordFormat("idx_mxfp4", di)}
    else:
        window = RecordFormat("swa_v4", hd, rope=cfg.qk_rope_head_dim)
        fmt = {"swa": window, "dspark": window, "ckv": window}
    kinds = tuple(dataclasses.replace(k, record=fmt.get(k.name.rstrip("0123456789"))) for k in layout.kinds)
    return dataclasses.replace(layout, kinds=kinds)


class PagedCache:
    """The cache tensors of every kind: ``tensors[kind][layer]`` is [num_blocks · rows_per_block, *row_shape]
    (flat slots), ``state[layer]`` is [num_state_rows, *row_shape]. Block ids and slots come from v41-sched.
    """

    def __init__(self, layout: CacheLayout, num_blocks: int, num_state_rows: int, dtype: torch.dtype,
                 device: torch.device | str):
        self.layout, self.num_blocks, self.num_state_rows = layout, num_blocks, num_state_rows
        self.tensors: dict[str, dict[int, torch.Tensor]] = {}
        for k in layout.kinds:
            rows = layout.block_tokens // k.tokens_per_entry
            self.tensors[k.name] = {lid: torch.zeros(num_blocks * rows, *k.row_shape, dtype=dtype, device=device)
                                    for lid in k.layers}
        state_dtype = torch.promote_types(dtype, torch.float32)
        self.state = {s.layer: torch.zeros(num_state_rows, *s.row_shape, dtype=state_dtype, device=device)
                      for s in layout.states}

    def rows_per_block(self, kind: str) -> int:
        return self.layout.block_tokens // self.layout.kind(kind).tokens_per_entry


def blocks_for_budget(layout: CacheLayout, budget_bytes: int, num_state_rows: int, itemsize: int) -> int:
    """How many block ids fit ``budget_bytes`` after the state rows. Raises ValueError if not even one."""
    free = budget_bytes - num_state_rows * layout.bytes_per_state_row(max(itemsize, 4))
    n = free // max(1, layout.bytes_per_block(itemsize))
    if n < 1:
        raise ValueError(f"kv_cache_bytes={budget_bytes} is too small: one block needs "
                         f"{layout.bytes_per_block(itemsize)} bytes plus {num_state_rows} state rows")
    return int(n)
