//! One engine step: who runs, how many tokens each, and the flat arrays the model runner needs.
//!
//! Order within the token budget `max_num_batched_tokens`: running decodes (the last committed token
//! plus drafts), then running partial prefills (chunked prefill), then waiting requests by
//! `(priority, arrival)` while fewer than `max_num_seqs` run — skipped in a step that preempted.
//! Each request gets `min(known − num_computed, budget left, long_prefill_token_threshold)` tokens and
//! `num_computed` advances by that count at once (optimistically; `update_from_output` rolls back
//! rejected drafts). A running request that cannot get its blocks preempts the least important
//! (highest `priority` value), latest-arrived running request (possibly itself) and retries; a
//! waiting one that cannot simply waits, and so does everything behind it (no overtaking, hence no
//! starvation).
//!
//! Block tables are persistent on the consumer's side: each running request owns a row
//! (`table_rows`, `0..max_num_seqs`) of one `[max_num_seqs, width]` table per kind, and a step
//! carries only the entries that changed since that row was last sent (`KindStep::diff_*`): blocks
//! appended since, window blocks released since (`-1`, just those entries), pages switched to their
//! prefix-cache copies (from the first switched page on), and
//! for a request admitted into a row its whole table plus `-1` over what the row's previous occupant
//! left. Applying every step's diff in order keeps, for each scheduled request, row
//! `table_rows[i]` equal to its block table over `0..max_blocks` and `-1` beyond its length — the
//! padded `[R, max_blocks]` table of the step is `table[table_rows, :max_blocks]`.

use crate::request::{FinishReason, RequestStatus};
use crate::scheduler::Scheduler;

/// Per token-indexed kind arrays of a step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KindStep {
    /// The longest block table among scheduled requests (the width the step reads).
    pub max_blocks: usize,
    /// `[D]` int32: table row of each changed entry (see the module docs).
    pub diff_rows: Vec<i32>,
    /// `[D]` int32: logical block (column) of each changed entry.
    pub diff_cols: Vec<i32>,
    /// `[D]` int32: the entry's physical block, `-1` = none.
    pub diff_blocks: Vec<i32>,
    /// `[T]` int32: slot written by each scheduled token, in entries of this kind
    /// (`block · entries_per_block + entry % entries_per_block`); `-1` if the token closes no entry.
    pub slot_mapping: Vec<i32>,
}

/// The plan of one step; per-request arrays are `[R]`, per-token arrays `[T]` (requests' tokens
/// concatenated in `req_ids` order).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepOutput {
    /// `[R]` scheduled request ids.
    pub req_ids: Vec<u64>,
    /// `[R]` tokens scheduled per request (sum = T).
    pub num_scheduled: Vec<u32>,
    /// `[R]` position of each request's first scheduled token (= `num_computed` before the step).
    pub start_pos: Vec<u32>,
    /// `[R]` how many of the scheduled tokens are speculative drafts (at the end of the chunk).
    pub num_draft_tokens: Vec<u32>,
    /// `[R]` the chunk starts before the last committed token: it computes prompt (or recomputed)
    /// tokens, not just the last token + drafts. The opposite is a decode.
    pub is_prefill: Vec<bool>,
    /// `[R]` the chunk reaches the last committed token, so the engine samples `1 + accepted drafts`
    /// tokens and must report them with `update_from_output`. False for a partial prefill chunk.
    pub do_sample: Vec<bool>,
    /// `[R]` tokens reused from the prefix cache by requests admitted in this step, else 0.
    pub prefix_hit_tokens: Vec<u32>,
    /// `[T]` token ids.
    pub token_ids: Vec<u32>,
    /// `[T]` positions.
    pub positions: Vec<u32>,
    /// Per token-indexed kind, in layout order.
    pub kinds: Vec<KindStep>,
    /// `[R]` `cstate` row of each request, `-1` if the layout has none.
    pub state_rows: Vec<i32>,
    /// `[R]` persistent block-table row of each request (module docs).
    pub table_rows: Vec<i32>,
    /// Requests preempted in this step (they are not in `req_ids`).
    pub preempted: Vec<u64>,
    /// Requests that ended since the previous step.
    pub finished: Vec<(u64, FinishReason)>,
}

impl StepOutput {
    /// R: scheduled requests.
    pub fn num_reqs(&self) -> usize {
        self.req_ids.len()
    }

    /// T: scheduled tokens.
    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }
}

