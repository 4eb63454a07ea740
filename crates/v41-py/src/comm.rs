//! Python bindings of `v41-comm`: `v41._native.HostComm` and `v41._native.CommError`.
//!
//! Thin: checks array arguments (dtype, 1-D, C-contiguous, writable → `ValueError`), maps
//! `v41_comm::CommError` once (`InvalidArgument` → `ValueError`, `Io` → `OSError` with errno, everything else
//! → `v41._native.CommError`), and releases the GIL around every call that waits for peers.

use std::path::PathBuf;
use std::time::Duration;

use numpy::{PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use v41_comm::Communicator;

pyo3::create_exception!(
    v41._native,
    CommError,
    PyRuntimeError,
    "A host collective failed: a rank died, left or lags past the deadline, or ranks disagree on \
     the call. The message names the operation, its sequence number and the rank(s)."
);

fn to_py_err(err: v41_comm::CommError) -> PyErr {
    match &err {
        v41_comm::CommError::InvalidArgument(_) => PyValueError::new_err(err.to_string()),
        v41_comm::CommError::Io { source, .. } => {
            PyOSError::new_err((source.raw_os_error().unwrap_or(0), err.to_string()))
        }
        _ => CommError::new_err(err.to_string()),
    }
}

fn seconds(timeout_s: Option<f64>) -> PyResult<Option<Duration>> {
    timeout_s
        .map(|s| {
            Duration::try_from_secs_f64(s).map_err(|_| {
                PyValueError::new_err(format!("timeout_s must be >= 0 seconds or None, got {s}"))
            })
        })
        .transpose()
}

/// `timeout_s` of one call: omitted → the communicator's `timeout_s`; `None` → wait forever;
/// a number → seconds.
enum Timeout {
    Default,
    Given(Option<f64>),
}

impl<'a, 'py> FromPyObject<'a, 'py> for Timeout {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(Timeout::Given(obj.extract()?))
    }
}

/// "float32 array of shape (3, 2)" or the Python type name.
fn describe(obj: &Bound<'_, PyAny>) -> String {
    match obj.cast::<numpy::PyUntypedArray>() {
        Ok(a) => format!("{} array of shape {:?}", a.dtype(), a.shape()),
        Err(_) => obj
            .get_type()
            .name()
            .map_or_else(|_| "?".into(), |n| n.to_string()),
    }
}

/// `obj` as a 1-D array of `T`, or a `ValueError` saying what was expected.
fn array1<'py, T: numpy::Element>(
    obj: &Bound<'py, PyAny>,
    what: &str,
    dtype: &str,
) -> PyResult<Bound<'py, PyArray1<T>>> {
    obj.cast::<PyArray1<T>>().cloned().map_err(|_| {
        PyValueError::new_err(format!(
            "{what}: expected a 1-D {dtype} numpy array, got {}",
            describe(obj)
        ))
    })
}

/// A borrowed view of `arr`'s data, released by `f`'s end; `ValueError` unless C-contiguous and
/// writable.
fn with_slice_mut<T: numpy::Element, R>(
    arr: &Bound<'_, PyArray1<T>>,
    what: &str,
    f: impl FnOnce(&mut [T]) -> PyResult<R>,
) -> PyResult<R> {
    let mut rw = arr
        .try_readwrite()
        .map_err(|e| PyValueError::new_err(format!("{what}: array is not writable ({e})")))?;
    let slice = rw
        .as_slice_mut()
        .map_err(|_| PyValueError::new_err(format!("{what}: array must be C-contiguous")))?;
    f(slice)
}

/// One rank of a host shared-memory communicator (see `_native.pyi`).
#[pyclass(module = "v41._native", name = "HostComm")]
pub struct PyHostComm {
    inner: Communicator,
    timeout: Option<Duration>,
    path: String,
}

impl PyHostComm {
    fn timeout(&self, given: Timeout) -> PyResult<Option<Duration>> {
        match given {
            Timeout::Default => Ok(self.timeout),
            Timeout::Given(t) => seconds(t),
        }
    }
}

