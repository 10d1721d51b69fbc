//! Node configuration: one TOML file, kebab-case keys, unknown keys refused.
//!
//! [`NodeConfig`] is the file; each `[section]` has a type of its own ([`PoolConfig`],
//! [`EngineConfig`], [`ClusterConfig`], …) with its defaults, and [`NodeConfig::validate`]
//! checks every value and the rules across sections, naming the key that breaks one.
//! Sizes are [`ByteSize`]s. Secrets (tokens, a Redis password) never reach `Debug`.

mod cluster;
mod device;
mod directory;
mod engine;
mod error;
mod host;
mod lease;
mod limits;
pub mod log;
mod metrics;
mod node;
mod pool;
pub(crate) mod redact;
mod tenants;
mod tls;

pub use crate::bytes::ByteSize;
pub use cluster::{
    tls_lanes, ClusterConfig, PeerConfig, DEFAULT_DATA_LANES, MAX_DATA_LANES, TLS_LANES_FACTOR,
};
pub use device::DeviceConfig;
pub use directory::DirectoryConfig;
pub use engine::EngineConfig;
pub use error::ConfigError;
pub use host::HostMemory;
pub use lease::LeaseConfig;
pub use limits::{MAX_SLOT_BYTES, MAX_SOCKET_PATH, MAX_TTL_SECS};
pub use metrics::MetricsConfig;
pub use node::NodeConfig;
pub use pool::PoolConfig;
pub use tenants::{QuotaSection, TenantsConfig, MAX_METRIC_NAMESPACES};
pub use tls::{ClientAuth, TlsConfig, TlsListener, MAX_EXPIRY_WARN_DAYS, MAX_HANDSHAKE_TIMEOUT_MS};

#[cfg(test)]
mod tests;
