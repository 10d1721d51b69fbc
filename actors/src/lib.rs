//! The kvferry runtime. [`Node`] is the in-process handle over the actors:
//! [`store::BlockStore`] (host block cache over the [`pool::HostPool`]),
//! [`keeper::LeaseKeeper`] (queries, leases over [`lease::LeaseTable`], loads),
//! [`registry::InstanceRegistry`] (engine instances and their KV layouts) and
//! [`transfer::Transfer`] (one per load or save, owning what its copies touch).

pub mod api;
pub mod cache;
pub mod clock;
pub mod config;
pub mod error;
pub mod keeper;
pub mod lease;
pub mod log_config;
pub(crate) mod log_limit;
pub mod metrics;
pub mod nic;
pub mod node;
pub mod plan;
pub mod pool;
pub mod private_fs;
pub mod registry;
pub mod remote;
pub mod rpc;
mod slot_lru;
pub mod ssd;
pub mod store;
pub mod suffix;
pub mod transfer;

pub use api::*;
pub use clock::{Clock, ManualClock};
pub use config::NodeConfig;
pub use error::NodeError;
pub use kvferry_proto::{fence, model};
pub use kvferry_proto::{BlockHash, BlockKey, Fence, InstanceId, LeaseId, Namespace};
pub use node::Node;
