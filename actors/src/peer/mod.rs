//! Other nodes: the directory, links to owners ([`link::PeerLink`]: mapped for loopback and
//! shm, [`rc_link::RcLink`] over tcp or a verbs NIC, bundled per NIC by [`verbs::VerbsLink`]),
//! the Peer API's client ([`client::PeerClient`]) and owner side ([`server`]: Hello,
//! Handshake, PinBlocks, Unpin), owner-side pins and the in-process cluster.

pub mod batches;
pub mod bounce;
pub mod breaker;
pub mod client;
pub mod cluster;
mod data_tls;
pub mod directory;
pub mod endpoint;
pub mod error;
pub mod grpc;
pub mod link;
pub mod pin_service;
pub mod pins;
pub mod plane_regs;
pub mod rc_link;
pub mod redis;
pub mod redis_url;
pub mod server;
pub mod verbs;

pub use breaker::BreakerState;
pub use client::{PeerClient, PeerClientError, PeerHandshake, PeerInfo, PeerPin};
pub use cluster::{LocalCluster, Provider};
pub use directory::{
    Directory, DirectoryHealth, DirectoryStats, EmbeddedDirectory, Segment, StaticDirectory,
};
pub use endpoint::{EndpointError, VerbsPeerEndpoint, VerbsResponder};
pub use error::{LinkError, RemoteError};
pub use grpc::{GrpcPeers, GrpcPeersConfig};
pub use link::{PeerLink, PinnedRemote, RemoteBlock, RemotePin};
pub use pin_service::{PinService, PinServiceError};
pub use redis::{RedisDirectory, RedisError, RedisOptions};
pub use redis_url::{redact_url, RedisUrl, RedisUrlError};
pub use server::{
    serve, serve_with_tls, DataEndpoint, NicRegistration, PeerBackend, PeerServeError,
};

use std::sync::Arc;

use kvferry_transport::HostRegion;

/// How a node reaches its peers: the directory it shares with them, and a link to each.
/// [`LocalCluster`] is the in-process implementation.
pub trait Peers: Send + Sync + std::fmt::Debug {
    fn directory(&self) -> &Arc<dyn Directory>;
    /// A link from node `from` to owner `to` (made once and shared; making one may take a
    /// round trip to the owner).
    fn link(&self, from: &str, to: &str) -> link::BoxFut<Result<Arc<dyn PeerLink>, LinkError>>;
    /// Makes `node`'s pool reachable to the others; `store` pins its blocks for them.
    fn join(
        &self,
        node: &str,
        store: Arc<dyn PinService>,
        memory: Arc<HostRegion>,
    ) -> Result<(), LinkError>;
    /// Withdraws `node`: its directory entries go and links to it are dropped.
    fn leave(&self, node: &str);
    /// The RDMA NICs a joined node reads peers with, for links over verbs. Peers that do
    /// not read over verbs ignore it.
    fn attach_verbs(&self, side: crate::nic::runtime::VerbsSide) {
        let _ = side;
    }
    /// What `node`'s tcp data server refused, by reason (none without a tcp data server).
    fn data_rejections(&self, node: &str) -> Option<Arc<kvferry_transport::Rejections>> {
        let _ = node;
        None
    }
}
