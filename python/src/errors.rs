//! Failures raised to Python. The exception classes live in `kvferry/errors.py` (so they
//! can also be `ValueError`s and carry docstrings); this module picks one by the gRPC code
//! of the failure and fills in `.code` and `.method` (the Python method that failed).

use std::error::Error as _;

use kvferry_client::proto::shm::mailbox::MailboxError;
use kvferry_client::proto::shm::ShmError;
use kvferry_client::{Code, EngineClientError};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

/// A failure of the Rust client during `method`.
pub fn client(py: Python<'_>, method: &str, e: &EngineClientError) -> PyErr {
    let (kind, code) = match e {
        EngineClientError::Call { code, .. } | EngineClientError::FdRefused { code, .. } => {
            ("call", code_name(*code))
        }
        // The node's fd socket could not be reached or broke mid-request.
        EngineClientError::FdSocket { .. } => ("fd_socket", "UNAVAILABLE"),
        EngineClientError::Address { .. } => ("call", "INVALID_ARGUMENT"),
        EngineClientError::Connect { .. } | EngineClientError::ConnectTimeout { .. } => {
            ("call", "UNAVAILABLE")
        }
        EngineClientError::Malformed { .. } => ("call", "INTERNAL"),
        EngineClientError::WaitTimeout { .. } => ("call", "DEADLINE_EXCEEDED"),
        EngineClientError::NoFdSocket => ("call", "FAILED_PRECONDITION"),
        // This process could not make its mailbox (memory, descriptors); anything else the
        // mailbox says is a broken answer.
        EngineClientError::Mailbox {
            source: MailboxError::Shm {
                source: ShmError::Os { .. },
            },
            ..
        } => ("call", "RESOURCE_EXHAUSTED"),
        EngineClientError::Mailbox { .. } => ("call", "INTERNAL"),
        // A node that does not write this build's board: loads are polled instead.
        EngineClientError::Board { .. } => ("call", "FAILED_PRECONDITION"),
        _ => ("call", "UNKNOWN"),
    };
    raise(py, kind, code, method, &chain(e))
}

/// Input refused before anything was sent.
pub fn invalid(py: Python<'_>, method: &str, message: impl AsRef<str>) -> PyErr {
    raise(py, "call", "INVALID_ARGUMENT", method, message.as_ref())
}

/// A call this client can no longer make (a closed session).
pub fn precondition(py: Python<'_>, method: &str, message: impl AsRef<str>) -> PyErr {
    raise(py, "call", "FAILED_PRECONDITION", method, message.as_ref())
}

/// A wait that ran out of time on this side.
pub fn deadline(py: Python<'_>, method: &str, message: impl AsRef<str>) -> PyErr {
    raise(py, "call", "DEADLINE_EXCEEDED", method, message.as_ref())
}

fn raise(py: Python<'_>, kind: &str, code: &str, method: &str, message: &str) -> PyErr {
    let made = py
        .import("kvferry.errors")
        .and_then(|m| m.getattr("_from_native"))
        .and_then(|f| f.call1((kind, code, method, message)));
    match made {
        Ok(exc) => PyErr::from_value(exc),
        // Only when `_native` is imported outside its package.
        Err(_) => PyRuntimeError::new_err(format!("{method}: {code}: {message}")),
    }
}

/// The message with its causes: "transport error" alone does not say the port is closed.
fn chain(e: &EngineClientError) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        cause = c.source();
    }
    s
}

/// The canonical gRPC name of a status code, as `kvferry.errors` keys its classes.
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}
