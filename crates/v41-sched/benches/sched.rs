//! Criterion benches of the control plane (targets on a 2-core CI VM: a 1,024-request decode step
//! under 100 µs, a 128k-token prefix match under 1 ms). Results: `benches/RESULTS.md`.
//!
//! Layout: V4.1-like kinds `swa` (window 128), `ckv2`, `ckv1`, `idx2`, `idx1`, page 64 tokens, plus
//! `cstate` rows.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use v41_sched::block_pool::BlockPool;
use v41_sched::radix::RadixCache;
use v41_sched::{
    CacheKind, Layout, NewRequest, RequestOutput, Scheduler, SchedulerConfig, StateKind, StepOutput,
};

const PAGE: u32 = 64;

fn layout(num_blocks: u32) -> Layout {
    let kind = |name: &str, r, w| CacheKind {
        name: name.into(),
        tokens_per_block: PAGE,
        tokens_per_entry: r,
        window_tokens: w,
        num_blocks,
    };
    let kinds = vec![
        kind("swa", 1, Some(128)),
        kind("ckv2", 2, None),
        kind("ckv1", 1, None),
        kind("idx2", 2, None),
        kind("idx1", 1, None),
    ];
    Layout::new(
        kinds,
        Some(StateKind {
            name: "cstate".into(),
            state_rows: 2048,
        }),
    )
    .unwrap()
}

fn tokens(n: usize, seed: u64) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 128_000) as u32
        })
        .collect()
}

/// Samples one token for every request that asked for it.
fn report(s: &mut Scheduler, out: &StepOutput) {
    let outputs: Vec<RequestOutput> = (0..out.num_reqs())
        .filter(|&i| out.do_sample[i])
        .map(|i| RequestOutput {
            id: out.req_ids[i],
            sampled: vec![7],
            ..Default::default()
        })
        .collect();
    s.update_from_output(&outputs).unwrap();
}

/// 1,024 running requests decoding at `context` tokens, plus 64 waiting (blocked by max_num_seqs).
/// Pools hold twice the footprint, except `swa` when `swa_blocks_per_request` is given (the
/// sliding-window ring plus slack, so the prefix cache's window blocks must be trimmed under pressure).
fn decode_scheduler(context: usize, swa_blocks_per_request: Option<u32>) -> Scheduler {
    let config = SchedulerConfig {
        max_num_batched_tokens: 16_384,
        max_num_seqs: 1024,
        max_model_len: 131_072,
        long_prefill_token_threshold: None,
        enable_prefix_caching: true,
    };
    let blocks = 2 * 1088 * (context as u32 / PAGE + 2);
    let mut kinds = layout(blocks).kinds().to_vec();
    if let Some(per_request) = swa_blocks_per_request {
        kinds[0].num_blocks = 1088 * per_request;
    }
    let state = layout(blocks).state().cloned();
    let mut s = Scheduler::new(Layout::new(kinds, state).unwrap(), config).unwrap();
    for id in 0..1024 {
        let new = NewRequest {
            id,
            prompt: tokens(context, id),
            max_tokens: 4096,
            priority: 0,
            cache_salt: None,
            lookahead: 0,
        };
        s.add_request(new).unwrap();
    }
    while s.stats().num_running < 1024 || s.request(1023).unwrap().num_computed < context {
        let out = s.step();
        report(&mut s, &out);
    }
    for _ in 0..3 {
        let out = s.step();
        report(&mut s, &out);
    }
    for id in 1024..1088 {
        let new = NewRequest {
            id,
            prompt: tokens(512, id),
            max_tokens: 64,
            priority: 0,
            cache_salt: None,
            lookahead: 0,
        };
        s.add_request(new).unwrap();
    }
    s
}

/// A decode workload kept near its configured context: rebuilt from scratch (not cloned, so its
/// vectors have their natural spare capacity) every 256 steps; page crossings, with their block
/// allocations and prefix-cache insertions, are part of the measured steps.
struct SteadyDecode {
    context: usize,
    swa_blocks_per_request: Option<u32>,
    sched: Scheduler,
    out: StepOutput,
    steps: u32,
}

impl SteadyDecode {
    fn new(context: usize, swa_blocks_per_request: Option<u32>) -> Self {
        let sched = decode_scheduler(context, swa_blocks_per_request);
        let out = StepOutput::default();
        Self {
            context,
            swa_blocks_per_request,
            sched,
            out,
            steps: 0,
        }
    }

    /// Times `iters` steps (`step_into` with a reused output), optionally with their updates.
    fn run(&mut self, iters: u64, with_update: bool) -> Duration {
        let mut total = Duration::ZERO;
        for _ in 0..iters {
            if self.steps == 256 {
                self.sched = decode_scheduler(self.context, self.swa_blocks_per_request);
                self.steps = 0;
            }
            let start = Instant::now();
            self.sched.step_into(&mut self.out);
            if with_update {
                report(&mut self.sched, &self.out);
            }
            total += start.elapsed();
            if !with_update {
                report(&mut self.sched, &self.out);
            }
            self.steps += 1;
        }
        total
    }
}

