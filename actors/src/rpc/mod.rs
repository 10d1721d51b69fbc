//! gRPC services of a node. [`peer_server::serve`] runs the owner side of
//! `kvferry.v1.Peer` over a [`peer_server::PeerBackend`]; [`peer_client::PeerClient`] is
//! the requester's client, with a deadline on every call. [`engine_server::serve`] runs
//! `kvferry.v1.Engine` over a `Node`, with client memory arriving on an
//! [`fd_socket::FdSocket`]; [`engine_client::EngineClient`] is the engine's client, a
//! [`board::Board`] shows it its loads landing without an RPC, and a [`mailbox::Mailbox`]
//! carries its queries and loads without the gRPC stack.

pub mod completions;
mod engine_request;
pub mod engine_server;
pub mod fd_socket;
pub(crate) mod mailbox_server;
pub mod memory_handles;
pub mod peer_client;
pub mod peer_server;
mod statuses;

pub use kvferry_proto::limits::*;
pub use kvferry_proto::shm::{board, mailbox};
pub use kvferry_proto::v1 as proto;

pub use engine_server::{serve as serve_engine, EngineOptions, EngineServeError};
pub use fd_socket::FdSocket;
pub use peer_client::{PeerClient, PeerClientError, PeerHandshake, PeerInfo, PeerPin};
pub use peer_server::{serve, DataEndpoint, NicRegistration, PeerBackend, PeerServeError};
pub use tonic::{Code, Status};
