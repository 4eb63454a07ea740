//! Known answers: the pinned V4.1-Flash table sizes and rows computed by the Python hasher
//! (`v41.models.engram_hash.EngramHasher`, the oracle) for a fixed token map.

use crate::*;

const FLASH_MULT_1: [u64; 4] = [
    76632096046245,
    4839876093313,
    35959672319349,
    73987337458391,
];
const FLASH_MULT_14: [u64; 4] = [
    67716810739261,
    51510806800915,
    30921347202721,
    82619226485591,
];

/// Flash parameters with the token map `map[i] = (i·7919) mod 99092` over 129,280 ids.
fn flash() -> NgramHasher {
    let token_map = (0..129_280u64)
        .map(|i| ((i * 7919) % 99_092) as u32)
        .collect();
    NgramHasher::new(HashParams {
        token_map,
        compressed_vocab_size: 99_092,
        pad_token_id: 2,
        max_ngram: 4,
        n_heads: 8,
        engram_vocab_size: 16_000_000,
        layers: vec![(1, FLASH_MULT_1.to_vec()), (14, FLASH_MULT_14.to_vec())],
    })
    .unwrap()
}

#[test]
fn flash_table_rows_are_pinned() {
    let h = flash();
    assert_eq!(h.table_rows(0), 384_006_168);
    assert_eq!(h.table_rows(1), 384_016_682);
    assert_eq!(h.primes(0)[0], 16_000_057);
    assert!(h
        .primes(0)
        .iter()
        .chain(h.primes(1))
        .all(|&p| is_prime(p) && p > 15_999_999));
}

const L1_FIRST: [i64; 24] = [
    4150041, 26236090, 43371009, 55939121, 70422504, 83685352, 106898473, 117772742, 138503094,
    150194191, 166349582, 176408859, 195329374, 218252386, 227464572, 249183569, 260987589,
    275807014, 302538479, 309748763, 331239258, 340499256, 363703516, 383178830,
];
const L1_LAST: [i64; 24] = [
    1861865, 28684321, 36322800, 54448869, 74366067, 85465989, 107852491, 114728906, 133097105,
    146860968, 169135684, 178588856, 196161246, 212006993, 236599897, 250604020, 262788483,
    272584393, 289733588, 306795306, 323683595, 341286343, 358972702, 370314918,
];
const L14_LAST: [i64; 24] = [
    9809761, 29713129, 45480489, 48163663, 66357337, 84945407, 97423717, 120907160, 134645769,
    147168243, 163576662, 176132597, 200174242, 215305310, 237266675, 251090120, 269623823,
    281729733, 301180597, 312585644, 331756178, 340386955, 356474360, 373690999,
];

#[test]
fn flash_rows_match_the_python_hasher() {
    let h = flash();
    let toks = [5, 100, 129_279, 2, 77, 5000];
    let mut out = vec![0; 2 * 6 * 24];
    h.hash_step(&toks, &[6], &[-1, -1, -1], None, &mut out)
        .unwrap();
    assert_eq!(out[..24], L1_FIRST);
    assert_eq!(out[5 * 24..6 * 24], L1_LAST);
    assert_eq!(out[(6 + 5) * 24..], L14_LAST);
    // the same last token as a 2-token chunk after 3 committed ids: identical rows
    let mut chunk = vec![0; 2 * 2 * 24];
    h.hash_step(&[77, 5000], &[2], &[100, 129_279, 2], None, &mut chunk)
        .unwrap();
    assert_eq!(chunk[24..48], L1_LAST);
}

#[test]
fn pads_before_the_start_and_at_dead_tokens() {
    let h = flash();
    let mut a = vec![0; 2 * 24];
    let mut b = vec![0; 2 * 24];
    // a dead history entry blocks exactly like the sequence start
    h.hash_step(&[5000], &[1], &[7, -2, 9], None, &mut a)
        .unwrap();
    h.hash_step(&[5000], &[1], &[-1, -1, 9], None, &mut b)
        .unwrap();
    assert_eq!(a, b);
    // a dead token hashes pads only: the rows of the pad id at the sequence start... with pad lookbacks
    let mut dead = vec![0; 2 * 24];
    let mut pad = vec![0; 2 * 24];
    h.hash_step(&[5000], &[1], &[7, 8, 9], Some(&[true]), &mut dead)
        .unwrap();
    h.hash_step(&[2], &[1], &[-1, -1, -1], None, &mut pad)
        .unwrap();
    assert_eq!(dead, pad);
}

