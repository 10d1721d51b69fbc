//! kvferry's wire, shared by the node and its clients without the runtime: the generated
//! `kvferry.v1` messages and services ([`v1`]), the limits both sides read ([`limits`]), the
//! ids of the data model ([`BlockHash`], [`BlockKey`], [`InstanceId`], [`LeaseId`],
//! [`Namespace`]), the engine API's request types ([`api`]), request fences ([`Fence`]), the
//! fd socket's answer line ([`fd_line`]) and the shared-memory formats beside the calls
//! ([`shm::board`], [`shm::mailbox`]). A shared-memory format keeps both of its sides in one
//! file, as a protocol does, so that its tests pair a writer with a reader.

pub mod api;
pub mod fd_line;
pub mod fence;
pub mod limits;
pub mod model;
pub mod shm;

pub use fence::Fence;
pub use limits::*;
pub use model::{BlockHash, BlockKey, InstanceId, LeaseId, ModelError, Namespace};

/// The generated `kvferry.v1` messages, clients and servers.
#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("kvferry.v1");
}
