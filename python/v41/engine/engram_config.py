"""Engram offload options (issue 16; docs/engram.md §6): ``--engram-config`` of ``v41-serve`` (a JSON object string,
the seed's flag: its command passes ``{"cpu_offload":true}``) and ``engram_config=`` of :class:`v41.LLM` /
:class:`v41.AsyncEngine` (a dict)::

    {"cpu_offload": true, "hot_rows": 4194304, "transfer": "copy"}

:meth:`EngramConfig.parse` raises ``ValueError`` naming the key (``engram_config.<key>``) for unknown keys, wrong
types and bad values. Without ``cpu_offload`` (or with no Engram layers in the checkpoint) the tables stay on the
device as before and the other keys are unused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .json_options import parse_options

TRANSFERS = ("uva", "copy")
# Default hot-row budget per Engram layer per rank: 1 GiB of slots (4M V4.1 rows of 264 B), at least one full step.
DEFAULT_HOT_BYTES = 1 << 30


@dataclass(frozen=True)
class EngramConfig:
    """Validated Engram offload options; constructing one with a bad value raises ``ValueError``.

    cpu_offload: keep the Engram tables in pinned host memory (one ``/dev/shm`` mapping per layer shared by the
    node's ranks, each pinning its own hash columns' rows) and page the rows each step needs into a device cache
    (default False: tables on the device). hot_rows: device slots per Engram layer per rank that cache rows across
    steps (8-way set-associative CLOCK, rounded down to whole sets); None (default) = :data:`DEFAULT_HOT_BYTES` of
    slots, at least the rows of one full step, at most the rank's table rows; 0 = no cache (every row copied every
    step). Besides them each layer holds staging slots for the misses of one full step. transfer: how misses reach
    the device: ``"copy"`` (the default: gathered on the host into a pinned buffer, copied in one transfer before
    the forward) or ``"uva"`` (inside the forward a Triton kernel reads the pinned rows over UVA on a side stream,
    beside the layers before each Engram layer). Both were measured on the H200 (benches/RESULTS.md, "Engram
    offload"): ``copy`` was as fast at batch 1 and faster at batch 64 and in prefill, so it is the default. On a CPU
    device slots are an ordinary tensor and ``uva`` runs the in-forward fill with a PyTorch gather (a test path).
    """

    cpu_offload: bool = False
    hot_rows: int | None = None
    transfer: str | None = None

    def __post_init__(self) -> None:
        _require(isinstance(self.cpu_offload, bool), "cpu_offload", "true or false", self.cpu_offload)
        hot = self.hot_rows
        _require(hot is None or (isinstance(hot, int) and not isinstance(hot, bool) and hot >= 0), "hot_rows",
                 "an integer >= 0 or null", hot)
        _require(self.transfer is None or self.transfer in TRANSFERS, "transfer",
                 "one of " + ", ".join(repr(t) for t in TRANSFERS) + " or null", self.transfer)

    @classmethod
    def parse(cls, value: EngramConfig | dict | str | None) -> EngramConfig | None:
        """The options from a JSON object string, a dict or an instance (returned as is); None stays None. Raises
        ValueError for text that is not a JSON object, an unknown key (naming it and the known ones) or a bad
        value."""
        return parse_options(cls, "engram_config", value)

    def resolved_transfer(self) -> str:
        """``uva`` or ``copy`` (the default)."""
        return self.transfer or "copy"

    def resolved_hot_rows(self, record_bytes: int, step_rows: int, table_rows: int) -> int:
        """Hot slots of one layer: ``hot_rows``, or the default budget (docstring), never above ``table_rows``."""
        if self.hot_rows is not None:
            return min(self.hot_rows, table_rows)
        return min(max(DEFAULT_HOT_BYTES // record_bytes, step_rows), table_rows)


def _require(ok: bool, key: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"engram_config.{key} must be {allowed}, got {value!r}")
