//! What a call of the engine client can fail with, sorted by what the caller does next.

use std::path::PathBuf;
use std::time::Duration;

use thiserror::Error;
use tonic::Code;

use kvferry_proto::shm::mailbox::MailboxError;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum EngineClientError {
    #[error("engine service at {addr}: {reason}")]
    Address { addr: String, reason: String },
    #[error("engine service at {addr}: connecting")]
    Connect {
        addr: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("engine service at {addr}: no connection within {after:?}")]
    ConnectTimeout { addr: String, after: Duration },
    /// The node answered with an error status (or the call ran past its deadline:
    /// `DeadlineExceeded`, or the connection broke: `Unavailable`).
    #[error("engine service at {addr}: {method} failed: {code:?}: {message}")]
    Call {
        addr: String,
        method: &'static str,
        code: Code,
        message: String,
    },
    #[error("engine fd socket {path}: {what}")]
    FdSocket {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The fd socket refused the memory.
    #[error("engine fd socket {path}: refused: {code:?}: {message}")]
    FdRefused {
        path: PathBuf,
        code: Code,
        message: String,
    },
    #[error("engine service at {addr}: {method} answered a malformed response: {reason}")]
    Malformed {
        addr: String,
        method: &'static str,
        reason: String,
    },
    #[error("load {load_id}: no completion within {after:?}")]
    WaitTimeout { load_id: u64, after: Duration },
    #[error("no fd socket: connect with its path (Capabilities.fd_socket)")]
    NoFdSocket,
    /// The request mailbox failed (creating it, or waiting for an answer).
    #[error("engine service at {addr}: request mailbox")]
    Mailbox {
        addr: String,
        #[source]
        source: MailboxError,
    },
    /// The request asks for what the node's protocol does not have (checked here, so it is
    /// never silently served without it).
    #[error("engine service at {addr}: {what} needs engine protocol {needs}; the node speaks {protocol}")]
    Unsupported {
        addr: String,
        what: &'static str,
        needs: u32,
        protocol: u32,
    },
    /// The node took a completion board without saying it writes this build's version.
    #[error("engine service at {addr}: completion board {handle}")]
    Board {
        addr: String,
        handle: u64,
        #[source]
        source: kvferry_proto::shm::board::BoardError,
    },
}

impl EngineClientError {
    /// The gRPC status code of a refused call or fd request.
    pub fn code(&self) -> Option<Code> {
        match self {
            EngineClientError::Call { code, .. } | EngineClientError::FdRefused { code, .. } => {
                Some(*code)
            }
            EngineClientError::Unsupported { .. } => Some(Code::FailedPrecondition),
            _ => None,
        }
    }
}
