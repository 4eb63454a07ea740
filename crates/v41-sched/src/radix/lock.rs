//! Locks: a running request pins the path it reads (its prefix hit) and the pages it published, so
//! they are never evicted while it runs. Evicting them would free nothing of the unbounded kinds (the
//! request holds those blocks itself) and would throw away the path its next insertion extends;
//! their tree-only sliding-window blocks can still be trimmed ([`RadixCache::evict`]).

use super::{NodeId, RadixCache};

impl RadixCache {
    /// Locks the path from the root to `node` against eviction (one count per node).
    pub fn lock(&mut self, node: NodeId) {
        self.lock_down_to(node, None);
    }

    /// Extends a lock held on `from` (or no lock) to its descendant `to`: locks the nodes below
    /// `from` down to `to`, so that one [`RadixCache::unlock`] of `to` releases everything. Cost:
    /// O(pages between them).
    ///
    /// # Panics
    /// If `from` is not an ancestor of (or equal to) `to`.
    pub fn extend_lock(&mut self, from: Option<NodeId>, to: NodeId) {
        if from != Some(to) {
            self.lock_down_to(to, from);
        }
    }

    fn lock_down_to(&mut self, node: NodeId, stop: Option<NodeId>) {
        let mut id = node;
        while Some(id) != stop {
            let n = self.nodes[id as usize].as_mut().expect("live node");
            if n.is_root() {
                assert!(
                    stop.is_none(),
                    "extend_lock: {stop:?} is not an ancestor of {node}"
                );
                return;
            }
            if Self::is_evictable(n) {
                self.evictable.remove(&(n.last_access, id));
            }
            n.lock_refs += 1;
            id = n.parent;
        }
    }

    /// Undoes one [`RadixCache::lock`] (or extended lock) of `node`.
    ///
    /// # Panics
    /// If the path is not locked (a bug in the caller's bookkeeping).
    pub fn unlock(&mut self, node: NodeId) {
        let mut id = node;
        while !self.node(id).is_root() {
            let n = self.nodes[id as usize].as_mut().expect("live node");
            assert!(n.lock_refs > 0, "unlock of unlocked radix node {id}");
            n.lock_refs -= 1;
            if Self::is_evictable(n) {
                self.evictable.insert((n.last_access, id));
            }
            id = n.parent;
        }
    }
}
