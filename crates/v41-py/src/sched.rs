//! Python bindings of `v41-sched`: `v41._native.Scheduler` and `v41._native.StepOutput`.
//!
//! Thin: converts types, maps [`SchedError`] once (`UnknownRequest` → `KeyError`, everything else →
//! `ValueError`), and releases the GIL around `step()`. Per-step arrays cross as numpy arrays that take
//! ownership of the Rust buffers (no per-element Python objects).

use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1};
use pyo3::exceptions::{PyKeyError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use v41_sched::{
    CacheKind, Layout, NewRequest, RequestOutput, SchedError, Scheduler, SchedulerConfig,
    StateKind, StepOutput,
};

fn to_py_err(err: SchedError) -> PyErr {
    match err {
        SchedError::UnknownRequest { .. } => PyKeyError::new_err(err.to_string()),
        _ => PyValueError::new_err(err.to_string()),
    }
}

const KIND_KEYS: [&str; 6] = [
    "name",
    "tokens_per_block",
    "tokens_per_entry",
    "window_tokens",
    "num_blocks",
    "state_rows",
];

/// One layout entry: a dict with `name` and either `tokens_per_block`, `tokens_per_entry`,
/// `window_tokens` (optional), `num_blocks` — or, for `cstate`, `state_rows`.
fn parse_kind(item: &Bound<'_, PyAny>) -> PyResult<Result<CacheKind, StateKind>> {
    let dict = item
        .cast::<PyDict>()
        .map_err(|_| PyValueError::new_err("layout entries must be dicts"))?;
    for key in dict.keys() {
        let key: String = key.extract()?;
        if !KIND_KEYS.contains(&key.as_str()) {
            return Err(PyValueError::new_err(format!(
                "unknown layout key '{key}' (expected {KIND_KEYS:?})"
            )));
        }
    }
    let get = |key: &str| -> PyResult<Option<Bound<'_, PyAny>>> {
        Ok(dict.get_item(key)?.filter(|v| !v.is_none()))
    };
    let required = |key: &str, name: &str| -> PyResult<u32> {
        get(key)?
            .ok_or_else(|| {
                PyValueError::new_err(format!("layout kind '{name}' is missing '{key}'"))
            })?
            .extract()
    };
    let name: String = get("name")?
        .ok_or_else(|| PyValueError::new_err("layout entry without 'name'"))?
        .extract()?;
    if let Some(rows) = get("state_rows")? {
        return Ok(Err(StateKind {
            name,
            state_rows: rows.extract()?,
        }));
    }
    Ok(Ok(CacheKind {
        tokens_per_block: required("tokens_per_block", &name)?,
        tokens_per_entry: required("tokens_per_entry", &name)?,
        window_tokens: get("window_tokens")?.map(|w| w.extract()).transpose()?,
        num_blocks: required("num_blocks", &name)?,
        name,
    }))
}

