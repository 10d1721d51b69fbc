//! The Redis backend of the block directory, for nodes in different processes or hosts.
//!
//! Data model, under a key prefix (`kvf` by default):
//!
//! - `{prefix}:blk:{namespace}:{hex hash}` — the set of node ids holding that block;
//! - `{prefix}:node:{node}` — the set of block keys the node published, so that
//!   [`crate::peer::Directory::withdraw_node`] can remove a departed node without scanning, and a node
//!   can reconcile what the server lists for it with what it holds.
//!
//! [`RedisDirectory`] never lets Redis stall a node. It owns a thread with a small tokio
//! runtime and one `redis` [`ConnectionManager`](redis::aio::ConnectionManager) (pipelined, reconnecting):
//!
//! - `publish` / `withdraw` / `withdraw_node` record the change in a ledger of what each of
//!   this process's nodes holds and queue it; the thread writes everything queued in one
//!   MULTI/EXEC pipeline per round (the block sets and the node set stay consistent).
//! - a lookup is one pipeline of SMEMBERS run on that thread under `lookup_timeout`; the
//!   caller awaits the answer, never the network, and gets empty owner lists when the
//!   directory is down, slow or skipped.
//! - a [`Breaker`](crate::peer::breaker::Breaker) opens after `breaker_failures` failed calls in a row or one call past its
//!   deadline; while it is open lookups are answered empty at once and queued writes are
//!   dropped (the ledger keeps the truth). Every `probe_interval` the thread asks the
//!   server for its `run_id`: that is the half-open probe while open, and a heartbeat that
//!   detects a restarted server while closed.
//! - when the breaker closes again, or the server's `run_id` changed (a restart, with or
//!   without its data), every node of this process re-announces all it holds; every
//!   `reconcile_interval` each node's set on the server is compared with its ledger and
//!   the differences written, so writes lost to a failure are repaired.

//!
//! Files: `directory` (the callers' side), `worker` (the thread's rounds), `shared` (what
//! both see, and how a call's outcome feeds the breaker), `ledger` (what this process's
//! nodes hold and what is queued), `keys` (the data model's key names).

mod directory;
mod error;
mod keys;
mod ledger;
mod options;
mod shared;
mod worker;

#[cfg(test)]
mod test_server;
#[cfg(test)]
mod tests;

pub use crate::peer::redis_url::{redact_url, RedisUrl, RedisUrlError, DEFAULT_PORT};
pub use directory::RedisDirectory;
pub use error::RedisError;
pub use options::RedisOptions;
