//! The errors of `v41-comm`. Every collective error names the operation and its sequence number
//! (`all_reduce #17`), and the rank(s) at fault, so a log line says who to look at.

use std::path::PathBuf;
use std::time::Duration;

/// Result of a `v41-comm` call.
pub type Result<T, E = CommError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// A rank's process no longer exists (or is a zombie) while we wait for it.
    #[error("{op} #{seq}: rank {rank} (pid {pid}) died")]
    RankDied {
        op: &'static str,
        seq: u64,
        rank: usize,
        pid: u32,
    },
    /// A rank closed its communicator (or it failed and gave up) while we wait for it.
    #[error("{op} #{seq}: rank {rank} (pid {pid}) left")]
    RankLeft {
        op: &'static str,
        seq: u64,
        rank: usize,
        pid: u32,
    },
    /// The deadline passed (`waited`: the caller's timeout); `lagging` are the ranks that had not
    /// arrived (all alive).
    #[error(
        "{op} #{seq}: timed out after {secs:.1} s waiting for rank(s) {lagging:?} ({why})",
        secs = .waited.as_secs_f64(),
        why = if *.op == "join" { "not joined" } else { "alive but lagging" }
    )]
    Timeout {
        op: &'static str,
        seq: u64,
        waited: Duration,
        lagging: Vec<usize>,
    },
    /// Ranks called different collectives, or the same one with different sizes or roots.
    #[error("{op} #{seq}: rank {rank} disagrees: {detail}")]
    Mismatch {
        op: &'static str,
        seq: u64,
        rank: usize,
        detail: String,
    },
    /// The segment file exists but was made for another world size, lane size or version.
    #[error("segment {}: {detail}", .path.display())]
    Header { path: PathBuf, detail: String },
    /// Creating, sizing or mapping the segment file failed (ENOSPC on /dev/shm lands here).
    #[error("segment {}: {source}", .path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Bad arguments from the caller (rank out of range, lengths that do not match, ...).
    #[error("{0}")]
    InvalidArgument(String),
    /// A collective failed earlier; peers may be mid-operation, so the communicator is unusable.
    #[error("communicator unusable after an earlier error: {0}")]
    Poisoned(String),
    /// `close()` was called.
    #[error("communicator is closed")]
    Closed,
}
