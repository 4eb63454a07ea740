//! Cache layout: which KV pools exist and how positions map to blocks and entries.
//!
//! Invariants (checked by [`Layout::new`]):
//! - every token-indexed kind has `tokens_per_entry >= 1` dividing `tokens_per_block`, and all of them
//!   share one `tokens_per_block`, the page size of the prefix cache ([`Layout::page_tokens`]); hence a
//!   page boundary is also a boundary of every compression ratio;
//! - names are canonical (docs/cache.md): `swa` (ratio 1, with a window), `ckv{r}` and `idx{r}` (ratio r,
//!   unbounded), `cov{r}` (V4 CSA overlap halves, ratio r, unbounded), at most one of each, and `cstate`
//!   for the per-request state rows;
//! - pool sizes are positive and every slot index fits in an `i32` (block tables and slot mappings are
//!   `int32` on the Python side, `-1` meaning "none").
//!
//! Logical block `b` of every token-indexed kind covers token positions `[b·B, (b+1)·B)` with
//! `B = page_tokens`; for a kind of ratio `r` it holds entries `[b·E, (b+1)·E)`, `E = B / r`, where entry
//! `j` is produced by (closed by) the token at position `j·r + r − 1`.

use crate::error::SchedError;

/// One token-indexed cache pool (sliding-window KV, compressed KV or index keys).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheKind {
    /// Canonical name: `swa`, `ckv{r}`, `idx{r}` or `cov{r}`.
    pub name: String,
    /// Tokens covered by one block (the page size; equal for all token-indexed kinds).
    pub tokens_per_block: u32,
    /// Compression ratio r: tokens per cache entry (1 for `swa`).
    pub tokens_per_entry: u32,
    /// Sliding window in tokens, including the current token (`swa`: 128); `None` = unbounded.
    pub window_tokens: Option<u32>,
    /// Number of physical blocks in the pool.
    pub num_blocks: u32,
}

impl CacheKind {
    /// Entries per block: `tokens_per_block / tokens_per_entry`.
    pub fn entries_per_block(&self) -> u32 {
        self.tokens_per_block / self.tokens_per_entry
    }

    /// Logical blocks needed to hold every entry closed by the tokens at positions `< end_pos`.
    pub fn blocks_for_tokens(&self, end_pos: u64) -> u64 {
        let entries = end_pos / u64::from(self.tokens_per_entry);
        entries.div_ceil(u64::from(self.entries_per_block()))
    }
}

/// The per-request state rows (`cstate`: compressor state; one row per running request).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateKind {
    /// Canonical name: `cstate`.
    pub name: String,
    /// Number of rows; bounds the number of running requests.
    pub state_rows: u32,
}

/// A validated set of cache kinds; see the module docs for the invariants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    kinds: Vec<CacheKind>,
    state: Option<StateKind>,
    page_tokens: u32,
}

fn invalid(msg: impl Into<String>) -> SchedError {
    SchedError::InvalidLayout(msg.into())
}

/// Parses `ckv4` → `Some(4)` for the given prefix.
fn ratio_suffix(name: &str, prefix: &str) -> Option<u32> {
    let digits = name.strip_prefix(prefix)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) || digits.starts_with('0') {
        return None;
    }
    digits.parse().ok()
}

fn validate_kind(kind: &CacheKind) -> Result<(), SchedError> {
    let name = kind.name.as_str();
    if kind.tokens_per_block == 0 || kind.tokens_per_entry == 0 {
        return Err(invalid(format!(
            "kind '{name}': tokens_per_block and tokens_per_entry must be > 0"
        )));
    }
    if kind.tokens_per_block % kind.tokens_per_entry != 0 {
        return Err(invalid(format!(
            "kind '{name}': tokens_per_entry ({}) must divide tokens_per_block ({})",
            kind.tokens_per_entry, kind.tokens_per_block
        )));
    }
    if kind.num_blocks == 0 {
        return Err(invalid(format!("kind '{name}': num_blocks must be > 0")));
    }
    let slots = u64::from(kind.num_blocks) * u64::from(kind.entries_per_block());
    if slots > i32::MAX as u64 {
        return Err(invalid(format!(
            "kind '{name}': num_blocks × entries per block = {slots} does not fit in int32 slot ids"
        )));
    }
    match (name, kind.window_tokens) {
        ("swa" | "dspark", None) => Err(invalid(format!("kind '{name}' needs window_tokens"))),
        ("swa" | "dspark", Some(0)) => Err(invalid(format!("kind '{name}': window_tokens must be > 0"))),
        ("swa" | "dspark", Some(_)) if kind.tokens_per_entry != 1 => {
            Err(invalid(format!("kind '{name}' must have tokens_per_entry = 1")))
        }
        ("swa" | "dspark", Some(_)) => Ok(()),
        _ => {
            let ratio = ratio_suffix(name, "ckv")
                .or_else(|| ratio_suffix(name, "idx"))
                .or_else(|| ratio_suffix(name, "cov"));
            match ratio {
                None => Err(invalid(format!(
                    "unknown cache kind name '{name}' (expected swa, dspark, ckv{{r}}, idx{{r}}, cov{{r}} or cstate)"
                ))),
                Some(r) if r != kind.tokens_per_entry => Err(invalid(format!(
                    "kind '{name}': tokens_per_entry ({}) must equal its ratio {r}",
                    kind.tokens_per_entry
                ))),
                Some(_) if kind.window_tokens.is_some() => Err(invalid(format!(
                    "kind '{name}' is unbounded; window_tokens must be None"
                ))),
                Some(_) => Ok(()),
            }
        }
    }
}

