//! The error every `Node` operation returns.

use kvferry_gpu::{DeviceError, LayoutError, ShapeError, SpanError};
use thiserror::Error;

use crate::config::ConfigError;
use crate::model::{InstanceId, LeaseId, ModelError};
use crate::tier::cache::CacheError;
use crate::tier::pool::PoolError;

/// A lease the table refused to consume (kept here, below `lease/`, so that
/// [`NodeError`] can wrap it without importing upward).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LeaseError {
    #[error("lease {lease} is unknown or expired")]
    UnknownOrExpired { lease: LeaseId },
    #[error("lease {lease} belongs to instance {owner}, not {caller}")]
    WrongInstance {
        lease: LeaseId,
        owner: InstanceId,
        caller: InstanceId,
    },
    #[error("rank {rank} already consumed lease {lease}")]
    RankConsumed { lease: LeaseId, rank: u32 },
    #[error("rank {rank} is out of range for lease {lease} (tp {world})")]
    RankOutOfRange {
        lease: LeaseId,
        rank: u32,
        world: u32,
    },
}

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum NodeError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Shape(#[from] ShapeError),
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error(transparent)]
    Lease(#[from] LeaseError),
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error(transparent)]
    Pool(#[from] PoolError),
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Ssd(#[from] crate::tier::ssd::SsdError),
    #[error("instance {instance} is not registered")]
    UnknownInstance { instance: InstanceId },
    #[error("instance {instance} rank {rank} is not registered")]
    UnknownRank { instance: InstanceId, rank: u32 },
    #[error(
        "instance {instance} is registered with {existing}, rank {rank} registered {requested}"
    )]
    InstanceMismatch {
        instance: InstanceId,
        rank: u32,
        existing: String,
        requested: String,
    },
    #[error("instance {instance} rank {rank} is already registered")]
    RankRegistered { instance: InstanceId, rank: u32 },
    #[error("device {ordinal} is not configured on this node ({count} devices)")]
    NoSuchDevice { ordinal: u32, count: usize },
    #[error("bad request: {reason}")]
    BadRequest { reason: String },
    /// The load's client cancelled it (CancelLoad): what it had submitted drained, nothing
    /// more was copied, and its destinations hold no valid KV.
    #[error("cancelled by its client after {landed} of {layers} layers landed")]
    Cancelled { landed: u32, layers: u32 },
    /// A request named a new tenant and the node keeps as many apart as it may.
    #[error(
        "the node keeps {limit} tenants apart (Capabilities.max_tenants); no new one is taken"
    )]
    TooManyTenants { limit: usize },
    #[error("copy failed on {path} load: {source}")]
    Transfer {
        path: &'static str,
        #[source]
        source: DeviceError,
    },
    /// A copy batch refused a span before anything was copied: a range outside the memory
    /// that guards it (device memory a driver refused is [`NodeError::Device`]).
    #[error("{what}: copy refused: {source}")]
    Span {
        what: &'static str,
        #[source]
        source: SpanError,
    },
    #[error("peer {peer}: {source}")]
    Remote {
        peer: String,
        #[source]
        source: crate::peer::RemoteError,
    },
    /// A direct load with a remote suffix that no verbs NIC near its GPU can read (direct is
    /// direct: there is no fallback to staging). A local failure: no peer was asked.
    #[error("no verbs nic can carry this direct load: {source}")]
    Unroutable {
        #[source]
        source: kvferry_transport::verbs::AffinityError,
    },
    #[error("the node is shutting down ({what})")]
    Stopped { what: &'static str },
    /// Write-through: sealed blocks of this request are in RAM but not on disk, so a crash
    /// would lose them; the put or save is not acknowledged.
    #[error(
        "write-through: {failed} of {blocks} sealed block(s) are not on disk (RAM still \
         holds them): {source}"
    )]
    NotDurable {
        failed: usize,
        blocks: usize,
        #[source]
        source: crate::tier::ssd::SsdError,
    },
    /// The request's fence (the moment its client gave up) passed before it took effect:
    /// what it did is discarded (a save's copies are not sealed, a query's lease is
    /// released).
    #[error("{what}: the client's deadline passed {late:?} ago; discarded")]
    DeadlinePassed {
        what: &'static str,
        late: std::time::Duration,
    },
}

impl NodeError {
    pub(crate) fn bad(reason: impl Into<String>) -> Self {
        NodeError::BadRequest {
            reason: reason.into(),
        }
    }

    /// A remote failure with `peer`.
    pub fn remote(peer: impl Into<String>, source: crate::peer::RemoteError) -> Self {
        NodeError::Remote {
            peer: peer.into(),
            source,
        }
    }
}

impl NodeError {
    /// A span refused while building `what`'s copies. Device memory the driver refused is
    /// reported as the device error it is, as when the backend refuses it at submission.
    pub(crate) fn span(what: &'static str, e: SpanError) -> Self {
        match e {
            SpanError::NotDeviceRange { source, .. } => NodeError::Device(source),
            source => NodeError::Span { what, source },
        }
    }
}

impl From<actix::MailboxError> for NodeError {
    fn from(_: actix::MailboxError) -> Self {
        NodeError::Stopped {
            what: "actor mailbox closed",
        }
    }
}

/// A link's error is the node's variant of the same name.
impl From<crate::peer::LinkError> for NodeError {
    fn from(e: crate::peer::LinkError) -> Self {
        use crate::peer::LinkError as L;
        match e {
            L::Remote { peer, source } => NodeError::Remote { peer, source },
            L::Stopped { what } => NodeError::Stopped { what },
            L::Span { what, source } => NodeError::Span { what, source },
            L::Device(e) => NodeError::Device(e),
            L::BadRequest { reason } => NodeError::BadRequest { reason },
        }
    }
}

/// A tier's error is the node's variant of the same name.
impl From<crate::tier::TierError> for NodeError {
    fn from(e: crate::tier::TierError) -> Self {
        use crate::tier::TierError as T;
        match e {
            T::Cache(e) => NodeError::Cache(e),
            T::Pool(e) => NodeError::Pool(e),
            T::Ssd(e) => NodeError::Ssd(e),
            T::NotDurable {
                failed,
                blocks,
                source,
            } => NodeError::NotDurable {
                failed,
                blocks,
                source,
            },
            T::DeadlinePassed { what, late } => NodeError::DeadlinePassed { what, late },
            T::BadRequest { reason } => NodeError::BadRequest { reason },
            T::Stopped { what } => NodeError::Stopped { what },
        }
    }
}
