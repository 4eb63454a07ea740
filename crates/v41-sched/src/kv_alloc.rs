//! Per-request block bookkeeping: allocation for scheduled positions, sliding-window release,
//! prefix-hit adoption, publication of computed pages, and freeing.
//!
//! For positions `[num_computed, end)` a kind of ratio r needs logical blocks
//! `0..ceil(floor(end / r) / E)` (entries closed by those tokens); a request's tables grow
//! contiguously, so the new blocks are the missing tail. A windowed kind (ratio 1, window W) keeps only
//! blocks covering positions `>= c − W + 1`, where `c = min(num_computed, committed)` is the next
//! position whose KV is not yet final: the next token attends to `[c − W + 1, c]`. Rolled-back drafts
//! never move `c` below its value at the start of the step that scheduled them, so released blocks
//! are never needed again.

use crate::radix::PrefixMatch;
use crate::scheduler::Scheduler;

impl Scheduler {
    /// First logical block a windowed kind with window `w` must keep for next position `c`.
    fn first_kept_block(&self, w: usize, c: usize) -> usize {
        self.geometry.page.div((c + 1).saturating_sub(w))
    }

    /// Positions covered by blocks in every kind: `min_k(table_k.len()) · B`.
    fn covered_tokens(&self, slot: u32) -> usize {
        let tables = &self.req(slot).block_tables;
        tables.iter().map(Vec::len).min().unwrap_or(0) * self.geometry.page.get()
    }

    /// Allocates the blocks request `slot` needs to compute positions `< end`, all-or-nothing across
    /// kinds, evicting from the prefix cache when short. Returns `false` (nothing allocated) if the
    /// pools cannot provide them.
    #[inline]
    pub(crate) fn try_allocate(&mut self, slot: u32, end: usize) -> bool {
        if end <= self.req(slot).alloc_tokens {
            return true; // decode inside the current blocks: the common case
        }
        self.allocate_more(slot, end)
    }

    fn allocate_more(&mut self, slot: u32, end: usize) -> bool {
        let req = self.slots[slot as usize].as_ref().expect("live slot");
        let mut needed = std::mem::take(&mut self.scratch_needed);
        let mut short = false;
        for (k, geo) in self.geometry.kinds.iter().enumerate() {
            let total = geo.blocks_for(end);
            needed[k] = total.saturating_sub(req.block_tables[k].len()) as u32;
            short |= self.pools[k].num_free() < needed[k];
        }
        if short && self.config.enable_prefix_caching {
            self.radix.evict(&mut self.pools, &needed);
            short = self
                .pools
                .iter()
                .zip(&needed)
                .any(|(p, &n)| p.num_free() < n);
        }
        if !short {
            let req = self.slots[slot as usize].as_mut().expect("live slot");
            for (k, &n) in needed.iter().enumerate() {
                if n > 0 {
                    self.pools[k]
                        .allocate(n, &mut req.block_tables[k])
                        .expect("checked free");
                }
            }
            let covered = self.covered_tokens(slot);
            self.req_mut(slot).alloc_tokens = covered;
        }
        self.scratch_needed = needed;
        !short
    }

    /// Releases windowed-kind blocks that fell behind the window of request `slot`.
    #[inline]
    pub(crate) fn release_window(&mut self, slot: u32) {
        let req = self.slots[slot as usize].as_mut().expect("live slot");
        let c = req.num_computed.min(req.committed_len());
        for &(k, w) in &self.geometry.windowed {
            let keep_from = self.geometry.page.div((c + 1).saturating_sub(w));
            let from = req.released_blocks[k] as usize;
            if keep_from <= from {
                continue; // nothing fell out of the window since the last step
            }
            let table = &mut req.block_tables[k];
            let keep_from = keep_from.min(table.len());
            for blk in &mut table[from.min(keep_from)..keep_from] {
                if *blk >= 0 {
                    self.pools[k].decref(*blk);
                    *blk = -1;
                }
            }
            req.released_blocks[k] = req.released_blocks[k].max(keep_from as u32);
        }
    }

    /// Offers the fully computed, committed pages of request `slot` to the prefix cache.
    #[inline]
    pub(crate) fn commit_pages(&mut self, slot: u32) {
        let req = self.req(slot);
        let pages = self
            .geometry
            .page
            .div(req.num_computed.min(req.committed_len()));
        if pages as u32 > req.cached_pages {
            self.insert_pages(slot, pages);
        }
    }

    fn insert_pages(&mut self, slot: u32, pages: usize) {
        let page = self.geometry.page;
        let req = self.slots[slot as usize].as_mut().expect("live slot");
        let salt = req.cache_salt.as_deref();
        let tokens = &req.token_ids[..pages * page.get()];
        let out = self.radix.insert(
            salt,
            tokens,
            &mut req.block_tables,
            &mut self.pools,
            req.insert_cursor,
        );
        req.cached_pages = pages as u32;
        req.insert_cursor = out.cursor;
        if let Some(p) = out.first_switched_page {
            for synced in &mut req.table_synced {
                *synced = (*synced).min(p);
            }
        }
        // Pin what this request published: evicting it would free nothing it does not hold itself.
        if let Some(last) = out.cursor.map(|c| c.node()) {
            self.radix.extend_lock(req.prefix_lock, last);
            req.prefix_lock = Some(last);
        }
    }

    /// Adopts a prefix hit for a waiting request: takes a reference on every block it will read
    /// (all pages for unbounded kinds, the window before the boundary for windowed kinds) and locks
    /// the hit's path.
    pub(crate) fn take_hit(&mut self, slot: u32, hit: &PrefixMatch) {
        let h = hit.hit_tokens as usize;
        let pages = self.geometry.page.div(h);
        let firsts: Vec<usize> = self
            .geometry
            .kinds
            .iter()
            .map(|k| k.window.map_or(0, |w| self.first_kept_block(w, h)))
            .collect();
        let req = self.slots[slot as usize].as_mut().expect("live slot");
        for (k, first) in firsts.into_iter().enumerate() {
            let table = &mut req.block_tables[k];
            debug_assert!(table.is_empty());
            table.resize(first.min(pages), -1);
            for &blk in &hit.blocks[k][first.min(pages)..pages] {
                assert!(blk >= 0, "prefix hit lacks a block it promised");
                self.pools[k].incref(blk);
                table.push(blk);
            }
            req.released_blocks[k] = first.min(pages) as u32;
        }
        req.num_computed = h;
        req.cached_pages = pages as u32;
        req.alloc_tokens = h;
        if let Some(node) = hit.last_node {
            self.radix.lock(node);
            req.prefix_lock = Some(node);
            req.insert_cursor = Some(self.radix.cursor_at(node));
        }
    }

    /// Drops every block reference, the prefix lock, the state row and the table row of request
    /// `slot`.
    pub(crate) fn free_blocks(&mut self, slot: u32) {
        let req = self.slots[slot as usize].as_mut().expect("live slot");
        for (k, table) in req.block_tables.iter_mut().enumerate() {
            for &blk in table.iter().filter(|&&b| b >= 0) {
                self.pools[k].decref(blk);
            }
            table.clear();
            req.released_blocks[k] = 0;
        }
        if let Some(node) = req.prefix_lock.take() {
            self.radix.unlock(node);
        }
        if let Some(row) = req.table_row.take() {
            self.free_table_rows.push(row);
        }
        if let Some(row) = req.state_row.take() {
            self.state_pool
                .as_mut()
                .expect("state pool")
                .decref(row as i32);
        }
        req.cached_pages = 0;
        req.insert_cursor = None;
        req.alloc_tokens = 0;
    }
}