#[test]
fn bad_steps_are_errors_and_write_nothing() {
    let h = flash();
    let mut out = vec![7; 2 * 24];
    assert!(matches!(
        h.hash_step(&[129_280], &[1], &[-1; 3], None, &mut out),
        Err(EngramError::TokenOutOfRange { token: 129_280, .. })
    ));
    assert!(matches!(
        h.hash_step(&[-5], &[1], &[-1; 3], None, &mut out),
        Err(EngramError::TokenOutOfRange { .. })
    ));
    assert!(matches!(
        h.hash_step(&[1], &[1], &[-1; 3 - 1], None, &mut out),
        Err(EngramError::InvalidStep(_))
    ));
    assert!(matches!(
        h.hash_step(&[1], &[2], &[-1; 3], None, &mut out),
        Err(EngramError::InvalidStep(_))
    ));
    assert!(matches!(
        h.hash_step(&[1], &[1], &[-1, -1, -3], None, &mut out),
        Err(EngramError::TokenOutOfRange { .. })
    ));
    assert!(out.iter().all(|&v| v == 7));
}

#[test]
fn bad_params_are_errors() {
    let params = |mult: Vec<u64>| HashParams {
        token_map: vec![0, 1, 2],
        compressed_vocab_size: 3,
        pad_token_id: 2,
        max_ngram: 2,
        n_heads: 1,
        engram_vocab_size: 5,
        layers: vec![(1, mult)],
    };
    assert!(NgramHasher::new(params(vec![1, 3])).is_ok());
    assert!(NgramHasher::new(params(vec![2, 3])).is_err()); // even
    assert!(NgramHasher::new(params(vec![1])).is_err()); // too few
    assert!(NgramHasher::new(params(vec![1, (1 << 63) - 1])).is_err()); // overflows
    let mut p = params(vec![1, 3]);
    p.pad_token_id = 3;
    assert!(NgramHasher::new(p).is_err());
}

#[test]
fn cache_hits_evicts_and_stages() {
    let mut c = SlotCache::new(2, 2, 100).unwrap();
    let p = c.plan(0, &[10, 11, 10]).unwrap();
    assert_eq!(p.slots, vec![0, 1, 0]);
    assert_eq!(
        (p.copy_rows.clone(), p.copy_slots.clone()),
        (vec![10, 11], vec![0, 1])
    );
    // step 0 in flight: its slots are pinned, so new rows go to staging
    let p = c.plan(1, &[12]).unwrap();
    assert_eq!(p.slots, vec![2]);
    assert_eq!(c.slot_of(12), None);
    c.release(0).unwrap();
    c.release(1).unwrap();
    let p = c.plan(2, &[11, 13]).unwrap();
    assert_eq!(p.copy_rows, vec![13]);
    assert_eq!(c.slot_of(11), Some(1));
    assert_eq!(c.slot_of(10), None); // evicted
    let s = c.stats();
    assert_eq!(
        (s.lookups, s.hits, s.misses, s.evictions, s.staged),
        (5, 1, 4, 1, 1)
    );
    assert!(matches!(
        c.plan(2, &[1]),
        Err(EngramError::DuplicateStep(2))
    ));
    assert!(matches!(c.release(9), Err(EngramError::UnknownStep(9))));
    assert!(matches!(
        c.plan(3, &[100]),
        Err(EngramError::RowOutOfRange { row: 100, .. })
    ));
}

#[test]
fn a_step_too_large_is_an_error_and_rolls_back() {
    let mut c = SlotCache::new(2, 1, 100).unwrap();
    c.plan(0, &[1]).unwrap();
    c.release(0).unwrap();
    let err = c.plan(1, &[5, 6, 7, 8]).unwrap_err();
    assert!(
        matches!(err, EngramError::NoFreeSlots { needed: 4, .. }),
        "{err}"
    );
    assert_eq!(c.in_flight(), 0);
    assert_eq!((c.slot_of(5), c.slot_of(6)), (None, None));
    // every slot is free again: a step that fits plans
    c.plan(2, &[5, 6, 7]).unwrap();
}

#[test]
fn zero_hot_slots_copy_every_row_every_step() {
    let mut c = SlotCache::new(0, 4, 100).unwrap();
    for step in 0..3 {
        let p = c.plan(step, &[3, 4, 3]).unwrap();
        assert_eq!(p.slots, vec![0, 1, 0]);
        assert_eq!(p.copy_rows, vec![3, 4]);
        c.release(step).unwrap();
    }
    assert_eq!(c.stats().hits, 0);
}
