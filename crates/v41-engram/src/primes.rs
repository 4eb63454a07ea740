//! Prime buckets of the Engram tables (docs/model.md §3.3 "Prime buckets").
//!
//! A global used-prime set spans all Engram layers: for each layer (in order), each n-gram order
//! `n = 2..=max_ngram` and each of the `n_heads` heads, the bucket is the smallest prime above the
//! previous head's (the first head of an order: above `engram_vocab_size - 1`) not used yet. A layer's
//! table is the concatenation of its columns' buckets (order-major, head-minor), so column `c` owns
//! rows `offsets[c] .. offsets[c] + primes[c]`. V4.1-Flash (layers 1 and 14, 4, 8, 16,000,000) gives
//! 384,006,168 and 384,016,682 rows (checked in the tests).

use std::collections::HashSet;

fn mul_mod(a: u64, b: u64, m: u64) -> u64 {
    ((a as u128 * b as u128) % m as u128) as u64
}

fn pow_mod(mut base: u64, mut exp: u64, m: u64) -> u64 {
    let mut acc = 1u64;
    base %= m;
    while exp > 0 {
        if exp & 1 == 1 {
            acc = mul_mod(acc, base, m);
        }
        base = mul_mod(base, base, m);
        exp >>= 1;
    }
    acc
}

const BASES: [u64; 13] = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41];

/// Deterministic Miller–Rabin with the prime bases 2..41: exact for every `u64`.
pub fn is_prime(n: u64) -> bool {
    if n < 2 {
        return false;
    }
    for p in BASES {
        if n % p == 0 {
            return n == p;
        }
    }
    let (mut d, mut r) = (n - 1, 0u32);
    while d % 2 == 0 {
        d /= 2;
        r += 1;
    }
    'bases: for a in BASES {
        let mut x = pow_mod(a, d, n);
        if x == 1 || x == n - 1 {
            continue;
        }
        for _ in 1..r {
            x = mul_mod(x, x, n);
            if x == n - 1 {
                continue 'bases;
            }
        }
        return false;
    }
    true
}

/// Bucket sizes per Engram layer, in `num_layers` order: `Vec` of `[(max_ngram - 1) * n_heads]`
/// primes, column `c = (n - 2) * n_heads + h`.
pub fn engram_primes(
    num_layers: usize,
    max_ngram: usize,
    n_heads: usize,
    engram_vocab_size: u64,
) -> Vec<Vec<u64>> {
    let mut used = HashSet::new();
    (0..num_layers)
        .map(|_| {
            let mut cols = Vec::with_capacity(max_ngram.saturating_sub(1) * n_heads);
            for _order in 2..=max_ngram {
                let mut current = engram_vocab_size.saturating_sub(1);
                for _head in 0..n_heads {
                    current += 1;
                    while used.contains(&current) || !is_prime(current) {
                        current += 1;
                    }
                    used.insert(current);
                    cols.push(current);
                }
            }
            cols
        })
        .collect()
}

/// Exclusive prefix sums of one layer's primes: column `c`'s first row (`offsets[0] == 0`).
pub fn engram_offsets(primes: &[u64]) -> Vec<u64> {
    primes
        .iter()
        .scan(0u64, |acc, &p| {
            let start = *acc;
            *acc += p;
            Some(start)
        })
        .collect()
}
