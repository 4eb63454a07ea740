"""Static inputs of one CUDA graph (docs/architecture.md §3a): a region of ``size`` requests × ``query_tokens`` token
rows, one device buffer and its pinned host twin, filled by one non-blocking copy per step.

Request ``i`` of a step owns token rows ``i·q .. i·q + q − 1`` of the graph (``q`` = ``query_tokens``: 1 for plain
decode, ``1 + K`` for speculative verify steps); a request with ``n < q`` tokens leaves its last ``q − n`` rows as
padding. Padding token rows write nothing (slot −1 in every kind), sit at their request's last position (or 0 for
padding requests) and are never returned. Padding requests read the tables' padding row (all −1) and the padding
state row. The compressor segments of each request get ``nseg`` fixed rows (the most windows of ``ratio``
positions that ``q`` consecutive positions can touch); unused segment rows are all −1, which the fast model pools
to nothing and writes nowhere (:meth:`v41.models.fast.attention.StepContext.write_closed`). Unused block-table
diff entries write −1 into the padding row.
"""

from __future__ import annotations

import numpy as np
import torch

from ..kernels.table_prologue import TablePrologue
from ..models.protocol import StepBatch
from .block_tables import DeviceBlockTables
from .host_step import HostStep


def segment_shape(ratio: int, query_tokens: int) -> tuple[int, int]:
    """(segment rows per request, columns) of ratio ``ratio`` for runs of at most ``query_tokens`` tokens."""
    q = query_tokens
    if q == 1:
        return 1, 1
    return max((p + q - 1) // ratio - p // ratio + 1 for p in range(ratio)), min(ratio, q)


class GraphInputs:
    """The static inputs of the graph of ``size`` requests of ``query_tokens`` rows each (module docstring).

    tables: the persistent block tables; block_tables: kind → [≥ size, width] static gather target shared by every
    graph (graphs replay one at a time); engram_cols: layer → columns; ratios: the model's segment ratios;
    engram_copies: the forward fills offloaded Engram slots (a copy list of up to T·cols entries per layer).
    ``prologue()`` applies the static diff to the persistent tables and gathers the static rows (device work, captured
    with the forward: :class:`v41.kernels.table_prologue.TablePrologue`)."""

    def __init__(self, size: int, tables: DeviceBlockTables, block_tables: dict[str, torch.Tensor],
                 engram_cols: dict[int, int], ratios: list[int], max_model_len: int, dummy_state_row: int,
                 device: torch.device, query_tokens: int = 1, engram_copies: bool = False):
        self.size, self.q, self.max_model_len, self.dummy_state_row = size, query_tokens, max_model_len, dummy_state_row
        self.tables = tables
        self.block_tables = {k: t[:size] for k, t in block_tables.items()}
        self.diff_capacity = 2 * size + 16  # per kind: a new block and a released window block per request
        self.seg_shape = {r: segment_shape(r, query_tokens) for r in ratios}
        b, t = size, size * query_tokens
        fields: list[tuple[str, object, tuple[int, ...]]] = [
            ("token_ids", None, (t,)), ("positions", None, (t,)), ("req_index", None, (t,)), ("seq_lens", None, (b,)),
            ("state_rows", None, (b,)), ("logits_rows", None, (t,)), ("table_rows", None, (b,)),
            ("out_rows", None, (t,))]
        fields += [("table_diffs", k, (3, self.diff_capacity)) for k in tables.widths]
        fields += [("slot_mapping", k, (t,)) for k in tables.widths]
        fields += [("engram_rows", lid, (t, c)) for lid, c in engram_cols.items()]
        if engram_copies:
            fields += [("engram_copies", lid, (2, t * c)) for lid, c in engram_cols.items()]
        fields += [("segments", r, (b * n, w)) for r, (n, w) in self.seg_shape.items()]
        n = sum(int(np.prod(s)) for *_, s in fields)
        cuda = torch.device(device).type == "cuda"
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=cuda)
        self.dev = torch.zeros(n, dtype=torch.int64, device=device) if cuda else self.host
        self._done: torch.cuda.Event | None = None
        self.views: dict[str, object] = {"table_diffs": {}, "slot_mapping": {}, "engram_rows": {}, "segments": {},
                                         "engram_copies": {}}
        # (name, key, host view) per field, made once: a step only writes into the host views
        self._fields: list[tuple[str, object, np.ndarray]] = []
        host = self.host.numpy()
        off = 0
        for name, key, shape in fields:
            count = int(np.prod(shape))
            view = self.dev[off:off + count].view(*shape)
            if key is None:
                self.views[name] = view
            else:
                self.views[name][key] = view
            self._fields.append((name, key, host[off:off + count].reshape(shape)))
            off += count
        for name, _, rows in self._fields:
            rows[...] = self._padding(name, rows)
        self._padding_image = host.copy()  # every field's padding, restored by one copy per step
        self.num_out = 0
        self.fill(None)  # padding everywhere: what capture runs on
        self.prologue = TablePrologue(tables.tables, self.views["table_diffs"], self.views["table_rows"],
                                      self.block_tables)

    def fits(self, step: HostStep) -> bool:
        """At most ``size`` requests of at most ``query_tokens`` tokens each, and every kind's block-table diff fits
        the static region."""
        return (step.num_requests <= self.size and int(step.num_scheduled.max(initial=0)) <= self.q
                and all(d.shape[1] <= self.diff_capacity for d in step.table_diffs.values()))

    def batch(self) -> StepBatch:
        """The static batch (what the graph captured)."""
        views = {k: v for k, v in self.views.items() if k not in ("table_rows", "table_diffs", "out_rows")}
        return StepBatch(max_seq_len=self.max_model_len, starts=None, block_tables=self.block_tables, **views)

    def outputs(self, logits: torch.Tensor) -> torch.Tensor:
        """The step's logits rows (its ``logits_rows``, in order) out of the graph's [size·q, V] logits."""
        if self.num_out < 0:  # the step's rows are the graph's first rows
            return logits[:-self.num_out]
        return logits.index_select(0, self.views["out_rows"][:self.num_out])

    def fill(self, step: HostStep | None, dummy_ids: np.ndarray | None = None) -> None:
        """Pack ``step`` (None = all padding) into the static inputs with one non-blocking copy. ``dummy_ids``
        [size·q] int64: token ids of an all-padding fill (the verify-cost profile routes them like real tokens;
        they still write nowhere)."""
        for k, diff in ({} if step is None else step.table_diffs).items():
            self.tables.check(k, diff)
        if self._done is not None:
            self._done.synchronize()
        self.host.numpy()[:] = self._padding_image
        if step is not None:
            self._pack(step)
        elif dummy_ids is not None:
            self._fields[0][2][:] = dummy_ids  # token_ids
        if self.dev is not self.host:
            self.dev.copy_(self.host, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(self.dev.device))

    def _pack(self, step: HostStep) -> None:
        """Write ``step`` into the host views (over the padding image). Token rows land at their graph rows; when
        those are the first T rows (plain decode: one token per request at q = 1) every per-token field is a
        prefix copy. At q = 1 the segments are the padding image itself (each request's one row is its own
        window run), so they are not rewritten."""
        r, q, t = step.num_requests, self.q, step.num_tokens
        counts = step.num_scheduled.astype(np.int64, copy=False)
        if q == 1 and t == r:  # every request one token: token row i is graph row i
            req = grow = None
            out = step.logits_rows
            at = slice(0, t)
        else:
            first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
            req = step.req_index()
            grow = req * q + np.arange(t) - first[req]  # graph row of each step row
            out = grow[step.logits_rows]
            at = grow
        self.num_out = -out.size if np.array_equal(out, np.arange(out.size)) else out.size
        for name, key, rows in self._fields:
            if name == "token_ids":  # req_index and logits_rows keep their padding image
                rows[at] = step.token_ids
            elif name == "positions":
                if grow is not None:
                    rows.reshape(self.size, q)[:r] = (step.start_pos + counts - 1)[:, None]
                rows[at] = step.positions
            elif name == "out_rows":
                rows[:out.size] = out
            elif name == "seq_lens":
                rows[:r] = step.start_pos + counts
            elif name in ("state_rows", "table_rows"):
                rows[:r] = getattr(step, name)
            elif name == "table_diffs":
                src = step.table_diffs[key]
                rows[:, :src.shape[1]] = src
            elif name in ("slot_mapping", "engram_rows"):
                rows[at] = getattr(step, name)[key]
            elif name == "engram_copies":
                src = step.engram_copies[key]
                rows[:, :src.shape[1]] = src
            elif name == "segments" and q > 1:
                self._pack_segments(rows, step.segments(key), req, grow, key)

    def _pack_segments(self, rows: np.ndarray, seg: np.ndarray, req: np.ndarray, grow: np.ndarray, ratio: int) -> None:
        """The step's segments [S, L] of ``ratio`` into request blocks of ``nseg`` rows, as graph rows."""
        nseg, _ = self.seg_shape[ratio]
        if seg.shape[0] == 0:
            return
        owner = req[seg[:, 0]]
        starts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
        within = np.arange(owner.size) - np.repeat(starts, np.diff(np.r_[starts, owner.size]))
        dest = owner * nseg + within
        rows[dest, :seg.shape[1]] = np.where(seg >= 0, grow[np.maximum(seg, 0)], -1)

    def _padding(self, name: str, rows: np.ndarray):
        if name == "req_index":
            return np.arange(rows.shape[0]) // self.q
        if name == "logits_rows":
            return np.arange(rows.shape[0])
        if name == "segments":
            return np.arange(rows.shape[0])[:, None] if self.q == 1 else -1
        if name == "state_rows":
            return self.dummy_state_row
        if name == "table_rows":
            return self.tables.padding_row
        if name == "table_diffs":  # write −1 into the padding row's first column
            return np.array([[self.tables.padding_row], [0], [-1]])
        if name == "seq_lens":
            return 1
        if name == "slot_mapping":
            return -1
        if name == "engram_copies":  # row 0, slot −1: nothing to copy
            return np.array([[0], [-1]])
        return 0
