//! `kvferry.Session`: the stream that ties registered instances to this client. When it
//! closes, is garbage-collected, or the process dies, the node unregisters its instances,
//! releases their leases and closes their unused memory handles.

use std::sync::{Arc, Mutex, MutexGuard};

use kvferry_client::EngineSession;
use pyo3::prelude::*;
use tokio::runtime::Runtime;

use crate::{convert, errors};

#[pyclass(module = "kvferry._native", frozen)]
pub struct Session {
    rt: Arc<Runtime>,
    /// `None` once closed.
    inner: Mutex<Option<EngineSession>>,
    bound: Mutex<Vec<String>>,
    /// The process that opened it (see `EngineClient`: a fork leaves the runtime behind).
    pid: u32,
}

impl Session {
    pub fn new(rt: Arc<Runtime>, s: EngineSession, bound: Vec<String>) -> Self {
        Self {
            rt,
            inner: Mutex::new(Some(s)),
            bound: Mutex::new(bound),
            pid: std::process::id(),
        }
    }

    fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
        // A panic cannot happen while these are held; recover the data if it ever did.
        m.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[pymethods]
impl Session {
    /// Binds a registered instance to this session.
    fn bind(&self, py: Python<'_>, instance: &str) -> PyResult<()> {
        const M: &str = "Session.bind";
        let id = convert::instance(py, M, instance)?;
        if std::process::id() != self.pid {
            return Err(errors::precondition(
                py,
                M,
                "this session was opened in another process",
            ));
        }
        let rt = &self.rt;
        let inner = &self.inner;
        let bound = py.detach(|| {
            let mut guard = Self::lock(inner);
            guard.as_mut().map(|s| rt.block_on(s.bind(&id)))
        });
        match bound {
            None => Err(errors::precondition(py, M, "the session is closed")),
            Some(Err(e)) => Err(errors::client(py, M, &e)),
            Some(Ok(())) => {
                Self::lock(&self.bound).push(instance.to_owned());
                Ok(())
            }
        }
    }

    /// Ends the session: the node unregisters its instances. Closing twice is harmless.
    fn close(&self, py: Python<'_>) {
        let rt = &self.rt;
        let inner = &self.inner;
        py.detach(|| {
            let taken = Self::lock(inner).take();
            let _in_runtime = rt.enter();
            drop(taken);
        });
    }

    #[getter]
    fn closed(&self) -> bool {
        Self::lock(&self.inner).is_none()
    }

    /// The instances bound so far.
    #[getter]
    fn instances(&self) -> Vec<String> {
        Self::lock(&self.bound).clone()
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

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let state = if self.closed() { "closed" } else { "open" };
        let bound = self.instances().into_pyobject(py)?.repr()?;
        Ok(format!("Session({bound}, {state})"))
    }
}
