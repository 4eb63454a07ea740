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
    """Blocks (rows) with at least one holder: requests and/or the prefix cache."""
    cached: int
    """Of ``used``, blocks held only by the prefix cache (evictable); ``used - cached`` are held by requests."""
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
    table_rows: npt.NDArray[np.int32]
    """[R] int32: each request's row of the caller's persistent block tables (one [max_num_seqs, width] table
    per kind; the row is the request's while it runs)."""
    table_diffs: dict[str, npt.NDArray[np.int32]]
    """kind name -> [3, D] int32 (row, logical block, physical block) of the entries that changed since each
    row was last sent: new blocks, released window blocks (-1), pages switched to their prefix-cache copies, a
    newly admitted request's whole table plus -1 over the previous occupant's tail. Logical block b covers
    positions [b*B, (b+1)*B); -1 = released (behind the sliding window) or not taken."""
    max_blocks: dict[str, int]
    """kind name -> the longest block table among scheduled requests: after applying every step's diff in
    order, ``table[table_rows, :max_blocks]`` is this step's padded block table (-1 beyond each length)."""
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
    ``{"name": "swa" | "dspark" | "ckv{r}" | "idx{r}", "tokens_per_block": B, "tokens_per_entry": r,
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
    def set_last_token(self, request_id: int, token: int) -> bool:
        """Replace the last committed token (an async-scheduling placeholder reported to
        ``update_from_output`` before the sampled id was known; the step planned right after it feeds it as
        an input) with ``token``, before the ``step`` after that one.
        False when the request has finished or was aborted. Raises ``ValueError`` when it has no output
        token or the token was already offered to the prefix cache."""
    def stats(self) -> _SchedulerStats:
        """Occupancy per pool, queue lengths, prefix-cache counters (tokens), preemptions."""
    def reset_prefix_cache(self) -> int:
        """Evict every unlocked prefix-cache page; returns the number of pages evicted."""
    def check_invariants(self) -> None:
        """Check internal consistency (O(blocks)); raises ``RuntimeError`` on a violation. For tests."""

# --- host collectives (crate v41-comm; bindings in crates/v41-py/src/comm.rs) -----------------------

class CommError(RuntimeError):
    """A host collective failed. The message names the operation, its sequence number and the rank(s):

    - ``"all_reduce #17: rank 1 (pid 4242) died"`` (process gone, or a zombie),
    - ``"all_reduce #17: rank 1 (pid 4242) left"`` (it closed, or gave up after its own error),
    - ``"all_reduce #17: timed out after 5.0 s waiting for rank(s) [1] (alive but lagging)"``,
    - ``"join #0: timed out after 60.0 s waiting for rank(s) [2] (not joined)"``,
    - ``"barrier #3: rank 1 disagrees: it is in broadcast #3 (root 0, 12 bytes), this rank in barrier #3"``,
    - a segment made for another ``world_size``/``lane_bytes``, or a call after ``close()`` or after an error.

    After any ``CommError`` from a collective the communicator is unusable (later calls raise again) and
    counts as departed for its peers.
    """

@final
class HostComm:
    """One rank of a host shared-memory communicator: W processes on one host map one segment file and
    run collectives through it. Every rank must call the same collectives in the same order.

    ``all_reduce`` is deterministic: element ``i`` is the float32 sum of the ranks' elements ``i`` in
    rank order 0, 1, …, W−1 (bfloat16: rounded once at the end, to nearest even), so every rank holds
    identical bytes and the result does not depend on ``lane_bytes``.

    ``timeout_s`` of a call: omitted → the communicator's ``timeout_s``; ``None`` → wait forever (an
    idle worker waiting for the next step); seconds otherwise. Dead or departed ranks are detected
    within about 1 ms whatever the timeout. Every waiting call releases the GIL.
    """

    def __init__(
        self,
        path: str,
        rank: int,
        world_size: int,
        lane_bytes: int = 1 << 20,
        timeout_s: float | None = 60.0,
    ) -> None:
        """Join the segment at ``path`` (e.g. ``/dev/shm/v41-<job>``; unique per job) as ``rank``.

        Rank 0 creates the file (replacing a stale one) and removes the name once all ranks joined;
        the others wait for it. Returns after every rank joined. ``lane_bytes`` (a positive multiple of
        64) is the most one rank moves per round: messages are chunked into rounds of that size.
        1 MiB keeps a round's working set in cache (16 MB messages: 4.8 ms with 1 MiB lanes vs 8.3 ms in
        one 16 MiB round, W=2, noisy 2-core VM; crates/v41-comm/README.md); the file takes
        ``segment_bytes(world_size, lane_bytes)`` bytes.

        Raises ``CommError`` (missing rank past ``timeout_s``, mismatched segment), ``ValueError``
        (``rank``/``world_size``/``lane_bytes`` out of range), ``OSError`` (cannot create or map the
        file, e.g. ``ENOSPC`` on a full /dev/shm: fall back to a file-backed path).
        """
    @staticmethod
    def segment_bytes(world_size: int, lane_bytes: int) -> int:
        """Bytes of the segment file: one 4 KiB header page + ``(2·world_size + 2) · lane_bytes``."""
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def lane_bytes(self) -> int: ...
    @property
    def seq(self) -> int:
        """Collectives started so far (the join is #0; the next call is ``seq + 1``)."""
    @property
    def path(self) -> str:
        """The path joined at (rank 0 removes the file name once every rank joined)."""
    @property
    def timeout_s(self) -> float | None:
        """Default deadline of a collective, in seconds (``None``: forever)."""
    def all_reduce(
        self,
        buf: npt.NDArray[np.float32] | npt.NDArray[np.int16] | npt.NDArray[np.uint16],
        dtype: Literal["float32", "bfloat16"],
        timeout_s: float | None = ...,
    ) -> None:
        """Sum ``buf`` over ranks, in place. ``buf``: ``[N]``, C-contiguous, writable, equal ``N`` on every
        rank; float32 for ``dtype="float32"``, int16 or uint16 bfloat16 bit patterns for
        ``dtype="bfloat16"`` (torch: ``t.view(torch.int16).numpy()`` shares ``t``'s memory).

        Raises ``ValueError`` (dtype, shape, layout), ``CommError`` (dead/departed/lagging rank, or ranks
        that disagree on the operation or ``N``).
        """
    def all_gather(
        self,
        inp: npt.NDArray[np.uint8],
        out: npt.NDArray[np.uint8],
        timeout_s: float | None = ...,
    ) -> None:
        """``out[r·n:(r+1)·n]`` = rank r's ``inp``. ``inp``: ``[n]`` uint8 (equal ``n`` on every rank), ``out``:
        ``[world_size·n]`` uint8, writable; both C-contiguous. Used to exchange CUDA IPC handles.
        Raises ``ValueError`` / ``CommError`` as ``all_reduce``."""
    def broadcast(self, data: bytes | None, root: int = 0, timeout_s: float | None = ...) -> bytes:
        """Send ``data`` (any length, including empty) from ``root`` to every rank: the root passes the
        bytes and gets the same object back, the others pass ``None`` and get the message.
        Raises ``ValueError`` (root passes ``None``, a non-root passes bytes, root out of range),
        ``CommError`` as ``all_reduce`` (a dead root is detected even with ``timeout_s=None``)."""
    def barrier(self, timeout_s: float | None = ...) -> None:
        """Return once every rank reached this barrier (also the flag barrier of the PCIe pull
        all-reduce). Raises ``CommError``."""
    def close(self) -> None:
        """Mark this rank departed (peers waiting for it get ``CommError`` "... left"); later calls raise
        ``CommError``. Also done on garbage collection and by ``with HostComm(...) as comm:``."""
    def __enter__(self) -> HostComm: ...
    def __exit__(self, *exc: object) -> None: ...

# --- Engram offload paging (crate v41-engram; bindings in crates/v41-py/src/engram.rs) --------------------------

@final
class EngramHasher:
    """Token ids of a step → Engram table rows of every layer (docs/model.md §3.3; docs/engram.md §2).

    ``token_map``: int64 ``[len(tokenizer)]`` compressed id per token id, each < ``compressed_vocab_size``;
    ``layers``: ``(layer id, multipliers [max_ngram_size])`` per Engram layer, in ``engram_layer_ids`` order (the
    primes are derived here, as §3.3's rule). Raises ``ValueError`` for inconsistent parameters."""

    def __init__(
        self,
        token_map: npt.NDArray[np.int64],
        compressed_vocab_size: int,
        pad_token_id: int,
        max_ngram_size: int,
        n_heads: int,
        engram_vocab_size: int,
        layers: Sequence[tuple[int, Sequence[int]]],
    ) -> None: ...
    @property
    def columns(self) -> int:
        """Hash columns per layer, ``(max_ngram_size − 1)·n_heads``."""
    @property
    def layer_ids(self) -> list[int]: ...
    def primes(self, index: int) -> list[int]:
        """Bucket primes of the layer at ``index`` (construction order). ``ValueError`` out of range."""
    def table_rows(self, index: int) -> int:
        """Rows of that layer's table (the sum of its primes)."""
    def hash_step(
        self,
        token_ids: npt.NDArray[np.int64],
        counts: npt.NDArray[np.int64],
        history: npt.NDArray[np.int64],
        dead: npt.NDArray[np.bool_] | None = None,
    ) -> npt.NDArray[np.int64]:
        """``int64 [layers, T, columns]`` rows of one step. ``token_ids [T]``: requests' runs concatenated;
        ``counts [R]``; ``history [R·(max_ngram_size − 1)]``: per request the committed ids before its run, oldest
        first, −1 = before the sequence start, −2 = a dead (image) token; ``dead [T]``: dead tokens of the runs.
        Releases the GIL. Raises ``ValueError`` (lengths, an id outside the token map); nothing is returned then."""

@final
class EngramSlotCache:
    """The device row cache of one Engram layer on one rank (docs/engram.md §4): ``hot_rows`` cached slots
    (8-way set-associative CLOCK; above 8 rounded down to whole sets), then ``staging_rows`` per-step slots.
    Raises ``ValueError`` for a table of 2^40 rows or more, or more than 2^32 slots."""

    def __init__(self, hot_rows: int, staging_rows: int, table_rows: int) -> None: ...
    @property
    def hot_rows(self) -> int: ...
    @property
    def staging_rows(self) -> int: ...
    def plan(
        self, step: int, rows: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """``(slots [N], copy_rows [M], copy_slots [M])`` for ``rows [N]`` (each in ``[0, table_rows)``): the slot
        of every lookup and the distinct misses to copy in; pins the step's slots until :meth:`release`. Releases
        the GIL. Raises ``ValueError``: a row out of range, a step still in flight, no free slot for a miss (the
        cache is then as before)."""
    def release(self, step: int) -> None:
        """The step's forward has read its slots: unpin them. ``ValueError`` for a step not in flight."""
    def slot_of(self, row: int) -> int | None:
        """The hot slot holding ``row``, or None."""
    def stats(self) -> dict[str, int]:
        """Cumulative ``lookups`` (distinct rows per step), ``hits``, ``misses`` (hits + misses = lookups),
        ``evictions``, ``staged`` (misses placed in staging slots)."""