fn parse_layout(items: &[Bound<'_, PyAny>]) -> PyResult<Layout> {
    let (mut kinds, mut state) = (Vec::new(), None);
    for item in items {
        match parse_kind(item)? {
            Ok(kind) => kinds.push(kind),
            Err(_) if state.is_some() => {
                return Err(PyValueError::new_err("more than one state kind"))
            }
            Err(s) => state = Some(s),
        }
    }
    Layout::new(kinds, state).map_err(to_py_err)
}

/// The plan of one step. Per-request arrays have shape `[R]`, per-token arrays `[T]`;
/// `slot_mappings[kind]` is `[T]` int32 in entries of that kind (−1 = the token closes no entry).
/// Block tables are persistent on the caller's side (`v41_sched::step` docs): request `i` owns row
/// `table_rows[i]` of a `[max_num_seqs, width]` table per kind, and `table_diffs[kind]` is
/// `[3, D]` int32 (row, column, block; −1 = none) of the entries that changed; after applying it,
/// `table[table_rows, :max_blocks[kind]]` is the step's padded block table.
#[pyclass(module = "v41._native", name = "StepOutput", frozen, get_all)]
pub struct PyStepOutput {
    /// `[R]` uint64 request ids.
    req_ids: Py<PyArray1<u64>>,
    /// `[R]` uint32 tokens scheduled per request.
    num_scheduled: Py<PyArray1<u32>>,
    /// `[R]` uint32 position of the first scheduled token.
    start_pos: Py<PyArray1<u32>>,
    /// `[R]` uint32 draft tokens at the end of each chunk.
    num_draft_tokens: Py<PyArray1<u32>>,
    /// `[R]` bool: chunk starts before the last committed token.
    is_prefill: Py<PyArray1<bool>>,
    /// `[R]` bool: chunk reaches the last committed token (sample and report).
    do_sample: Py<PyArray1<bool>>,
    /// `[R]` uint32 prefix-cache hit of requests admitted this step.
    prefix_hit_tokens: Py<PyArray1<u32>>,
    /// `[T]` uint32 token ids.
    token_ids: Py<PyArray1<u32>>,
    /// `[T]` uint32 positions.
    positions: Py<PyArray1<u32>>,
    /// `[R]` int32 cstate rows (−1 = no state kind).
    state_rows: Py<PyArray1<i32>>,
    /// `[R]` int32 persistent block-table row of each request.
    table_rows: Py<PyArray1<i32>>,
    /// kind name → `[3, D]` int32 (row, column, block) of the changed table entries.
    table_diffs: Py<PyDict>,
    /// kind name → the longest block table among scheduled requests.
    max_blocks: Py<PyDict>,
    /// kind name → `[T]` int32.
    slot_mappings: Py<PyDict>,
    /// Ids preempted in this step.
    preempted: Vec<u64>,
    /// `(id, reason)` of requests that ended since the previous step; reason ∈ length/stop/abort.
    finished: Vec<(u64, &'static str)>,
    /// R.
    num_reqs: usize,
    /// T.
    num_tokens: usize,
}

#[pymethods]
impl PyStepOutput {
    fn __repr__(&self) -> String {
        format!(
            "StepOutput(num_reqs={}, num_tokens={}, preempted={:?}, finished={:?})",
            self.num_reqs, self.num_tokens, self.preempted, self.finished
        )
    }
}

fn step_to_py(py: Python<'_>, out: StepOutput, names: &[String]) -> PyResult<PyStepOutput> {
    let (num_reqs, num_tokens) = (out.num_reqs(), out.num_tokens());
    let table_diffs = PyDict::new(py);
    let max_blocks = PyDict::new(py);
    let slot_mappings = PyDict::new(py);
    for (name, mut kind) in names.iter().zip(out.kinds) {
        let d = kind.diff_rows.len();
        let mut diff = std::mem::take(&mut kind.diff_rows);
        diff.extend_from_slice(&kind.diff_cols);
        diff.extend_from_slice(&kind.diff_blocks);
        let diff = Array2::from_shape_vec((3, d), diff)
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        table_diffs.set_item(name, diff.into_pyarray(py))?;
        max_blocks.set_item(name, kind.max_blocks)?;
        slot_mappings.set_item(name, kind.slot_mapping.into_pyarray(py))?;
    }
    Ok(PyStepOutput {
        req_ids: out.req_ids.into_pyarray(py).unbind(),
        num_scheduled: out.num_scheduled.into_pyarray(py).unbind(),
        start_pos: out.start_pos.into_pyarray(py).unbind(),
        num_draft_tokens: out.num_draft_tokens.into_pyarray(py).unbind(),
        is_prefill: out.is_prefill.into_pyarray(py).unbind(),
        do_sample: out.do_sample.into_pyarray(py).unbind(),
        prefix_hit_tokens: out.prefix_hit_tokens.into_pyarray(py).unbind(),
        token_ids: out.token_ids.into_pyarray(py).unbind(),
        positions: out.positions.into_pyarray(py).unbind(),
        state_rows: out.state_rows.into_pyarray(py).unbind(),
        table_rows: out.table_rows.into_pyarray(py).unbind(),
        table_diffs: table_diffs.unbind(),
        max_blocks: max_blocks.unbind(),
        slot_mappings: slot_mappings.unbind(),
        preempted: out.preempted,
        finished: out
            .finished
            .into_iter()
            .map(|(id, r)| (id, r.as_str()))
            .collect(),
        num_reqs,
        num_tokens,
    })
}

/// The engine's scheduler: requests, KV block pools per cache kind and the radix prefix cache.
#[pyclass(module = "v41._native", name = "Scheduler")]
pub struct PyScheduler {
    inner: Scheduler,
    kind_names: Vec<String>,
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (
        layout, *, max_num_batched_tokens, max_num_seqs, max_model_len,
        long_prefill_token_threshold = None, enable_prefix_caching = true
    ))]
    fn new(
        layout: Vec<Bound<'_, PyAny>>,
        max_num_batched_tokens: u32,
        max_num_seqs: u32,
        max_model_len: u32,
        long_prefill_token_threshold: Option<u32>,
        enable_prefix_caching: bool,
    ) -> PyResult<Self> {
        let layout = parse_layout(&layout)?;
        let kind_names = layout.kinds().iter().map(|k| k.name.clone()).collect();
        let config = SchedulerConfig {
            max_num_batched_tokens,
            max_num_seqs,
            max_model_len,
            long_prefill_token_threshold,
            enable_prefix_caching,
        };
        Ok(Self {
            inner: Scheduler::new(layout, config).map_err(to_py_err)?,
            kind_names,
        })
    }

    /// Names of the token-indexed kinds, in layout order.
    #[getter]
    fn kind_names(&self) -> Vec<String> {
        self.kind_names.clone()
    }

    #[pyo3(signature = (request_id, prompt_token_ids, max_tokens, priority = 0, cache_salt = None, lookahead = 0))]
    fn add_request(
        &mut self,
        request_id: u64,
        prompt_token_ids: Vec<u32>,
        max_tokens: u32,
        priority: i32,
        cache_salt: Option<String>,
        lookahead: u32,
    ) -> PyResult<()> {
        let new = NewRequest {
            id: request_id,
            prompt: prompt_token_ids,
            max_tokens,
            priority,
            cache_salt,
            lookahead,
        };
        self.inner.add_request(new).map_err(to_py_err)
    }

    fn abort_request(&mut self, request_id: u64) -> PyResult<()> {
        self.inner.abort_request(request_id).map_err(to_py_err)
    }

    fn finish_request(&mut self, request_id: u64) -> PyResult<()> {
        self.inner.finish_request(request_id).map_err(to_py_err)
    }

    fn __contains__(&self, request_id: u64) -> bool {
        self.inner.request(request_id).is_some()
    }

    fn step(&mut self, py: Python<'_>) -> PyResult<PyStepOutput> {
        let inner = &mut self.inner;
        let out = py.detach(|| inner.step());
        step_to_py(py, out, &self.kind_names)
    }

    #[pyo3(signature = (req_ids, sampled, accepted = None, drafts = None))]
    fn update_from_output(
        &mut self,
        req_ids: Vec<u64>,
        sampled: Vec<Vec<u32>>,
        accepted: Option<Vec<u32>>,
        drafts: Option<Vec<Option<Vec<u32>>>>,
    ) -> PyResult<()> {
        let n = req_ids.len();
        let lengths_ok = sampled.len() == n
            && accepted.as_ref().is_none_or(|a| a.len() == n)
            && drafts.as_ref().is_none_or(|d| d.len() == n);
        if !lengths_ok {
            return Err(PyValueError::new_err(
                "req_ids, sampled, accepted and drafts must have equal lengths",
            ));
        }
        let mut accepted = accepted.map(Vec::into_iter);
        let mut drafts = drafts.map(Vec::into_iter);
        let outputs: Vec<RequestOutput> = req_ids
            .into_iter()
            .zip(sampled)
            .map(|(id, sampled)| RequestOutput {
                id,
                sampled,
                num_accepted_drafts: accepted.as_mut().and_then(Iterator::next).unwrap_or(0),
                new_draft: drafts
                    .as_mut()
                    .and_then(Iterator::next)
                    .flatten()
                    .unwrap_or_default(),
            })
            .collect();
        self.inner.update_from_output(&outputs).map_err(to_py_err)
    }

    /// Replace the last committed token of ``request_id`` (an async-scheduling placeholder) with ``token``;
    /// False when the request has finished or was aborted. ValueError when it has no output token or the
    /// token was already offered to the prefix cache.
    fn set_last_token(&mut self, request_id: u64, token: u32) -> PyResult<bool> {
        self.inner.set_last_token(request_id, token).map_err(to_py_err)
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.inner.stats();
        let dict = PyDict::new(py);
        dict.set_item("running", stats.num_running)?;
        dict.set_item("waiting", stats.num_waiting)?;
        let pool = |p: v41_sched::PoolStats| -> PyResult<Bound<'py, PyDict>> {
            let d = PyDict::new(py);
            d.set_item("used", p.used)?;
            d.set_item("cached", p.cached_only)?;
            d.set_item("free", p.free)?;
            d.set_item("total", p.total)?;
            Ok(d)
        };
        let blocks = PyDict::new(py);
        for (name, p) in self.kind_names.iter().zip(stats.kinds) {
            blocks.set_item(name, pool(p)?)?;
        }
        if let (Some(state), Some(p)) = (self.inner.layout().state(), stats.state_rows) {
            blocks.set_item(&state.name, pool(p)?)?;
        }
        dict.set_item("blocks", blocks)?;
        let prefix = stats.prefix;
        let rate = if prefix.query_tokens == 0 {
            0.0
        } else {
            prefix.hit_tokens as f64 / prefix.query_tokens as f64
        };
        dict.set_item("prefix_query_tokens", prefix.query_tokens)?;
        dict.set_item("prefix_hit_tokens", prefix.hit_tokens)?;
        dict.set_item("prefix_hit_rate", rate)?;
        dict.set_item("prefix_cached_pages", prefix.cached_pages)?;
        dict.set_item("num_preemptions", stats.num_preemptions)?;
        Ok(dict)
    }

    fn reset_prefix_cache(&mut self) -> usize {
        self.inner.reset_prefix_cache()
    }

    fn check_invariants(&self) -> PyResult<()> {
        self.inner
            .check_invariants()
            .map_err(PyRuntimeError::new_err)
    }
}

/// Adds the scheduler classes to `v41._native`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyScheduler>()?;
    m.add_class::<PyStepOutput>()?;
    Ok(())
}
