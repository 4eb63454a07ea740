//! Engram n-gram hashing of a whole step (docs/model.md §3.3 "Hash ids per token").
//!
//! For each Engram layer ℓ and each new token at position `p` of a request: walk `s = 0..max_ngram`
//! back to token `p − s`; `v_s = token_map[token]`, except that once the walk passes the sequence start
//! or meets a dead (image) token, that slot and every older one hold `pad = token_map[pad_token_id]`.
//! `R_s = XOR_{k ≤ s} v_k·m_k` (the odd multipliers `m` of ℓ; every product fits 63 bits by construction)
//! and for order `n = s + 1 ≥ 2`, head `h`: column `c = (n − 2)·n_heads + h`, row
//! `(R_s mod prime_c) + offset_c`. The modulo is a Barrett reduction by a precomputed reciprocal
//! (one 64×64→128 multiply, one multiply-subtract and one correction); the 48 of them per V4.1 token bound
//! the speed (benches/RESULTS.md, "Engram offload").
//!
//! The Python hasher `v41.models.engram_hash` is the test oracle of this module.

use crate::error::EngramError;
use crate::primes::{engram_offsets, engram_primes};

/// History entry: no token there (before the sequence start).
pub const HISTORY_NONE: i64 = -1;
/// History entry: a dead (image) token.
pub const HISTORY_DEAD: i64 = -2;
const BLOCK: u64 = u64::MAX;

/// Construction parameters (the `engram_*` fields of the model config, plus the compressed token map
/// built from the tokenizer and each layer's multipliers).
#[derive(Debug, Clone)]
pub struct HashParams {
    /// Compressed id of every token id, `[len(tokenizer)]`, each `< compressed_vocab_size`.
    pub token_map: Vec<u32>,
    /// `engram_compressed_vocab_size` (bounds the multipliers).
    pub compressed_vocab_size: u32,
    /// `engram_pad_token_id`: `pad = token_map[pad_token_id]`.
    pub pad_token_id: u32,
    /// `engram_max_ngram_size` (≥ 2): lookback `max_ngram − 1` tokens.
    pub max_ngram: usize,
    /// `engram_n_heads`.
    pub n_heads: usize,
    /// `engram_vocab_size`: the primes start above it.
    pub engram_vocab_size: u64,
    /// `(layer id, multipliers [max_ngram])` per Engram layer, in `engram_layer_ids` order.
    pub layers: Vec<(u32, Vec<u64>)>,
}

#[derive(Debug, Clone, Copy)]
struct Column {
    prime: u64,
    offset: u64,
    reciprocal: u64,
}

impl Column {
    /// `x mod prime + offset` (Barrett: `q = ⌊x·⌊(2^64−1)/p⌋ / 2^64⌋` is `⌊x/p⌋` or one less).
    #[inline(always)]
    fn row(self, x: u64) -> u64 {
        let q = ((x as u128 * self.reciprocal as u128) >> 64) as u64;
        let r = x - q * self.prime;
        (if r >= self.prime { r - self.prime } else { r }) + self.offset
    }
}

#[derive(Debug, Clone)]
struct LayerHash {
    id: u32,
    multipliers: Vec<u64>,
    primes: Vec<u64>,
    columns: Vec<Column>,
    rows: u64,
}

#[allow(clippy::needless_range_loop)] // s indexes both the lookback values and the multipliers
impl LayerHash {
    /// Rows of every token (`vals [T·n]` lookback values) into `out [T, (n−1)·H]`, for `H` heads known at
    /// compile time (V4.1's 8: the column loop unrolls, ~1.5× the dynamic loop).
    fn rows<const H: usize>(&self, vals: &[u64], n: usize, out: &mut [i64]) {
        for (row, v) in out.chunks_exact_mut((n - 1) * H).zip(vals.chunks_exact(n)) {
            let mut rolling = v[0] * self.multipliers[0];
            for s in 1..n {
                rolling ^= v[s] * self.multipliers[s];
                let o: &mut [i64; H] = (&mut row[(s - 1) * H..s * H]).try_into().unwrap();
                let c: &[Column; H] = self.columns[(s - 1) * H..s * H].try_into().unwrap();
                for h in 0..H {
                    o[h] = c[h].row(rolling) as i64;
                }
            }
        }
    }

