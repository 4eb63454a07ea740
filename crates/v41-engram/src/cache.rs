//! The GPU hot-row cache of one Engram layer on one rank: which table rows sit in which device slot.
//!
//! The device holds `hot + staging` slots of one record each. `hot` slots cache rows across steps,
//! replaced by CLOCK (second chance): a hit sets the slot's reference bit; the hand clears set bits and
//! evicts the first slot whose bit is clear. A slot used by a step that is still in flight (planned, not
//! yet [`SlotCache::release`]d) is pinned and never evicted, so a step's rows stay put until its forward
//! has read them. Misses that find no evictable hot slot (a step with more distinct rows than the cache,
//! or every slot pinned) go to the `staging` slots, which are never cached and return to their free list
//! when the step is released; sized for the largest step (times the steps in flight), every step can be
//! planned.
//!
//! [`SlotCache::plan`] turns a step's rows into the slot of each lookup plus the copy list of misses
//! (`row → slot`), which the caller moves to the device before the Engram layer runs. Rows are known from
//! token ids before the forward, so the plan is made when the step is scheduled. Counters: `lookups`
//! (distinct rows per step, summed), `hits + misses = lookups`, `evictions` (cached rows replaced).

use rustc_hash::FxHashMap;

use crate::error::EngramError;

const EMPTY: u64 = u64::MAX;

/// Cumulative counters of one cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Distinct rows looked up, summed over steps.
    pub lookups: u64,
    /// Of those, rows already resident in a hot slot.
    pub hits: u64,
    /// Of those, rows copied in (to a hot or a staging slot).
    pub misses: u64,
    /// Cached rows replaced to make room.
    pub evictions: u64,
    /// Misses that went to a staging slot (not cached).
    pub staged: u64,
}

/// One step's plan: `slots[i]` is the slot of lookup `i`; copy `copy_rows[j]` into `copy_slots[j]`
/// before the step reads the slots.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// Slot of every lookup, same order as the rows given.
    pub slots: Vec<i64>,
    /// Table rows to copy (distinct).
    pub copy_rows: Vec<i64>,
    /// Their destination slots (distinct).
    pub copy_slots: Vec<i64>,
}

/// The slot map of one layer's device cache (module docs).
#[derive(Debug)]
pub struct SlotCache {
    hot: usize,
    staging: usize,
    table_rows: u64,
    resident: FxHashMap<u64, u32>,
    owner: Vec<u64>,
    referenced: Vec<bool>,
    pins: Vec<u32>,
    hand: usize,
    staging_free: Vec<u32>,
    in_flight: FxHashMap<u64, InFlight>,
    stats: CacheStats,
}

/// What an in-flight step holds: its pinned hot slots and its staging slots.
#[derive(Debug, Default)]
struct InFlight {
    pinned: Vec<u32>,
    staging: Vec<u32>,
}

impl SlotCache {
    /// A cache of `hot` cached slots and `staging` per-step slots for a table of `table_rows` rows.
    pub fn new(hot: usize, staging: usize, table_rows: u64) -> Self {
        Self {
            hot,
            staging,
            table_rows,
            resident: FxHashMap::with_capacity_and_hasher(hot, Default::default()),
            owner: vec![EMPTY; hot],
            referenced: vec![false; hot],
            pins: vec![0; hot],
            hand: 0,
            staging_free: (hot as u32..(hot + staging) as u32).rev().collect(),
            in_flight: FxHashMap::default(),
            stats: CacheStats::default(),
        }
    }

    /// Cached slots.
    pub fn hot(&self) -> usize {
        self.hot
    }

    /// Per-step staging slots (they follow the hot ones: slots `hot .. hot + staging`).
    pub fn staging(&self) -> usize {
        self.staging
    }

    /// Cumulative counters.
    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// The hot slot holding `row`, if cached.
    pub fn slot_of(&self, row: u64) -> Option<u32> {
        self.resident.get(&row).copied()
    }