/// One scheduled request before the arrays are built.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Planned {
    slot: u32,
    tokens: u32,
    hit: u32,
}

/// Tokens request `slot` may compute now within `budget`.
fn tokens_to_schedule(s: &Scheduler, slot: u32, budget: u32) -> u32 {
    let req = s.req(slot);
    let left = (req.known_len() - req.num_computed) as u32;
    left.min(budget)
        .min(s.config.long_prefill_token_threshold.unwrap_or(u32::MAX))
}

pub(crate) fn plan(s: &mut Scheduler, out: &mut StepOutput) {
    let caching = s.config.enable_prefix_caching;
    // One pass: publish computed pages, release the window, classify (decodes first).
    let mut order = std::mem::take(&mut s.scratch_order);
    let mut prefills = std::mem::take(&mut s.scratch_prefills);
    order.clear();
    prefills.clear();
    for i in 0..s.running.len() {
        let slot = s.running[i];
        if caching {
            s.commit_pages(slot);
        }
        s.release_window(slot);
        let req = s.req_mut(slot);
        req.scheduled_tokens = 0;
        req.scheduled_drafts = 0;
        if req.is_decode() {
            order.push(slot)
        } else {
            prefills.push(slot)
        }
    }
    order.extend_from_slice(&prefills);
    let mut budget = s.config.max_num_batched_tokens;
    let mut planned = std::mem::take(&mut s.scratch_planned);
    planned.clear();
    let mut preempted = Vec::new();
    for &slot in &order {
        if s.slots[slot as usize]
            .as_ref()
            .is_none_or(|r| r.status != RequestStatus::Running)
        {
            continue; // preempted earlier in this step
        }
        let tokens = tokens_to_schedule(s, slot, budget);
        if tokens == 0 {
            continue;
        }
        let end = s.req(slot).num_computed + tokens as usize;
        loop {
            if s.try_allocate(slot, end) {
                planned.push(Planned {
                    slot,
                    tokens,
                    hit: 0,
                });
                budget -= tokens;
                break;
            }
            let victim = s.pick_victim();
            preempted.push(s.preempt(victim));
            if let Some(i) = planned.iter().position(|p| p.slot == victim) {
                budget += planned.remove(i).tokens;
            }
            if victim == slot {
                break;
            }
        }
    }
    if preempted.is_empty() {
        admit_waiting(s, &mut planned, &mut budget);
    }
    build_output(s, &planned, preempted, out);
    s.scratch_order = order;
    s.scratch_prefills = prefills;
    s.scratch_planned = planned;
}

/// Admits waiting requests in `(priority, arrival)` order until one does not fit.
fn admit_waiting(s: &mut Scheduler, planned: &mut Vec<Planned>, budget: &mut u32) {
    while s.running.len() < s.config.max_num_seqs as usize && *budget > 0 {
        let Some((&key, &slot)) = s.waiting.first_key_value() else {
            break;
        };
        if s.state_pool.as_ref().is_some_and(|p| p.num_free() == 0) {
            break;
        }
        let hit = if s.config.enable_prefix_caching {
            let req = s.slots[slot as usize].as_ref().expect("live slot");
            s.radix
                .match_prefix(req.cache_salt.as_deref(), &req.token_ids)
        } else {
            Default::default()
        };
        if hit.hit_tokens > 0 {
            s.take_hit(slot, &hit);
        }
        let tokens = tokens_to_schedule(s, slot, *budget);
        let end = hit.hit_tokens as usize + tokens as usize;
        if !s.try_allocate(slot, end) {
            s.free_blocks(slot);
            s.req_mut(slot).num_computed = 0;
            break;
        }
        let row = s
            .state_pool
            .as_mut()
            .map(|p| p.allocate_one().expect("checked free"));
        let table_row = s
            .free_table_rows
            .pop()
            .expect("fewer than max_num_seqs run");
        s.waiting.remove(&key);
        s.running.push(slot);
        let query = s.req(slot).committed_len() as u64;
        if s.config.enable_prefix_caching {
            s.radix.record_query(query, u64::from(hit.hit_tokens));
        }
        let req = s.req_mut(slot);
        req.state_row = row;
        req.table_row = Some(table_row);
        req.table_synced.fill(0);
        req.table_released_sent.fill(0);
        req.status = RequestStatus::Running;
        req.prefix_hit_tokens = hit.hit_tokens;
        planned.push(Planned {
            slot,
            tokens,
            hit: hit.hit_tokens,
        });
        *budget -= tokens;
    }
}

