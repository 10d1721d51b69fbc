//! The RDMA verbs provider and the logic under it.
//!
//! Everything that decides something is plain code, compiled and tested on every build:
//! [`gid`] (GID/LID choice, path MTU), [`sysfs`] and [`affinity`] (devices, PCIe placement,
//! NIC choice and striping), [`registration`] (splitting, access flags, key lookup), [`work`]
//! (RDMA READ requests, completion statuses), [`qp_attrs`] (the reset → RTS attributes),
//! [`capability`] (the `direct_gpu` gate) and [`nic`] (a NIC as the node uses it: port address
//! and split host-pool registration). The provider reaches verbs through one table of
//! functions, [`ops::VerbsOps`]: rdma-core's (`ffi`, cargo feature `verbs`) or the software
//! device's ([`soft`], every build), chosen by device name at run time; [`device`] owns the
//! objects and [`provider::VerbsNic`] / [`provider::VerbsConnector`] implement the provider
//! over them.

pub mod affinity;
pub mod capability;
pub mod config;
pub mod device;
pub mod gid;
pub mod nic;
pub mod ops;
pub mod provider;
pub mod qp_attrs;
pub mod registration;
pub mod soft;
pub mod sysfs;
pub mod work;

#[cfg(feature = "verbs")]
mod ffi;

pub use affinity::{choose_nics, stripe, Affinity, AffinityError, Destination};
pub use capability::{probe, VerbsCapability};
pub use config::{VerbsConfig, VerbsConfigError};
pub use gid::{choose_address, GidError, PortAddress, PortInfo};
pub use nic::{
    compiled, open_nic, register_host_split, AcceptError, ChunkMr, EndpointExchange, LocalMr,
    NicHostMr, NicLimits, NicOpenError, RdmaNic, RegistrarError,
};
pub use ops::{is_soft_name, VerbsOps};
pub use qp_attrs::QpEndpoint;
pub use registration::{KeyMap, RegistrationError};
pub use soft::{SoftFault, SoftOps, SoftProfile};
pub use sysfs::{NicInfo, Sysfs, SysfsError};
pub use work::{build_read, ReadWr, WorkError};
