"""Step inputs on the device: the only place that copies host → device in a step (docs/architecture.md §3a).

:class:`InputBuffers` owns one pinned host staging buffer and one device buffer of int64, sized at start-up for
``max_num_batched_tokens`` tokens and ``max_num_seqs`` requests. Each step it packs the :class:`HostStep` arrays
(token ids, positions, per-token request rows, per-request cached lengths, state rows, logits rows, block-table
rows, the block-table diff and slot mappings per kind, Engram rows, compressor segments) into the staging buffer,
issues **one** non-blocking copy, applies the diffs to the persistent device tables (:mod:`.block_tables`) and
returns a :class:`~v41.models.protocol.StepBatch` of views into the device buffer plus the step's block tables
gathered from the persistent ones.
There are two staging buffers used in turn, each reused only after its copy has finished (an event), so the host
can pack step N+1 while the GPU still runs step N. A step needing more room than the start-up estimate (large
block-table diffs after admissions, many short segments beside long ones) grows the buffers.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from ..models.protocol import StepBatch
from .block_tables import DeviceBlockTables
from .host_step import HostStep

log = logging.getLogger("v41.engine")


class InputBuffers:
    """Persistent step-input buffers on ``device`` (module docstring).

    max_tokens / max_reqs: per-step bounds; tables: the persistent block tables (their kinds); ratios: compressor
    ratios whose segments the model needs; engram_cols: Engram layer → hash columns.
    """

    def __init__(self, device: torch.device | str, max_tokens: int, max_reqs: int, tables: DeviceBlockTables,
                 ratios: list[int], engram_cols: dict[int, int]):
        self.device = torch.device(device)
        self.ratios = list(ratios)
        self.tables, self.engram_cols = tables, dict(engram_cols)
        per_token = 4 + len(tables.widths) + 3 * sum(engram_cols.values())  # Engram rows, copy lists
        per_req = 4 + 3 * 2 * len(tables.widths)  # diffs: about two changed entries per kind and request
        segs = sum((2 * max_reqs + max_tokens // r + 1) * r for r in self.ratios)
        self._turn = 0
        self._done: list[torch.cuda.Event | None] = [None, None]
        self._alloc(per_token * max_tokens + per_req * max_reqs + segs)

    def _alloc(self, n: int) -> None:
        for ev in self._done:
            if ev is not None:
                ev.synchronize()
        self.capacity = n
        pin = self.device.type == "cuda"
        self.host = [torch.empty(n, dtype=torch.int64, pin_memory=pin) for _ in range(2 if pin else 1)]
        self.dev = self.host[0] if self.device.type == "cpu" else torch.empty(n, dtype=torch.int64, device=self.device)

    def load(self, step: HostStep) -> StepBatch:
        """Pack ``step`` and copy it to the device; returns the step's batch (views valid until the next load)."""
        req_index = step.req_index()
        seq_lens = step.start_pos.astype(np.int64) + step.num_scheduled
        fields: list[tuple[str, object, np.ndarray]] = [
            ("token_ids", None, step.token_ids), ("positions", None, step.positions), ("req_index", None, req_index),
            ("seq_lens", None, seq_lens), ("state_rows", None, step.state_rows),
            ("logits_rows", None, step.logits_rows)]
        fields.append(("table_rows", None, step.table_rows))
        for k, diff in step.table_diffs.items():
            self.tables.check(k, diff)
            fields.append(("table_diffs", k, diff))
        fields += [("slot_mapping", k, v) for k, v in step.slot_mapping.items()]
        fields += [("engram_rows", k, v) for k, v in step.engram_rows.items()]
        fields += [("engram_copies", k, v) for k, v in step.engram_copies.items()]
        fields += [("segments", r, step.segments(r)) for r in self.ratios]
        need = sum(a.size for *_, a in fields)
        if need > self.capacity:
            log.info("input buffers grow from %d to %d int64 values", self.capacity, need)
            self._alloc(need)
        turn = self._turn
        self._turn = (turn + 1) % len(self.host)
        if self._done[turn] is not None:
            self._done[turn].synchronize()  # this staging buffer's last copy must have finished
        host = self.host[turn]
        host_np = host.numpy()
        views, off = [], 0
        for name, key, a in fields:
            host_np[off:off + a.size] = a.reshape(-1)
            views.append((name, key, off, a.shape))
            off += a.size
        if self.dev is not host:
            self.dev[:off].copy_(host[:off], non_blocking=True)
            self._done[turn] = torch.cuda.Event()
            self._done[turn].record(torch.cuda.current_stream(self.device))
        out: dict[str, object] = {"table_diffs": {}, "slot_mapping": {}, "engram_rows": {}, "segments": {},
                                  "engram_copies": {}}
        for name, key, o, shape in views:
            t = self.dev[o:o + int(np.prod(shape, dtype=np.int64))].view(*shape)
            if key is None:
                out[name] = t
            else:
                out[name][key] = t
        rows = out.pop("table_rows")
        for k, diff in out.pop("table_diffs").items():
            self.tables.apply(k, diff)
        out["block_tables"] = {k: self.tables.gather(k, rows, step.max_blocks[k]) for k in self.tables.widths}
        max_len = int(seq_lens.max()) if seq_lens.size else 0
        return StepBatch(max_seq_len=max_len, starts=step.starts(), **out)
