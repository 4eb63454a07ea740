//! Engram offload paging of v41 (docs/model.md §3.3, docs/engram.md).
//!
//! * [`hasher`]: the rolling n-gram hashes of a whole step — token ids of every request (each with its
//!   committed lookback) → the table rows of every Engram layer, before the forward.
//! * [`cache`]: the hot-row cache of one layer's device slots (CLOCK, rows of in-flight steps pinned),
//!   giving per step the row → slot map and the copy list of misses.
//! * [`primes`]: the prime bucket sizes that define each layer's table.
//!
//! Pure Rust; the Python bindings live in `v41-py` (`v41._native.EngramHasher`, `EngramSlotCache`).

pub mod cache;
pub mod error;
pub mod hasher;
pub mod primes;

pub use cache::{CacheStats, SlotCache, StepPlan};
pub use error::EngramError;
pub use hasher::{HashParams, NgramHasher, HISTORY_DEAD, HISTORY_NONE};
pub use primes::{engram_offsets, engram_primes, is_prime};

#[cfg(test)]
mod proptests;
#[cfg(test)]
mod tests;
