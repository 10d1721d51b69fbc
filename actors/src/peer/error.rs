//! Why a remote operation failed, sorted by what the caller does about it: a link that
//! could not be made or broke is rebuilt on its next use (the load fails now, the next one
//! reconnects); an owner that refused will refuse again (report it, do not retry blindly);
//! a node without a data path for the read must be configured (back off); blocks that
//! vanished on their owner are reported as failed blocks (the engine recomputes them).

use kvferry_gpu::{DeviceError, SpanError};
use thiserror::Error;

/// An error from below (a socket, an RPC, a queue) kept as the cause.
pub type Cause = Box<dyn std::error::Error + Send + Sync + 'static>;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RemoteError {
    /// Reaching the owner or handshaking with it failed.
    #[error("connecting failed: {what}")]
    Connect {
        what: String,
        #[source]
        source: Option<Cause>,
    },
    /// An established link broke during an operation (a pin, a read).
    #[error("the link broke during {during}")]
    Lost {
        during: &'static str,
        #[source]
        source: Option<Cause>,
    },
    /// The owner answered and refused, or answered something this node cannot use.
    #[error("refused: {reason}")]
    Refused { reason: String },
    /// This node has no data path for the read (no NIC for the GPU, no data side).
    #[error("no data path: {reason}")]
    NoDataPath { reason: String },
    /// This node's own side failed (binding a socket, registering or pinning memory, a
    /// bounce copy): the owner is fine; back off.
    #[error("local resource: {what}")]
    Local {
        what: String,
        #[source]
        source: Option<Cause>,
    },
    /// Pinned blocks are gone on the owner.
    #[error("{blocks} pinned block(s) vanished on the owner")]
    Vanished { blocks: usize },
}

impl RemoteError {
    pub fn connect(what: impl Into<String>, source: impl Into<Cause>) -> Self {
        RemoteError::Connect {
            what: what.into(),
            source: Some(source.into()),
        }
    }

    pub fn lost(during: &'static str, source: impl Into<Cause>) -> Self {
        RemoteError::Lost {
            during,
            source: Some(source.into()),
        }
    }

    pub fn refused(reason: impl Into<String>) -> Self {
        RemoteError::Refused {
            reason: reason.into(),
        }
    }

    pub fn local(what: impl Into<String>, source: impl Into<Cause>) -> Self {
        RemoteError::Local {
            what: what.into(),
            source: Some(source.into()),
        }
    }

    pub fn no_path(reason: impl Into<String>) -> Self {
        RemoteError::NoDataPath {
            reason: reason.into(),
        }
    }

    /// The link must be rebuilt before it is used again.
    pub fn is_link_failure(&self) -> bool {
        matches!(self, RemoteError::Connect { .. } | RemoteError::Lost { .. })
    }

    /// The short kind an engine sees in a failed load's completion.
    pub fn kind(&self) -> &'static str {
        match self {
            RemoteError::Connect { .. } | RemoteError::Lost { .. } => "remote",
            RemoteError::Refused { .. } => "remote_refused",
            RemoteError::NoDataPath { .. } => "no_data_path",
            RemoteError::Local { .. } => "local_resource",
            RemoteError::Vanished { .. } => "vanished",
        }
    }
}

/// What a link, or the set of links, reports to the load or the node that called it: a
/// remote failure names its peer; the rest are this node's own (shutting down, a copy refused,
/// a name nobody serves). The node's own error keeps each of these as the variant of the same
/// name.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum LinkError {
    #[error("peer {peer}: {source}")]
    Remote {
        peer: String,
        #[source]
        source: RemoteError,
    },
    #[error("the node is shutting down ({what})")]
    Stopped { what: &'static str },
    /// A copy batch refused a span before anything was copied.
    #[error("{what}: copy refused: {source}")]
    Span {
        what: &'static str,
        #[source]
        source: SpanError,
    },
    /// Device memory the driver refused.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A name or value given by the caller that no link can serve (an unknown provider).
    #[error("bad request: {reason}")]
    BadRequest { reason: String },
}

impl LinkError {
    /// A remote failure with `peer`.
    pub fn remote(peer: impl Into<String>, source: RemoteError) -> Self {
        LinkError::Remote {
            peer: peer.into(),
            source,
        }
    }

    pub(crate) fn bad(reason: impl Into<String>) -> Self {
        LinkError::BadRequest {
            reason: reason.into(),
        }
    }

    /// A span refused while building `what`'s copies; device memory the driver refused is
    /// the device error it is.
    pub(crate) fn span(what: &'static str, e: SpanError) -> Self {
        match e {
            SpanError::NotDeviceRange { source, .. } => LinkError::Device(source),
            source => LinkError::Span { what, source },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn kinds_and_causes_are_kept() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
        let e = RemoteError::lost("a read", io);
        assert!(e.is_link_failure());
        assert_eq!(e.kind(), "remote");
        assert_eq!(e.source().unwrap().to_string(), "reset by peer");
        let e = RemoteError::refused("range outside the pool");
        assert!(!e.is_link_failure());
        assert_eq!(e.kind(), "remote_refused");
        assert_eq!(RemoteError::no_path("no nic").kind(), "no_data_path");
        let e = RemoteError::local("pinning the bounce ring", std::io::Error::other("ENOMEM"));
        assert_eq!((e.kind(), e.is_link_failure()), ("local_resource", false));
        assert_eq!(RemoteError::Vanished { blocks: 2 }.kind(), "vanished");
    }
}
