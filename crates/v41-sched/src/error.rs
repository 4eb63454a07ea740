//! Errors of `v41-sched`: bad input from the caller (layout, config, requests, step results).
//!
//! A broken internal invariant (for example a block reference count going below zero) is a bug and
//! panics instead; see the module docs of [`crate::block_pool`] and [`crate::radix`].

use thiserror::Error;

/// Everything the scheduler can reject. Messages name the violated limit so that the Python layer
/// can surface them unchanged (`ValueError` / `KeyError` in `v41._native`).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SchedError {
    /// The cache layout is inconsistent (names, block sizes, ratios, windows, pool sizes).
    #[error("invalid cache layout: {0}")]
    InvalidLayout(String),
    /// The scheduler configuration is inconsistent (a zero limit, ...).
    #[error("invalid scheduler config: {0}")]
    InvalidConfig(String),
    /// `add_request` with an id that is still waiting or running.
    #[error("request {id} already exists")]
    DuplicateRequest {
        /// The offending request id.
        id: u64,
    },
    /// An id that was never added, or that already finished or was aborted.
    #[error("unknown request {id} (never added, or already finished or aborted)")]
    UnknownRequest {
        /// The offending request id.
        id: u64,
    },
    /// The request itself is malformed (empty prompt, `max_tokens == 0`, ...).
    #[error("request {id}: {reason}")]
    InvalidRequest {
        /// The offending request id.
        id: u64,
        /// What is wrong.
        reason: String,
    },
    /// `prompt + max_tokens` exceeds `max_model_len`.
    #[error(
        "request {id}: prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds \
         max_model_len ({max_model_len})"
    )]
    ExceedsMaxModelLen {
        /// The offending request id.
        id: u64,
        /// Prompt length in tokens.
        prompt_tokens: usize,
        /// Requested output budget in tokens.
        max_tokens: u32,
        /// The configured limit in tokens.
        max_model_len: u32,
    },
    /// The request could never fit in one pool, even with every other block free.
    #[error(
        "request {id}: needs {needed_blocks} blocks of cache kind '{kind}' at once, \
         but the pool has num_blocks={num_blocks}"
    )]
    ExceedsPool {
        /// The offending request id.
        id: u64,
        /// Cache kind name (`swa`, `ckv2`, ...).
        kind: String,
        /// Blocks the request needs at its peak.
        needed_blocks: u64,
        /// Size of the pool.
        num_blocks: u32,
    },
    /// `update_from_output` got results that contradict the last step's plan.
    #[error("request {id}: invalid step output: {reason}")]
    InvalidOutput {
        /// The offending request id.
        id: u64,
        /// What is wrong.
        reason: String,
    },
}
