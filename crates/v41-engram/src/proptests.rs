//! Properties of the hasher (chunking cannot change rows) and of the slot cache (a slot is never owned
//! twice, a row of an in-flight step is never evicted, every lookup reads its own row, hits + misses =
//! lookups).

use proptest::prelude::*;

use crate::*;

fn small_hasher() -> NgramHasher {
    NgramHasher::new(HashParams {
        token_map: (0..64u32).map(|i| (i * 7) % 40).collect(),
        compressed_vocab_size: 40,
        pad_token_id: 2,
        max_ngram: 4,
        n_heads: 3,
        engram_vocab_size: 50,
        layers: vec![
            (1, vec![1_000_003, 77, 12_345_679, 5]),
            (4, vec![3, 9_999_991, 1, 123_457]),
        ],
    })
    .unwrap()
}

fn hash_whole(h: &NgramHasher, toks: &[i64]) -> Vec<i64> {
    let mut out = vec![0; 2 * toks.len() * h.columns()];
    h.hash_step(toks, &[toks.len() as i64], &[-1; 3], None, &mut out)
        .unwrap();
    out
}

proptest! {
    /// Splitting a sequence into chunks (each with its 3 committed ids of lookback), and hashing two
    /// requests in one step, gives the rows of hashing it whole.
    #[test]
    fn chunks_and_batches_equal_whole(seq in prop::collection::vec(0i64..64, 1..40), cut in 0usize..40) {
        let h = small_hasher();
        let cols = h.columns();
        let cut = cut.min(seq.len());
        let whole = hash_whole(&h, &seq);
        let (a, b) = seq.split_at(cut);
        let hist: Vec<i64> = (0..3).map(|k| {
            let i = cut as i64 - 3 + k;
            if i < 0 { -1 } else { seq[i as usize] }
        }).collect();
        // one step: request 0 = the whole sequence, request 1 = the tail chunk after `cut`
        let toks: Vec<i64> = seq.iter().chain(b).copied().collect();
        let mut history = vec![-1, -1, -1];
        history.extend(&hist);
        let t = toks.len();
        let mut out = vec![0; 2 * t * cols];
        h.hash_step(&toks, &[seq.len() as i64, b.len() as i64], &history, None, &mut out).unwrap();
        for layer in 0..2 {
            let got = &out[layer * t * cols..(layer + 1) * t * cols];
            let want = &whole[layer * seq.len() * cols..(layer + 1) * seq.len() * cols];
            prop_assert_eq!(&got[..seq.len() * cols], want);
            prop_assert_eq!(&got[seq.len() * cols..], &want[a.len() * cols..]);
            for (c, row) in got.iter().enumerate() {
                let col = c % cols;
                let lo: u64 = h.primes(layer)[..col].iter().sum();
                prop_assert!(*row as u64 >= lo && (*row as u64) < lo + h.primes(layer)[col]);
            }
        }
    }

    /// Random steps (plan, sometimes release an older step): the device contents implied by the copy lists
    /// always hold each lookup's row, no slot is owned twice, and the counters add up.
    #[test]
    fn slot_cache_keeps_every_lookup_correct(
        hot in 0usize..40,
        steps in prop::collection::vec((prop::collection::vec(0i64..60, 0..24), any::<bool>()), 1..40),
    ) {
        let staging = 24;
        let mut c = SlotCache::new(hot, staging, 60).unwrap();
        let mut device: Vec<Option<i64>> = vec![None; hot + staging];
        let mut open: Vec<(u64, Vec<i64>, Vec<i64>)> = Vec::new(); // in-flight: step, rows, slots
        for (step, (rows, release_oldest)) in steps.into_iter().enumerate() {
            let before = c.stats();
            let plan = match c.plan(step as u64, &rows) {
                Ok(p) => p,
                Err(EngramError::NoFreeSlots { .. }) => continue, // 3 steps in flight can exhaust a small cache
                Err(e) => return Err(TestCaseError::fail(e.to_string())),
            };
            for (&r, &s) in plan.copy_rows.iter().zip(&plan.copy_slots) {
                device[s as usize] = Some(r);
            }
            // every lookup of this step and of every step still in flight reads its own row
            open.push((step as u64, rows.clone(), plan.slots.clone()));
            for (_, rs, ss) in &open {
                for (&r, &s) in rs.iter().zip(ss) {
                    prop_assert_eq!(device[s as usize], Some(r));
                }
            }
            // a hot slot is owned by at most one row, and resident rows map to their slot
            let mut owners = std::collections::HashMap::new();
            for row in 0..60u64 {
                if let Some(s) = c.slot_of(row) {
                    prop_assert!((s as usize) < c.hot() && c.hot() <= hot);
                    prop_assert!(owners.insert(s, row).is_none(), "slot {} owned twice", s);
                    prop_assert_eq!(device[s as usize], Some(row as i64));
                }
            }
            let after = c.stats();
            let mut distinct = rows.clone();
            distinct.sort_unstable();
            distinct.dedup();
            prop_assert_eq!(after.lookups - before.lookups, distinct.len() as u64);
            prop_assert_eq!(after.hits + after.misses, after.lookups);
            prop_assert_eq!(after.misses - before.misses, plan.copy_rows.len() as u64);
            if release_oldest || open.len() > 2 {
                let (s, _, _) = open.remove(0);
                c.release(s).unwrap();
            }
        }
    }
}