    fn rows_dyn(&self, vals: &[u64], n: usize, heads: usize, out: &mut [i64]) {
        for (row, v) in out
            .chunks_exact_mut((n - 1) * heads)
            .zip(vals.chunks_exact(n))
        {
            let mut rolling = v[0] * self.multipliers[0];
            for s in 1..n {
                rolling ^= v[s] * self.multipliers[s];
                let c0 = (s - 1) * heads;
                for (o, col) in row[c0..c0 + heads]
                    .iter_mut()
                    .zip(&self.columns[c0..c0 + heads])
                {
                    *o = col.row(rolling) as i64;
                }
            }
        }
    }
}

/// Token ids → Engram table rows of every Engram layer, for all requests of a step at once.
#[derive(Debug, Clone)]
pub struct NgramHasher {
    token_map: Vec<u32>,
    pad: u64,
    max_ngram: usize,
    n_heads: usize,
    layers: Vec<LayerHash>,
}

impl NgramHasher {
    /// Validate `params` and precompute the primes, offsets and reciprocals.
    ///
    /// Errors: [`EngramError::InvalidParams`] for `max_ngram < 2`, no heads, an empty or out-of-range
    /// token map, a pad id outside it, duplicate layer ids, or multipliers that are not
    /// `max_ngram` odd values whose products with every compressed id fit 63 bits.
    pub fn new(params: HashParams) -> Result<Self, EngramError> {
        let bad = |m: String| Err(EngramError::InvalidParams(m));
        if params.max_ngram < 2 {
            return bad(format!(
                "max_ngram_size must be >= 2, got {}",
                params.max_ngram
            ));
        }
        if params.n_heads == 0 || params.engram_vocab_size == 0 {
            return bad("n_heads and engram_vocab_size must be positive".into());
        }
        let cvs = params.compressed_vocab_size;
        if params.token_map.is_empty() || params.token_map.iter().any(|&v| v >= cvs) {
            return bad(format!(
                "token_map must be non-empty with values in [0, {cvs})"
            ));
        }
        let Some(&pad) = params.token_map.get(params.pad_token_id as usize) else {
            return bad(format!(
                "pad_token_id {} outside the token map",
                params.pad_token_id
            ));
        };
        let mut ids: Vec<u32> = params.layers.iter().map(|l| l.0).collect();
        ids.sort_unstable();
        ids.dedup();
        if ids.len() != params.layers.len() {
            return bad("duplicate Engram layer ids".into());
        }
        let max_v = u64::from(*params.token_map.iter().max().unwrap_or(&0));
        let primes = engram_primes(
            params.layers.len(),
            params.max_ngram,
            params.n_heads,
            params.engram_vocab_size,
        );
        let mut layers = Vec::with_capacity(params.layers.len());
        for ((id, multipliers), primes) in params.layers.into_iter().zip(primes) {
            let ok = multipliers.len() == params.max_ngram
                && multipliers
                    .iter()
                    .all(|&m| m % 2 == 1 && max_v.checked_mul(m).is_some_and(|p| p < 1 << 63));
            if !ok {
                return bad(format!(
                    "layer {id}: need {} odd multipliers with max_compressed_id·m < 2^63, got {multipliers:?}",
                    params.max_ngram
                ));
            }
            let columns = primes
                .iter()
                .zip(engram_offsets(&primes))
                .map(|(&prime, offset)| Column {
                    prime,
                    offset,
                    reciprocal: u64::MAX / prime,
                })
                .collect();
            let rows = primes.iter().sum();
            layers.push(LayerHash {
                id,
                multipliers,
                primes,
                columns,
                rows,
            });
        }
        Ok(Self {
            token_map: params.token_map,
            pad: u64::from(pad),
            max_ngram: params.max_ngram,
            n_heads: params.n_heads,
            layers,
        })
    }

    /// Hash columns per layer, `(max_ngram − 1)·n_heads`.
    pub fn columns(&self) -> usize {
        (self.max_ngram - 1) * self.n_heads
    }

    /// Lookback entries of a request's history, `max_ngram − 1`.
    pub fn history_len(&self) -> usize {
        self.max_ngram - 1
    }

