//! Radix (page trie) prefix cache over token ids, one namespace per cache salt.
//!
//! A node is one page of `B = page_tokens` tokens. It stores the page's tokens, a content hash
//! chained from its parent ([`hash`]), and one block reference per token-indexed kind (`-1` when the
//! page's block of that kind is not resident: a sliding-window block that was released before the
//! page was inserted, or trimmed under pressure). Each salt has its own root sentinel (no tokens, no
//! blocks); requests only share pages with the same salt.
//!
//! Invariants (see [`RadixCache::check`]):
//! - every non-root node's `children` counts its live children, and `page` = parent's `page + 1`;
//! - `lock_refs(parent) >= lock_refs(child)` (a lock covers the whole path from the root; running
//!   requests lock the pages they reuse and publish);
//! - `evictable` holds exactly the unlocked non-root leaves, keyed by last access (LRU first);
//! - each held block id is one reference in its pool (the scheduler counts them all).
//!
//! A match is only as long as what is resident and usable: every unbounded kind must have the blocks
//! of all pages before the boundary, every windowed kind the blocks covering the window before the
//! boundary, and the boundary is aligned to every compression ratio (always true for page-aligned
//! boundaries once [`crate::layout::Layout`] validated the ratios, but checked anyway). Never wrong, at
//! worst less reuse.
//!
//! Cost: match and insert are O(pages · (B + kinds)) with one hash-map probe per page; eviction is
//! O(log n) per node; trimming windowed blocks scans all nodes (only when a windowed pool is short
//! after leaf eviction).

mod evict;
pub mod hash;
mod insert;
mod lock;

use std::collections::{BTreeSet, HashMap};

use crate::layout::Layout;
use hash::{page_hash, root_hash, IdentityBuild};

pub use insert::{InsertCursor, InsertOutcome};

/// Index of a node in the tree's arena.
pub type NodeId = u32;

const NO_PARENT: NodeId = NodeId::MAX;

#[derive(Debug, Clone)]
struct Node {
    /// `NO_PARENT` for a root sentinel.
    parent: NodeId,
    /// Chained content hash (the root's is the salt seed).
    hash: u64,
    /// Page index in the sequence (0 = first page); unused for roots.
    page: u32,
    /// The page's tokens; empty for roots.
    tokens: Box<[u32]>,
    /// One block per token-indexed kind, `-1` = not resident; empty for roots.
    blocks: Box<[i32]>,
    /// Live children.
    children: u32,
    /// Requests using this node as part of a prefix hit.
    lock_refs: u32,
    /// Logical clock of the last match/insert touching the node.
    last_access: u64,
    /// The salt of a root sentinel (`None` for the unsalted root and for pages).
    root_salt: Option<Box<str>>,
}

impl Node {
    fn is_root(&self) -> bool {
        self.parent == NO_PARENT
    }
}

/// Result of [`RadixCache::match_prefix`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Usable cached prefix in tokens: a multiple of the page size, `< tokens.len()`.
    pub hit_tokens: u32,
    /// Deepest node of the hit (lock it while the hit is in use).
    pub last_node: Option<NodeId>,
    /// `blocks[k][p]`: block of kind `k` for page `p < hit_tokens / B`, `-1` if not resident
    /// (only possible for windowed kinds, outside the window before the boundary).
    pub blocks: Vec<Vec<i32>>,
}

/// Prefix-cache counters, in tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Prompt tokens looked up at admission.
    pub query_tokens: u64,
    /// Of those, tokens served from the cache.
    pub hit_tokens: u64,
    /// Pages currently in the tree.
    pub cached_pages: u64,
}

