"""What the engine hands a model each step, and what a step model provides (docs/architecture.md §2, §3a).

A :class:`StepBatch` is one flattened, variable-length step: requests r = 0..R−1 contribute contiguous token
runs (prefill chunks and decodes mixed), T tokens in all. Its tensors live on the model's device; the engine
builds them once per step from the scheduler's plan (``v41.engine.input_buffers``), as views of persistent
buffers. A model must not read anything back to the host while it runs a batch (docs/architecture.md §3a): the host-side
fields below are fixed per batch shape, so a decode batch can be captured in a CUDA graph and replayed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from ..cache.layout import CacheLayout
from ..config import ModelConfig


@dataclass(frozen=True, slots=True)
class StepBatch:
    """One step (module docstring). Device tensors:

    token_ids [T] int64; positions [T] int64 absolute positions; req_index [T] int64 request row of each token;
    seq_lens [R] int64 tokens of each request cached after this step (first position + count);
    block_tables: kind → [R, B] int64 physical block of each logical block (−1 = none); slot_mapping: kind →
    [T] int64 slot written by each token (−1 = the token writes no row of that kind); state_rows [R] int64
    compressor-state row of each request; engram_rows: Engram layer id → [T, cols] int64 table rows of each
    token (hashed on the host from committed ids, docs/model.md §3.3); logits_rows [N] int64 rows whose
    logits the step returns; segments: compression ratio r → [S, L] int64 token rows of each (request, window of
    r positions) run in this step, in position order, −1 = padding (the compressors pool over them);
    engram_copies: Engram offload with the fill inside the forward (``transfer`` uva) → [2, M] int64 per layer:
    host-table rows (row 0) to copy into device slots (row 1, −1 = padding) before the layer reads
    ``engram_rows`` (then slot ids), docs/engram.md §5.

    Host fields: max_seq_len ≥ every seq_len (bounds per-request scratch such as indexer scores; a captured
    graph uses the engine's max_model_len); starts: per request (first token row, token count, first position),
    for the eager parity bridge only (None in captured graphs).
    """

    token_ids: Tensor
    positions: Tensor
    req_index: Tensor
    seq_lens: Tensor
    block_tables: dict[str, Tensor]
    slot_mapping: dict[str, Tensor]
    state_rows: Tensor
    engram_rows: dict[int, Tensor]
    logits_rows: Tensor
    segments: dict[int, Tensor]
    max_seq_len: int
    starts: tuple[tuple[int, int, int], ...] | None = None
    engram_copies: dict[int, Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_requests(self) -> int:
        return int(self.seq_lens.shape[0])


class StepModel(Protocol):
    """A model the engine can run: the fast model (``models/fast``) or the paged bridge (``models/paged``).

    ``cache_layout(block_tokens)`` says which cache kinds (and row shapes) it needs; ``segment_ratios`` which
    compressor ratios' :attr:`StepBatch.segments` it reads; ``init_cache`` allocates
    them (``num_blocks`` blocks per kind plus any reserved padding block, ``num_state_rows`` state rows plus a
    padding row); ``forward(batch)`` returns float32 logits [N, vocab] for ``batch.logits_rows`` and, with
    ``return_aux``, also the DSpark aux hidden states [T, n_targets·D] (None without DSpark targets).
    """

    cfg: ModelConfig
    segment_ratios: list[int]

    def cache_layout(self, block_tokens: int | None = None) -> CacheLayout: ...

    def init_cache(self, num_blocks: int, num_state_rows: int, block_tokens: int) -> None: ...

    def forward(self, batch: StepBatch, return_aux: bool = False): ...
