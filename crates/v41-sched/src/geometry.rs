//! Precomputed per-kind arithmetic for the hot path: positions → blocks, entries and slots.
//!
//! Divisors are the page size `B`, the ratio `r` and the entries per block `E = B / r`; they are
//! powers of two in every real layout, where division becomes a shift (a general division is kept as
//! the fallback). Everything here mirrors [`crate::layout::CacheKind`] and is only faster.

use crate::layout::{CacheKind, Layout};

/// Division by a fixed positive divisor.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Divisor {
    d: usize,
    shift: u32,
    pow2: bool,
}

impl Divisor {
    pub(crate) fn new(d: u32) -> Self {
        assert!(d > 0, "divisor must be positive");
        Self {
            d: d as usize,
            shift: d.trailing_zeros(),
            pow2: d.is_power_of_two(),
        }
    }

    #[inline]
    pub(crate) fn get(self) -> usize {
        self.d
    }

    #[inline]
    pub(crate) fn div(self, x: usize) -> usize {
        if self.pow2 {
            x >> self.shift
        } else {
            x / self.d
        }
    }

    #[inline]
    pub(crate) fn rem(self, x: usize) -> usize {
        if self.pow2 {
            x & (self.d - 1)
        } else {
            x % self.d
        }
    }
}

/// Arithmetic of one token-indexed kind.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KindGeometry {
    /// Tokens per entry (r).
    pub ratio: Divisor,
    /// Entries per block (E).
    pub entries: Divisor,
    /// Sliding window in tokens, if any.
    pub window: Option<usize>,
}

impl KindGeometry {
    fn new(kind: &CacheKind) -> Self {
        Self {
            ratio: Divisor::new(kind.tokens_per_entry),
            entries: Divisor::new(kind.entries_per_block()),
            window: kind.window_tokens.map(|w| w as usize),
        }
    }

    /// Logical blocks holding every entry closed by positions `< end`.
    #[inline]
    pub(crate) fn blocks_for(self, end: usize) -> usize {
        self.entries
            .div(self.ratio.div(end) + self.entries.get() - 1)
    }

    /// Slot written by the token at `pos` (in entries), `-1` if it closes no entry.
    #[inline]
    pub(crate) fn slot(self, table: &[i32], pos: usize) -> i32 {
        if self.ratio.rem(pos + 1) != 0 {
            return -1;
        }
        let entry = self.ratio.div(pos + 1) - 1;
        let blk = table[self.entries.div(entry)];
        debug_assert!(blk >= 0, "writing through a released block");
        blk * self.entries.get() as i32 + self.entries.rem(entry) as i32
    }
}

/// Arithmetic of a whole layout.
#[derive(Debug, Clone)]
pub(crate) struct Geometry {
    /// Page size B.
    pub page: Divisor,
    /// Per kind, in layout order.
    pub kinds: Vec<KindGeometry>,
    /// `(kind index, window)` of the windowed kinds.
    pub windowed: Vec<(usize, usize)>,
}

impl Geometry {
    pub(crate) fn new(layout: &Layout) -> Self {
        Self {
            page: Divisor::new(layout.page_tokens()),
            kinds: layout.kinds().iter().map(KindGeometry::new).collect(),
            windowed: (layout.kinds().iter().enumerate())
                .filter_map(|(k, kind)| kind.window_tokens.map(|w| (k, w as usize)))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_division_matches_plain_division() {
        for d in [1u32, 2, 3, 4, 7, 64, 128] {
            let div = Divisor::new(d);
            for x in 0..1000usize {
                assert_eq!((div.div(x), div.rem(x)), (x / d as usize, x % d as usize));
            }
        }
    }

    #[test]
    fn blocks_for_matches_the_layout_formula() {
        let kind = CacheKind {
            name: "ckv4".into(),
            tokens_per_block: 16,
            tokens_per_entry: 4,
            window_tokens: None,
            num_blocks: 1,
        };
        let g = KindGeometry::new(&kind);
        for end in 0..200usize {
            assert_eq!(g.blocks_for(end) as u64, kind.blocks_for_tokens(end as u64));
        }
    }
}