/// The prefix cache; see the module docs.
#[derive(Debug, Clone)]
pub struct RadixCache {
    page_tokens: u32,
    /// Per kind: sliding window in tokens, `None` = unbounded.
    windows: Vec<Option<u32>>,
    /// Least common multiple of all compression ratios.
    align_tokens: u32,
    nodes: Vec<Option<Node>>,
    free_ids: Vec<NodeId>,
    by_hash: HashMap<u64, NodeId, IdentityBuild>,
    salted_roots: HashMap<Box<str>, NodeId>,
    unsalted_root: Option<NodeId>,
    /// Unlocked non-root leaves, `(last_access, id)`, oldest first.
    evictable: BTreeSet<(u64, NodeId)>,
    clock: u64,
    stats: PrefixCacheStats,
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl RadixCache {
    /// An empty cache for the token-indexed kinds of `layout`.
    pub fn new(layout: &Layout) -> Self {
        let align_tokens = layout.kinds().iter().fold(1u32, |acc, k| {
            acc / gcd(acc, k.tokens_per_entry) * k.tokens_per_entry
        });
        Self {
            page_tokens: layout.page_tokens(),
            windows: layout.kinds().iter().map(|k| k.window_tokens).collect(),
            align_tokens,
            nodes: Vec::new(),
            free_ids: Vec::new(),
            by_hash: HashMap::default(),
            salted_roots: HashMap::new(),
            unsalted_root: None,
            evictable: BTreeSet::new(),
            clock: 0,
            stats: PrefixCacheStats::default(),
        }
    }

    /// Page size in tokens.
    pub fn page_tokens(&self) -> u32 {
        self.page_tokens
    }

    /// Counters (query/hit tokens recorded by [`RadixCache::record_query`]).
    pub fn stats(&self) -> PrefixCacheStats {
        self.stats
    }

    /// Records one admission's lookup: `query_tokens` looked up, `hit_tokens` reused.
    pub fn record_query(&mut self, query_tokens: u64, hit_tokens: u64) {
        self.stats.query_tokens += query_tokens;
        self.stats.hit_tokens += hit_tokens;
    }

    fn node(&self, id: NodeId) -> &Node {
        self.nodes[id as usize].as_ref().expect("live node")
    }

    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        self.nodes[id as usize].as_mut().expect("live node")
    }

    fn root(&self, salt: Option<&str>) -> Option<NodeId> {
        match salt {
            None => self.unsalted_root,
            Some(s) => self.salted_roots.get(s).copied(),
        }
    }

    fn is_evictable(node: &Node) -> bool {
        !node.is_root() && node.children == 0 && node.lock_refs == 0
    }

    /// Sets the last access of `id`, keeping the LRU set in order.
    fn touch(&mut self, id: NodeId, now: u64) {
        let node = self.nodes[id as usize].as_mut().expect("live node");
        if Self::is_evictable(node) {
            self.evictable.remove(&(node.last_access, id));
            self.evictable.insert((now, id));
        }
        node.last_access = now;
    }

    /// Longest usable cached prefix of `tokens` in the namespace of `salt`, capped at
    /// `tokens.len() − 1` so that at least one token is computed. Refreshes the path's LRU time;
    /// takes no references (the caller increfs what it keeps, and locks `last_node`).
    pub fn match_prefix(&mut self, salt: Option<&str>, tokens: &[u32]) -> PrefixMatch {
        let kinds = self.windows.len();
        let Some(root) = self.root(salt) else {
            return PrefixMatch {
                blocks: vec![Vec::new(); kinds],
                ..PrefixMatch::default()
            };
        };
        let b = self.page_tokens as usize;
        let max_pages = tokens.len().saturating_sub(1) / b;
        let mut path = Vec::with_capacity(max_pages);
        let (mut cur, mut h) = (root, self.node(root).hash);
        for page in tokens.chunks_exact(b).take(max_pages) {
            h = page_hash(h, page);
            match self.by_hash.get(&h) {
                Some(&id) if self.node(id).parent == cur && *self.node(id).tokens == *page => {
                    path.push(id);
                    cur = id;
                }
                _ => break,
            }
        }
        path.truncate(self.usable_pages(&path));
        self.clock += 1;
        let now = self.clock;
        let mut blocks = vec![Vec::with_capacity(path.len()); kinds];
        for &id in &path {
            self.touch(id, now);
            for (k, col) in blocks.iter_mut().enumerate() {
                col.push(self.node(id).blocks[k]);
            }
        }
        PrefixMatch {
            hit_tokens: (path.len() * b) as u32,
            last_node: path.last().copied(),
            blocks,
        }
    }