fn bench_decode_step(c: &mut Criterion) {
    let mut g = c.benchmark_group("schedule_step");
    g.sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    let cases = [
        (1024usize, None, "ctx1024"),
        (4096, None, "ctx4096"),
        (1024, Some(8), "ctx1024_swa_pool_8_per_req"),
    ];
    for (context, swa, name) in cases {
        let mut steady = SteadyDecode::new(context, swa);
        let out = steady.sched.clone().step();
        assert_eq!((out.num_reqs(), out.num_tokens()), (1024, 1024));
        g.bench_function(format!("decode_1024_running_64_waiting_{name}"), |b| {
            b.iter_custom(|iters| steady.run(iters, false))
        });
        if swa.is_none() {
            g.bench_function(format!("decode_1024_step_and_update_{name}"), |b| {
                b.iter_custom(|iters| steady.run(iters, true))
            });
        }
    }
    g.finish();
}

/// A tree holding 8 × 128k = 1M tokens (5 kinds), with every cached path locked so that
/// `clear()` only removes what a bench inserted.
fn radix_with_1m_tokens() -> (RadixCache, Vec<BlockPool>, Vec<Vec<u32>>) {
    let layout = layout(24_000);
    let mut tree = RadixCache::new(&layout);
    let mut pools: Vec<BlockPool> = layout
        .kinds()
        .iter()
        .map(|k| BlockPool::new(k.num_blocks))
        .collect();
    let mut seqs = Vec::new();
    for seed in 0..8 {
        let seq = tokens(131_072, 100 + seed);
        let mut tables = fresh_tables(&mut pools, 131_072 / PAGE);
        tree.insert(None, &seq, &mut tables, &mut pools, None);
        release(&tables, &mut pools);
        let mut probe = seq.clone();
        probe.push(1);
        let hit = tree.match_prefix(None, &probe);
        assert_eq!(hit.hit_tokens, 131_072);
        tree.lock(hit.last_node.unwrap());
        seqs.push(seq);
    }
    (tree, pools, seqs)
}

fn fresh_tables(pools: &mut [BlockPool], pages: u32) -> Vec<Vec<i32>> {
    pools
        .iter_mut()
        .map(|p| {
            let mut t = Vec::new();
            p.allocate(pages, &mut t).unwrap();
            t
        })
        .collect()
}

fn release(tables: &[Vec<i32>], pools: &mut [BlockPool]) {
    for (k, t) in tables.iter().enumerate() {
        for &b in t {
            pools[k].decref(b);
        }
    }
}

fn bench_radix(c: &mut Criterion) {
    let (mut tree, mut pools, seqs) = radix_with_1m_tokens();
    let mut g = c.benchmark_group("radix_1m_cached");
    g.sample_size(30)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    g.throughput(Throughput::Elements(131_072));
    let mut probe = seqs[3].clone();
    probe.push(5);
    g.bench_function("match_128k_full_hit", |b| {
        b.iter(|| black_box(tree.match_prefix(None, black_box(&probe))))
    });
    let miss = tokens(131_073, 999);
    g.bench_function("match_128k_miss", |b| {
        b.iter(|| black_box(tree.match_prefix(None, black_box(&miss))))
    });
    let new_seq = tokens(131_072, 4242);
    g.bench_function("insert_128k_new", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let mut tables = fresh_tables(&mut pools, 131_072 / PAGE);
                let start = Instant::now();
                black_box(tree.insert(None, &new_seq, &mut tables, &mut pools, None));
                total += start.elapsed();
                release(&tables, &mut pools);
                tree.clear(&mut pools);
            }
            total
        })
    });
    g.bench_function("insert_128k_already_cached", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let mut tables = fresh_tables(&mut pools, 131_072 / PAGE);
                let start = Instant::now();
                let out = tree.insert(None, &seqs[5], &mut tables, &mut pools, None);
                total += start.elapsed();
                assert_eq!(out.already_cached_tokens, 131_072);
                release(&tables, &mut pools);
            }
            total
        })
    });
    g.finish();
}

fn bench_block_pool(c: &mut Criterion) {
    let mut g = c.benchmark_group("block_pool");
    g.sample_size(30)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    let mut pool = BlockPool::new(100_000);
    let mut held = Vec::with_capacity(64);
    g.throughput(Throughput::Elements(64));
    g.bench_function("alloc_free_64", |b| {
        b.iter(|| {
            held.clear();
            pool.allocate(64, &mut held).unwrap();
            for &blk in &held {
                pool.decref(blk);
            }
        })
    });
    g.throughput(Throughput::Elements(1));
    g.bench_function("alloc_one_free_one", |b| {
        b.iter(|| {
            let blk = pool.allocate_one().unwrap();
            pool.decref(black_box(blk as i32));
        })
    });
    g.finish();
}

criterion_group!(benches, bench_decode_step, bench_radix, bench_block_pool);
criterion_main!(benches);
