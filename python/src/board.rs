//! `CompletionBoard`: a rank's loads landing, seen in shared memory without an RPC (engine
//! protocol 3). `EngineClient.open_board` creates it, sends it to the node and hands it to
//! `register(..., board=...)`; `load(..., board_slot=, board_tag=)` reports to a slot, and
//! `wait` sleeps on the node's futex (GIL released) until a layer has landed or the load ended.

use std::sync::Arc;

use kvferry_actors::rpc::board::{Board, SlotState, SlotView};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::client::seconds;
use crate::errors;

#[pyclass(module = "kvferry._native", frozen)]
pub struct CompletionBoard {
    pub(crate) board: Arc<Board>,
    /// The handle the node gave it (what `register` names).
    #[pyo3(get)]
    pub(crate) handle: u64,
}

fn state_name(s: SlotState) -> &'static str {
    match s {
        SlotState::Idle => "idle",
        SlotState::Running => "running",
        SlotState::Ok => "ok",
        SlotState::Failed => "failed",
    }
}

fn view_dict<'py>(py: Python<'py>, v: SlotView) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("tag", v.tag)?;
    d.set_item("state", state_name(v.state))?;
    d.set_item("layers", v.layers)?;
    d.set_item("done", v.state.is_done())?;
    Ok(d)
}

#[pymethods]
impl CompletionBoard {
    /// Number of slots.
    #[getter]
    fn slots(&self) -> u32 {
        self.board.slots()
    }

    /// What slot `slot` says now: `{"tag", "state", "layers", "done"}`.
    fn view<'py>(&self, py: Python<'py>, slot: u32) -> PyResult<Bound<'py, PyDict>> {
        let v = self
            .board
            .view(slot)
            .map_err(|e| errors::invalid(py, "view", e.to_string()))?;
        view_dict(py, v)
    }

    /// Waits (GIL released) until slot `slot` shows `tag` with at least `layers` landed or
    /// the load ended, or `timeout_s` passed; returns what the slot says then (check
    /// `done`, `state` and `layers`).
    #[pyo3(signature = (slot, tag, layers, timeout_s=10.0))]
    fn wait<'py>(
        &self,
        py: Python<'py>,
        slot: u32,
        tag: u32,
        layers: u32,
        timeout_s: f64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let timeout = seconds(py, "timeout_s", timeout_s)?;
        let board = Arc::clone(&self.board);
        let v = py
            .detach(move || board.wait(slot, tag, layers, timeout))
            .map_err(|e| errors::invalid(py, "wait", e.to_string()))?;
        view_dict(py, v)
    }

    fn __repr__(&self) -> String {
        format!(
            "CompletionBoard(handle={}, slots={})",
            self.handle,
            self.board.slots()
        )
    }
}
