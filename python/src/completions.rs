//! `kvferry.Completions`: one instance rank's completed loads as the node streams them, so
//! an engine step drains every finished load with no RPC per load.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvferry_client::{CompletionStream, EngineClientError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use tokio::runtime::Runtime;

use crate::{convert, errors};

/// Longest a wait stays away from Python, so Ctrl-C interrupts it.
const SIGNAL_CHECK: Duration = Duration::from_millis(200);

#[pyclass(module = "kvferry._native", frozen)]
pub struct Completions {
    rt: Arc<Runtime>,
    /// `None` once closed.
    inner: Mutex<Option<CompletionStream>>,
    addr: String,
    pid: u32,
}

impl Completions {
    pub fn new(rt: Arc<Runtime>, s: CompletionStream, addr: String) -> Self {
        Self {
            rt,
            inner: Mutex::new(Some(s)),
            addr,
            pid: std::process::id(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Option<CompletionStream>> {
        // A panic cannot happen while this is held; recover the data if it ever did.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `step` on the stream in slices of at most [`SIGNAL_CHECK`] until it yields,
    /// checking for signals between slices; `Ok(None)` when `timeout` passed first.
    fn sliced<T: Send>(
        &self,
        py: Python<'_>,
        method: &str,
        timeout: Duration,
        step: impl Fn(&mut CompletionStream, Duration) -> Result<Option<T>, EngineClientError>
            + Send
            + Sync,
    ) -> PyResult<Option<T>> {
        if std::process::id() != self.pid {
            return Err(errors::precondition(
                py,
                method,
                "this stream was opened in another process",
            ));
        }
        let end = Instant::now() + timeout;
        loop {
            let slice = end
                .saturating_duration_since(Instant::now())
                .min(SIGNAL_CHECK);
            let got = py.detach(|| {
                let mut guard = self.lock();
                guard.as_mut().map(|s| step(s, slice))
            });
            match got {
                None => return Err(errors::precondition(py, method, "the stream is closed")),
                Some(Err(e)) => return Err(errors::client(py, method, &e)),
                Some(Ok(Some(v))) => return Ok(Some(v)),
                Some(Ok(None)) if Instant::now() >= end => return Ok(None),
                Some(Ok(None)) => py.check_signals()?,
            }
        }
    }
}

fn timeout(py: Python<'_>, method: &str, s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s).map_err(|_| {
        errors::invalid(
            py,
            method,
            format!("timeout_s must be >= 0 seconds, got {s}"),
        )
    })
}

#[pymethods]
impl Completions {
    /// The next completion, or None when none came within `timeout_s` (zero: only one
    /// that already arrived).
    #[pyo3(signature = (timeout_s=crate::client::DEFAULT_DEADLINE_S))]
    fn next<'py>(&self, py: Python<'py>, timeout_s: f64) -> PyResult<Option<Bound<'py, PyDict>>> {
        const M: &str = "Completions.next";
        let rt = &self.rt;
        let got = self.sliced(py, M, timeout(py, M, timeout_s)?, |s, slice| {
            rt.block_on(async {
                match tokio::time::timeout(slice, s.next()).await {
                    Err(_) => Ok(None),
                    Ok(Ok(Some(c))) => Ok(Some(c)),
                    Ok(Ok(None)) => Err(EngineClientError::Call {
                        addr: self.addr.clone(),
                        method: "Completions",
                        code: kvferry_client::Code::Unavailable,
                        message: "the node ended the stream".into(),
                    }),
                    Ok(Err(e)) => Err(e),
                }
            })
        })?;
        got.map(|c| convert::completion(py, c)).transpose()
    }

    /// Waits up to `timeout_s` for the completion of `load_id` (DeadlineExceeded after),
    /// keeping the others for `next`.
    #[pyo3(signature = (load_id, timeout_s=crate::client::DEFAULT_DEADLINE_S))]
    fn wait_for<'py>(
        &self,
        py: Python<'py>,
        load_id: u64,
        timeout_s: f64,
    ) -> PyResult<Bound<'py, PyDict>> {
        const M: &str = "Completions.wait_for";
        let rt = &self.rt;
        let got = self.sliced(py, M, timeout(py, M, timeout_s)?, |s, slice| {
            match rt.block_on(s.wait_for(load_id, slice)) {
                Ok(c) => Ok(Some(c)),
                Err(EngineClientError::WaitTimeout { .. }) => Ok(None),
                Err(e) => Err(e),
            }
        })?;
        match got {
            Some(c) => convert::completion(py, c),
            None => Err(errors::deadline(
                py,
                M,
                format!("load {load_id}: no completion within {timeout_s} s"),
            )),
        }
    }

    /// Ends the stream (completions not yet delivered stay with the node for `poll_load`
    /// or another stream).
    fn close(&self, py: Python<'_>) {
        let rt = &self.rt;
        py.detach(|| {
            let taken = self.lock().take();
            let _in_runtime = rt.enter();
            drop(taken);
        });
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _exc_type: Option<Bound<'_, PyAny>>,
        _exc: Option<Bound<'_, PyAny>>,
        _tb: Option<Bound<'_, PyAny>>,
    ) -> bool {
        self.close(py);
        false
    }
}
