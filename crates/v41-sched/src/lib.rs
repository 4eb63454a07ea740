//! `v41-sched`: the control plane of every engine step, in pure Rust (no Python).
//!
//! - [`layout`]: the cache kinds (`swa`, `ckv{r}`, `idx{r}`, `cstate`) and how positions map to
//!   blocks and entries;
//! - [`block_pool`]: one reference-counted pool per kind;
//! - [`request`]: per-request tokens, status and block tables;
//! - [`radix`]: the prefix cache (pages of `tokens_per_block` tokens, namespaced by cache salt);
//! - [`scheduler`], [`step`], [`update`]: the step rule — computed tokens catch up with known tokens,
//!   under one token budget, with chunked prefill, speculative drafts and preemption.
//!
//! See `docs/cache.md` and `docs/model.md` §6 for the cache kinds. The Python bindings live
//! in `crates/v41-py/src/sched.rs`.

#![warn(missing_docs)]

pub mod block_pool;
pub mod error;
mod geometry;
mod invariants;
mod kv_alloc;
pub mod layout;
pub mod radix;
pub mod request;
pub mod scheduler;
pub mod step;
pub mod update;

#[cfg(test)]
mod proptests;
#[cfg(test)]
mod tests;

pub use error::SchedError;
pub use layout::{CacheKind, Layout, StateKind};
pub use request::{FinishReason, Request, RequestStatus};
pub use scheduler::{NewRequest, PoolStats, Scheduler, SchedulerConfig, SchedulerStats};
pub use step::{KindStep, StepOutput};
pub use update::RequestOutput;