    /// Engram layer ids, in construction order.
    pub fn layer_ids(&self) -> Vec<u32> {
        self.layers.iter().map(|l| l.id).collect()
    }

    /// Bucket primes of layer `index` (construction order), `[columns]`.
    pub fn primes(&self, index: usize) -> &[u64] {
        &self.layers[index].primes
    }

    /// Table rows of layer `index` (the sum of its primes).
    pub fn table_rows(&self, index: usize) -> u64 {
        self.layers[index].rows
    }

    /// Rows of one step for every layer, written to `out` `[layers, T, columns]` (row-major).
    ///
    /// `tokens [T]`: the step's new token ids, request after request (draft tokens included: their
    /// lookback stays within the run). `counts [R]`: tokens per request (sum `T`). `history
    /// [R·(max_ngram − 1)]`: per request the committed ids right before its run, oldest first, with
    /// [`HISTORY_NONE`] where the sequence has not started and [`HISTORY_DEAD`] for a dead token.
    /// `dead [T]` (optional): dead (image) tokens of the run.
    ///
    /// Errors: [`EngramError::InvalidStep`] for inconsistent lengths, [`EngramError::TokenOutOfRange`]
    /// for an id (or history entry) outside the token map. Nothing is written on error.
    pub fn hash_step(
        &self,
        tokens: &[i64],
        counts: &[i64],
        history: &[i64],
        dead: Option<&[bool]>,
        out: &mut [i64],
    ) -> Result<(), EngramError> {
        let keep = self.history_len();
        let t = tokens.len();
        let step = |m: String| Err(EngramError::InvalidStep(m));
        if counts.iter().any(|&c| c < 0) || counts.iter().sum::<i64>() != t as i64 {
            return step(format!(
                "counts must be non-negative and sum to the {t} tokens"
            ));
        }
        if history.len() != counts.len() * keep {
            return step(format!(
                "history needs {} entries ({} requests × {keep})",
                counts.len() * keep,
                counts.len()
            ));
        }
        if dead.is_some_and(|d| d.len() != t) {
            return step(format!("dead needs one flag per token ({t})"));
        }
        if out.len() != self.layers.len() * t * self.columns() {
            return step(format!(
                "output needs {} entries",
                self.layers.len() * t * self.columns()
            ));
        }
        // per token its max_ngram lookback values, pads applied (shared by every layer)
        let n = self.max_ngram;
        let mut vals = vec![self.pad; t * n];
        let mut ext: Vec<u64> = Vec::with_capacity(keep + t);
        let mut tok = tokens.iter().enumerate();
        let mut at = 0;
        for (r, &count) in counts.iter().enumerate() {
            ext.clear();
            for &h in &history[r * keep..(r + 1) * keep] {
                ext.push(match h {
                    HISTORY_NONE | HISTORY_DEAD => BLOCK,
                    _ => self.compress(h)?,
                });
            }
            for _ in 0..count {
                let (i, &id) = tok.next().expect("counts sum to T");
                let v = self.compress(id)?;
                ext.push(if dead.is_some_and(|d| d[i]) { BLOCK } else { v });
                // walk back from the newest; the first BLOCK leaves it and every older slot at pad
                for (slot, &e) in vals[at * n..(at + 1) * n].iter_mut().zip(ext.iter().rev()) {
                    if e == BLOCK {
                        break;
                    }
                    *slot = e;
                }
                at += 1;
            }
        }
        for (li, layer) in self.layers.iter().enumerate() {
            let block = &mut out[li * t * self.columns()..(li + 1) * t * self.columns()];
            match self.n_heads {
                8 => layer.rows::<8>(&vals, n, block),
                _ => layer.rows_dyn(&vals, n, self.n_heads, block),
            }
        }
        Ok(())
    }

    #[inline]
    fn compress(&self, id: i64) -> Result<u64, EngramError> {
        usize::try_from(id)
            .ok()
            .and_then(|i| self.token_map.get(i))
            .map(|&v| u64::from(v))
            .ok_or(EngramError::TokenOutOfRange {
                token: id,
                vocab: self.token_map.len(),
            })
    }
}
