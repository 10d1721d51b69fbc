//! The SSD tier: blocks that leave RAM are kept on local disks and come back on a hit.
//!
//! [`SsdTier`] is what the block store drives: an [`index::SsdIndex`] of which disk slot
//! holds which block (LRU by capacity), and one I/O thread per directory ([`io::DirIo`],
//! `O_DIRECT` on an io_uring where the filesystem and kernel allow, a logged fallback where
//! not). Every block on disk carries its key and an xxh3 checksum ([`format`](mod@format)): a torn or
//! corrupt block is a miss, never wrong bytes. [`SsdConfig`] is the `[ssd]` config section.

mod aligned;
mod backlog;
mod block_file;
pub mod config;
pub mod error;
pub mod format;
pub mod index;
pub mod io;
pub mod metrics;
pub mod port;
pub mod tier;

pub use config::{SsdConfig, SsdDir};
pub use error::SsdError;
pub use io::IoMode;
pub use metrics::{SsdMetrics, SsdStats};
pub use tier::SsdTier;
