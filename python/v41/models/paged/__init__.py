"""The paged parity bridge: reference modules over the paged caches (eager, CPU-capable; docs/architecture.md §2)."""

from .runner import PagedModel

__all__ = ["PagedModel"]
