//! gRPC services of a node. [`peer_server::serve`] runs the owner side of
//! `kvferry.v1.Peer` over a [`peer_server::PeerBackend`]; [`peer_client::PeerClient`] is
//! the requester's client, with a deadline on every call.

pub mod peer_client;
pub mod peer_server;

/// The generated `kvferry.v1` messages, client and server.
#[allow(clippy::all, missing_docs)]
pub mod proto {
    tonic::include_proto!("kvferry.v1");
}

pub use peer_client::{PeerClient, PeerClientError, PeerHandshake, PeerInfo, PeerPin};
pub use peer_server::{serve, DataEndpoint, NicRegistration, PeerBackend, PeerServeError};
pub use tonic::Code;

/// The peer protocol revision this build speaks.
pub const PROTOCOL: u32 = 1;

/// What this build can do for peers, announced in Hello.
pub const CAPABILITIES: &[&str] = &["pin-blocks", "pin-ttl", "unpin"];

/// Most hashes accepted in one PinBlocks request.
pub const MAX_PIN_HASHES: usize = 4096;

/// The kvferry release of this build.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
