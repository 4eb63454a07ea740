//! PyO3 bindings for v41, built by maturin as the Python extension module `v41._native`.
//! Thin by design: all logic lives in the pure-Rust crates.

use pyo3::prelude::*;
use pyo3::types::PyDict;

mod comm;
mod engram;
mod sched;

/// Native extension of v41 (Rust).
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(build_info, m)?)?;
    sched::register(m)?;
    comm::register(m)?;
    engram::register(m)?;
    Ok(())
}

/// Return how this extension was built, as a dict of strings with keys
/// `version`, `profile`, `target`, `rustc` and `git_commit`.
#[pyfunction]
fn build_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let dict = PyDict::new(py);
    for (key, value) in v41_core::build_info().fields() {
        dict.set_item(key, value)?;
    }
    Ok(dict)
}
