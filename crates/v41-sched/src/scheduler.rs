//! The scheduler: owns requests, block pools and the prefix cache, and plans every engine step.
//!
//! Lifecycle: `add_request` (validated; rejected if it can never fit) → waiting → admitted by `step`
//! (prefix hit, blocks, state row) → running; each step schedules `known − num_computed` tokens per
//! request under one token budget; `update_from_output` commits sampled tokens and rolls back
//! rejected drafts; the request ends by length, `finish_request` or `abort_request`, and its id is
//! reported in the next [`StepOutput`]. Under block pressure a running request is preempted (all blocks
//! freed, recompute from position 0) and re-enters the waiting queue at its original place.
//!
//! No deadlock: `add_request` rejects any request whose peak footprint exceeds a pool (unbounded kinds:
//! all its entries; windowed kinds: its window plus one step's chunk). A request running or admitted
//! alone can always get that footprint: every other block is then held only by the prefix cache,
//! either in unlocked pages (evictable) or in its own locked path, whose unbounded-kind blocks it
//! holds itself and whose other sliding-window blocks are trimmable ([`crate::radix`]). Preemption
//! always picks the least important (highest `priority` value), latest-arrived running request, so
//! the most important one makes progress; waiting requests never overtake the head of the queue, so
//! none starves.
//!
//! Cost: `step` is O(running + scheduled tokens × kinds + changed block-table entries) plus
//! prefix-cache work for admissions and completed pages (block tables travel as diffs of persistent
//! rows, see [`crate::step`]).

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use crate::block_pool::BlockPool;
use crate::error::SchedError;
use crate::geometry::Geometry;
use crate::layout::Layout;
use crate::radix::{PrefixCacheStats, RadixCache};
use crate::request::{FinishReason, Request, RequestStatus};
use crate::step::{Planned, StepOutput};

/// Hasher for request ids (caller-chosen integers): one multiply, good high and low bits.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, id: u64) {
        self.0 = (id ^ (id >> 32)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// Map from request id to slot.
pub(crate) type IdMap = HashMap<u64, u32, BuildHasherDefault<IdHasher>>;

/// Limits of the scheduler (vLLM names).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Token budget of one step (prefill chunks + decode + draft tokens).
    pub max_num_batched_tokens: u32,
    /// Maximum running requests.
    pub max_num_seqs: u32,
    /// Maximum `prompt + max_tokens` of a request, in tokens.
    pub max_model_len: u32,
    /// Optional cap on the tokens one request gets per step (chunks long prefills).
    pub long_prefill_token_threshold: Option<u32>,
    /// Reuse and publish KV pages through the radix prefix cache.
    pub enable_prefix_caching: bool,
}

/// A request as submitted by the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewRequest {
    /// Unique id chosen by the caller.
    pub id: u64,
    /// Prompt token ids (non-empty).
    pub prompt: Vec<u32>,
    /// Output budget in tokens (≥ 1).
    pub max_tokens: u32,
    /// Lower = more important.
    pub priority: i32,
    /// Prefix-cache namespace.
    pub cache_salt: Option<String>,
    /// Maximum speculative draft tokens per step.
    pub lookahead: u32,
}

/// Occupancy of one pool, in blocks (or rows). `used - cached_only` blocks are held by requests
/// (some of them shared with the prefix cache); `cached_only` are reclaimable by eviction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStats {
    /// Blocks with at least one holder.
    pub used: u32,
    /// Of those, blocks whose only holder is the prefix cache (evictable or trimmable; 0 for state
    /// rows, which the cache never holds).
    pub cached_only: u32,
    /// Free blocks.
    pub free: u32,
    /// Pool size.
    pub total: u32,
}

/// Snapshot for metrics and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerStats {
    /// Running requests.
    pub num_running: usize,
    /// Waiting (incl. preempted) requests.
    pub num_waiting: usize,
    /// Per token-indexed kind, in layout order.
    pub kinds: Vec<PoolStats>,
    /// The `cstate` rows, if any.
    pub state_rows: Option<PoolStats>,
    /// Prefix-cache counters.
    pub prefix: PrefixCacheStats,
    /// Preemptions since creation.
    pub num_preemptions: u64,
}

