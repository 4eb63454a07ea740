//! Freeing cached blocks under pressure: LRU eviction of unlocked leaves, then trimming of
//! windowed-kind blocks that only the tree holds.
//!
//! Trimming exists because a sliding-window block behind every running request's window is dead
//! weight for them, yet a locked or interior node cannot be evicted whole (running requests lock the
//! pages they read and publish). Trimming is O(nodes) and frees a batch at a time. Dropping such a block
//! keeps the node (its unbounded-kind blocks stay reusable) and only shortens future hits whose window
//! would need it. With trimming, a request running alone can always obtain its own footprint: every
//! other block is evictable or trimmable (the scheduler's no-deadlock argument relies on this).

use super::{NodeId, RadixCache};
use crate::block_pool::BlockPool;

impl RadixCache {
    /// Frees cached blocks until `pools[k].num_free() >= needed[k]` for every kind, or nothing more
    /// can be freed. Returns the number of pages evicted (trimmed blocks not counted).
    pub fn evict(&mut self, pools: &mut [BlockPool], needed: &[u32]) -> usize {
        let short = |pools: &[BlockPool]| pools.iter().zip(needed).any(|(p, &n)| p.num_free() < n);
        let mut evicted = 0;
        while short(pools) {
            let Some(&(_, id)) = self.evictable.first() else {
                break;
            };
            self.remove_leaf(id, pools);
            evicted += 1;
        }
        for k in 0..self.windows.len() {
            if self.windows[k].is_some() && pools[k].num_free() < needed[k] {
                // Trim a batch (1/16 of the pool beyond the need) so that a run of allocations
                // under pressure does not rescan the tree each time.
                let batch = needed[k].saturating_add(pools[k].num_blocks() / 16);
                self.trim_windowed(k, batch.min(pools[k].num_blocks()), pools);
            }
        }
        evicted
    }

    /// Drops tree-only references to blocks of windowed kind `k`, least recently used first, until
    /// `needed` blocks are free or none is left.
    fn trim_windowed(&mut self, k: usize, needed: u32, pools: &mut [BlockPool]) {
        let mut victims: Vec<(u64, NodeId)> = self
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(id, n)| {
                let n = n.as_ref()?;
                let blk = *n.blocks.get(k)?;
                (blk >= 0 && pools[k].ref_count(blk) == 1).then_some((n.last_access, id as NodeId))
            })
            .collect();
        victims.sort_unstable();
        for (_, id) in victims {
            if pools[k].num_free() >= needed {
                break;
            }
            let node = self.node_mut(id);
            let blk = std::mem::replace(&mut node.blocks[k], -1);
            pools[k].decref(blk);
        }
    }

    /// Evicts every unlocked page (leaves first, repeatedly); locked paths stay. Returns the number
    /// of pages evicted.
    pub fn clear(&mut self, pools: &mut [BlockPool]) -> usize {
        let mut evicted = 0;
        while let Some(&(_, id)) = self.evictable.first() {
            self.remove_leaf(id, pools);
            evicted += 1;
        }
        evicted
    }

    /// Removes evictable leaf `id`, returning its block references.
    fn remove_leaf(&mut self, id: NodeId, pools: &mut [BlockPool]) {
        let node = self.nodes[id as usize].take().expect("live node");
        debug_assert!(Self::is_evictable(&node), "evicting a locked or inner node");
        self.evictable.remove(&(node.last_access, id));
        for (k, &blk) in node.blocks.iter().enumerate() {
            if blk >= 0 {
                pools[k].decref(blk);
            }
        }
        self.by_hash.remove(&node.hash);
        self.free_ids.push(id);
        self.stats.cached_pages -= 1;
        let parent_id = node.parent;
        let parent = self.node_mut(parent_id);
        parent.children -= 1;
        if parent.is_root() {
            self.remove_root_if_empty(parent_id);
        } else if Self::is_evictable(parent) {
            let key = (parent.last_access, parent_id);
            self.evictable.insert(key);
        }
    }

    /// Drops root sentinel `id` when nothing hangs below it (its namespace has nothing cached).
    pub(super) fn remove_root_if_empty(&mut self, id: NodeId) {
        if self.node(id).children > 0 {
            return;
        }
        let root = self.nodes[id as usize].take().expect("live root");
        debug_assert!(root.is_root(), "not a root");
        match root.root_salt {
            None => self.unsalted_root = None,
            Some(salt) => {
                self.salted_roots.remove(&salt);
            }
        }
        self.free_ids.push(id);
    }
}
