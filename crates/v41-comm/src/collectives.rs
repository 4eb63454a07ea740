//! [`Communicator`]: one rank's handle on a segment, and the collectives.
//!
//! Every rank calls the same collectives in the same order. Each collective gets the next sequence
//! number (`seq`, 1-based; the join is #0) and a deadline, and is a series of *rounds*:
//!
//! | collective | one round (per chunk of at most `lane_bytes`)                                    |
//! |------------|-------------------------------------------------------------------------------------|
//! | all_reduce | copy chunk → own lane · barrier · reduce own piece of every lane → result · barrier · copy result → buffer |
//! | all_gather | copy chunk → own lane · barrier · copy every lane → output                          |
//! | broadcast  | root copies chunk → its lane · barrier · others copy root's lane                    |
//! | barrier    | barrier                                                                             |
//!
//! In its first round every rank also publishes `(op, seq, len, root)` and checks its peers' after the
//! barrier, so ranks that disagree get a `Mismatch` error instead of exchanging garbage.
//!
//! **Why two buffers (parity).** Round `k` uses the regions of parity `k mod 2`. A rank finishes all
//! reads of round `k` before it arrives at the first barrier of round `k + 1`, and it writes the
//! regions of parity `k mod 2` again only in round `k + 2`, after passing that barrier, i.e. after
//! every rank finished reading round `k`. So a region is never written while someone reads it, with a
//! single barrier per all-gather/broadcast round and two per all-reduce round (the second separates
//! the owners' writes of `result` from everyone's reads of it). With one set of buffers, a fast rank
//! could overwrite its lane for round `k + 1` while a slow rank still copies round `k` out of it; a
//! third barrier per round would be needed.
//!
//! Errors: a collective that fails (timeout, dead peer, mismatch) leaves peers mid-protocol, so the
//! communicator is poisoned and marks itself departed; peers waiting for it fail fast with "left".

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::error::{CommError, Result};
use crate::meta::{check_peers, Kind, NO_LEN};
use crate::reduce::{sum_bf16, sum_f32};
use crate::segment::{Elem, Layout, Meta, Segment};
use crate::wait::{self, Op};

enum State {
    Ready,
    Poisoned(String),
    Closed,
}

/// One rank of a shared-memory communicator. Dropping it closes it.
pub struct Communicator {
    seg: Segment,
    rank: usize,
    /// Barriers passed (the join barrier is epoch 1).
    epoch: u64,
    /// Rounds done; the next round uses parity `round % 2`.
    round: u64,
    /// Collectives started (the join is #0).
    seq: u64,
    state: State,
}

