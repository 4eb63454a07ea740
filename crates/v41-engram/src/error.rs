//! Errors of `v41-engram`: bad input from the caller (hash parameters, token ids, step shapes, cache
//! sizes). A broken internal invariant (a slot owned twice) is a bug and panics instead.

use thiserror::Error;

/// Everything the hasher and the slot cache reject; messages name the violated limit so the Python
/// layer can surface them unchanged (`ValueError` in `v41._native`).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum EngramError {
    /// Inconsistent hash parameters (sizes, multipliers, token map).
    #[error("invalid Engram hash parameters: {0}")]
    InvalidParams(String),
    /// A token id outside the compressed token map.
    #[error("token id {token} is outside the Engram token map [0, {vocab})")]
    TokenOutOfRange {
        /// The offending id.
        token: i64,
        /// Size of the token map (the tokenizer's length).
        vocab: usize,
    },
    /// Step arrays whose lengths disagree (counts vs tokens, history rows vs requests, output size).
    #[error("invalid Engram step: {0}")]
    InvalidStep(String),
    /// A row id outside the layer's table.
    #[error("Engram row {row} is outside the table [0, {rows})")]
    RowOutOfRange {
        /// The offending row id.
        row: i64,
        /// Rows of the table.
        rows: u64,
    },
    /// A step needs more slots than the cache and its staging area hold.
    #[error("Engram step needs {needed} slots for its missing rows, only {free} are free (hot {hot}, staging {staging})")]
    NoFreeSlots {
        /// Missing rows of the step.
        needed: usize,
        /// Slots that could take them.
        free: usize,
        /// Cached slots.
        hot: usize,
        /// Per-step staging slots.
        staging: usize,
    },
    /// `release` of a step that was never planned, or released twice.
    #[error("Engram step {0} is not in flight")]
    UnknownStep(u64),
    /// `plan` with a step id that is still in flight.
    #[error("Engram step {0} is already in flight")]
    DuplicateStep(u64),
}