/// See the module docs.
#[derive(Debug, Clone)]
pub struct Scheduler {
    pub(crate) layout: Layout,
    pub(crate) geometry: Geometry,
    pub(crate) config: SchedulerConfig,
    pub(crate) pools: Vec<BlockPool>,
    pub(crate) state_pool: Option<BlockPool>,
    /// Free rows of the persistent block tables (`0..max_num_seqs`; see [`crate::step`]).
    pub(crate) free_table_rows: Vec<u32>,
    /// `[max_num_seqs × kinds]`: entries of each row the consumer's tables may hold a block in (beyond
    /// them the row is `-1`); a new occupant's first diff clears its predecessor's tail.
    pub(crate) table_row_widths: Vec<u32>,
    pub(crate) radix: RadixCache,
    pub(crate) slots: Vec<Option<Request>>,
    pub(crate) free_slots: Vec<u32>,
    pub(crate) index: IdMap,
    /// Slots of running requests, in admission order.
    pub(crate) running: Vec<u32>,
    /// Waiting and preempted requests by `(priority, arrival)`.
    pub(crate) waiting: BTreeMap<(i32, u64), u32>,
    pub(crate) next_arrival: u64,
    /// Ended since the last step, reported by the next one.
    pub(crate) finished: Vec<(u64, FinishReason)>,
    pub(crate) num_preemptions: u64,
    /// Scratch: blocks needed per kind.
    pub(crate) scratch_needed: Vec<u32>,
    /// Scratch buffers of `step` (kept for their capacity).
    pub(crate) scratch_order: Vec<u32>,
    pub(crate) scratch_prefills: Vec<u32>,
    pub(crate) scratch_planned: Vec<Planned>,
}

impl Scheduler {
    /// Builds a scheduler with empty pools.
    ///
    /// # Errors
    /// [`SchedError::InvalidConfig`] if a limit is zero.
    pub fn new(layout: Layout, config: SchedulerConfig) -> Result<Self, SchedError> {
        let bad = |what: &str| Err(SchedError::InvalidConfig(format!("{what} must be > 0")));
        if config.max_num_batched_tokens == 0 {
            return bad("max_num_batched_tokens");
        }
        if config.max_num_seqs == 0 {
            return bad("max_num_seqs");
        }
        if config.max_model_len < 2 {
            return Err(SchedError::InvalidConfig(
                "max_model_len must be >= 2".into(),
            ));
        }
        if config.long_prefill_token_threshold == Some(0) {
            return bad("long_prefill_token_threshold");
        }
        Ok(Self {
            pools: layout
                .kinds()
                .iter()
                .map(|k| BlockPool::new(k.num_blocks))
                .collect(),
            state_pool: layout.state().map(|s| BlockPool::new(s.state_rows)),
            free_table_rows: (0..config.max_num_seqs).rev().collect(),
            table_row_widths: vec![0; config.max_num_seqs as usize * layout.kinds().len()],
            radix: RadixCache::new(&layout),
            scratch_needed: vec![0; layout.kinds().len()],
            geometry: Geometry::new(&layout),
            layout,
            config,
            slots: Vec::new(),
            free_slots: Vec::new(),
            index: IdMap::default(),
            running: Vec::new(),
            waiting: BTreeMap::new(),
            next_arrival: 0,
            finished: Vec::new(),
            num_preemptions: 0,
            scratch_order: Vec::new(),
            scratch_prefills: Vec::new(),
            scratch_planned: Vec::new(),
        })
    }

    /// The cache layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The limits.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The request with this id, if it is waiting or running.
    pub fn request(&self, id: u64) -> Option<&Request> {
        self.index.get(&id).map(|&slot| self.req(slot))
    }

    /// Reference count of `block` in the pool of kind `kind` (0 = free); for tests and debugging.
    pub fn block_ref_count(&self, kind: usize, block: i32) -> u32 {
        self.pools[kind].ref_count(block)
    }

    #[inline]
    pub(crate) fn req(&self, slot: u32) -> &Request {
        self.slots[slot as usize].as_ref().expect("live slot")
    }

    #[inline]
    pub(crate) fn req_mut(&mut self, slot: u32) -> &mut Request {
        self.slots[slot as usize].as_mut().expect("live slot")
    }

