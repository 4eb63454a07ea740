//! A pool of physical blocks (or state rows) with reference counts and an O(1) free list.
//!
//! Ownership: a block id held in a request's block table or in a radix-tree node is one reference.
//! Whoever stores the id owns that reference and must give it back with [`BlockPool::decref`] exactly
//! once (finish, abort, preemption, sliding-window release, eviction). The scheduler is the only owner
//! of pools, requests and the tree, so these handles are plain `i32` ids whose release is tied to the
//! owner's end of life; the property tests check that the reference count of every block equals the
//! number of places holding it.
//!
//! Invariants: `ref_count(b) == 0` ⇔ `b` is on the free list (exactly once);
//! `num_free() + num_used() == num_blocks()`. Bad requests (asking for more than is free) are errors;
//! a reference-count underflow or a reference to a free block is a bug and panics.
//!
//! Cost: `allocate(n)` is O(n), `incref`/`decref` O(1).

use thiserror::Error;

/// Not enough free blocks for an all-or-nothing allocation; nothing was allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("pool exhausted: requested {requested} blocks, {free} free")]
pub struct PoolExhausted {
    /// Blocks asked for.
    pub requested: u32,
    /// Blocks free at the time.
    pub free: u32,
}

/// Reference-counted blocks `0..num_blocks` with a LIFO free list.
#[derive(Debug, Clone)]
pub struct BlockPool {
    ref_counts: Vec<u32>,
    free: Vec<u32>,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks; the first allocations return `0, 1, 2, ...`.
    ///
    /// # Panics
    /// If `num_blocks > i32::MAX` (the layout validates this).
    pub fn new(num_blocks: u32) -> Self {
        assert!(num_blocks <= i32::MAX as u32, "block ids must fit in i32");
        Self {
            ref_counts: vec![0; num_blocks as usize],
            free: (0..num_blocks).rev().collect(),
        }
    }

    /// Total number of blocks.
    pub fn num_blocks(&self) -> u32 {
        self.ref_counts.len() as u32
    }

    /// Blocks with reference count 0.
    pub fn num_free(&self) -> u32 {
        self.free.len() as u32
    }

    /// Blocks with reference count ≥ 1.
    pub fn num_used(&self) -> u32 {
        self.num_blocks() - self.num_free()
    }

    /// Allocates `n` blocks with reference count 1 each and appends their ids to `out`, or
    /// allocates nothing.
    ///
    /// # Errors
    /// [`PoolExhausted`] when fewer than `n` blocks are free.
    pub fn allocate(&mut self, n: u32, out: &mut Vec<i32>) -> Result<(), PoolExhausted> {
        if n > self.num_free() {
            return Err(PoolExhausted {
                requested: n,
                free: self.num_free(),
            });
        }
        out.reserve(n as usize);
        for _ in 0..n {
            let block = self.free.pop().expect("checked above");
            debug_assert_eq!(self.ref_counts[block as usize], 0);
            self.ref_counts[block as usize] = 1;
            out.push(block as i32);
        }
        Ok(())
    }

    /// Allocates one block (reference count 1), or `None` when the pool is empty.
    pub fn allocate_one(&mut self) -> Option<u32> {
        let block = self.free.pop()?;
        self.ref_counts[block as usize] = 1;
        Some(block)
    }

    /// Adds a reference to an allocated block (sharing through the prefix cache).
    ///
    /// # Panics
    /// If `block` is out of range or free: sharing a free block is a bug.
    pub fn incref(&mut self, block: i32) {
        let rc = &mut self.ref_counts[block as usize];
        assert!(*rc > 0, "incref of free block {block}");
        *rc += 1;
    }

    /// Drops one reference; returns `true` when the block became free.
    ///
    /// # Panics
    /// If `block` is out of range or already free (reference-count underflow is a bug).
    pub fn decref(&mut self, block: i32) -> bool {
        let rc = &mut self.ref_counts[block as usize];
        assert!(
            *rc > 0,
            "decref of free block {block}: reference count underflow"
        );
        *rc -= 1;
        if *rc == 0 {
            self.free.push(block as u32);
            true
        } else {
            false
        }
    }

    /// Current reference count of `block` (0 = free).
    pub fn ref_count(&self, block: i32) -> u32 {
        self.ref_counts[block as usize]
    }

    /// Checks that the free list holds exactly the blocks with reference count 0, each once.
    /// O(num_blocks); for tests and `check_invariants`.
    pub fn check_free_list(&self) -> Result<(), String> {
        let mut seen = vec![false; self.ref_counts.len()];
        for &b in &self.free {
            let slot = seen
                .get_mut(b as usize)
                .ok_or(format!("free list holds bad id {b}"))?;
            if std::mem::replace(slot, true) {
                return Err(format!("block {b} is on the free list twice"));
            }
            if self.ref_counts[b as usize] != 0 {
                return Err(format!(
                    "block {b} is free but has ref count {}",
                    self.ref_counts[b as usize]
                ));
            }
        }
        let zero = self.ref_counts.iter().filter(|&&rc| rc == 0).count();
        if zero != self.free.len() {
            return Err(format!(
                "{zero} blocks have ref count 0 but {} are on the free list",
                self.free.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_is_all_or_nothing() {
        let mut pool = BlockPool::new(4);
        let mut out = Vec::new();
        pool.allocate(3, &mut out).unwrap();
        assert_eq!(out, vec![0, 1, 2]);
        let err = pool.allocate(2, &mut out).unwrap_err();
        assert_eq!(
            err,
            PoolExhausted {
                requested: 2,
                free: 1
            }
        );
        assert_eq!(out.len(), 3);
        assert_eq!(pool.num_free() + pool.num_used(), pool.num_blocks());
    }

    #[test]
    fn shared_block_is_freed_by_its_last_reference() {
        let mut pool = BlockPool::new(2);
        let b = pool.allocate_one().unwrap() as i32;
        pool.incref(b);
        assert_eq!(pool.ref_count(b), 2);
        assert!(!pool.decref(b));
        assert!(pool.decref(b));
        assert_eq!(pool.num_free(), 2);
        pool.check_free_list().unwrap();
    }

    #[test]
    #[should_panic(expected = "underflow")]
    fn refcount_underflow_panics() {
        let mut pool = BlockPool::new(1);
        let b = pool.allocate_one().unwrap() as i32;
        pool.decref(b);
        pool.decref(b);
    }

    #[test]
    #[should_panic(expected = "incref of free block")]
    fn sharing_a_free_block_panics() {
        let mut pool = BlockPool::new(1);
        pool.incref(0);
    }
}
