//! Per-request state owned by the scheduler.
//!
//! Token positions: the committed tokens `token_ids = prompt ++ output` occupy positions
//! `0..committed_len()`; the speculative `draft` follows at `committed_len()..known_len()`.
//! `num_computed` counts positions whose KV has been (or, for the step just planned, is being) written;
//! it catches up with `known_len()` — one rule for prefill, decode and speculation. It may exceed
//! `committed_len()` only by draft tokens scheduled in the last step, until `update_from_output`
//! rolls back the rejected ones.
//!
//! Block tables: `block_tables[k][b]` is the physical block of kind `k` for logical block `b`
//! (positions `[b·B, (b+1)·B)`), one pool reference each; `-1` = released (sliding-window blocks
//! behind the window) or never taken (prefix-hit pages behind the window). Entries
//! `released_blocks[k]..len` of a windowed kind are all `>= 0`.

use crate::radix::InsertCursor;

/// Lifecycle of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RequestStatus {
    /// Queued, never scheduled.
    Waiting,
    /// Admitted: holds blocks and (if the layout has one) a state row.
    Running,
    /// Evicted to free blocks; back in the waiting queue, will recompute from position 0.
    Preempted,
    /// Ended normally (length or stop).
    Finished,
    /// Ended by `abort_request`.
    Aborted,
}

/// Why a request ended; reported once in the next `StepOutput`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// `output` reached `max_tokens`.
    Length,
    /// Python decided to stop (EOS, stop string, ...) through `finish_request`.
    Stop,
    /// `abort_request` (client gone, ...).
    Abort,
}

impl FinishReason {
    /// Lower-case name used on the Python side: `length`, `stop` or `abort`.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Abort => "abort",
        }
    }
}

/// A generation request and its cache bookkeeping.
#[derive(Debug, Clone)]
pub struct Request {
    /// Caller-chosen unique id.
    pub id: u64,
    /// Committed tokens: the prompt followed by the sampled output.
    pub token_ids: Vec<u32>,
    /// Number of prompt tokens at the start of `token_ids`.
    pub num_prompt_tokens: usize,
    /// Speculative lookahead tokens after the last committed token (at most `lookahead`).
    pub draft: Vec<u32>,
    /// Positions whose KV is written (see module docs).
    pub num_computed: usize,
    /// Lifecycle state.
    pub status: RequestStatus,
    /// Lower = more important (vLLM convention).
    pub priority: i32,
    /// Admission order (monotonic counter); ties in priority go to the earlier arrival.
    pub arrival: u64,
    /// Prefix-cache namespace; requests only share cache with the same salt.
    pub cache_salt: Option<String>,
    /// Output budget in tokens; the request finishes with `Length` when reached.
    pub max_tokens: u32,
    /// Maximum draft tokens per step (speculative decoding); 0 = none.
    pub lookahead: u32,
    /// Per token-indexed kind: logical block → physical block, `-1` = none (see module docs).
    pub block_tables: Vec<Vec<i32>>,
    /// Per kind: table entries below this index have been released (windowed kinds only).
    pub released_blocks: Vec<u32>,
    /// State row (`cstate`) while running.
    pub state_row: Option<u32>,
    /// Row of the persistent block tables while running (see [`crate::step`]).
    pub table_row: Option<u32>,
    /// Per kind: entries `0..table_synced[k]` of `table_row` already hold this table (as emitted by
    /// earlier steps' diffs) except window releases since (`table_released_sent`); any other change
    /// below marks it down, a growing table stays above it.
    pub(crate) table_synced: Vec<u32>,
    /// Per kind: `released_blocks[k]` as of the last diff; entries released since (below
    /// `table_synced`) are sent as `-1` by the next one.
    pub(crate) table_released_sent: Vec<u32>,
    /// Tokens reused from the prefix cache at the latest admission.
    pub prefix_hit_tokens: u32,
    /// Times this request was preempted.
    pub num_preemptions: u32,
    /// Deepest radix node locked by this request: the end of its prefix hit, then of the pages it
    /// published (the lock covers the path from the root).
    pub(crate) prefix_lock: Option<u32>,
    /// Full pages already offered to the prefix cache.
    pub(crate) cached_pages: u32,
    /// Where the last insertion ended (lets the next one skip the walk from the root).
    pub(crate) insert_cursor: Option<InsertCursor>,
    /// Positions `< alloc_tokens` have blocks in every kind (fast path of allocation).
    pub(crate) alloc_tokens: usize,
    /// Tokens scheduled by the last step (0 if not scheduled).
    pub(crate) scheduled_tokens: u32,
    /// Of those, draft tokens.
    pub(crate) scheduled_drafts: u32,
}

impl Request {
    /// A new waiting request; validation is the scheduler's job.
    pub fn new(id: u64, prompt: Vec<u32>, max_tokens: u32, priority: i32, arrival: u64) -> Self {
        Self {
            id,
            num_prompt_tokens: prompt.len(),
            token_ids: prompt,
            draft: Vec::new(),
            num_computed: 0,
            status: RequestStatus::Waiting,
            priority,
            arrival,
            cache_salt: None,
            max_tokens,
            lookahead: 0,
            block_tables: Vec::new(),
            released_blocks: Vec::new(),
            state_row: None,
            table_row: None,
            table_synced: Vec::new(),
            table_released_sent: Vec::new(),
            prefix_hit_tokens: 0,
            num_preemptions: 0,
            prefix_lock: None,
            cached_pages: 0,
            insert_cursor: None,
            alloc_tokens: 0,
            scheduled_tokens: 0,
            scheduled_drafts: 0,
        }
    }

    /// The prompt tokens.
    pub fn prompt(&self) -> &[u32] {
        &self.token_ids[..self.num_prompt_tokens]
    }

    /// The committed output tokens.
    pub fn output(&self) -> &[u32] {
        &self.token_ids[self.num_prompt_tokens..]
    }

    /// Committed tokens (prompt + output).
    #[inline]
    pub fn committed_len(&self) -> usize {
        self.token_ids.len()
    }

    /// Known tokens: prompt + output + draft.
    #[inline]
    pub fn known_len(&self) -> usize {
        self.token_ids.len() + self.draft.len()
    }

    /// Token at `pos < known_len()`.
    #[inline]
    pub fn token_at(&self, pos: usize) -> u32 {
        match self.token_ids.get(pos) {
            Some(&t) => t,
            None => self.draft[pos - self.token_ids.len()],
        }
    }

    /// Decode: only the last committed token (plus drafts) is left to compute.
    #[inline]
    pub fn is_decode(&self) -> bool {
        self.num_computed + 1 >= self.committed_len()
    }

    /// Number of draft tokens worth keeping: at most `lookahead`, and none that would only produce
    /// tokens beyond `max_tokens`.
    pub fn draft_limit(&self) -> usize {
        let left = (self.max_tokens as usize).saturating_sub(self.output().len());
        (self.lookahead as usize).min(left.saturating_sub(1))
    }
}
