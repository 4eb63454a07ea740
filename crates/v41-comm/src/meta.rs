//! What every rank announces in the first round of a collective, `(op, seq, len, root)`, and the check
//! each rank makes of its peers' announcements after that round's barrier: ranks that call different
//! collectives, or the same one with other lengths or roots, get a `Mismatch` error naming the other
//! rank instead of exchanging garbage.

use crate::error::{CommError, Result};
use crate::segment::{Meta, Segment};
use crate::wait::Op;

/// The collective kinds, as published in the meta words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Join = 1,
    Barrier = 2,
    AllReduceF32 = 3,
    AllReduceBf16 = 4,
    AllGather = 5,
    Broadcast = 6,
}

/// Broadcast receivers do not know the length; they publish this instead.
pub(crate) const NO_LEN: u64 = u64::MAX;

impl Kind {
    const ALL: [Kind; 6] = [
        Kind::Join,
        Kind::Barrier,
        Kind::AllReduceF32,
        Kind::AllReduceBf16,
        Kind::AllGather,
        Kind::Broadcast,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Join => "join",
            Kind::Barrier => "barrier",
            Kind::AllReduceF32 | Kind::AllReduceBf16 => "all_reduce",
            Kind::AllGather => "all_gather",
            Kind::Broadcast => "broadcast",
        }
    }
}

/// `all_reduce #3 (float32, 1000 elements)`, for mismatch messages.
fn describe(meta: Meta) -> String {
    let Some(kind) = Kind::ALL.into_iter().find(|k| *k as u64 == meta.op) else {
        return format!("an unknown operation (code {})", meta.op);
    };
    let what = match kind {
        Kind::Join | Kind::Barrier => String::new(),
        Kind::AllReduceF32 => format!(" (float32, {} elements)", meta.len),
        Kind::AllReduceBf16 => format!(" (bfloat16, {} elements)", meta.len),
        Kind::AllGather => format!(" ({} bytes per rank)", meta.len),
        Kind::Broadcast if meta.len == NO_LEN => format!(" (receiving from root {})", meta.root),
        Kind::Broadcast => format!(" (root {}, {} bytes)", meta.root, meta.len),
    };
    format!("{} #{}{what}", kind.name(), meta.seq)
}

/// After the first barrier of a collective: every peer must be in the same one.
pub(crate) fn check_peers(
    seg: &Segment,
    me: usize,
    parity: usize,
    mine: Meta,
    op: &Op,
) -> Result<()> {
    let broadcast = mine.op == Kind::Broadcast as u64;
    for rank in (0..seg.layout.world_size).filter(|&r| r != me) {
        let theirs = seg.read_meta(rank, parity);
        let agree = theirs.op == mine.op
            && theirs.seq == mine.seq
            && theirs.root == mine.root
            && if broadcast {
                (rank as u64 == mine.root) == (theirs.len != NO_LEN)
            } else {
                theirs.len == mine.len
            };
        if !agree {
            return Err(CommError::Mismatch {
                op: op.name,
                seq: op.seq,
                rank,
                detail: format!(
                    "it is in {}, this rank in {}",
                    describe(theirs),
                    describe(mine)
                ),
            });
        }
    }
    Ok(())
}
