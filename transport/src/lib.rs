//! kvferry transport: memory regions, remote descriptors and one-sided read providers.
//!
//! Key types: [`MrTable`] (keys, bounds, access, deferred deregistration) over [`HostRegion`]s
//! and device ranges written through a [`DeviceSink`]; [`ReadRequest`] (one
//! [`RemoteDescriptor`] scattered into [`LocalSegment`]s); [`RcQueue`], the provider-neutral
//! RC state machine, and [`Qp`], which pairs it with a provider [`Connection`];
//! [`CompletionQueue`] for poller threads; [`NicConfig`]. Providers: [`loopback`], [`tcp`],
//! [`shm`] (its descriptors travel with [`fd_passing`]), [`verbs`] (its rdma-core layer
//! behind the `verbs` feature), and the [`fault`] wrapper.

mod completion;
mod config;
mod connection;
mod cq;
pub mod data_auth;
mod descriptor;
mod mr_table;
mod owner_loop;
mod qp;
mod qp_key;
mod rc_queue;
mod region;
mod scatter;
mod sink;
mod tls;
mod wire;

pub mod fault;
pub mod fd_passing;
pub mod loopback;
pub mod shm;
pub mod tcp;
pub mod verbs;

pub use completion::{CompletionSink, CompletionStatus, WorkCompletion};
pub use config::{ConfigError, NicConfig, ProviderKind};
pub use connection::{Connection, ConnectionError, Connector, WorkRequest};
pub use cq::CompletionQueue;
pub use data_auth::{DataAuth, DataAuthError, LinkGrant, LinkSecret, Reject, Rejections};
pub use descriptor::{LocalSegment, ReadRequest, RemoteDescriptor};
pub use mr_table::{
    Access, MrError, MrExport, MrGauges, MrHandle, MrKey, MrKind, MrTable, RemoteSource,
};
pub use qp::{Qp, QpError, QpGaugeValues, QpGauges};
pub use qp_key::{NicId, NodeId, QpKey, QpNum};
pub use rc_queue::{
    CompletionEffect, QpState, QueueFault, QueueLimits, RcQueue, RcQueueError, Reported, Submit,
};
pub use region::{HostRegion, RegionError};
pub use scatter::{Scatter, ScatterError};
pub use sink::{DeviceSink, SinkError, StagingArea};
