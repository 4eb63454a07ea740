use super::*;
use crate::block_pool::BlockPool;
use crate::layout::{CacheKind, Layout};

const B: usize = 4;

/// swa (window 6) and ckv2, page 4 tokens, 64 blocks each.
fn setup() -> (RadixCache, Vec<BlockPool>) {
    let kind = |name: &str, r, w| CacheKind {
        name: name.into(),
        tokens_per_block: B as u32,
        tokens_per_entry: r,
        window_tokens: w,
        num_blocks: 64,
    };
    let layout = Layout::new(vec![kind("swa", 1, Some(6)), kind("ckv2", 2, None)], None).unwrap();
    (
        RadixCache::new(&layout),
        vec![BlockPool::new(64), BlockPool::new(64)],
    )
}

/// Fresh blocks for `pages` pages of every kind, as a request would hold them.
fn tables(pools: &mut [BlockPool], pages: u32) -> Vec<Vec<i32>> {
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
        t.iter().filter(|&&b| b >= 0).for_each(|&b| {
            pools[k].decref(b);
        });
    }
}

fn seq(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i * 7 + seed).collect()
}

#[test]
fn match_returns_longest_cached_page_prefix_below_full_length() {
    let (mut tree, mut pools) = setup();
    let tokens = seq(3 * B, 1);
    let mut t = tables(&mut pools, 3);
    let out = tree.insert(None, &tokens, &mut t, &mut pools, None);
    assert_eq!((out.already_cached_tokens, out.cached_tokens), (0, 12));
    let mut longer = tokens.clone();
    longer.push(99);
    let m = tree.match_prefix(None, &longer);
    assert_eq!(m.hit_tokens, 12);
    assert_eq!(m.blocks[1], t[1]);
    // The identical prompt: at least one token must be computed, so only 2 pages are reused.
    assert_eq!(tree.match_prefix(None, &tokens).hit_tokens, 8);
    let mut diverged = tokens.clone();
    diverged[5] = 1000;
    assert_eq!(tree.match_prefix(None, &diverged).hit_tokens, 4);
    tree.check().unwrap();
    release(&t, &mut pools);
    tree.clear(&mut pools);
    assert!(pools.iter().all(|p| p.num_used() == 0));
}

#[test]
fn salts_isolate_namespaces() {
    let (mut tree, mut pools) = setup();
    let tokens = seq(2 * B + 1, 3);
    let mut t = tables(&mut pools, 2);
    tree.insert(Some("alice"), &tokens[..2 * B], &mut t, &mut pools, None);
    assert_eq!(tree.match_prefix(Some("alice"), &tokens).hit_tokens, 8);
    assert_eq!(tree.match_prefix(Some("bob"), &tokens).hit_tokens, 0);
    assert_eq!(tree.match_prefix(None, &tokens).hit_tokens, 0);
    tree.check().unwrap();
}

#[test]
fn a_namespace_whose_first_page_collides_leaves_no_root_behind() {
    let (mut tree, mut pools) = setup();
    let tokens = seq(2 * B, 5);
    let mut alice = tables(&mut pools, 2);
    tree.insert(Some("alice"), &tokens, &mut alice, &mut pools, None);
    // Make bob's first page hash collide with alice's first page (SHA-256 salt roots cannot be
    // crafted to do this; a 64-bit collision still can happen by chance).
    let bob_first = page_hash(root_hash(Some("bob")), &tokens[..B]);
    let alice_first = tree.by_hash[&page_hash(root_hash(Some("alice")), &tokens[..B])];
    tree.by_hash.insert(bob_first, alice_first);
    let mut bob = tables(&mut pools, 2);
    let out = tree.insert(Some("bob"), &tokens, &mut bob, &mut pools, None);
    assert_eq!((out.cached_tokens, out.cursor), (0, None));
    assert!(
        !tree.salted_roots.contains_key("bob"),
        "an empty root for bob stayed"
    );
    tree.by_hash.remove(&bob_first);
    tree.check().unwrap();
}

#[test]
fn duplicate_insert_switches_to_cached_block_and_frees_own() {
    let (mut tree, mut pools) = setup();
    let tokens = seq(2 * B, 5);
    let mut first = tables(&mut pools, 2);
    tree.insert(None, &tokens, &mut first, &mut pools, None);
    let mut second = tables(&mut pools, 2);
    let used_before = pools[1].num_used();
    let out = tree.insert(None, &tokens, &mut second, &mut pools, None);
    assert_eq!(out.already_cached_tokens, 8);
    assert_eq!(second, first);
    assert_eq!(
        pools[1].num_used(),
        used_before - 2,
        "the duplicates were freed"
    );
    assert_eq!(pools[1].ref_count(first[1][0]), 3, "tree + two requests");
    tree.check().unwrap();
}

