//! Insertion of fully computed pages into the prefix cache.
//!
//! The caller passes its block tables; for each page already cached the request switches to the
//! cached block and drops its own duplicate (the contents are equal: same salt, same tokens, same
//! positions), and a cached page missing a block the request still holds gets it (repair after a
//! trim). New pages take one extra reference on the request's blocks.

use super::{page_hash, root_hash, Node, NodeId, RadixCache, NO_PARENT};
use crate::block_pool::BlockPool;

/// Where an insertion ended; lets the next insertion of the same sequence skip the walk from the
/// root. Stale cursors (the node was evicted) are detected and ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InsertCursor {
    node: NodeId,
    hash: u64,
    pages: u32,
}

/// Result of [`RadixCache::insert`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InsertOutcome {
    /// Leading tokens that were already cached before this call (their duplicate blocks were
    /// switched to the cached ones).
    pub already_cached_tokens: u32,
    /// Tokens now cached for this sequence (≤ the inserted length; shorter only on a hash collision).
    pub cached_tokens: u32,
    /// Resume point for the next insertion of this sequence.
    pub cursor: Option<InsertCursor>,
    /// First page whose block in the caller's tables was switched to a cached one (`None`: the
    /// tables are unchanged).
    pub first_switched_page: Option<u32>,
}

impl InsertCursor {
    pub(super) fn new(node: NodeId, hash: u64, pages: u32) -> Self {
        Self { node, hash, pages }
    }

    /// The deepest node of the inserted sequence.
    pub fn node(&self) -> NodeId {
        self.node
    }
}

impl RadixCache {
    fn root_or_create(&mut self, salt: Option<&str>) -> NodeId {
        if let Some(root) = self.root(salt) {
            return root;
        }
        let node = Node {
            parent: NO_PARENT,
            hash: root_hash(salt),
            page: u32::MAX,
            tokens: Box::default(),
            blocks: Box::default(),
            children: 0,
            lock_refs: 0,
            last_access: self.clock,
            root_salt: salt.map(Box::from),
        };
        let id = self.alloc_node(node);
        match salt {
            None => self.unsalted_root = Some(id),
            Some(s) => {
                self.salted_roots.insert(Box::from(s), id);
            }
        }
        id
    }

    pub(super) fn alloc_node(&mut self, node: Node) -> NodeId {
        match self.free_ids.pop() {
            Some(id) => {
                self.nodes[id as usize] = Some(node);
                id
            }
            None => {
                self.nodes.push(Some(node));
                (self.nodes.len() - 1) as NodeId
            }
        }
    }

    /// Inserts the full pages of `tokens` (its length must be a multiple of the page size) for a
    /// request whose tables are `tables[k][page]`. See the module docs for how duplicate blocks are
    /// reconciled; every reference moved is balanced in `pools`.
    ///
    /// # Panics
    /// If `tokens.len()` is not page-aligned, or a table lacks a block the pool says is free (bugs).
    pub fn insert(
        &mut self,
        salt: Option<&str>,
        tokens: &[u32],
        tables: &mut [Vec<i32>],
        pools: &mut [BlockPool],
        cursor: Option<InsertCursor>,
    ) -> InsertOutcome {
        let b = self.page_tokens as usize;
        assert_eq!(tokens.len() % b, 0, "insert takes whole pages");
        let num_pages = tokens.len() / b;
        if num_pages == 0 {
            return InsertOutcome {
                already_cached_tokens: 0,
                cached_tokens: 0,
                cursor,
                first_switched_page: None,
            };
        }
        let valid = |c: &InsertCursor| {
            c.pages as usize <= num_pages && self.by_hash.get(&c.hash) == Some(&c.node)
        };
        let (start, mut cur, mut h) = match cursor.filter(valid) {
            Some(c) => (c.pages as usize, c.node, c.hash),
            None => {
                let root = self.root_or_create(salt);
                (0, root, self.node(root).hash)
            }
        };
        self.clock += 1;
        let now = self.clock;
        let mut already = start;
        let mut done = start;
        let mut first_switched = None;
        for (p, page) in tokens.chunks_exact(b).enumerate().skip(start) {
            h = page_hash(h, page);
            match self.by_hash.get(&h).copied() {
                Some(id) if self.node(id).parent == cur && *self.node(id).tokens == *page => {
                    if self.share_page(id, p, tables, pools) {
                        first_switched = first_switched.or(Some(p as u32));
                    }
                    self.touch(id, now);
                    if already == p {
                        already = p + 1;
                    }
                    cur = id;
                }
                Some(_) => break, // hash collision: stop caching this sequence here
                None => cur = self.add_page(cur, h, p, page, tables, pools, now),
            }
            done = p + 1;
        }
        if done == 0 {
            self.remove_root_if_empty(cur); // collided on the first page of a namespace created above
        }
        let cursor = (done > 0).then_some(InsertCursor {
            node: cur,
            hash: h,
            pages: done as u32,
        });
        InsertOutcome {
            already_cached_tokens: (already * b) as u32,
            cached_tokens: (done * b) as u32,
            cursor,
            first_switched_page: first_switched,
        }
    }

    /// Reconciles the request's blocks for page `p` with cached node `id`; true if a table entry
    /// changed.
    fn share_page(
        &mut self,
        id: NodeId,
        p: usize,
        tables: &mut [Vec<i32>],
        pools: &mut [BlockPool],
    ) -> bool {
        let mut switched = false;
        let node = self.nodes[id as usize].as_mut().expect("live node");
        for (k, table) in tables.iter_mut().enumerate() {
            let Some(mine) = table.get_mut(p) else {
                continue;
            };
            let cached = &mut node.blocks[k];
            if *mine < 0 || *mine == *cached {
                continue;
            }
            if *cached >= 0 {
                pools[k].incref(*cached);
                pools[k].decref(*mine);
                *mine = *cached;
                switched = true;
            } else {
                pools[k].incref(*mine);
                *cached = *mine;
            }
        }
        switched
    }

    #[allow(clippy::too_many_arguments)]
    fn add_page(
        &mut self,
        parent: NodeId,
        hash: u64,
        p: usize,
        page: &[u32],
        tables: &[Vec<i32>],
        pools: &mut [BlockPool],
        now: u64,
    ) -> NodeId {
        let blocks: Box<[i32]> = tables
            .iter()
            .map(|t| t.get(p).copied().unwrap_or(-1))
            .collect();
        for (k, &blk) in blocks.iter().enumerate() {
            if blk >= 0 {
                pools[k].incref(blk);
            }
        }
        let node = Node {
            parent,
            hash,
            page: p as u32,
            tokens: page.into(),
            blocks,
            children: 0,
            lock_refs: 0,
            last_access: now,
            root_salt: None,
        };
        let id = self.alloc_node(node);
        let par = self.nodes[parent as usize].as_mut().expect("live parent");
        if Self::is_evictable(par) {
            self.evictable.remove(&(par.last_access, parent));
        }
        par.children += 1;
        self.by_hash.insert(hash, id);
        self.evictable.insert((now, id));
        self.stats.cached_pages += 1;
        id
    }
}
