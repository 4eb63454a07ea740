//! Generates the Rust stubs of `proto/v41/v1/engine.proto` (client only) into OUT_DIR with
//! tonic-prost-build, using the `protoc` binary of the `protoc-bin-vendored` crate: no system protoc.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let proto = root.join("v41/v1/engine.proto");
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // prost-build reads PROTOC from the environment (a build script is single-threaded).
    std::env::set_var("PROTOC", protoc);
    println!("cargo:rerun-if-changed={}", proto.display());
    tonic_prost_build::configure()
        .build_server(false)
        .compile_protos(&[proto], &[root])?;
    Ok(())
}
