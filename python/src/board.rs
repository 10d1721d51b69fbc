//! `CompletionBoard`: a rank's loads landing and ending, seen in shared memory without an RPC
//! (engine protocol 3, board version 2). `EngineClient.open_board` creates it, sends it to
//! the node and hands it to `register(..., board=...)`; `load(..., board_slot=, board_tag=)`
//! reports to a slot, `wait` sleeps on the node's futex (GIL released) until a layer has
//! landed or the load ended, and `wait_ends` until one of many loads ended. A slot's final
//! word is the outcome (`ok`, or `failed_blocks`): a load that ended ok needs no `poll_load`.

use std::sync::Arc;

use kvferry_client::proto::shm::board::{Board, SlotState, SlotView};
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
    d.set_item("ok", v.state == SlotState::Ok)?;
    d.set_item("failed_blocks", v.failed_blocks)?;
    Ok(d)
}

#[pymethods]
impl CompletionBoard {
    /// Number of slots.
    #[getter]
    fn slots(&self) -> u32 {
        self.board.slots()
    }

    /// What slot `slot` says now: `{"tag", "state", "layers", "done", "ok",
    /// "failed_blocks"}`. Once `done`, `ok` is the outcome; a failed load's `failed_blocks`
    /// counts its failed destination blocks (which ones, and why: `poll_load`).
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

    /// Waits (GIL released) until at least one of `loads` (`(slot, tag)` pairs) ended,
    /// `interrupt` was called since the last call, or `timeout_s` passed; returns the ended
    /// ones as views with their `"slot"` (empty: interrupted or timed out). Layers landing do
    /// not wake it. For the one thread of a rank that watches all its loads.
    #[pyo3(signature = (loads, timeout_s=10.0))]
    fn wait_ends<'py>(
        &self,
        py: Python<'py>,
        loads: Vec<(u32, u32)>,
        timeout_s: f64,
    ) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let timeout = seconds(py, "timeout_s", timeout_s)?;
        let board = Arc::clone(&self.board);
        let ended = py
            .detach(move || board.wait_ends(&loads, timeout))
            .map_err(|e| errors::invalid(py, "wait_ends", e.to_string()))?;
        ended
            .into_iter()
            .map(|(slot, v)| {
                let d = view_dict(py, v)?;
                d.set_item("slot", slot)?;
                Ok(d)
            })
            .collect()
    }

    /// Ends this process's current (or next) `wait_ends` at once.
    fn interrupt(&self) {
        self.board.interrupt();
    }

    fn __repr__(&self) -> String {
        format!(
            "CompletionBoard(handle={}, slots={})",
            self.handle,
            self.board.slots()
        )
    }
}
