//! Criterion benches of Engram paging at V4.1-Flash sizes (layers 1 and 14, 4-grams, 8 heads: 48 hash
//! columns per token; tables of 384M rows). Targets: hashing ≥ 20M tokens/s per core; step planning for
//! 64 requests × 1 decode token and for a 4,096-token prefill chunk. Also prints the hot-row cache hit
//! rate under Zipf(s = 1) token traffic for several cache sizes. Results: `benches/RESULTS.md`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use v41_engram::{HashParams, NgramHasher, SlotCache};

const VOCAB: u64 = 129_280;
const COLS: usize = 24;

/// xorshift64*: a deterministic stream without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Flash hashing parameters with a stand-in token map (the real one needs the tokenizer; the hashing
/// cost does not depend on it).
fn flash() -> NgramHasher {
    NgramHasher::new(HashParams {
        token_map: (0..VOCAB).map(|i| ((i * 7919) % 99_092) as u32).collect(),
        compressed_vocab_size: 99_092,
        pad_token_id: 2,
        max_ngram: 4,
        n_heads: 8,
        engram_vocab_size: 16_000_000,
        layers: vec![
            (
                1,
                vec![
                    76632096046245,
                    4839876093313,
                    35959672319349,
                    73987337458391,
                ],
            ),
            (
                14,
                vec![
                    67716810739261,
                    51510806800915,
                    30921347202721,
                    82619226485591,
                ],
            ),
        ],
    })
    .unwrap()
}

/// Token ids drawn from Zipf(s = 1) over the vocabulary (inverse CDF by binary search).
struct Zipf(Vec<f64>);
impl Zipf {
    fn new(n: u64) -> Self {
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = (1..=n)
            .map(|k| {
                acc += 1.0 / k as f64;
                acc
            })
            .collect();
        cdf.iter_mut().for_each(|c| *c /= acc);
        Zipf(cdf)
    }
    fn sample(&self, rng: &mut Rng) -> i64 {
        let u = rng.uniform();
        self.0.partition_point(|&c| c < u).min(self.0.len() - 1) as i64
    }
}

/// One step's layer-1 rows: `requests` runs of `tokens` Zipf tokens each.
fn step_rows(
    h: &NgramHasher,
    zipf: &Zipf,
    rng: &mut Rng,
    requests: usize,
    tokens: usize,
) -> Vec<i64> {
    let toks: Vec<i64> = (0..requests * tokens).map(|_| zipf.sample(rng)).collect();
    let history: Vec<i64> = (0..requests * 3).map(|_| zipf.sample(rng)).collect();
    let mut out = vec![0; 2 * toks.len() * COLS];
    h.hash_step(
        &toks,
        &vec![tokens as i64; requests],
        &history,
        None,
        &mut out,
    )
    .unwrap();
    out.truncate(toks.len() * COLS);
    out
}

fn hashing(c: &mut Criterion) {
    let h = flash();
    let zipf = Zipf::new(VOCAB);
    let mut rng = Rng(7);
    let mut group = c.benchmark_group("hash");
    for (requests, tokens) in [(64usize, 1usize), (1, 4096)] {
        let toks: Vec<i64> = (0..requests * tokens)
            .map(|_| zipf.sample(&mut rng))
            .collect();
        let counts = vec![tokens as i64; requests];
        let history = vec![5; requests * 3];
        let mut out = vec![0; 2 * toks.len() * COLS];
        group.throughput(Throughput::Elements(toks.len() as u64));
        group.bench_function(format!("{requests}x{tokens}_tokens_48_columns"), |b| {
            b.iter(|| {
                h.hash_step(black_box(&toks), &counts, &history, None, &mut out)
                    .unwrap()
            })
        });
    }
    group.finish();
}

