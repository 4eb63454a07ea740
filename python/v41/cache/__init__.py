"""Paged cache tensors of every cache kind (docs/cache.md); v41-sched owns the block indices."""

from .layout import CacheLayout, KindSpec, PagedCache, StateSpec, blocks_for_budget, build_layout

__all__ = ["CacheLayout", "KindSpec", "PagedCache", "StateSpec", "blocks_for_budget", "build_layout"]
