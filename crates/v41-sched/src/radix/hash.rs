//! Content hashes of prefix-cache pages, chained from the parent page ("v41 page hash v1").
//!
//! `hash(page) = page_hash(hash(parent), tokens)`, with the root of each cache-salt namespace seeded by
//! [`root_hash`]. Equal hashes identify equal token prefixes within one salt up to collisions, which
//! the tree resolves by comparing tokens, so a collision can cost reuse but never give wrong KV. The
//! function is fixed (no per-process seed) so that replicas agree; cache-aware routing and KV events
//! will publish these values. Cost: one 64×64→128-bit multiply per two tokens.
//!
//! Salts are caller-chosen strings, so their roots come from SHA-256 (when a namespace's root is
//! created): with the multiply chain a client could craft a salt whose root equals the (public)
//! unsalted root, or a known salt's, and keep those requests' pages out of the cache (the tree keeps
//! one node per hash).

use sha2::{Digest, Sha256};

const SEED: u64 = 0x9E37_79B9_7F4A_7C15;
const K1: u64 = 0xA076_1D64_78BD_642F;
const K2: u64 = 0xE703_7ED1_A0B4_28DB;

#[inline]
fn mum(a: u64, b: u64) -> u64 {
    let r = u128::from(a) * u128::from(b);
    (r as u64) ^ ((r >> 64) as u64)
}

/// Hash of a page of `tokens` whose parent page hashed to `parent`.
#[inline]
pub fn page_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = parent ^ SEED;
    let mut pairs = tokens.chunks_exact(2);
    for pair in &mut pairs {
        let word = u64::from(pair[0]) | (u64::from(pair[1]) << 32);
        h = mum(h ^ word, K1);
    }
    if let [last] = pairs.remainder() {
        h = mum(h ^ u64::from(*last), K1);
    }
    mum(h ^ tokens.len() as u64, K2)
}

/// Seed of the namespace of `salt` (`None` = unsalted requests): for a salt, the first 8 bytes
/// (little-endian) of SHA-256("v41 cache salt\0" ‖ salt).
pub fn root_hash(salt: Option<&str>) -> u64 {
    let Some(salt) = salt else {
        return mum(SEED, K2);
    };
    let digest = Sha256::new()
        .chain_update(b"v41 cache salt\0")
        .chain_update(salt.as_bytes())
        .finalize();
    u64::from_le_bytes(
        digest[..8]
            .try_into()
            .expect("a SHA-256 digest has 32 bytes"),
    )
}

/// `Hasher` for maps keyed by these already-mixed hashes (identity on `u64`).
#[derive(Default, Clone, Copy)]
pub struct IdentityHasher(u64);

impl std::hash::Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) ^ u64::from(b) ^ (self.0 >> 56);
        }
    }
    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }
}

/// Builder for [`IdentityHasher`].
pub type IdentityBuild = std::hash::BuildHasherDefault<IdentityHasher>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_hash_depends_on_parent_order_and_length() {
        let a = page_hash(root_hash(None), &[1, 2, 3, 4]);
        assert_ne!(a, page_hash(root_hash(None), &[2, 1, 3, 4]));
        assert_ne!(a, page_hash(root_hash(Some("s")), &[1, 2, 3, 4]));
        assert_ne!(page_hash(0, &[0, 0]), page_hash(0, &[0, 0, 0]));
        assert_eq!(a, page_hash(root_hash(None), &[1, 2, 3, 4]));
    }

    const SALT_ROOT_TENANT_A: u64 = 0xcc6e_f02a_d9f9_7d28;

    #[test]
    fn salt_roots_are_fixed_sha256_prefixes() {
        // Replicas must agree: pinned to SHA-256("v41 cache salt\0tenant-a")[..8] (Python hashlib).
        assert_eq!(root_hash(Some("tenant-a")), SALT_ROOT_TENANT_A);
        assert_ne!(root_hash(Some("")), root_hash(None));
        assert_ne!(root_hash(Some("a")), root_hash(Some("a\0")));
    }
}
