"""Type stubs for ``v41._native``, the Rust extension module (crate ``v41-py``)."""

from collections.abc import Mapping, Sequence
from typing import Literal, TypedDict, final

import numpy as np
import numpy.typing as npt

__version__: str
"""Version of the Rust crate; equals ``v41.__version__``."""

def build_info() -> dict[str, str]:
    """Return how this extension was built.

    Keys: ``version``, ``profile`` (``debug``/``release``), ``target`` (target triple),
    ``rustc`` (``rustc --version`` or ``unknown``), ``git_commit`` (hash or ``unknown``).
    """

# --- scheduler (crate v41-sched; bindings in crates/v41-py/src/sched.rs) ---------------------------

class _PoolStats(TypedDict):
    used: int
    free: int
    total: int

class _SchedulerStats(TypedDict):
    running: int
    waiting: int
    blocks: dict[str, _PoolStats]
    """Per kind name (token-indexed kinds, then ``cstate`` rows if present)."""
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefix_hit_rate: float
    prefix_cached_pages: int
    num_preemptions: int

@final
class StepOutput:
    """The plan of one step. ``R`` = scheduled requests, ``T`` = scheduled tokens (requests'
    tokens concatenated in ``req_ids`` order). Arrays own their memory (moved from Rust)."""

    req_ids: npt.NDArray[np.uint64]
    """[R] request ids."""
    num_scheduled: npt.NDArray[np.uint32]
    """[R] tokens scheduled per request; sums to T."""
    start_pos: npt.NDArray[np.uint32]
    """[R] position of each request's first scheduled token (its computed tokens before the step)."""
    num_draft_tokens: npt.NDArray[np.uint32]
    """[R] how many of the scheduled tokens are speculative drafts (at the end of the chunk)."""
    is_prefill: npt.NDArray[np.bool_]
    """[R] the chunk starts before the last committed token (prompt/recompute work); else decode."""
    do_sample: npt.NDArray[np.bool_]
    """[R] the chunk reaches the last committed token: sample ``1 + accepted`` tokens and report them
    with ``update_from_output``. False for a partial prefill chunk."""
    prefix_hit_tokens: npt.NDArray[np.uint32]
    """[R] tokens reused from the prefix cache by requests admitted in this step, else 0."""
    token_ids: npt.NDArray[np.uint32]
    """[T] token ids."""
    positions: npt.NDArray[np.uint32]
    """[T] positions."""
    state_rows: npt.NDArray[np.int32]
    """[R] ``cstate`` row per request, -1 if the layout has no state kind."""
    block_tables: dict[str, npt.NDArray[np.int32]]
    """kind name -> [R, max_blocks] int32: logical block (positions [b*B, (b+1)*B)) -> physical block;
    -1 = released (behind the sliding window), not taken, or padding."""
    slot_mappings: dict[str, npt.NDArray[np.int32]]
    """kind name -> [T] int32: slot written by each token, in entries of that kind
    (``block * entries_per_block + entry % entries_per_block``); -1 if the token closes no entry."""
    preempted: list[int]
    """Requests preempted in this step (not in ``req_ids``; they recompute later)."""
    finished: list[tuple[int, Literal["length", "stop", "abort"]]]
    """Requests that ended since the previous step."""
    num_reqs: int
    num_tokens: int

class Scheduler:
    """Request scheduler with KV block pools per cache kind and a radix prefix cache.

    ``layout``: one dict per cache kind, in the order used for block tables:
    ``{"name": "swa" | "ckv{r}" | "idx{r}", "tokens_per_block": B, "tokens_per_entry": r,
    "window_tokens": W | None, "num_blocks": N}`` (all kinds share ``B``, the prefix-cache page), plus
    optionally ``{"name": "cstate", "state_rows": rows}`` (one row per running request).

    Raises ``ValueError`` for an invalid layout or config.
    """

    def __init__(
        self,
        layout: Sequence[Mapping[str, object]],
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        long_prefill_token_threshold: int | None = None,
        enable_prefix_caching: bool = True,
    ) -> None: ...
    @property
    def kind_names(self) -> list[str]:
        """Token-indexed kind names, in layout order."""
    def add_request(
        self,
        request_id: int,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        priority: int = 0,
        cache_salt: str | None = None,
        lookahead: int = 0,
    ) -> None:
        """Queue a request (lower ``priority`` = more important; ``lookahead`` = max draft tokens).

        Raises ``ValueError`` naming the limit for a duplicate id, empty prompt, ``max_tokens < 1``,
        ``prompt + max_tokens > max_model_len``, or a request that can never fit a pool.
        """
    def abort_request(self, request_id: int) -> None:
        """Abort in any state; frees everything. Raises ``KeyError`` for unknown or ended ids."""
    def finish_request(self, request_id: int) -> None:
        """End a request decided by Python (EOS, stop string); computed pages stay cached.
        Raises ``KeyError`` for unknown or ended ids."""
    def __contains__(self, request_id: int) -> bool:
        """Whether the request is waiting or running."""
    def step(self) -> StepOutput:
        """Plan one step (releases the GIL while planning)."""
    def update_from_output(
        self,
        req_ids: Sequence[int],
        sampled: Sequence[Sequence[int]],
        accepted: Sequence[int] | None = None,
        drafts: Sequence[Sequence[int] | None] | None = None,
    ) -> None:
        """Report the last step: per request the committed tokens (accepted drafts then the sampled
        token; empty for a partial prefill), the number of accepted drafts, and the next drafts.
        Ids no longer running are ignored. Raises ``ValueError`` if an entry contradicts the plan."""
    def stats(self) -> _SchedulerStats:
        """Occupancy per pool, queue lengths, prefix-cache counters (tokens), preemptions."""
    def reset_prefix_cache(self) -> int:
        """Evict every unlocked prefix-cache page; returns the number of pages evicted."""
    def check_invariants(self) -> None:
        """Check internal consistency (O(blocks)); raises ``RuntimeError`` on a violation. For tests."""
