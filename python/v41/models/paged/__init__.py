"""The paged parity bridge: reference modules over the paged caches (eager, CPU-capable; DESIGN.md §2)."""

from .runner import PagedModel

__all__ = ["PagedModel"]
