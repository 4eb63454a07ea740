//! Python bindings of `v41-engram`: `v41._native.EngramHasher` and `v41._native.EngramSlotCache`.
//!
//! Thin: numpy arrays in, numpy arrays out (moved from Rust, no per-element objects); every
//! [`EngramError`] becomes a `ValueError` with the crate's message; the GIL is released around the
//! per-step work.

use numpy::ndarray::Array3;
use numpy::{IntoPyArray, PyArray1, PyArray3, PyReadonlyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use v41_engram::{EngramError, HashParams, NgramHasher, SlotCache};

fn to_py_err(err: EngramError) -> PyErr {
    PyValueError::new_err(err.to_string())
}

fn contiguous<'a, T: numpy::Element>(
    a: &'a PyReadonlyArray1<'_, T>,
    what: &str,
) -> PyResult<&'a [T]> {
    a.as_slice()
        .map_err(|_| PyValueError::new_err(format!("{what}: array must be C-contiguous")))
}

/// Token ids of a step → Engram table rows of every layer (see `_native.pyi`).
#[pyclass(module = "v41._native", name = "EngramHasher", frozen)]
pub struct PyEngramHasher {
    inner: NgramHasher,
}

#[pymethods]
impl PyEngramHasher {
    #[new]
    #[pyo3(signature = (token_map, compressed_vocab_size, pad_token_id, max_ngram_size, n_heads, engram_vocab_size, layers))]
    fn new(
        token_map: PyReadonlyArray1<'_, i64>,
        compressed_vocab_size: u32,
        pad_token_id: u32,
        max_ngram_size: usize,
        n_heads: usize,
        engram_vocab_size: u64,
        layers: Vec<(u32, Vec<u64>)>,
    ) -> PyResult<Self> {
        let token_map = contiguous(&token_map, "token_map")?
            .iter()
            .map(|&v| {
                u32::try_from(v)
                    .map_err(|_| PyValueError::new_err(format!("token_map value {v} out of range")))
            })
            .collect::<PyResult<Vec<u32>>>()?;
        let params = HashParams {
            token_map,
            compressed_vocab_size,
            pad_token_id,
            max_ngram: max_ngram_size,
            n_heads,
            engram_vocab_size,
            layers,
        };
        Ok(Self {
            inner: NgramHasher::new(params).map_err(to_py_err)?,
        })
    }

    /// Hash columns per layer.
    #[getter]
    fn columns(&self) -> usize {
        self.inner.columns()
    }

    /// Layer ids in construction order.
    #[getter]
    fn layer_ids(&self) -> Vec<u32> {
        self.inner.layer_ids()
    }

    /// Bucket primes of the layer at `index` (construction order).
    fn primes(&self, index: usize) -> PyResult<Vec<u64>> {
        self.check(index)?;
        Ok(self.inner.primes(index).to_vec())
    }

    /// Table rows of the layer at `index`.
    fn table_rows(&self, index: usize) -> PyResult<u64> {
        self.check(index)?;
        Ok(self.inner.table_rows(index))
    }

    /// `int64 [layers, T, columns]` rows of one step (see `_native.pyi`).
    #[pyo3(signature = (token_ids, counts, history, dead = None))]
    fn hash_step<'py>(
        &self,
        py: Python<'py>,
        token_ids: PyReadonlyArray1<'py, i64>,
        counts: PyReadonlyArray1<'py, i64>,
        history: PyReadonlyArray1<'py, i64>,
        dead: Option<PyReadonlyArray1<'py, bool>>,
    ) -> PyResult<Bound<'py, PyArray3<i64>>> {
        let (tokens, counts, history) = (
            contiguous(&token_ids, "token_ids")?,
            contiguous(&counts, "counts")?,
            contiguous(&history, "history")?,
        );
        let dead = dead.as_ref().map(|d| contiguous(d, "dead")).transpose()?;
        let shape = (
            self.inner.layer_ids().len(),
            tokens.len(),
            self.inner.columns(),
        );
        let mut out = vec![0i64; shape.0 * shape.1 * shape.2];
        py.detach(|| {
            self.inner
                .hash_step(tokens, counts, history, dead, &mut out)
        })
        .map_err(to_py_err)?;
        let arr = Array3::from_shape_vec(shape, out).expect("shape matches the length");
        Ok(arr.into_pyarray(py))
    }
}

impl PyEngramHasher {
    fn check(&self, index: usize) -> PyResult<()> {
        let n = self.inner.layer_ids().len();
        if index >= n {
            return Err(PyValueError::new_err(format!(
                "layer index {index} out of range ({n} Engram layers)"
            )));
        }
        Ok(())
    }
}

/// The hot-row slot cache of one Engram layer on one rank (see `_native.pyi`).
#[pyclass(module = "v41._native", name = "EngramSlotCache")]
pub struct PyEngramSlotCache {
    inner: SlotCache,
}

#[pymethods]
impl PyEngramSlotCache {
    #[new]
    fn new(hot_rows: usize, staging_rows: usize, table_rows: u64) -> PyResult<Self> {
        Ok(Self {
            inner: SlotCache::new(hot_rows, staging_rows, table_rows).map_err(to_py_err)?,
        })
    }

    #[getter]
    fn hot_rows(&self) -> usize {
        self.inner.hot()
    }

    #[getter]
    fn staging_rows(&self) -> usize {
        self.inner.staging()
    }

    /// `(slots [N], copy_rows [M], copy_slots [M])`, all int64 (see `_native.pyi`).
    #[allow(clippy::type_complexity)]
    fn plan<'py>(
        &mut self,
        py: Python<'py>,
        step: u64,
        rows: PyReadonlyArray1<'py, i64>,
    ) -> PyResult<(
        Bound<'py, PyArray1<i64>>,
        Bound<'py, PyArray1<i64>>,
        Bound<'py, PyArray1<i64>>,
    )> {
        let rows = contiguous(&rows, "rows")?;
        let inner = &mut self.inner;
        let plan = py.detach(|| inner.plan(step, rows)).map_err(to_py_err)?;
        Ok((
            plan.slots.into_pyarray(py),
            plan.copy_rows.into_pyarray(py),
            plan.copy_slots.into_pyarray(py),
        ))
    }

    /// Unpin the slots of `step` (its forward has read them).
    fn release(&mut self, step: u64) -> PyResult<()> {
        self.inner.release(step).map_err(to_py_err)
    }

    /// The hot slot holding `row`, or None.
    fn slot_of(&self, row: u64) -> Option<u32> {
        self.inner.slot_of(row)
    }

    /// Cumulative counters: lookups, hits, misses, evictions, staged.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("lookups", s.lookups)?;
        d.set_item("hits", s.hits)?;
        d.set_item("misses", s.misses)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("staged", s.staged)?;
        Ok(d)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEngramHasher>()?;
    m.add_class::<PyEngramSlotCache>()?;
    Ok(())
}
