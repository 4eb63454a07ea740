//! Whole-state consistency check, O(blocks + nodes + Σ table sizes); for tests and debugging.

use std::collections::HashMap;

use crate::request::RequestStatus;
use crate::scheduler::Scheduler;

impl Scheduler {
    /// Checks every invariant the scheduler relies on:
    /// - per pool: free list = blocks with reference count 0; `free + used == total`;
    /// - the reference count of every block equals its holders (request tables + tree nodes), and
    ///   all holders of a block hold it for the same logical page;
    /// - a shared block (count > 1) covers a page that every holding request has fully computed and
    ///   committed, so no one writes into it;
    /// - windowed tables: released entries are `-1`, the rest resident;
    /// - running ≤ `max_num_seqs`, each running request owns a distinct state row (if any) and a
    ///   distinct table row, the other table rows are free; waiting requests hold nothing;
    /// - radix lock counts equal the number of requests whose hit path covers the node, plus the
    ///   tree's own structural invariants.
    ///
    /// # Errors
    /// A description of the first violation.
    pub fn check_invariants(&self) -> Result<(), String> {
        let b = self.layout.page_tokens() as usize;
        // (kind, block) -> (holders, page)
        let mut holders: HashMap<(usize, i32), (u32, u32)> = HashMap::new();
        let mut hold = |k: usize, blk: i32, page: u32, who: &str| -> Result<(), String> {
            let entry = holders.entry((k, blk)).or_insert((0, page));
            if entry.1 != page {
                return Err(format!(
                    "kind {k} block {blk} held for pages {} and {page} ({who})",
                    entry.1
                ));
            }
            entry.0 += 1;
            Ok(())
        };
        self.radix.check()?;
        let mut tree_blocks = Vec::new();
        self.radix
            .for_each_block(|k, page, blk| tree_blocks.push((k, page, blk)));
        for (k, page, blk) in tree_blocks {
            hold(k, blk, page, "tree")?;
        }
        let mut locks: HashMap<u32, u32> = HashMap::new();
        let mut rows = Vec::new();
        let mut table_rows = self.free_table_rows.clone();
        for req in self.slots.iter().flatten() {
            let who = format!("request {}", req.id);
            let running = req.status == RequestStatus::Running;
            if !running
                && (req.block_tables.iter().any(|t| !t.is_empty()) || req.prefix_lock.is_some())
            {
                return Err(format!("{who} is not running but holds blocks"));
            }
            if running != self.running.contains(&self.index[&req.id]) {
                return Err(format!(
                    "{who}: status {:?} disagrees with the running list",
                    req.status
                ));
            }
            if let Some(node) = req.prefix_lock {
                for id in self.radix.path_to_root(node) {
                    *locks.entry(id).or_default() += 1;
                }
            }
            match (running, req.table_row) {
                (true, Some(row)) => table_rows.push(row),
                (false, None) => {}
                _ => {
                    return Err(format!(
                        "{who}: running {running}, table row {:?}",
                        req.table_row
                    ))
                }
            }
            if running && self.state_pool.is_some() {
                rows.push(
                    req.state_row
                        .ok_or(format!("{who} runs without a state row"))?,
                );
            }
            let stable = req.num_computed.min(req.committed_len());
            let covered = req.block_tables.iter().map(Vec::len).min().unwrap_or(0) * b;
            if req.alloc_tokens > covered {
                return Err(format!(
                    "{who}: alloc_tokens {} > covered {covered}",
                    req.alloc_tokens
                ));
            }
            for (k, table) in req.block_tables.iter().enumerate() {
                let released = req.released_blocks[k] as usize;
                for (page, &blk) in table.iter().enumerate() {
                    if (page < released) != (blk < 0) {
                        return Err(format!(
                            "{who}: kind {k} page {page} block {blk}, released below {released}"
                        ));
                    }
                    if blk < 0 {
                        continue;
                    }
                    hold(k, blk, page as u32, &who)?;
                    if self.pools[k].ref_count(blk) > 1 && (page + 1) * b > stable {
                        return Err(format!(
                            "{who}: shared kind {k} block {blk} at page {page} is still written"
                        ));
                    }
                }
            }
        }
        for (k, pool) in self.pools.iter().enumerate() {
            pool.check_free_list()
                .map_err(|e| format!("kind {k}: {e}"))?;
            for blk in 0..pool.num_blocks() as i32 {
                let held = holders.get(&(k, blk)).map_or(0, |h| h.0);
                if pool.ref_count(blk) != held {
                    return Err(format!(
                        "kind {k} block {blk}: ref count {} but {held} holders",
                        pool.ref_count(blk)
                    ));
                }
            }
        }
        for (node, count) in self.radix.lock_counts() {
            if count != locks.get(&node).copied().unwrap_or(0) {
                return Err(format!(
                    "radix node {node} has {count} locks, expected {:?}",
                    locks.get(&node)
                ));
            }
        }
        if self.running.len() > self.config.max_num_seqs as usize {
            return Err(format!("{} running > max_num_seqs", self.running.len()));
        }
        if let Some(pool) = &self.state_pool {
            pool.check_free_list()?;
            let mut sorted = rows.clone();
            sorted.sort_unstable();
            sorted.dedup();
            if sorted.len() != rows.len() || pool.num_used() as usize != rows.len() {
                return Err("state rows are shared or leaked".into());
            }
        }
        table_rows.sort_unstable();
        if !table_rows.iter().copied().eq(0..self.config.max_num_seqs) {
            return Err("table rows are shared or leaked".into());
        }
        if self.running.len() + self.waiting.len() != self.index.len() {
            return Err("running + waiting != live requests".into());
        }
        Ok(())
    }
}
