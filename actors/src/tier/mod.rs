//! Where blocks live on this node: the host pool ([`pool::HostPool`]), the RAM block cache
//! over it ([`cache`], `slot_lru`) and its namespaces' quotas ([`quota`]), the SSD tier below ([`ssd`]), the policy that decides
//! what moves between them ([`policy::Tiers`]: plain state that returns effects) and the
//! store actor that drives it ([`store::BlockStore`]).

pub mod cache;
mod error;
pub mod policy;
pub mod pool;
pub mod quota;
pub(crate) mod slot_lru;
pub mod ssd;
pub mod store;

pub use error::TierError;
