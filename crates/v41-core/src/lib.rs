//! Pure-Rust core of v41. It has no Python knowledge; `v41-py` exposes it as `v41._native`.

/// Metadata about how this build of v41 was produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BuildInfo {
    /// Crate version (the workspace version, identical to the Python package version).
    pub version: &'static str,
    /// Cargo profile: `debug` or `release`.
    pub profile: &'static str,
    /// Target triple, e.g. `x86_64-unknown-linux-gnu`.
    pub target: &'static str,
    /// Output of `rustc --version`, or `unknown`.
    pub rustc: &'static str,
    /// Git commit hash at build time (`V41_GIT_COMMIT` overrides), or `unknown`.
    pub git_commit: &'static str,
}

impl BuildInfo {
    /// The fields as `(key, value)` pairs, in declaration order; keys match the field names.
    pub fn fields(&self) -> [(&'static str, &'static str); 5] {
        [
            ("version", self.version),
            ("profile", self.profile),
            ("target", self.target),
            ("rustc", self.rustc),
            ("git_commit", self.git_commit),
        ]
    }
}

/// Returns the build metadata captured at compile time by `build.rs`.
pub fn build_info() -> BuildInfo {
    BuildInfo {
        version: env!("CARGO_PKG_VERSION"),
        profile: env!("V41_BUILD_PROFILE"),
        target: env!("V41_BUILD_TARGET"),
        rustc: env!("V41_BUILD_RUSTC"),
        git_commit: env!("V41_BUILD_GIT_COMMIT"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_is_crate_version() {
        assert_eq!(build_info().version, env!("CARGO_PKG_VERSION"));
    }

    #[test]
    fn profile_matches_debug_assertions() {
        // Tests run under the default profiles, where debug assertions track the profile.
        let expected = if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        };
        assert_eq!(build_info().profile, expected);
    }

    #[test]
    fn target_looks_like_a_triple() {
        let target = build_info().target;
        assert!(
            target.split('-').count() >= 3,
            "bad target triple: {target}"
        );
        assert!(target.starts_with(std::env::consts::ARCH), "{target}");
    }

    #[test]
    fn rustc_and_git_are_well_formed() {
        let info = build_info();
        assert!(
            info.rustc == "unknown" || info.rustc.starts_with("rustc "),
            "{}",
            info.rustc
        );
        let commit = info.git_commit;
        let is_hash = commit.len() >= 7 && commit.chars().all(|c| c.is_ascii_hexdigit());
        assert!(commit == "unknown" || is_hash, "bad git commit: {commit}");
    }

    #[test]
    fn fields_cover_every_key_once() {
        let info = build_info();
        let keys: Vec<_> = info.fields().iter().map(|(k, _)| *k).collect();
        assert_eq!(
            keys,
            ["version", "profile", "target", "rustc", "git_commit"]
        );
        assert!(info.fields().iter().all(|(_, v)| !v.is_empty()));
    }
}