impl Layout {
    /// Validates and builds a layout from the token-indexed kinds (in the order Python will index
    /// them) and the optional state rows.
    ///
    /// # Errors
    /// [`SchedError::InvalidLayout`] naming the kind and the violated rule.
    pub fn new(kinds: Vec<CacheKind>, state: Option<StateKind>) -> Result<Self, SchedError> {
        let first = kinds
            .first()
            .ok_or_else(|| invalid("at least one token-indexed kind is needed"))?;
        let page_tokens = first.tokens_per_block;
        for (i, kind) in kinds.iter().enumerate() {
            validate_kind(kind)?;
            if kinds[..i].iter().any(|k| k.name == kind.name) {
                return Err(invalid(format!("duplicate cache kind '{}'", kind.name)));
            }
            if kind.tokens_per_block != page_tokens {
                return Err(invalid(format!(
                    "all token-indexed kinds must share tokens_per_block (the prefix-cache page): \
                     '{}' has {} but '{}' has {}",
                    kind.name, kind.tokens_per_block, first.name, page_tokens
                )));
            }
        }
        if let Some(state) = &state {
            if state.name != "cstate" {
                return Err(invalid(format!(
                    "state kind must be named 'cstate', got '{}'",
                    state.name
                )));
            }
            if state.state_rows == 0 || state.state_rows > i32::MAX as u32 {
                return Err(invalid("kind 'cstate': state_rows must be in 1..=2^31-1"));
            }
        }
        Ok(Self {
            kinds,
            state,
            page_tokens,
        })
    }

    /// Token-indexed kinds, in layout order (the order of block tables and slot mappings).
    pub fn kinds(&self) -> &[CacheKind] {
        &self.kinds
    }

    /// The per-request state rows, if the model has any.
    pub fn state(&self) -> Option<&StateKind> {
        self.state.as_ref()
    }

    /// Page size of the prefix cache in tokens (= `tokens_per_block` of every kind).
    pub fn page_tokens(&self) -> u32 {
        self.page_tokens
    }

    /// Index of the kind with this name in [`Layout::kinds`].
    pub fn kind_index(&self, name: &str) -> Option<usize> {
        self.kinds.iter().position(|k| k.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(name: &str, block: u32, ratio: u32, window: Option<u32>) -> CacheKind {
        CacheKind {
            name: name.into(),
            tokens_per_block: block,
            tokens_per_entry: ratio,
            window_tokens: window,
            num_blocks: 16,
        }
    }

    #[test]
    fn v41_layout_is_accepted() {
        let kinds = vec![
            kind("swa", 64, 1, Some(128)),
            kind("ckv2", 64, 2, None),
            kind("ckv1", 64, 1, None),
            kind("idx2", 64, 2, None),
        ];
        let state = StateKind {
            name: "cstate".into(),
            state_rows: 8,
        };
        let layout = Layout::new(kinds, Some(state)).unwrap();
        assert_eq!(layout.page_tokens(), 64);
        assert_eq!(layout.kinds()[1].entries_per_block(), 32);
        assert_eq!(layout.kind_index("idx2"), Some(3));
    }

    #[test]
    fn ratio_must_divide_block() {
        let err = Layout::new(vec![kind("ckv128", 64, 128, None)], None).unwrap_err();
        assert!(
            err.to_string().contains("must divide tokens_per_block"),
            "{err}"
        );
    }

    #[test]
    fn kinds_must_share_the_page_size() {
        let err = Layout::new(
            vec![kind("swa", 64, 1, Some(128)), kind("ckv4", 128, 4, None)],
            None,
        )
        .unwrap_err();
        assert!(err.to_string().contains("share tokens_per_block"), "{err}");
    }

    #[test]
    fn names_are_canonical_and_ratio_matches() {
        assert!(Layout::new(vec![kind("kv", 64, 1, None)], None).is_err());
        assert!(Layout::new(vec![kind("ckv4", 64, 2, None)], None).is_err());
        assert!(Layout::new(vec![kind("ckv04", 64, 4, None)], None).is_err());
        assert!(Layout::new(vec![kind("swa", 64, 1, None)], None).is_err());
        assert!(Layout::new(vec![kind("dspark", 64, 1, None)], None).is_err());
        assert!(Layout::new(vec![kind("dspark", 64, 2, Some(8))], None).is_err());
        assert!(Layout::new(vec![kind("swa", 64, 1, Some(8)), kind("dspark", 64, 1, Some(8))], None).is_ok());
        assert!(Layout::new(vec![kind("idx4", 64, 4, Some(8))], None).is_err());
        assert!(Layout::new(
            vec![kind("swa", 64, 1, Some(8)), kind("swa", 64, 1, Some(8))],
            None
        )
        .is_err());
        let state = StateKind {
            name: "state".into(),
            state_rows: 4,
        };
        assert!(Layout::new(vec![kind("ckv1", 64, 1, None)], Some(state)).is_err());
    }

    #[test]
    fn blocks_for_tokens_counts_closed_entries() {
        let ckv4 = kind("ckv4", 16, 4, None); // 4 entries per block
        assert_eq!(ckv4.blocks_for_tokens(3), 0); // entry 0 is closed by position 3
        assert_eq!(ckv4.blocks_for_tokens(4), 1);
        assert_eq!(ckv4.blocks_for_tokens(16), 1);
        assert_eq!(ckv4.blocks_for_tokens(20), 2);
        let swa = kind("swa", 16, 1, Some(8));
        assert_eq!(swa.blocks_for_tokens(1), 1);
        assert_eq!(swa.blocks_for_tokens(17), 2);
    }
}
