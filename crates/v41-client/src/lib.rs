//! Rust client of the v41 engine's gRPC API (`proto/v41/v1/engine.proto`) and a load generator.
//!
//! - [`pb`]: the generated messages and `EngineClient` (tonic-prost-build, see `build.rs`).
//! - [`client::Client`]: connect, one-shot and streaming `Generate`, model info, loads.
//! - [`bench`]: `v41-client bench`, the seed document's method (warm-ups excluded, several measured
//!   batches; cold prefill, warm-prefix decode in the full-concurrency window, TTFT p50/p95).
//! - [`stats`]: percentiles and the full-concurrency decode window, unit-tested here.

pub mod bench;
pub mod client;
pub mod error;
pub mod stats;

/// Generated from `proto/v41/v1/engine.proto` (package `v41.v1`); never edited by hand.
pub mod pb {
    tonic::include_proto!("v41.v1");
}

pub use client::Client;
pub use error::ClientError;
