//! `kvferry._native`, the native half of the `kvferry` Python package: the Rust
//! [`kvferry_client::EngineClient`] bound with PyO3, so Python engines use the same
//! client as Rust ones. `client::EngineClient` owns a small tokio runtime and releases
//! the GIL while a call waits; `session::Session` ties instances to the client's life;
//! `board::CompletionBoard` shows loads landing layer by layer in shared memory, and their
//! outcome (`EngineClient.wait_load` for a client without a board);
//! `errors` raises the typed exceptions of `kvferry/errors.py`; `convert` turns Python
//! arguments into requests and answers into dicts. (Private modules: the Python API is
//! the interface, typed in `kvferry/_native.pyi`.)

mod board;
mod client;
mod convert;
mod errors;
mod session;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<client::EngineClient>()?;
    m.add_class::<session::Session>()?;
    m.add_class::<board::CompletionBoard>()?;
    m.add("__version__", kvferry_client::proto::VERSION)?;
    m.add("DEFAULT_DEADLINE_S", client::DEFAULT_DEADLINE_S)?;
    Ok(())
}
