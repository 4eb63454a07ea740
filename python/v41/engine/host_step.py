"""The plan of one step on the host (numpy arrays): what the scheduler decided plus the Engram rows hashed from
committed ids. Rank 0 builds it; tensor-parallel ranks receive it as msgpack bytes and fill their own device
buffers from it (:mod:`.input_buffers`), so no device tensor ever crosses processes (docs/architecture.md §3a).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgpack
import numpy as np

from .pending import PendingRows, pending_rows


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


def plan_host_step(plan, seqs, engram_rows=None, prev_rows: dict[int, int] | None = None, prev_sampled=None):
    """The step's :class:`HostStep` from the scheduler's plan, plus per request the rows to sample (the last row, or
    the k + 1 verify rows of k drafts; None) and the rows whose logits score prompt tokens (prompt_logprobs), and
    the async-scheduling rows whose ids are the previous step's sampled ids (:mod:`.pending`; None if none).

    seqs: the scheduled :class:`~.request.Sequence` s in plan order (their first admission is stamped here);
    engram_rows: the :class:`~.engram_rows.StepRowHasher` (None without Engram), which hashes every row from
    committed ids; prev_rows: seq id → its row of ``prev_sampled``, the previous step's sampled ids on the device.
    """
    counts = plan.num_scheduled.astype(np.int64)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    token_ids = plan.token_ids.astype(np.int64)
    sample_rows, prompt_rows, rows = [], [], []
    for a, n, p, seq, do, k in zip(first.tolist(), counts.tolist(), plan.start_pos.tolist(), seqs,
                                   plan.do_sample.tolist(), plan.num_draft_tokens.tolist()):
        sample_rows.append(list(range(a + n - 1 - k, a + n)) if do else None)
        if do:
            rows += sample_rows[-1]
        if seq.prompt_logprobs is not None and p < len(seq.prompt_token_ids) - 1:
            last = min(p + n, len(seq.prompt_token_ids) - 1)
            prompt_rows.append(list(range(a, a + last - p)))
            rows += prompt_rows[-1]
        else:
            prompt_rows.append(None)
    histories = None
    if engram_rows is not None:
        histories = [seq.history(p, engram_rows.keep) for p, seq in zip(plan.start_pos.tolist(), seqs)]
    pending: PendingRows | None = None
    if prev_rows:
        pending = pending_rows(token_ids, [prev_rows.get(s.seq_id) for s in seqs], counts, histories,
                               engram_rows.hasher if engram_rows is not None else None, prev_sampled)
    engram = engram_rows.rows(token_ids, counts, histories) if engram_rows is not None else {}
    step = HostStep(token_ids=token_ids, positions=plan.positions.astype(np.int64), num_scheduled=counts,
                    start_pos=plan.start_pos.astype(np.int64), table_rows=plan.table_rows,
                    table_diffs=dict(plan.table_diffs), max_blocks=dict(plan.max_blocks),
                    slot_mapping=dict(plan.slot_mappings), state_rows=plan.state_rows,
                    logits_rows=np.array(sorted(set(rows)), dtype=np.int64), engram_rows=engram)
    now = time.time()
    for seq, hit in zip(seqs, plan.prefix_hit_tokens.tolist()):
        if not seq.scheduled:  # the hit of the first admission (vLLM): a preempted sequence that is
            seq.num_cached_tokens, seq.scheduled = int(hit), True  # re-admitted hits its own pages
            seq.first_scheduled_time = now
    return step, sample_rows, prompt_rows, pending