    /// Number of leading pages of `path` usable as a hit (see module docs).
    fn usable_pages(&self, path: &[NodeId]) -> usize {
        let b = self.page_tokens as usize;
        let unbounded: Vec<usize> = (0..self.windows.len())
            .filter(|&k| self.windows[k].is_none())
            .collect();
        let limit = path
            .iter()
            .position(|&id| unbounded.iter().any(|&k| self.node(id).blocks[k] < 0))
            .unwrap_or(path.len());
        (1..=limit)
            .rev()
            .find(|&t| (t * b) % self.align_tokens as usize == 0 && self.window_resident(path, t))
            .unwrap_or(0)
    }

    /// Whether every windowed kind has the blocks covering the window before a boundary of
    /// `pages` pages: positions `[T − W + 1, T − 1]` with `T = pages · B`.
    fn window_resident(&self, path: &[NodeId], pages: usize) -> bool {
        let b = self.page_tokens as usize;
        let boundary = pages * b;
        self.windows.iter().enumerate().all(|(k, w)| match w {
            None => true,
            Some(w) => {
                let first_page = (boundary + 1).saturating_sub(*w as usize) / b;
                path[first_page..pages]
                    .iter()
                    .all(|&id| self.node(id).blocks[k] >= 0)
            }
        })
    }

    /// A cursor at `node` for [`RadixCache::insert`] (after a prefix hit ending there).
    pub fn cursor_at(&self, node: NodeId) -> InsertCursor {
        let n = self.node(node);
        InsertCursor::new(node, n.hash, n.page + 1)
    }

    /// The page nodes from `node` up to (excluding) its root, deepest first.
    pub fn path_to_root(&self, node: NodeId) -> Vec<NodeId> {
        let mut path = Vec::new();
        let mut id = node;
        while !self.node(id).is_root() {
            path.push(id);
            id = self.node(id).parent;
        }
        path
    }

    /// Lock count of every live page node, as `(node, lock_refs)`.
    pub fn lock_counts(&self) -> Vec<(NodeId, u32)> {
        let live = self.nodes.iter().enumerate();
        live.filter_map(|(id, n)| {
            n.as_ref()
                .filter(|n| !n.is_root())
                .map(|n| (id as NodeId, n.lock_refs))
        })
        .collect()
    }

    /// Calls `f(kind, page, block)` for every resident block reference held by the tree.
    pub fn for_each_block(&self, mut f: impl FnMut(usize, u32, i32)) {
        for node in self.nodes.iter().flatten() {
            for (k, &blk) in node.blocks.iter().enumerate() {
                if blk >= 0 {
                    f(k, node.page, blk);
                }
            }
        }
    }

    /// Checks the structural invariants of the module docs. O(nodes); for tests.
    pub fn check(&self) -> Result<(), String> {
        let mut children = vec![0u32; self.nodes.len()];
        let mut evictable = BTreeSet::new();
        for (id, node) in self.nodes.iter().enumerate() {
            let Some(node) = node else { continue };
            if node.is_root() {
                continue;
            }
            let parent = self
                .nodes
                .get(node.parent as usize)
                .and_then(|p| p.as_ref());
            let parent = parent.ok_or(format!("node {id} has a dead parent"))?;
            children[node.parent as usize] += 1;
            if !parent.is_root() && parent.lock_refs < node.lock_refs {
                return Err(format!("node {id} is locked more than its parent"));
            }
            let expected_page = if parent.is_root() { 0 } else { parent.page + 1 };
            if node.page != expected_page {
                return Err(format!(
                    "node {id} has page {} but parent implies {expected_page}",
                    node.page
                ));
            }
            if self.by_hash.get(&node.hash) != Some(&(id as NodeId)) {
                return Err(format!("node {id} is not indexed by its hash"));
            }
            if Self::is_evictable(node) {
                evictable.insert((node.last_access, id as NodeId));
            }
        }
        for (id, node) in self.nodes.iter().enumerate() {
            if let Some(node) = node {
                if node.children != children[id] {
                    return Err(format!(
                        "node {id} counts {} children, has {}",
                        node.children, children[id]
                    ));
                }
            }
        }
        if evictable != self.evictable {
            return Err("evictable set differs from the unlocked leaves".into());
        }
        let pages = self.nodes.iter().flatten().filter(|n| !n.is_root()).count() as u64;
        if pages != self.stats.cached_pages || pages != self.by_hash.len() as u64 {
            return Err("page count mismatch".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
