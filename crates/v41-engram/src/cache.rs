//! The GPU hot-row cache of one Engram layer on one rank: which table rows sit in which device slot.
//!
//! The device holds `hot + staging` slots of one record each. The `hot` slots cache rows across steps in a
//! set-associative layout: a row can only live in the `ways` (8) slots of its set (a hash of the row picks the
//! set), so finding it reads one cache line of tags — no hash map, which is what keeps planning a 4,096-token
//! chunk (98k lookups) fast. Within a set, CLOCK (second chance) replaces: a hit sets the slot's reference bit;
//! the set's hand clears set bits and evicts the first slot whose bit is clear. A slot used by a step that is
//! still in flight (planned, not yet [`SlotCache::release`]d) is pinned and never evicted, so a step's rows stay
//! put until its forward has read them. Misses that find no evictable slot in their set (every way pinned) go
//! to the `staging` slots, which are never cached and return to their free list when the step is released;
//! sized for the largest step (times the steps in flight), every step can be planned.
//!
//! [`SlotCache::plan`] turns a step's rows into the slot of each lookup plus the copy list of misses
//! (`row → slot`), which the caller moves to the device before the Engram layer runs. Rows are known from
//! token ids before the forward, so the plan is made when the step is scheduled. Counters: `lookups`
//! (distinct rows per step, summed), `hits + misses = lookups`, `evictions` (cached rows replaced).
//!
//! One tag word per hot slot: bits 0–39 `row + 1` (0 = empty), bit 40 the reference bit, bit 41 "used by the
//! step being planned" (a repeat within the step is neither a new lookup nor a new pin), bits 42–63 the pin
//! count (in-flight steps using the slot).

use rustc_hash::FxHashMap;

use crate::error::EngramError;

const WAYS: usize = 8;
const ROW_MASK: u64 = (1 << 40) - 1;
const REF: u64 = 1 << 40;
const IN_STEP: u64 = 1 << 41;
const PIN: u64 = 1 << 42;
const PREFETCH_AHEAD: usize = 16;

/// A zeroed `Vec<u64>` of `n` entries whose pages the kernel is asked to back with transparent huge pages (Linux
/// `MADV_HUGEPAGE`, before the first write), all faulted in: lookups touch random tags, and with 4 KiB pages
/// every one of them would also miss the TLB (a 1 GiB cache has 32 MiB of tags).
fn huge_zeroed(n: usize) -> Vec<u64> {
    let mut v = vec![0u64; n]; // large zeroed allocations are fresh, untouched mappings
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = v.as_ptr() as usize;
        let (lo, hi) = (start.next_multiple_of(HUGE), (start + n * 8) / HUGE * HUGE);
        if hi > lo {
            // SAFETY: [lo, hi) lies inside `v`'s allocation; MADV_HUGEPAGE is advice and changes no contents.
            unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_HUGEPAGE) };
        }
    }
    // Fault every page in now: otherwise the first steps pay a page fault per random tag they touch
    // (hundreds of µs per step for a few thousand steps).
    v.fill(0);
    v
}

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

/// What an in-flight step holds: its pinned hot slots and its staging slots.
#[derive(Debug, Default)]
struct InFlight {
    pinned: Vec<u32>,
    staging: Vec<u32>,
}

/// The slot map of one layer's device cache (module docs).
#[derive(Debug)]
pub struct SlotCache {
    ways: usize,
    sets: usize,
    staging: usize,
    table_rows: u64,
    tags: Vec<u64>,
    hands: Vec<u8>,
    staging_free: Vec<u32>,
    in_flight: FxHashMap<u64, InFlight>,
    stats: CacheStats,
}

impl SlotCache {
    /// A cache of `hot` cached slots (rounded down to a multiple of 8 ways when above 8) and `staging`
    /// per-step slots for a table of `table_rows` rows.
    ///
    /// Errors: [`EngramError::InvalidParams`] for a table of 2^40 rows or more, or more than 2^32 slots.
    pub fn new(hot: usize, staging: usize, table_rows: u64) -> Result<Self, EngramError> {
        if table_rows >= ROW_MASK
            || hot
                .checked_add(staging)
                .is_none_or(|n| n > u32::MAX as usize)
        {
            return Err(EngramError::InvalidParams(format!(
                "a slot cache holds tables below 2^40 rows and at most 2^32 slots, got {table_rows} rows and {hot} + \
                 {staging} slots"
            )));
        }
        let ways = hot.min(WAYS);
        let sets = hot.checked_div(ways).unwrap_or(0);
        let tags = huge_zeroed(sets * ways);
        let mut hands = vec![0u8; sets];
        hands.fill(0); // faulted in now, as the tags
        Ok(Self {
            ways,
            sets,
            staging,
            table_rows,
            tags,
            hands,
            staging_free: ((sets * ways) as u32..(sets * ways + staging) as u32)
                .rev()
                .collect(),
            in_flight: FxHashMap::default(),
            stats: CacheStats::default(),
        })
    }

    /// Cached slots (slots `0 .. hot`).
    pub fn hot(&self) -> usize {
        self.tags.len()
    }

    /// Per-step staging slots (they follow the hot ones: slots `hot .. hot + staging`).
    pub fn staging(&self) -> usize {
        self.staging
    }

    /// Cumulative counters.
    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// Steps planned and not yet released.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The hot slot holding `row`, if cached.
    pub fn slot_of(&self, row: u64) -> Option<u32> {
        if self.sets == 0 {
            return None;
        }
        let base = self.set_of(row) * self.ways;
        (base..base + self.ways)
            .find(|&s| self.tags[s] & ROW_MASK == row + 1)
            .map(|s| s as u32)
    }

