//! Waiting for peers: epoch barriers with a spin → yield → sleep backoff, a deadline, and liveness
//! checks, so a dead or lagging rank becomes an error naming it instead of a hang.
//!
//! Cost: a barrier among ranks that are all present costs a few hundred ns (spinning on one cache
//! line per peer). A waiter that keeps waiting yields for the first millisecond, then sleeps in
//! steps of at most 50 µs; every millisecond it checks the ranks not yet arrived (departed flag,
//! `kill(pid, 0)`, zombie state).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::error::{CommError, Result};
use crate::segment::{pid_alive, Segment};

const SPIN_ITERS: u32 = 256;
const YIELD_FOR: Duration = Duration::from_millis(1);
const SLEEP_MAX: Duration = Duration::from_micros(50);
const CHECK_EVERY: Duration = Duration::from_millis(1);

/// One collective in flight: its name and sequence number (for messages) and its deadline.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Op {
    pub name: &'static str,
    pub seq: u64,
    pub start: Instant,
    /// The caller's timeout; `None`: wait forever (dead or departed ranks are still detected).
    pub limit: Option<Duration>,
    pub deadline: Option<Instant>,
}

impl Op {
    pub fn new(name: &'static str, seq: u64, timeout: Option<Duration>) -> Self {
        let start = Instant::now();
        Self {
            name,
            seq,
            start,
            limit: timeout,
            deadline: timeout.map(|t| start + t),
        }
    }

    /// The timeout error: it names the caller's timeout (not the time measured, which a loaded machine
    /// stretches past it), so the message is the same on every run.
    pub fn timeout(&self, lagging: Vec<usize>) -> CommError {
        CommError::Timeout {
            op: self.name,
            seq: self.seq,
            waited: self.limit.unwrap_or_else(|| self.start.elapsed()),
            lagging,
        }
    }
}

/// Announce that `me` reached barrier `epoch` (Release: publishes every earlier write to the
/// segment), then wait until every peer has reached it (Acquire: their writes become visible).
pub(crate) fn barrier(seg: &Segment, me: usize, epoch: u64, op: &Op) -> Result<()> {
    seg.arrive(me).store(epoch, Ordering::Release);
    let arrived = |r: usize| seg.arrive(r).load(Ordering::Acquire) >= epoch;
    let world = seg.layout.world_size;
    let pending = |out: &mut Vec<usize>| {
        out.clear();
        out.extend((0..world).filter(|&r| r != me && !arrived(r)));
    };
    let mut waiting = Vec::with_capacity(world);
    let mut spins = 0u32;
    // Spin first without reading the clock.
    loop {
        pending(&mut waiting);
        if waiting.is_empty() {
            return Ok(());
        }
        if spins == SPIN_ITERS {
            break;
        }
        spins += 1;
        std::hint::spin_loop();
    }
    let waited_from = Instant::now();
    let mut next_check = waited_from;
    let mut sleep = Duration::from_micros(1);
    loop {
        let now = Instant::now();
        if now >= next_check {
            check_peers(seg, &waiting, op, &arrived)?;
            if op.deadline.is_some_and(|d| now >= d) {
                pending(&mut waiting);
                if waiting.is_empty() {
                    return Ok(());
                }
                return Err(op.timeout(waiting));
            }
            next_check = now + CHECK_EVERY;
        }
        if now - waited_from < YIELD_FOR {
            std::thread::yield_now();
        } else {
            std::thread::sleep(sleep);
            sleep = (sleep * 2).min(SLEEP_MAX);
        }
        pending(&mut waiting);
        if waiting.is_empty() {
            return Ok(());
        }
    }
}

/// Error if one of `waiting` left or died without arriving.
fn check_peers(
    seg: &Segment,
    waiting: &[usize],
    op: &Op,
    arrived: &dyn Fn(usize) -> bool,
) -> Result<()> {
    for &rank in waiting {
        let pid = seg.pid(rank).load(Ordering::Relaxed) as u32;
        let left = seg.departed(rank).load(Ordering::Acquire) != 0;
        let died = !left && !pid_alive(pid);
        // A rank that arrives and then leaves or exits did its part: look again before blaming it.
        if (left || died) && !arrived(rank) {
            let (name, seq) = (op.name, op.seq);
            return Err(if left {
                CommError::RankLeft {
                    op: name,
                    seq,
                    rank,
                    pid,
                }
            } else {
                CommError::RankDied {
                    op: name,
                    seq,
                    rank,
                    pid,
                }
            });
        }
    }
    Ok(())
}
