//! The kvferry runtime, by part:
//! - [`lease`]: queries answered with leases ([`lease::keeper::LeaseKeeper`] over the plain
//!   [`lease::table::LeaseTable`]) and the engine instances they load into
//!   ([`lease::registry::InstanceRegistry`]);
//! - [`load`]: a load planned ([`load::plan`]), its bytes moved from RAM, SSD and remote
//!   owners ([`load::transfer::Transfer`], [`load::remote`], [`load::ssd`]) and its end;
//! - [`tier`]: the host block cache over the pool and the SSD tier below it
//!   ([`tier::store::BlockStore`]);
//! - [`peer`]: links to other nodes, the directory, the owner side of the Peer API;
//! - [`service`]: the engine and peer gRPC servers, the fd socket and request mailboxes;
//! - [`nic`]: RDMA NIC workers, pure per-peer queues and the MR registry;
//! - [`events`]: what the node stores and drops, as vLLM KV events (a ring, a ZMQ publisher).
//!
//! [`Node`] is the in-process handle over them; the wire and the ids are `kvferry-proto`'s.

pub mod api;
pub mod bytes;
pub mod clock;
pub mod config;
pub mod error;
pub mod events;
pub mod lease;
pub mod load;
pub(crate) mod log_limit;
pub mod metrics;
pub mod nic;
pub mod node;
pub mod peer;
pub mod private_fs;
pub mod service;
pub(crate) mod statuses;
pub mod tier;
pub mod tls;

pub use api::*;
pub use clock::{Clock, ManualClock};
pub use config::NodeConfig;
pub use error::NodeError;
pub use kvferry_proto::{fence, model};
pub use kvferry_proto::{BlockHash, BlockKey, Fence, InstanceId, LeaseId, Namespace};
pub use node::Node;
