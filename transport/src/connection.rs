//! The provider-facing side of a QP: a connection that puts reads on the wire, and the
//! connector that builds one (and rebuilds it after a reset).

use std::io;
use std::sync::Arc;

use thiserror::Error;

use crate::completion::CompletionSink;
use crate::descriptor::RemoteDescriptor;
use crate::qp_key::{NodeId, QpKey};
use crate::scatter::Scatter;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ConnectionError {
    #[error("connecting to {peer} at {addr} failed")]
    Connect {
        peer: NodeId,
        addr: String,
        #[source]
        source: io::Error,
    },
    #[error("handshake with {peer} failed: {reason}")]
    Handshake { peer: NodeId, reason: String },
    #[error("handshake I/O with {peer} failed")]
    HandshakeIo {
        peer: NodeId,
        #[source]
        source: io::Error,
    },
    /// The TLS session with the owner could not be made or broke during the data-plane
    /// hello: its certificate is not one this node's CA signed for the owner's name, the
    /// owner refused this node's certificate, or the handshake missed its deadline.
    #[error("TLS with {peer} failed")]
    Tls {
        peer: NodeId,
        #[source]
        source: io::Error,
    },
    #[error("expected peer {expected}, {found} answered")]
    PeerMismatch { expected: NodeId, found: NodeId },
    #[error("peer {peer} speaks protocol version {theirs}, we speak {ours}")]
    VersionMismatch {
        peer: NodeId,
        ours: u16,
        theirs: u16,
    },
    /// The owner refused this requester's link grant (unknown, revoked or expired, or a
    /// proof that does not match): a new grant from the owner's Handshake is needed.
    #[error("owner {peer} refused the data link (unknown, revoked or expired): handshake again")]
    Unauthorized { peer: NodeId },
    #[error("connection to {peer} is lost")]
    ConnectionLost { peer: NodeId },
    #[error("peer {peer} is unreachable")]
    PeerUnreachable { peer: NodeId },
    #[error("posting request {wr_id} to {peer} failed: {reason}")]
    Post {
        peer: NodeId,
        wr_id: u64,
        reason: String,
    },
    #[error("sending request {wr_id} to {peer} failed")]
    Send {
        peer: NodeId,
        wr_id: u64,
        #[source]
        source: io::Error,
    },
    #[error("setting up the {what} for {peer} failed")]
    Setup {
        peer: NodeId,
        what: &'static str,
        #[source]
        source: io::Error,
    },
}

/// One read as a provider sees it.
#[derive(Clone)]
pub struct WorkRequest {
    pub qp: QpKey,
    pub wr_id: u64,
    pub remote: RemoteDescriptor,
    pub scatter: Arc<Scatter>,
}

/// A live connection to one peer for one QP.
///
/// Contract (every provider):
/// - `issue` returning `Ok` means exactly one completion for `wr_id` will reach the sink,
///   possibly from inside `issue`; `Err` means the request did not execute, wrote nothing, and
///   will not complete.
/// - A provider drops its clone of the scatter before it pushes the completion, so that the
///   destination is released exactly when the QP reports the request.
/// - After `abort`, no new request is accepted and every issued request completes soon (as
///   `Flushed` or `TransportError` unless it already finished).
/// - Dropping the connection aborts it and waits for its threads, if any.
pub trait Connection: Send {
    fn peer(&self) -> NodeId;
    fn issue(&mut self, wr: WorkRequest) -> Result<(), ConnectionError>;
    fn abort(&mut self);
}

/// Builds connections for a QP; used for the first connect and for every rebuild after reset.
pub trait Connector: Send + Sync {
    fn connect(
        &self,
        qp: QpKey,
        sink: Arc<dyn CompletionSink>,
    ) -> Result<Box<dyn Connection>, ConnectionError>;
}

impl<C: Connector + ?Sized> Connector for Box<C> {
    fn connect(
        &self,
        qp: QpKey,
        sink: Arc<dyn CompletionSink>,
    ) -> Result<Box<dyn Connection>, ConnectionError> {
        (**self).connect(qp, sink)
    }
}

impl<C: Connector + ?Sized> Connector for Arc<C> {
    fn connect(
        &self,
        qp: QpKey,
        sink: Arc<dyn CompletionSink>,
    ) -> Result<Box<dyn Connection>, ConnectionError> {
        (**self).connect(qp, sink)
    }
}
