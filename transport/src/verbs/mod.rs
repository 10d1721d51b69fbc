//! The RDMA verbs provider and the logic under it.
//!
//! Everything that decides something is plain code, compiled and tested on every build:
//! [`gid`] (GID/LID choice, path MTU), [`sysfs`] and [`affinity`] (devices, PCIe placement,
//! NIC choice and striping), [`registration`] (splitting, access flags, key lookup), [`work`]
//! (RDMA READ requests, completion statuses), [`qp_attrs`] (the reset → RTS attributes),
//! [`capability`] (the `direct_gpu` gate) and [`nic`] (a NIC as the node uses it: port address
//! and split host-pool registration, opened with or without the feature). With the `verbs`
//! cargo feature, `ffi` wraps the rdma-core calls, `device` owns the objects, and `provider::VerbsNic` /
//! `provider::VerbsConnector` implement the provider over them.

pub mod affinity;
pub mod capability;
pub mod config;
pub mod gid;
pub mod nic;
pub mod qp_attrs;
pub mod registration;
pub mod sysfs;
pub mod work;

#[cfg(feature = "verbs")]
pub mod device;
#[cfg(feature = "verbs")]
mod ffi;
#[cfg(feature = "verbs")]
pub mod provider;

pub use affinity::{choose_nics, stripe, Affinity, AffinityError, Destination};
pub use capability::{probe, VerbsCapability};
pub use config::{VerbsConfig, VerbsConfigError};
pub use gid::{choose_address, GidError, PortAddress, PortInfo};
pub use nic::{
    compiled, open_nic, register_host_split, AcceptError, ChunkMr, EndpointExchange, NicHostMr,
    NicOpenError, RdmaNic, RegistrarError,
};
pub use qp_attrs::QpEndpoint;
pub use registration::{KeyMap, RegistrationError};
pub use sysfs::{NicInfo, Sysfs, SysfsError};
pub use work::{build_read, ReadWr, WorkError};
