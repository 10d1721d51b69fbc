//! The node's servers: the engine service ([`engine`]: gRPC, fd socket, mailboxes) and the
//! statuses it answers with are `crate::statuses`, shared with the Peer server. The Peer server is `crate::peer::server`;
//! the engine's client is the `kvferry-client` crate.

pub mod engine;

pub use kvferry_proto::limits::*;
pub use kvferry_proto::shm::{board, mailbox};
pub use kvferry_proto::v1 as proto;

pub use engine::{serve as serve_engine, EngineOptions, EngineServeError, FdSocket};
pub use tonic::{Code, Status};
