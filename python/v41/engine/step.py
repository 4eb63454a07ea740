"""Step metadata: one flattened, variable-length batch (prefill chunks and decodes mixed) as the model
runner consumes it. Built once per step from the scheduler's plan; immutable."""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class StepBatch:
    """Requests r = 0..R−1 contribute contiguous token runs; T tokens in all.

    token_ids: [T] int64; positions: [T] int64 absolute positions; req_index: [T] int64 request of each token;
    starts: R tuples (first token row, token count, first position); block_tables: kind → [R, max_blocks]
    int64 (−1 = none); slot_mapping: kind → [T] int64 slot written by each token (−1 = the token writes no
    row of that kind); state_rows: [R] int64 compressor-state row of each request (−1 = none);
    engram_history: R lists of the ≤ 3 committed token ids before each run; logits_rows: [N] int64 token
    rows whose logits the step returns.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    req_index: torch.Tensor
    starts: tuple[tuple[int, int, int], ...]
    block_tables: dict[str, torch.Tensor]
    slot_mapping: dict[str, torch.Tensor]
    state_rows: torch.Tensor
    engram_history: tuple[tuple[int, ...], ...]
    logits_rows: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())

    @property
    def num_requests(self) -> int:
        return len(self.starts)


def slots_for_tokens(block_table: torch.Tensor, req_index: torch.Tensor, positions: torch.Tensor,
                     block_tokens: int, tokens_per_entry: int) -> torch.Tensor:
    """Slot written by each token of a kind with ``tokens_per_entry`` r: the entry ``p // r`` closed by
    position p when ``(p + 1) % r == 0``, else −1. block_table [R, B]; req_index, positions [T]."""
    from ..kernels.paged import block_slots

    rows_per_block = block_tokens // tokens_per_entry
    entry = torch.where((positions + 1) % tokens_per_entry == 0, positions // tokens_per_entry,
                        torch.full_like(positions, -1))
    return block_slots(block_table[req_index], entry[:, None], rows_per_block)[:, 0]


# -- wire format (rank 0 → the other tensor-parallel ranks) ---------------------------------------------------
def _pack_tensor(t: torch.Tensor) -> list:
    a = t.detach().cpu().contiguous()
    return [str(a.dtype).removeprefix("torch."), list(a.shape), a.numpy().tobytes()]


def _unpack_tensor(v: list, device: torch.device | str) -> torch.Tensor:
    dtype, shape, raw = v
    arr = np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape)
    return torch.from_numpy(arr.copy()).to(device)


def encode_step(batch: StepBatch) -> bytes:
    """One StepBatch → msgpack bytes: every tensor as (dtype name, shape, raw little-endian bytes), never a
    pickle. Only int64 tensors occur (ids, positions, tables, slots)."""
    return msgpack.packb({
        "token_ids": _pack_tensor(batch.token_ids), "positions": _pack_tensor(batch.positions),
        "req_index": _pack_tensor(batch.req_index), "starts": [list(s) for s in batch.starts],
        "block_tables": {k: _pack_tensor(v) for k, v in batch.block_tables.items()},
        "slot_mapping": {k: _pack_tensor(v) for k, v in batch.slot_mapping.items()},
        "state_rows": _pack_tensor(batch.state_rows),
        "engram_history": [list(h) for h in batch.engram_history],
        "logits_rows": _pack_tensor(batch.logits_rows)}, use_bin_type=True)


def decode_step(data: bytes, device: torch.device | str) -> StepBatch:
    """Inverse of :func:`encode_step`, tensors placed on ``device``. Raises ValueError for malformed bytes."""
    try:
        d = msgpack.unpackb(data, raw=False)
        return StepBatch(
            token_ids=_unpack_tensor(d["token_ids"], device), positions=_unpack_tensor(d["positions"], device),
            req_index=_unpack_tensor(d["req_index"], device),
            starts=tuple(tuple(int(x) for x in s) for s in d["starts"]),
            block_tables={k: _unpack_tensor(v, device) for k, v in d["block_tables"].items()},
            slot_mapping={k: _unpack_tensor(v, device) for k, v in d["slot_mapping"].items()},
            state_rows=_unpack_tensor(d["state_rows"], device),
            engram_history=tuple(tuple(int(x) for x in h) for h in d["engram_history"]),
            logits_rows=_unpack_tensor(d["logits_rows"], device))
    except (KeyError, TypeError, ValueError, msgpack.UnpackException) as e:
        raise ValueError(f"malformed step message ({e})") from None