    /// Peak blocks of kind `k` a request of `total_tokens` (prompt + max_tokens) can hold at once.
    fn footprint_blocks(&self, k: usize, total_tokens: u64) -> u64 {
        let kind = &self.layout.kinds()[k];
        // Positions ever computed are < total − 1 (the last output token is never fed back).
        let all = kind.blocks_for_tokens(total_tokens - 1);
        let Some(window) = kind.window_tokens else {
            return all;
        };
        let cap = self.config.long_prefill_token_threshold.unwrap_or(u32::MAX);
        let chunk = u64::from(self.config.max_num_batched_tokens.min(cap)).min(total_tokens);
        let span = u64::from(window) - 1 + chunk; // positions [c − W + 1, c + n − 1]
        let b = u64::from(kind.tokens_per_block);
        all.min((span + b - 2) / b + 1)
    }

    /// Queues a request.
    ///
    /// # Errors
    /// Duplicate id, empty prompt, `max_tokens == 0`, `prompt + max_tokens > max_model_len`, or a
    /// footprint larger than some pool ([`SchedError::ExceedsPool`] names the kind and `num_blocks`).
    pub fn add_request(&mut self, new: NewRequest) -> Result<(), SchedError> {
        let id = new.id;
        if self.index.contains_key(&id) {
            return Err(SchedError::DuplicateRequest { id });
        }
        let invalid = |reason: &str| {
            Err(SchedError::InvalidRequest {
                id,
                reason: reason.into(),
            })
        };
        if new.prompt.is_empty() {
            return invalid("prompt is empty");
        }
        if new.max_tokens == 0 {
            return invalid("max_tokens must be >= 1");
        }
        let total = new.prompt.len() as u64 + u64::from(new.max_tokens);
        if total > u64::from(self.config.max_model_len) {
            return Err(SchedError::ExceedsMaxModelLen {
                id,
                prompt_tokens: new.prompt.len(),
                max_tokens: new.max_tokens,
                max_model_len: self.config.max_model_len,
            });
        }
        for (k, kind) in self.layout.kinds().iter().enumerate() {
            let needed = self.footprint_blocks(k, total);
            if needed > u64::from(kind.num_blocks) {
                return Err(SchedError::ExceedsPool {
                    id,
                    kind: kind.name.clone(),
                    needed_blocks: needed,
                    num_blocks: kind.num_blocks,
                });
            }
        }
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        let mut req = Request::new(id, new.prompt, new.max_tokens, new.priority, arrival);
        req.cache_salt = new.cache_salt;
        req.lookahead = new.lookahead;
        let kinds = self.layout.kinds().len();
        req.block_tables = vec![Vec::new(); kinds];
        req.released_blocks = vec![0; kinds];
        req.table_synced = vec![0; kinds];
        req.table_released_sent = vec![0; kinds];
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Some(req);
                slot
            }
            None => {
                self.slots.push(Some(req));
                (self.slots.len() - 1) as u32
            }
        };
        self.index.insert(id, slot);
        self.waiting.insert((new.priority, arrival), slot);
        Ok(())
    }

    /// Ends a request because Python decided so (EOS, stop string): its computed pages go to the
    /// prefix cache, its blocks are freed, and the next step reports it with reason `stop`. Call it
    /// once the last step's forward has run (its KV is written), as for `update_from_output`, or while a
    /// later step that holds the request is still queued on the device (async output processing, async
    /// scheduling): its freed blocks and cached pages are handed out only by a later `step`, whose forward
    /// the engine queues after that one on the same device stream (with async scheduling that stream order
    /// is the only guard: the next step is launched before the earlier one has run).
    ///
    /// # Errors
    /// [`SchedError::UnknownRequest`] if the id is not waiting or running.
    pub fn finish_request(&mut self, id: u64) -> Result<(), SchedError> {
        self.end_request_id(id, FinishReason::Stop)
    }

    /// Aborts a request in any state: frees everything, reported with reason `abort`.
    ///
    /// # Errors
    /// [`SchedError::UnknownRequest`] if the id is not waiting or running (no side effects).
    pub fn abort_request(&mut self, id: u64) -> Result<(), SchedError> {
        self.end_request_id(id, FinishReason::Abort)
    }

    /// [`Self::end_request`] by request id; [`SchedError::UnknownRequest`] (no side effects) if the id
    /// is not waiting or running.
    fn end_request_id(&mut self, id: u64, reason: FinishReason) -> Result<(), SchedError> {
        let slot = *self
            .index
            .get(&id)
            .ok_or(SchedError::UnknownRequest { id })?;
        self.end_request(slot, reason);
        Ok(())
    }

    /// Removes request `slot` for good.
    pub(crate) fn end_request(&mut self, slot: u32, reason: FinishReason) {
        let status = self.req(slot).status;
        if status == RequestStatus::Running {
            if reason != FinishReason::Abort && self.config.enable_prefix_caching {
                self.commit_pages(slot);
            }
            self.running.retain(|&s| s != slot);
        } else {
            let key = (self.req(slot).priority, self.req(slot).arrival);
            self.waiting.remove(&key);
        }
        self.free_blocks(slot);
        let mut req = self.slots[slot as usize].take().expect("live slot");
        req.status = if reason == FinishReason::Abort {
            RequestStatus::Aborted
        } else {
            RequestStatus::Finished
        };
        self.index.remove(&req.id);
        self.free_slots.push(slot);
        self.finished.push((req.id, reason));
    }

    /// Frees all blocks, the prefix lock and the state row of a running request; back to waiting
    /// at its original `(priority, arrival)`, to recompute from position 0.
    pub(crate) fn preempt(&mut self, slot: u32) -> u64 {
        self.free_blocks(slot);
        self.running.retain(|&s| s != slot);
        self.num_preemptions += 1;
        let req = self.req_mut(slot);
        req.num_computed = 0;
        req.draft.clear();
        req.status = RequestStatus::Preempted;
        req.prefix_hit_tokens = 0;
        req.scheduled_tokens = 0;
        req.scheduled_drafts = 0;
        req.num_preemptions += 1;
        let (key, id) = ((req.priority, req.arrival), req.id);
        self.waiting.insert(key, slot);
        id
    }

    /// The running request to preempt first: highest `priority` value (least important), then latest
    /// arrival.
    pub(crate) fn pick_victim(&self) -> u32 {
        let key = |&&slot: &&u32| {
            let r = self.req(slot);
            (r.priority, r.arrival)
        };
        *self
            .running
            .iter()
            .max_by_key(key)
            .expect("a running request exists")
    }

    /// Evicts every unlocked page of the prefix cache; returns the number of pages evicted.
    pub fn reset_prefix_cache(&mut self) -> usize {
        self.radix.clear(&mut self.pools)
    }

    /// Current occupancy and counters. Cost: O(prefix-cache pages · kinds) (counts the blocks only
    /// the tree holds).
    pub fn stats(&self) -> SchedulerStats {
        let mut cached_only = vec![0u32; self.pools.len()];
        self.radix.for_each_block(|k, _, blk| {
            if self.pools[k].ref_count(blk) == 1 {
                cached_only[k] += 1;
            }
        });
        let pool_stats = |p: &BlockPool, cached_only: u32| PoolStats {
            used: p.num_used(),
            cached_only,
            free: p.num_free(),
            total: p.num_blocks(),
        };
        SchedulerStats {
            num_running: self.running.len(),
            num_waiting: self.waiting.len(),
            kinds: (self.pools.iter().zip(cached_only))
                .map(|(p, c)| pool_stats(p, c))
                .collect(),
            state_rows: self.state_pool.as_ref().map(|p| pool_stats(p, 0)),
            prefix: self.radix.stats(),
            num_preemptions: self.num_preemptions,
        }
    }

    /// Plans one step; see [`crate::step`].
    pub fn step(&mut self) -> StepOutput {
        let mut out = StepOutput::default();
        crate::step::plan(self, &mut out);
        out
    }

    /// Like [`Scheduler::step`], but refills `out` in place, reusing its buffers (no allocation or
    /// page faults once they have grown: the form for a hot loop).
    pub fn step_into(&mut self, out: &mut StepOutput) {
        crate::step::plan(self, out);
    }
}
