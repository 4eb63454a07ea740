//! Captures build metadata (profile, target, rustc version, git commit) as compile-time
//! environment variables read by `v41_core::build_info`.

use std::path::Path;
use std::process::Command;

/// Runs a command and returns its trimmed stdout, or `None` if it fails or prints nothing.
fn output_of(program: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(program).args(args).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?.trim().to_owned();
    (out.status.success() && !text.is_empty()).then_some(text)
}

/// Asks cargo to rerun this script when the checked-out commit may have changed.
fn watch_git() {
    let Some(git_dir) = output_of("git", &["rev-parse", "--absolute-git-dir"]) else {
        return;
    };
    // Watch only paths that exist: a missing path would make cargo rerun the script every build.
    for rel in ["HEAD", "refs/heads", "packed-refs"] {
        let path = Path::new(&git_dir).join(rel);
        if path.exists() {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=V41_GIT_COMMIT");
    watch_git();

    let profile = std::env::var("PROFILE").unwrap_or_else(|_| "unknown".into());
    let target = std::env::var("TARGET").unwrap_or_else(|_| "unknown".into());
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let rustc_version = output_of(&rustc, &["--version"]).unwrap_or_else(|| "unknown".into());
    let git_commit = std::env::var("V41_GIT_COMMIT")
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| output_of("git", &["rev-parse", "HEAD"]))
        .unwrap_or_else(|| "unknown".into());

    println!("cargo:rustc-env=V41_BUILD_PROFILE={profile}");
    println!("cargo:rustc-env=V41_BUILD_TARGET={target}");
    println!("cargo:rustc-env=V41_BUILD_RUSTC={rustc_version}");
    println!("cargo:rustc-env=V41_BUILD_GIT_COMMIT={git_commit}");
}
