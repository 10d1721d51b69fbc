//! The engine's client of a kvferry node, without the node's runtime: [`EngineClient`]
//! (typed `kvferry.v1.Engine` calls with a deadline each, memory sent on the node's fd
//! socket, Query, Load and Save through an attached request mailbox), [`EngineSession`]
//! (instances tied to this client) and the wire form of registrations ([`RegisterRegions`]).
//! A load's outcome is its completion board's final word, or [`EngineClient::wait_load`]. Boards and mailboxes, the ids and the
//! messages are `kvferry-proto`'s, re-exported here as [`proto`].

mod client;
mod error;
mod register;
mod session;

pub use client::{EngineClient, EngineTls, KvFd, QueryAnswer, DEFAULT_DEADLINE};
pub use error::EngineClientError;
pub use kvferry_proto as proto;
pub use register::{
    register_regions_request, register_request, LoadOptions, MemoryRegion, PlanePlacement,
    RegionLayer, RegisterRegions, Registration,
};
pub use session::EngineSession;
pub use tonic::{Code, Status};
