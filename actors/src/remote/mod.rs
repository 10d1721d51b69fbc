//! Remote suffixes: the directory, owner-side peer pins, links to owners and the in-process
//! cluster.

pub mod cluster;
pub mod directory;
pub mod link;
pub mod pins;
pub mod redis;
pub mod tcp;

pub use cluster::{LocalCluster, Provider};
pub use directory::{Directory, EmbeddedDirectory, Segment};
pub use link::{PeerLink, PinnedRemote, RemoteBlock, RemotePin};
pub use redis::RedisDirectory;