#[pymethods]
impl PyHostComm {
    #[new]
    #[pyo3(signature = (path, rank, world_size, lane_bytes = 1 << 20, timeout_s = Some(60.0)))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        rank: usize,
        world_size: usize,
        lane_bytes: usize,
        timeout_s: Option<f64>,
    ) -> PyResult<Self> {
        let timeout = seconds(timeout_s)?;
        let inner = py
            .detach(|| Communicator::join(&path, rank, world_size, lane_bytes, timeout))
            .map_err(to_py_err)?;
        Ok(Self {
            inner,
            timeout,
            path: path.display().to_string(),
        })
    }

    /// Bytes of the segment file for `world_size` ranks and `lane_bytes` per lane.
    #[staticmethod]
    fn segment_bytes(world_size: usize, lane_bytes: usize) -> PyResult<usize> {
        Communicator::segment_bytes(world_size, lane_bytes).map_err(to_py_err)
    }

    #[getter]
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    #[getter]
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    #[getter]
    fn lane_bytes(&self) -> usize {
        self.inner.lane_bytes()
    }

    #[getter]
    fn seq(&self) -> u64 {
        self.inner.seq()
    }

    #[getter]
    fn path(&self) -> &str {
        &self.path
    }

    #[getter]
    fn timeout_s(&self) -> Option<f64> {
        self.timeout.map(|t| t.as_secs_f64())
    }

    #[pyo3(signature = (buf, dtype, timeout_s = Timeout::Default))]
    fn all_reduce(
        &mut self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        dtype: &str,
        timeout_s: Timeout,
    ) -> PyResult<()> {
        let timeout = self.timeout(timeout_s)?;
        let comm = &mut self.inner;
        let what = "all_reduce(dtype='float32')";
        match dtype {
            "float32" => with_slice_mut(&array1::<f32>(buf, what, "float32")?, what, |s| {
                py.detach(|| comm.all_reduce_f32(s, timeout))
                    .map_err(to_py_err)
            }),
            "bfloat16" => {
                let what = "all_reduce(dtype='bfloat16')";
                let bits = if buf.cast::<PyArray1<i16>>().is_ok() {
                    buf.call_method1("view", ("uint16",))?
                } else {
                    buf.clone()
                };
                let arr = array1::<u16>(&bits, what, "int16 or uint16 (bfloat16 bits)").map_err(
                    |_| {
                        PyValueError::new_err(format!(
                            "{what}: expected a 1-D int16 or uint16 numpy array of bfloat16 bits \
                             (torch: t.view(torch.int16).numpy()), got {}",
                            describe(buf)
                        ))
                    },
                )?;
                with_slice_mut(&arr, what, |s| {
                    py.detach(|| comm.all_reduce_bf16(s, timeout))
                        .map_err(to_py_err)
                })
            }
            other => Err(PyValueError::new_err(format!(
                "all_reduce: dtype must be 'float32' or 'bfloat16', got '{other}'"
            ))),
        }
    }

    #[pyo3(signature = (inp, out, timeout_s = Timeout::Default))]
    fn all_gather(
        &mut self,
        py: Python<'_>,
        inp: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        timeout_s: Timeout,
    ) -> PyResult<()> {
        let timeout = self.timeout(timeout_s)?;
        let comm = &mut self.inner;
        let input = array1::<u8>(inp, "all_gather(inp)", "uint8")?;
        let output = array1::<u8>(out, "all_gather(out)", "uint8")?;
        let input = input
            .try_readonly()
            .map_err(|e| PyValueError::new_err(format!("all_gather(inp): {e}")))?;
        let input = input
            .as_slice()
            .map_err(|_| PyValueError::new_err("all_gather(inp): array must be C-contiguous"))?;
        with_slice_mut(&output, "all_gather(out)", |out| {
            py.detach(|| comm.all_gather_bytes(input, out, timeout))
                .map_err(to_py_err)
        })
    }

    #[pyo3(signature = (data, root = 0, timeout_s = Timeout::Default))]
    fn broadcast<'py>(
        &mut self,
        py: Python<'py>,
        data: Option<Bound<'py, PyBytes>>,
        root: usize,
        timeout_s: Timeout,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let timeout = self.timeout(timeout_s)?;
        let rank = self.inner.rank();
        let comm = &mut self.inner;
        match data {
            Some(data) if rank == root => {
                let bytes = data.as_bytes();
                py.detach(|| comm.broadcast_send(bytes, timeout))
                    .map_err(to_py_err)?;
                Ok(data)
            }
            None if rank != root => {
                let msg = py
                    .detach(|| comm.broadcast_recv(root, timeout))
                    .map_err(to_py_err)?;
                Ok(PyBytes::new(py, &msg))
            }
            Some(_) => Err(PyValueError::new_err(format!(
                "broadcast: rank {rank} is not the root ({root}); pass data=None"
            ))),
            None => Err(PyValueError::new_err(format!(
                "broadcast: rank {rank} is the root; pass the bytes to send"
            ))),
        }
    }

    #[pyo3(signature = (timeout_s = Timeout::Default))]
    fn barrier(&mut self, py: Python<'_>, timeout_s: Timeout) -> PyResult<()> {
        let timeout = self.timeout(timeout_s)?;
        let comm = &mut self.inner;
        py.detach(|| comm.barrier(timeout)).map_err(to_py_err)
    }

    fn close(&mut self) {
        self.inner.close();
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __exit__(
        &mut self,
        _exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) {
        self.inner.close();
    }

    fn __repr__(&self) -> String {
        format!(
            "HostComm(path={:?}, rank={}, world_size={}, lane_bytes={}, seq={})",
            self.path,
            self.inner.rank(),
            self.inner.world_size(),
            self.inner.lane_bytes(),
            self.inner.seq()
        )
    }
}

/// Adds `HostComm` and `CommError` to `v41._native`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyHostComm>()?;
    m.add("CommError", m.py().get_type::<CommError>())?;
    Ok(())
}