fn planning(c: &mut Criterion) {
    let h = flash();
    let zipf = Zipf::new(VOCAB);
    let mut rng = Rng(11);
    let mut group = c.benchmark_group("plan");
    for (requests, tokens) in [(64usize, 1usize), (1, 4096)] {
        let steps: Vec<Vec<i64>> = (0..64)
            .map(|_| step_rows(&h, &zipf, &mut rng, requests, tokens))
            .collect();
        let mut cache = SlotCache::new(4 << 20, 4096 * COLS, h.table_rows(0)).unwrap(); // the engine's default: 1 GiB
        let mut id = 0u64;
        group.throughput(Throughput::Elements((requests * tokens) as u64));
        group.bench_function(format!("{requests}x{tokens}_tokens_layer"), |b| {
            b.iter(|| {
                let plan = cache
                    .plan(id, black_box(&steps[id as usize % steps.len()]))
                    .unwrap();
                cache.release(id).unwrap();
                id += 1;
                plan.copy_rows.len()
            })
        });
    }
    group.finish();
}

/// Hit rate of layer 1's cache under Zipf(s = 1) tokens, batch 64 decode, after a warm-up.
fn print_hit_rates() {
    let h = flash();
    let zipf = Zipf::new(VOCAB);
    println!("engram hot-row cache, Zipf(s=1) tokens, 64 requests x 1 token per step, layer 1:");
    println!("{:>12} {:>10} {:>9}", "hot rows", "GiB@264B", "hit rate");
    for hot in [16_384usize, 65_536, 262_144, 1 << 20, 4 << 20] {
        let mut rng = Rng(3);
        let mut cache = SlotCache::new(hot, 64 * COLS, h.table_rows(0)).unwrap();
        let (warm, measured) = (2_000u64, 2_000u64);
        let mut at_warm = cache.stats();
        for step in 0..warm + measured {
            let rows = step_rows(&h, &zipf, &mut rng, 64, 1);
            cache.plan(step, &rows).unwrap();
            cache.release(step).unwrap();
            if step + 1 == warm {
                at_warm = cache.stats();
            }
        }
        let s = cache.stats();
        let rate = (s.hits - at_warm.hits) as f64 / (s.lookups - at_warm.lookups) as f64;
        println!(
            "{hot:>12} {:>10.3} {:>9.3}",
            hot as f64 * 264.0 / (1u64 << 30) as f64,
            rate
        );
    }
}

/// Hit rate when every hash column's rows follow Zipf(s = 1) themselves (the kernels notes' estimate: rank `k`
/// drawn as `⌊N^u⌋`, the continuous inverse CDF, then scattered over the column's bucket).
fn print_row_zipf_hit_rates() {
    let h = flash();
    println!("engram hot-row cache, rows Zipf(s=1) within each of the 24 columns, 64 lookups of 24 rows per step:");
    println!("{:>12} {:>10} {:>9}", "hot rows", "GiB@264B", "hit rate");
    let primes = h.primes(0).to_vec();
    let offsets: Vec<u64> = primes
        .iter()
        .scan(0, |a, &p| {
            let o = *a;
            *a += p;
            Some(o)
        })
        .collect();
    for hot in [65_536usize, 262_144, 1 << 20, 4 << 20, 16 << 20] {
        let mut rng = Rng(5);
        let mut cache = SlotCache::new(hot, 64 * COLS, h.table_rows(0)).unwrap();
        let mut at_warm = cache.stats();
        for step in 0..4_000u64 {
            let rows: Vec<i64> = (0..64 * COLS)
                .map(|i| {
                    let c = i % COLS;
                    let k = (primes[c] as f64).powf(rng.uniform()) as u64;
                    let scattered = k.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 20;
                    (offsets[c] + scattered % primes[c]) as i64
                })
                .collect();
            cache.plan(step, &rows).unwrap();
            cache.release(step).unwrap();
            if step + 1 == 2_000 {
                at_warm = cache.stats();
            }
        }
        let s = cache.stats();
        let rate = (s.hits - at_warm.hits) as f64 / (s.lookups - at_warm.lookups) as f64;
        println!(
            "{hot:>12} {:>10.3} {:>9.3}",
            hot as f64 * 264.0 / (1u64 << 30) as f64,
            rate
        );
    }
}

fn hit_rates(_: &mut Criterion) {
    print_hit_rates();
    print_row_zipf_hit_rates();
}

criterion_group!(benches, hashing, planning, hit_rates);
criterion_main!(benches);
