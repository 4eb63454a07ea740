"""The plan of one step on the host (numpy arrays): what the scheduler decided plus the Engram rows hashed from
committed ids. Rank 0 builds it; tensor-parallel ranks receive it as msgpack bytes and fill their own device
buffers from it (:mod:`.input_buffers`), so no device tensor ever crosses processes (docs/architecture.md §3a).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack
import numpy as np


@dataclass
class HostStep:
    """One step. Per token [T]: token_ids, positions (int64), slot_mapping[kind] (int32, −1 = no row). Per request
    [R]: num_scheduled, start_pos (int64), state_rows (int32, −1 = none), table_rows (int32: the request's row of
    the persistent block tables). Per kind: table_diffs[kind] [3, D] int32 (row, logical block, physical block;
    −1 = none) — the entries that changed since each row was last sent, applied in step order on every rank
    (:mod:`.block_tables`) — and max_blocks[kind], the columns this step reads. engram_rows[layer] [T, cols]
    int64 table rows; logits_rows [N] int64 rows whose logits the step returns. engram_copies[layer] [2, M] int64:
    this rank's copy list of Engram misses (rows; slots) when the forward fills its slots (docs/engram.md §5);
    made on each rank by its pager, never sent."""

    token_ids: np.ndarray
    positions: np.ndarray
    num_scheduled: np.ndarray
    start_pos: np.ndarray
    table_rows: np.ndarray
    table_diffs: dict[str, np.ndarray]
    max_blocks: dict[str, int]
    slot_mapping: dict[str, np.ndarray]
    state_rows: np.ndarray
    logits_rows: np.ndarray
    engram_rows: dict[int, np.ndarray] = field(default_factory=dict)
    engram_copies: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_requests(self) -> int:
        return int(self.num_scheduled.shape[0])

    @property
    def is_decode_only(self) -> bool:
        """Every request computes exactly one token (a CUDA-graph step)."""
        return self.num_tokens == self.num_requests

    def req_index(self) -> np.ndarray:
        """[T] int64 request row of each token."""
        return np.repeat(np.arange(self.num_requests, dtype=np.int64), self.num_scheduled)

    def starts(self) -> tuple[tuple[int, int, int], ...]:
        """(first token row, token count, first position) per request."""
        first = np.concatenate([[0], np.cumsum(self.num_scheduled)[:-1]]).astype(np.int64)
        return tuple((int(a), int(n), int(p)) for a, n, p in zip(first, self.num_scheduled, self.start_pos))

    def segments(self, ratio: int) -> np.ndarray:
        """[S, L] int64 token rows of every (request, window of ``ratio`` positions) run, in position order, −1
        padded (a segment starts at a request's first row and at every position ≡ 0 mod ratio)."""
        t = self.num_tokens
        if t == 0:
            return np.zeros((0, 1), dtype=np.int64)
        req = self.req_index()
        start = np.ones(t, dtype=bool)
        start[1:] = (req[1:] != req[:-1]) | (self.positions[1:] % ratio == 0)
        seg = np.cumsum(start) - 1
        first = np.flatnonzero(start)
        within = np.arange(t) - first[seg]
        out = np.full((int(seg[-1]) + 1, int(within.max()) + 1), -1, dtype=np.int64)
        out[seg, within] = np.arange(t)
        return out

    # -- wire format ---------------------------------------------------------------------------------------------
    def encode(self) -> bytes:
        """msgpack bytes: every array as (dtype, shape, raw little-endian bytes), never a pickle."""
        def arr(a: np.ndarray) -> list:
            a = np.ascontiguousarray(a)
            return [a.dtype.str, list(a.shape), a.tobytes()]
        return msgpack.packb({
            "token_ids": arr(self.token_ids), "positions": arr(self.positions),
            "num_scheduled": arr(self.num_scheduled), "start_pos": arr(self.start_pos),
            "table_rows": arr(self.table_rows), "table_diffs": {k: arr(v) for k, v in self.table_diffs.items()},
            "max_blocks": {k: int(v) for k, v in self.max_blocks.items()},
            "slot_mapping": {k: arr(v) for k, v in self.slot_mapping.items()},
            "state_rows": arr(self.state_rows), "logits_rows": arr(self.logits_rows),
            "engram_rows": {str(k): arr(v) for k, v in self.engram_rows.items()}}, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> "HostStep":
        """Inverse of :meth:`encode`. Raises ValueError for malformed bytes."""
        def arr(v: list) -> np.ndarray:
            dtype, shape, raw = v
            return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape)
        try:
            d = msgpack.unpackb(data, raw=False)
            return cls(token_ids=arr(d["token_ids"]), positions=arr(d["positions"]),
                       num_scheduled=arr(d["num_scheduled"]), start_pos=arr(d["start_pos"]),
                       table_rows=arr(d["table_rows"]),
                       table_diffs={k: arr(v) for k, v in d["table_diffs"].items()},
                       max_blocks={k: int(v) for k, v in d["max_blocks"].items()},
                       slot_mapping={k: arr(v) for k, v in d["slot_mapping"].items()},
                       state_rows=arr(d["state_rows"]), logits_rows=arr(d["logits_rows"]),
                       engram_rows={int(k): arr(v) for k, v in d["engram_rows"].items()})
        except (KeyError, TypeError, ValueError, msgpack.UnpackException) as e:
            raise ValueError(f"malformed step message ({e})") from None