#[test]
fn lru_evicts_unlocked_leaves_first_and_spares_locked_paths() {
    let (mut tree, mut pools) = setup();
    let (a, b) = (seq(2 * B, 10), seq(2 * B, 20));
    let mut ta = tables(&mut pools, 2);
    let mut tb = tables(&mut pools, 2);
    tree.insert(None, &a, &mut ta, &mut pools, None);
    tree.insert(None, &b, &mut tb, &mut pools, None);
    release(&ta, &mut pools);
    release(&tb, &mut pools);
    let mut probe = a.clone();
    probe.push(0);
    let hit = tree.match_prefix(None, &probe);
    tree.lock(hit.last_node.unwrap()); // `a` is in use and most recently used
    let free = pools[1].num_free();
    assert_eq!(tree.evict(&mut pools, &[0, free + 1]), 1);
    let mut probe_b = b.clone();
    probe_b.push(0);
    assert_eq!(
        tree.match_prefix(None, &probe_b).hit_tokens,
        4,
        "b's leaf went first"
    );
    assert_eq!(
        tree.evict(&mut pools, &[0, 64]),
        1,
        "only b's first page is evictable"
    );
    assert_eq!(tree.match_prefix(None, &probe).hit_tokens, 8);
    tree.unlock(hit.last_node.unwrap());
    assert_eq!(tree.clear(&mut pools), 2);
    assert!(pools.iter().all(|p| p.num_used() == 0));
    tree.check().unwrap();
}

#[test]
fn prefix_hit_stops_at_missing_window_block() {
    let (mut tree, mut pools) = setup();
    let tokens = seq(4 * B + 1, 30);
    let mut t = tables(&mut pools, 4);
    // The request released swa blocks of pages 0 and 1 before inserting (window 6 < 16 tokens).
    for blk in &mut t[0][..2] {
        pools[0].decref(*blk);
        *blk = -1;
    }
    tree.insert(None, &tokens[..4 * B], &mut t, &mut pools, None);
    // Boundary 16 needs positions 11..=15 (pages 2, 3): resident.
    let m = tree.match_prefix(None, &tokens);
    assert_eq!(m.hit_tokens, 16);
    assert_eq!(m.blocks[0][..2], [-1, -1]);
    // Drop page 3's swa block: boundary 16 is unusable, and boundary 12 needs 7..=11 (pages 1, 2)
    // where page 1 is missing; boundary 8 needs 3..=7 (pages 0, 1): missing too; boundary 4 needs
    // 0..=3 (page 0): missing. No usable hit at all.
    release(&t, &mut pools);
    let page3 = m.last_node.unwrap();
    let blk = std::mem::replace(&mut tree.node_mut(page3).blocks[0], -1);
    pools[0].decref(blk);
    assert_eq!(tree.match_prefix(None, &tokens).hit_tokens, 0);
    tree.check().unwrap();
}

#[test]
fn prefix_hit_is_page_and_ratio_aligned() {
    let (mut tree, mut pools) = setup();
    assert_eq!(tree.align_tokens, 2);
    let tokens = seq(3 * B + 3, 40);
    let mut t = tables(&mut pools, 3);
    tree.insert(None, &tokens[..3 * B], &mut t, &mut pools, None);
    for len in 1..tokens.len() {
        let hit = tree.match_prefix(None, &tokens[..len]).hit_tokens as usize;
        assert_eq!(hit % B, 0);
        assert_eq!(hit % 2, 0);
        assert!(hit < len);
    }
}

#[test]
fn trim_frees_only_tree_held_window_blocks() {
    let (mut tree, mut pools) = setup();
    let tokens = seq(3 * B, 50);
    let mut t = tables(&mut pools, 3);
    tree.insert(None, &tokens, &mut t, &mut pools, None);
    let mut probe = tokens.clone();
    probe.push(1);
    let hit = tree.match_prefix(None, &probe);
    tree.lock(hit.last_node.unwrap());
    // The request keeps page 2's swa block (inside its window) and drops pages 0 and 1.
    for blk in &mut t[0][..2] {
        pools[0].decref(*blk);
        *blk = -1;
    }
    let free = pools[0].num_free();
    tree.evict(&mut pools, &[64, 0]);
    assert_eq!(
        pools[0].num_free(),
        free + 2,
        "locked nodes lose their tree-only swa blocks"
    );
    assert_eq!(
        pools[0].ref_count(t[0][2]),
        2,
        "the shared in-window block stays"
    );
    tree.check().unwrap();
    tree.unlock(hit.last_node.unwrap());
}

#[test]
fn stale_cursor_is_ignored() {
    let (mut tree, mut pools) = setup();
    let tokens = seq(2 * B, 60);
    let mut t = tables(&mut pools, 2);
    let out = tree.insert(None, &tokens[..B], &mut t, &mut pools, None);
    tree.clear(&mut pools);
    let out2 = tree.insert(None, &tokens, &mut t, &mut pools, out.cursor);
    assert_eq!((out2.already_cached_tokens, out2.cached_tokens), (0, 8));
    let mut probe = tokens.clone();
    probe.push(0);
    assert_eq!(tree.match_prefix(None, &probe).hit_tokens, 8);
    tree.check().unwrap();
}
