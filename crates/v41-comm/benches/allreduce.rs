//! Host all-reduce throughput (float32, ranks as threads, each with its own mapping of a segment in
//! /dev/shm) at 2 and 4 ranks for 64 KB, 1 MB and 16 MB messages, against a single-thread memcpy of
//! the same bytes. Throughput counts the message bytes once (what one rank hands to all_reduce).
//! Lanes are 1 MiB (the Python default: a round's working set stays in cache); 16 MB messages are
//! also measured with 4 MiB lanes (W = 2, 4) and 16 MiB lanes (W = 2, one round), to show what that changes.
//!
//! Run: `cargo bench -p v41-comm --bench allreduce`. To carry it to another machine:
//! `cargo bench -p v41-comm --no-run` prints `target/release/deps/allreduce-<hash>`; copy that file
//! and run it with `--bench` (criterion filters work: `--bench allreduce_f32/16MB`). After criterion,
//! it prints one summary line per case: `allreduce W=2 16MB: X GB/s (memcpy Y GB/s, Z%)`.

use std::hint::black_box;
use std::path::PathBuf;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use v41_comm::Communicator;

const LANE_DEFAULT: usize = 1 << 20;
const SIZES: [(usize, &str); 3] = [(64 << 10, "64KB"), (1 << 20, "1MB"), (16 << 20, "16MB")];
/// (world size, lane bytes); cases with lanes larger than 1 MiB only run the largest message.
const CASES: [(usize, usize); 5] = [
    (2, 1 << 20),
    (4, 1 << 20),
    (2, 4 << 20),
    (4, 4 << 20),
    (2, 16 << 20),
];

/// Rank 0 runs in the calling thread; ranks 1.. are threads that run `iters` all-reduces of `len`
/// floats on command.
struct Ranks {
    comm: Communicator,
    buf: Vec<f32>,
    cmds: Vec<mpsc::Sender<(usize, u64)>>,
    workers: Vec<JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl Ranks {
    fn new(world: usize, lane_bytes: usize) -> Self {
        let dir = if std::path::Path::new("/dev/shm").is_dir() {
            tempfile::tempdir_in("/dev/shm").unwrap()
        } else {
            tempfile::tempdir().unwrap()
        };
        let path: PathBuf = dir.path().join("bench-seg");
        let timeout = Some(Duration::from_secs(60));
        let mut cmds = Vec::new();
        let mut workers = Vec::new();
        for rank in 1..world {
            let (tx, rx) = mpsc::channel::<(usize, u64)>();
            let path = path.clone();
            cmds.push(tx);
            workers.push(std::thread::spawn(move || {
                let mut comm = Communicator::join(&path, rank, world, lane_bytes, timeout).unwrap();
                let mut buf = Vec::new();
                while let Ok((len, iters)) = rx.recv() {
                    buf.resize(len, 0.0f32);
                    for _ in 0..iters {
                        comm.all_reduce_f32(&mut buf, None).unwrap();
                    }
                }
            }));
        }
        let comm = Communicator::join(&path, 0, world, lane_bytes, timeout).unwrap();
        Self {
            comm,
            buf: Vec::new(),
            cmds,
            workers,
            _dir: dir,
        }
    }

    fn name(&self) -> String {
        match self.comm.lane_bytes() {
            LANE_DEFAULT => format!("W={}", self.comm.world_size()),
            lane => format!("W={} lane={}MB", self.comm.world_size(), lane >> 20),
        }
    }

    /// Time `iters` all-reduces of `bytes` as seen by rank 0.
    fn run(&mut self, bytes: usize, iters: u64) -> Duration {
        let len = bytes / 4;
        self.buf.resize(len, 0.0);
        for tx in &self.cmds {
            tx.send((len, iters)).unwrap();
        }
        let start = Instant::now();
        for _ in 0..iters {
            self.comm
                .all_reduce_f32(black_box(&mut self.buf), None)
                .unwrap();
        }
        start.elapsed()
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        self.cmds.clear();
        for w in self.workers.drain(..) {
            w.join().unwrap();
        }
    }
}

fn memcpy(bytes: usize, iters: u64) -> Duration {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let start = Instant::now();
    for _ in 0..iters {
        dst.copy_from_slice(black_box(&src));
        black_box(&mut dst);
    }
    start.elapsed()
}

fn bench(c: &mut Criterion, ranks: &mut [Ranks]) {
    for (bytes, name) in SIZES {
        let mut group = c.benchmark_group(format!("allreduce_f32/{name}"));
        group.throughput(Throughput::Bytes(bytes as u64));
        group
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(2));
        if bytes >= 1 << 20 {
            group.sample_size(10);
        }
        for r in ranks
            .iter_mut()
            .filter(|r| r.comm.lane_bytes() <= bytes.max(LANE_DEFAULT))
        {
            group.bench_function(r.name(), |b| b.iter_custom(|iters| r.run(bytes, iters)));
        }
        group.bench_function("memcpy", |b| b.iter_custom(|iters| memcpy(bytes, iters)));
        group.finish();
    }
}

/// GB/s of `f`: the median of 5 timings of about 0.1 s each (after one warm-up call), so a burst
/// of other load on the machine does not set the figure.
fn rate(bytes: usize, mut f: impl FnMut(u64) -> Duration) -> f64 {
    f(1);
    let iters = ((100 << 20) / bytes).clamp(2, 10_000) as u64;
    let mut rates: Vec<f64> = (0..5)
        .map(|_| bytes as f64 * iters as f64 / f(iters).as_secs_f64() / 1e9)
        .collect();
    rates.sort_by(f64::total_cmp);
    rates[2]
}

fn summary(ranks: &mut [Ranks]) {
    for (bytes, name) in SIZES {
        let copy = rate(bytes, |n| memcpy(bytes, n));
        for r in ranks
            .iter_mut()
            .filter(|r| r.comm.lane_bytes() <= bytes.max(LANE_DEFAULT))
        {
            let gbs = rate(bytes, |n| r.run(bytes, n));
            println!(
                "allreduce {} {name}: {gbs:.2} GB/s (memcpy {copy:.2} GB/s, {:.0}%)",
                r.name(),
                100.0 * gbs / copy
            );
        }
    }
}

fn main() {
    let mut ranks: Vec<Ranks> = CASES
        .into_iter()
        .map(|(w, lane)| Ranks::new(w, lane))
        .collect();
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c, &mut ranks);
    c.final_summary();
    // Criterion runs each bench once in test mode (`cargo test --benches`); the summary is for real runs.
    if std::env::args().any(|a| a == "--bench") {
        summary(&mut ranks);
    }
}