    /// Steps planned and not yet released.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Plan step `step` over `rows` (each in `[0, table_rows)`; repeats share one slot): pins the hot
    /// slots it uses until [`Self::release`]`(step)`.
    ///
    /// Errors: [`EngramError::RowOutOfRange`], [`EngramError::DuplicateStep`] for a step still in flight,
    /// [`EngramError::NoFreeSlots`] when the misses outnumber the evictable hot slots plus the staging
    /// slots. On error the cache is as before (bar evictions of rows nobody was using).
    pub fn plan(&mut self, step: u64, rows: &[i64]) -> Result<StepPlan, EngramError> {
        if self.in_flight.contains_key(&step) {
            return Err(EngramError::DuplicateStep(step));
        }
        if let Some(&row) = rows.iter().find(|&&r| r < 0 || r as u64 >= self.table_rows) {
            return Err(EngramError::RowOutOfRange {
                row,
                rows: self.table_rows,
            });
        }
        let mut plan = StepPlan {
            slots: Vec::with_capacity(rows.len()),
            ..StepPlan::default()
        };
        let mut assigned: FxHashMap<u64, i64> =
            FxHashMap::with_capacity_and_hasher(rows.len(), Default::default());
        let mut held = InFlight::default();
        let mut inserted: Vec<u32> = Vec::new();
        let (mut hits, mut evictions) = (0u64, 0u64);
        for &r in rows {
            let row = r as u64;
            if let Some(&slot) = assigned.get(&row) {
                plan.slots.push(slot);
                continue;
            }
            let slot = if let Some(&slot) = self.resident.get(&row) {
                hits += 1;
                self.referenced[slot as usize] = true;
                self.pin(slot, &mut held.pinned);
                i64::from(slot)
            } else {
                let slot = match self.victim() {
                    Some(slot) => {
                        let old = std::mem::replace(&mut self.owner[slot as usize], row);
                        if old != EMPTY {
                            self.resident.remove(&old);
                            evictions += 1;
                        }
                        self.resident.insert(row, slot);
                        self.referenced[slot as usize] = true;
                        self.pin(slot, &mut held.pinned);
                        inserted.push(slot);
                        i64::from(slot)
                    }
                    None => match self.staging_free.pop() {
                        Some(slot) => {
                            held.staging.push(slot);
                            i64::from(slot)
                        }
                        None => {
                            self.undo(held, &inserted);
                            return Err(self.no_free_slots(rows));
                        }
                    },
                };
                plan.copy_rows.push(r);
                plan.copy_slots.push(slot);
                slot
            };
            assigned.insert(row, slot);
            plan.slots.push(slot);
        }
        let misses = plan.copy_rows.len() as u64;
        self.stats.lookups += hits + misses;
        self.stats.hits += hits;
        self.stats.misses += misses;
        self.stats.evictions += evictions;
        self.stats.staged += held.staging.len() as u64;
        self.in_flight.insert(step, held);
        Ok(plan)
    }

    /// The step's forward has read its slots: unpin them.
    ///
    /// Errors: [`EngramError::UnknownStep`] for a step not in flight.
    pub fn release(&mut self, step: u64) -> Result<(), EngramError> {
        let held = self
            .in_flight
            .remove(&step)
            .ok_or(EngramError::UnknownStep(step))?;
        self.unhold(held);
        Ok(())
    }

    fn pin(&mut self, slot: u32, pinned: &mut Vec<u32>) {
        self.pins[slot as usize] += 1;
        pinned.push(slot);
    }

    /// CLOCK: the next unpinned hot slot whose reference bit is clear (clearing bits on the way); None
    /// when two sweeps find none (every slot pinned, or no hot slots).
    fn victim(&mut self) -> Option<u32> {
        for _ in 0..2 * self.hot {
            let slot = self.hand;
            self.hand = (self.hand + 1) % self.hot;
            if self.pins[slot] > 0 {
                continue;
            }
            if self.referenced[slot] {
                self.referenced[slot] = false;
                continue;
            }
            return Some(slot as u32);
        }
        None
    }

    fn no_free_slots(&self, rows: &[i64]) -> EngramError {
        let mut missing: Vec<u64> = rows
            .iter()
            .map(|&r| r as u64)
            .filter(|r| !self.resident.contains_key(r))
            .collect();
        missing.sort_unstable();
        missing.dedup();
        EngramError::NoFreeSlots {
            needed: missing.len(),
            free: self.pins.iter().filter(|&&p| p == 0).count() + self.staging_free.len(),
            hot: self.hot,
            staging: self.staging,
        }
    }

    fn unhold(&mut self, held: InFlight) {
        for slot in held.pinned {
            self.pins[slot as usize] -= 1;
        }
        self.staging_free.extend(held.staging.into_iter().rev());
    }

    /// Roll back a failed plan: unpin its slots and forget the rows it placed (never copied).
    fn undo(&mut self, held: InFlight, inserted: &[u32]) {
        self.unhold(held);
        for &slot in inserted {
            let row = std::mem::replace(&mut self.owner[slot as usize], EMPTY);
            self.resident.remove(&row);
            self.referenced[slot as usize] = false;
        }
    }
}