impl Communicator {
    /// Join the segment at `path` as `rank` of `world_size`. Rank 0 creates the file (replacing an
    /// old one); the others wait for it. Returns once every rank has joined; rank 0 then removes the
    /// file name (the mapping lives on, so a crash leaves nothing behind in `/dev/shm`).
    ///
    /// `lane_bytes` (a positive multiple of 64) bounds the chunk of a message moved per round; the
    /// segment takes `(2 · world_size + 2) · lane_bytes` plus a page ([`Communicator::segment_bytes`]).
    /// `timeout: None` waits forever (dead ranks are still detected once they joined).
    pub fn join(
        path: impl AsRef<Path>,
        rank: usize,
        world_size: usize,
        lane_bytes: usize,
        timeout: Option<Duration>,
    ) -> Result<Self> {
        let path = path.as_ref();
        let layout = Layout::new(world_size, lane_bytes)?;
        if rank >= world_size {
            return Err(CommError::InvalidArgument(format!(
                "rank {rank} out of range for world_size {world_size}"
            )));
        }
        let op = Op::new(Kind::Join.name(), 0, timeout);
        let seg = if rank == 0 {
            Segment::create(path, layout)?
        } else {
            loop {
                if let Some(seg) = Segment::try_open(path, layout)? {
                    break seg;
                }
                if op.deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                    return Err(op.timeout(vec![0]));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        if rank != 0 {
            // Rank 0's pid is written by `Segment::create`, before the header is published.
            let pid = u64::from(std::process::id());
            let claim = seg
                .pid(rank)
                .compare_exchange(0, pid, Ordering::AcqRel, Ordering::Acquire);
            if let Err(other) = claim {
                return Err(CommError::Header {
                    path: path.to_owned(),
                    detail: format!("rank {rank} was already joined by pid {other}"),
                });
            }
        }
        let mut comm = Self {
            seg,
            rank,
            epoch: 0,
            round: 0,
            seq: 0,
            state: State::Ready,
        };
        let joined = comm.meta_round(Kind::Join, &op);
        if rank == 0 {
            comm.seg.unlink();
        }
        if let Err(e) = &joined {
            comm.fail(e);
        }
        joined.map(|()| comm)
    }

    /// Bytes of the segment file for `world_size` ranks and `lane_bytes` per lane.
    pub fn segment_bytes(world_size: usize, lane_bytes: usize) -> Result<usize> {
        Ok(Layout::new(world_size, lane_bytes)?.total_bytes)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.seg.layout.world_size
    }

    pub fn lane_bytes(&self) -> usize {
        self.seg.layout.lane_bytes
    }

    /// Collectives started so far (the next one is `seq() + 1`).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The path the segment was joined at (rank 0 removes the name once all ranks joined).
    pub fn path(&self) -> &Path {
        self.seg.path()
    }

    /// Wait until every rank reaches this barrier.
    pub fn barrier(&mut self, timeout: Option<Duration>) -> Result<()> {
        self.collective(Kind::Barrier, timeout, |c, op| {
            c.meta_round(Kind::Barrier, op)
        })
    }

    /// In-place sum over ranks of float32 `buf` (equal length on every rank), accumulated in rank
    /// order; every rank ends with identical bytes.
    pub fn all_reduce_f32(&mut self, buf: &mut [f32], timeout: Option<Duration>) -> Result<()> {
        self.all_reduce(Kind::AllReduceF32, buf, sum_f32, timeout)
    }

    /// In-place sum over ranks of bfloat16 bit patterns: float32 accumulation in rank order, one
    /// round-to-nearest-even at the end.
    pub fn all_reduce_bf16(&mut self, buf: &mut [u16], timeout: Option<Duration>) -> Result<()> {
        self.all_reduce(Kind::AllReduceBf16, buf, sum_bf16, timeout)
    }

    /// `output[r·n .. (r+1)·n]` = rank r's `input` (`n` bytes, equal on every rank).
    pub fn all_gather_bytes(
        &mut self,
        input: &[u8],
        output: &mut [u8],
        timeout: Option<Duration>,
    ) -> Result<()> {
        let (n, world) = (input.len(), self.world_size());
        if output.len() != world * n {
            return Err(CommError::InvalidArgument(format!(
                "all_gather: output has {} bytes, expected world_size × input = {world} × {n}",
                output.len()
            )));
        }
        let lane = self.lane_bytes();
        self.collective(Kind::AllGather, timeout, |c, op| {
            let meta = Meta {
                op: Kind::AllGather as u64,
                seq: op.seq,
                len: n as u64,
                root: 0,
            };
            for i in 0..n.div_ceil(lane).max(1) {
                let (start, end) = (i * lane, ((i + 1) * lane).min(n));
                let p = c.begin_round(i == 0, meta);
                // SAFETY: own lane of parity p; see the module doc (parity).
                unsafe { c.seg.lane_mut(c.rank, p, 0..end - start) }
                    .copy_from_slice(&input[start..end]);
                c.sync(op)?;
                if i == 0 {
                    check_peers(&c.seg, c.rank, p, meta, op)?;
                }
                for r in 0..world {
                    let dst = &mut output[r * n + start..r * n + end];
                    if r == c.rank {
                        dst.copy_from_slice(&input[start..end]);
                    } else {
                        // SAFETY: read after the barrier that follows rank r's write.
                        dst.copy_from_slice(unsafe { c.seg.lane(r, p, 0..end - start) });
                    }
                }
            }
            Ok(())
        })
    }

    /// Broadcast `data` (any length) from this rank; the others call [`Self::broadcast_recv`].
    pub fn broadcast_send(&mut self, data: &[u8], timeout: Option<Duration>) -> Result<()> {
        self.broadcast(self.rank, Some(data), timeout).map(drop)
    }

    /// Receive the message broadcast by `root`. With `timeout: None` this is how an idle worker
    /// waits for the next step (it still notices a dead or departed root).
    pub fn broadcast_recv(&mut self, root: usize, timeout: Option<Duration>) -> Result<Vec<u8>> {
        if root == self.rank {
            return Err(CommError::InvalidArgument(format!(
                "broadcast: rank {root} is the root; it sends with broadcast_send"
            )));
        }
        Ok(self.broadcast(root, None, timeout)?.unwrap_or_default())
    }

    /// Mark this rank departed: peers waiting for it get `RankLeft`. Later calls return `Closed`.
    pub fn close(&mut self) {
        if !matches!(self.state, State::Closed) {
            self.seg.departed(self.rank).store(1, Ordering::Release);
            self.state = State::Closed;
        }
    }

    fn all_reduce<T: Elem>(
        &mut self,
        kind: Kind,
        buf: &mut [T],
        sum: fn(&[&[T]], &mut [T]),
        timeout: Option<Duration>,
    ) -> Result<()> {
        let chunk = self.lane_bytes() / std::mem::size_of::<T>();
        let (len, world) = (buf.len(), self.world_size());
        self.collective(kind, timeout, |c, op| {
            let meta = Meta {
                op: kind as u64,
                seq: op.seq,
                len: len as u64,
                root: 0,
            };
            for (i, piece) in pieces_mut(buf, chunk).enumerate() {
                let n = piece.len();
                let p = c.begin_round(i == 0, meta);
                // SAFETY: own lane of parity p; see the module doc (parity).
                unsafe { c.seg.lane_mut(c.rank, p, 0..n) }.copy_from_slice(piece);
                c.sync(op)?;
                if i == 0 {
                    check_peers(&c.seg, c.rank, p, meta, op)?;
                }
                let own = owned_range(n, world, c.rank);
                let seg = &c.seg;
                // SAFETY: lanes are read after the barrier that follows their writes; the owned
                // piece of `result` is disjoint from every other rank's and read only after the
                // next barrier.
                let inputs: Vec<&[T]> = (0..world)
                    .map(|r| unsafe { seg.lane(r, p, own.clone()) })
                    .collect();
                sum(&inputs, unsafe { seg.result_mut(p, own) });
                c.sync(op)?;
                // SAFETY: every owner wrote its piece before the barrier just passed.
                piece.copy_from_slice(unsafe { c.seg.result(p, 0..n) });
            }
            Ok(())
        })
    }

    /// Root passes `Some(data)` and gets `None` back; receivers get the message.
    fn broadcast(
        &mut self,
        root: usize,
        data: Option<&[u8]>,
        timeout: Option<Duration>,
    ) -> Result<Option<Vec<u8>>> {
        if root >= self.world_size() {
            return Err(CommError::InvalidArgument(format!(
                "broadcast: root {root} out of range for world_size {}",
                self.world_size()
            )));
        }
        let lane = self.lane_bytes();
        self.collective(Kind::Broadcast, timeout, |c, op| {
            let len = data.map_or(NO_LEN, |d| d.len() as u64);
            let meta = Meta {
                op: Kind::Broadcast as u64,
                seq: op.seq,
                len,
                root: root as u64,
            };
            let mut received: Option<Vec<u8>> = None;
            let mut total = 0;
            let mut i = 0;
            loop {
                let p = c.begin_round(i == 0, meta);
                let start = i * lane;
                if let Some(data) = data {
                    let end = (start + lane).min(data.len());
                    // SAFETY: own lane of parity p; see the module doc (parity).
                    unsafe { c.seg.lane_mut(c.rank, p, 0..end - start) }
                        .copy_from_slice(&data[start..end]);
                }
                c.sync(op)?;
                if i == 0 {
                    check_peers(&c.seg, c.rank, p, meta, op)?;
                    total = usize::try_from(c.seg.read_meta(root, p).len).map_err(|_| {
                        CommError::InvalidArgument("broadcast: message larger than memory".into())
                    })?;
                    if data.is_none() {
                        received = Some(Vec::with_capacity(total));
                    }
                }
                let end = (start + lane).min(total);
                if let Some(out) = received.as_mut() {
                    // SAFETY: read after the barrier that follows the root's write.
                    out.extend_from_slice(unsafe { c.seg.lane(root, p, 0..end - start) });
                }
                i += 1;
                if i * lane >= total {
                    return Ok(received);
                }
            }
        })
    }

    /// Run `body` as the next collective; on error, poison and depart.
    fn collective<T>(
        &mut self,
        kind: Kind,
        timeout: Option<Duration>,
        body: impl FnOnce(&mut Self, &Op) -> Result<T>,
    ) -> Result<T> {
        match &self.state {
            State::Ready => {}
            State::Poisoned(first) => return Err(CommError::Poisoned(first.clone())),
            State::Closed => return Err(CommError::Closed),
        }
        self.seq += 1;
        let op = Op::new(kind.name(), self.seq, timeout);
        let out = body(self, &op);
        if let Err(e) = &out {
            self.fail(e);
        }
        out
    }

    fn fail(&mut self, err: &CommError) {
        self.seg.departed(self.rank).store(1, Ordering::Release);
        self.state = State::Poisoned(err.to_string());
    }

    /// Start a round: take its parity and, in a collective's first round, publish our meta.
    fn begin_round(&mut self, first: bool, meta: Meta) -> usize {
        let p = (self.round % 2) as usize;
        self.round += 1;
        if first {
            self.seg.write_meta(self.rank, p, meta);
        }
        p
    }

    fn sync(&mut self, op: &Op) -> Result<()> {
        self.epoch += 1;
        wait::barrier(&self.seg, self.rank, self.epoch, op)
    }

    /// A round with no data: meta, barrier, check (join and barrier).
    fn meta_round(&mut self, kind: Kind, op: &Op) -> Result<()> {
        let meta = Meta {
            op: kind as u64,
            seq: op.seq,
            len: 0,
            root: 0,
        };
        let p = self.begin_round(true, meta);
        self.sync(op)?;
        check_peers(&self.seg, self.rank, p, meta, op)
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        self.close();
    }
}

/// `buf` in pieces of at most `chunk` elements; an empty `buf` is one empty piece (every collective
/// has at least one round).
fn pieces_mut<T>(buf: &mut [T], chunk: usize) -> impl Iterator<Item = &mut [T]> {
    let empty = buf.is_empty();
    let (head, tail) = buf.split_at_mut(0);
    let first_empty = empty.then_some(head);
    first_empty.into_iter().chain(tail.chunks_mut(chunk))
}

/// Rank `rank`'s share of `n` elements: `world` contiguous pieces, sizes differing by at most one.
pub(crate) fn owned_range(n: usize, world: usize, rank: usize) -> std::ops::Range<usize> {
    (n * rank / world)..(n * (rank + 1) / world)
}
