//! Host shared-memory collectives for v41's tensor-parallel ranks (one process per GPU or CPU rank
//! on one host): a segment with per-rank lanes, epoch barriers, all-reduce of float32 and bfloat16,
//! all-gather and broadcast of bytes. The byte all-gather plus [`Communicator::barrier`] also carry the
//! CUDA IPC-handle exchange and the flags of the paired PCIe pull all-reduce (Python side).
//!
//! Guarantees:
//! - **Deterministic all-reduce.** Element `i` of the result is the float32 sum of the ranks'
//!   elements `i` in rank order 0, 1, …, W−1 (bfloat16: rounded once at the end, nearest even). Every
//!   rank holds identical bytes, and the result does not depend on `lane_bytes` (the chunking).
//! - **Never a hang.** Every collective has a sequence number and a deadline. A rank that died
//!   (including a zombie) or closed yields [`CommError::RankDied`] / [`CommError::RankLeft`] naming
//!   it; a rank that is alive but late yields [`CommError::Timeout`] listing the lagging ranks:
//!   `all_reduce #17: rank 1 (pid 4242) died`,
//!   `all_reduce #17: timed out after 5.0 s waiting for rank(s) [1] (alive but lagging)`.
//! - **Checked calls.** The first round of every collective compares (operation, seq, length, root)
//!   across ranks; a disagreement is a [`CommError::Mismatch`] naming the other rank.
//!
//! Modules: `segment` (file, mapping, header; the crate's `unsafe`), `wait` (barrier, backoff,
//! deadline, liveness), `collectives` ([`Communicator`]), `meta` (per-call
//! agreement check), `reduce` (fixed-order sums, bfloat16).
//! Segment layout, tests and bench: see `README.md` in this crate.

mod collectives;
mod error;
mod meta;
mod reduce;
mod segment;
mod wait;

pub use collectives::Communicator;
pub use error::{CommError, Result};
pub use reduce::{bf16_to_f32, f32_to_bf16};
pub use segment::{LANE_ALIGN, MAX_LANE_BYTES, MAX_WORLD_SIZE};

#[cfg(test)]
mod proptests;
#[cfg(test)]
mod tests;