    #[inline]
    fn set_of(&self, row: u64) -> usize {
        let h = row.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        ((h as u128 * self.sets as u128) >> 64) as usize
    }

    #[inline]
    fn prefetch(&self, set: usize) {
        self.prefetch_slot(set * self.ways);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `prefetch_slot`; `set < sets == hands.len()`.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            _mm_prefetch::<_MM_HINT_T0>(self.hands.as_ptr().add(set) as *const i8);
        }
    }

    #[inline]
    fn prefetch_slot(&self, slot: usize) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a prefetch is a hint; it never faults, and the address is inside `tags`.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            _mm_prefetch::<_MM_HINT_T0>(self.tags.as_ptr().add(slot) as *const i8);
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = slot;
    }

    /// Plan step `step` over `rows` (each in `[0, table_rows)`; repeats share one slot): pins the hot
    /// slots it uses until [`Self::release`]`(step)`.
    ///
    /// Errors: [`EngramError::RowOutOfRange`], [`EngramError::DuplicateStep`] for a step still in flight,
    /// [`EngramError::NoFreeSlots`] when a set's misses outnumber its evictable ways and the staging
    /// slots run out. On error the cache is as before (bar evictions of rows nobody was using).
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
        let sets: Vec<usize> = if self.sets == 0 {
            Vec::new()
        } else {
            rows.iter().map(|&r| self.set_of(r as u64)).collect()
        };
        let mut plan = StepPlan {
            slots: Vec::with_capacity(rows.len()),
            ..StepPlan::default()
        };
        let mut held = InFlight::default();
        let mut inserted: Vec<u32> = Vec::new();
        let mut staged_rows: FxHashMap<u64, i64> = FxHashMap::default();
        let (mut hits, mut evictions) = (0u64, 0u64);
        for (i, &r) in rows.iter().enumerate() {
            if let Some(&set) = sets.get(i + PREFETCH_AHEAD) {
                self.prefetch(set);
            }
            let row = r as u64;
            let slot = match sets.get(i) {
                Some(&set) => self.lookup(set, row),
                None => None,
            };
            let slot = match slot {
                Some(s) => {
                    let tag = &mut self.tags[s];
                    if *tag & IN_STEP == 0 {
                        hits += 1;
                        *tag |= IN_STEP | REF;
                        *tag += PIN;
                        held.pinned.push(s as u32);
                    }
                    s as i64
                }
                None if staged_rows.contains_key(&row) => staged_rows[&row],
                None => {
                    let slot = match sets.get(i).and_then(|&set| self.victim(set)) {
                        Some(s) => {
                            if self.tags[s] & ROW_MASK != 0 {
                                evictions += 1;
                            }
                            self.tags[s] = (row + 1) | REF | IN_STEP | PIN;
                            held.pinned.push(s as u32);
                            inserted.push(s as u32);
                            s as i64
                        }
                        None => match self.staging_free.pop() {
                            Some(s) => {
                                held.staging.push(s);
                                staged_rows.insert(row, i64::from(s));
                                i64::from(s)
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
                }
            };
            plan.slots.push(slot);
        }
        self.each_pinned(&held.pinned, |tag| *tag &= !IN_STEP);
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

    #[inline]
    fn lookup(&self, set: usize, row: u64) -> Option<usize> {
        let base = set * self.ways;
        (base..base + self.ways).find(|&s| self.tags[s] & ROW_MASK == row + 1)
    }

    /// CLOCK within `set`: the next unpinned way whose reference bit is clear (clearing bits on the way);
    /// None when two sweeps find none (every way pinned).
    fn victim(&mut self, set: usize) -> Option<usize> {
        let base = set * self.ways;
        for _ in 0..2 * self.ways {
            let way = self.hands[set] as usize;
            self.hands[set] = if way + 1 == self.ways {
                0
            } else {
                way as u8 + 1
            };
            let tag = &mut self.tags[base + way];
            if *tag >= PIN {
                continue;
            }
            if *tag & REF != 0 {
                *tag &= !REF;
                continue;
            }
            return Some(base + way);
        }
        None
    }

    /// `f` on the tag of every slot in `slots` (random slots: the tags are prefetched ahead).
    fn each_pinned(&mut self, slots: &[u32], f: impl Fn(&mut u64)) {
        for (i, &s) in slots.iter().enumerate() {
            if let Some(&ahead) = slots.get(i + PREFETCH_AHEAD) {
                self.prefetch_slot(ahead as usize);
            }
            f(&mut self.tags[s as usize]);
        }
    }

    fn unhold(&mut self, held: InFlight) {
        self.each_pinned(&held.pinned, |tag| *tag -= PIN);
        self.staging_free.extend(held.staging.into_iter().rev());
    }

    fn no_free_slots(&self, rows: &[i64]) -> EngramError {
        let mut missing: Vec<u64> = rows
            .iter()
            .map(|&r| r as u64)
            .filter(|&r| self.slot_of(r).is_none())
            .collect();
        missing.sort_unstable();
        missing.dedup();
        EngramError::NoFreeSlots {
            needed: missing.len(),
            free: self.tags.iter().filter(|&&t| t < PIN).count() + self.staging_free.len(),
            hot: self.tags.len(),
            staging: self.staging,
        }
    }

    /// Roll back a failed plan: unpin its slots and forget the rows it placed (never copied).
    fn undo(&mut self, held: InFlight, inserted: &[u32]) {
        self.each_pinned(&held.pinned, |tag| *tag &= !IN_STEP);
        self.unhold(held);
        for &s in inserted {
            self.tags[s as usize] = 0;
        }
    }
}
