//! Shared memory beside the RPCs: a completion [`board`] per rank (a load's layers and
//! outcome without a call) and a request [`mailbox`] per session (Query, Load and Save
//! without the gRPC stack), both memfds mapped by client and node (`shared_map`).

pub mod board;
pub mod mailbox;
mod shared_map;

pub use shared_map::ShmError;