fn build_output(s: &mut Scheduler, planned: &[Planned], preempted: Vec<u64>, out: &mut StepOutput) {
    let num_tokens: usize = planned.iter().map(|p| p.tokens as usize).sum();
    out.req_ids.clear();
    out.num_scheduled.clear();
    out.start_pos.clear();
    out.num_draft_tokens.clear();
    out.is_prefill.clear();
    out.do_sample.clear();
    out.prefix_hit_tokens.clear();
    out.token_ids.clear();
    out.positions.clear();
    out.state_rows.clear();
    out.table_rows.clear();
    out.preempted = preempted;
    out.finished.clear();
    out.finished.append(&mut s.finished);
    let num_kinds = s.geometry.kinds.len();
    out.kinds.resize_with(num_kinds, KindStep::default);
    for kind in &mut out.kinds {
        kind.max_blocks = 0;
        kind.diff_rows.clear();
        kind.diff_cols.clear();
        kind.diff_blocks.clear();
        kind.slot_mapping.clear();
        kind.slot_mapping.reserve(num_tokens);
    }
    // Request-major, so each request's state is touched once.
    for p in planned {
        let req = s.slots[p.slot as usize].as_mut().expect("live slot");
        let (start, end) = (req.num_computed, req.num_computed + p.tokens as usize);
        let row = req.table_row.expect("a running request has a table row");
        let widths = &mut s.table_row_widths[row as usize * num_kinds..][..num_kinds];
        let kinds = s.geometry.kinds.iter().zip(&mut out.kinds);
        let tables = req.block_tables.iter().zip(&req.released_blocks);
        let marks = req
            .table_synced
            .iter_mut()
            .zip(&mut req.table_released_sent);
        for ((((geo, kind), (table, &released)), (synced, released_sent)), width) in
            kinds.zip(tables).zip(marks).zip(widths)
        {
            kind.max_blocks = kind.max_blocks.max(table.len());
            let (from, len) = (*synced as usize, table.len());
            // Window blocks released since the last diff, below the re-sent range.
            let released_to = released.min(*synced);
            if *released_sent < released_to {
                let n = (released_to - *released_sent) as usize;
                kind.diff_rows.resize(kind.diff_rows.len() + n, row as i32);
                kind.diff_cols
                    .extend(*released_sent as i32..released_to as i32);
                kind.diff_blocks.resize(kind.diff_rows.len(), -1);
            }
            *released_sent = released;
            let stale = (*width as usize).max(len);
            if from < stale {
                // Changed entries, then -1 over a previous occupant's longer row.
                kind.diff_rows
                    .resize(kind.diff_rows.len() + stale - from, row as i32);
                kind.diff_cols.extend(from as i32..stale as i32);
                kind.diff_blocks.extend_from_slice(&table[from.min(len)..]);
                kind.diff_blocks.resize(kind.diff_rows.len(), -1);
            }
            *synced = len as u32;
            *width = len as u32;
            if end == start + 1 {
                kind.slot_mapping.push(geo.slot(table, start)); // decode fast path
            } else {
                kind.slot_mapping
                    .extend((start..end).map(|pos| geo.slot(table, pos)));
            }
        }
        let committed = req.committed_len();
        let drafts = end.saturating_sub(committed);
        out.req_ids.push(req.id);
        out.num_scheduled.push(p.tokens);
        out.start_pos.push(start as u32);
        out.num_draft_tokens.push(drafts as u32);
        out.is_prefill.push(start + 1 < committed);
        out.do_sample.push(end >= committed);
        out.prefix_hit_tokens.push(p.hit);
        out.state_rows.push(req.state_row.map_or(-1, |r| r as i32));
        out.table_rows.push(row as i32);
        if end == start + 1 {
            out.token_ids.push(req.token_at(start)); // decode fast path
        } else {
            out.token_ids
                .extend_from_slice(&req.token_ids[start.min(committed)..end.min(committed)]);
            if drafts > 0 {
                out.token_ids
                    .extend_from_slice(&req.draft[start.max(committed) - committed..drafts]);
            }
        }
        out.positions.extend(start as u32..end as u32);
        req.num_computed = end;
        req.scheduled_tokens = p.tokens;
        req.scheduled_drafts = drafts as u32;
    }
}
