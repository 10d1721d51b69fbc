//! The `[directory]` config section's deadlines and breaker, as the Redis directory uses
//! them.

use std::time::Duration;

/// Deadlines and breaker of a [`RedisDirectory`](super::RedisDirectory) (the `[directory]` config section).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedisOptions {
    /// One connection attempt (and the PING at start).
    pub connect_timeout: Duration,
    /// The longest a query waits on the directory.
    pub lookup_timeout: Duration,
    /// One write pipeline, probe or reconcile step.
    pub write_timeout: Duration,
    /// Failed calls in a row that open the breaker (one call past its deadline opens it).
    pub breaker_failures: u32,
    /// The breaker's cool-down before a probe, and the heartbeat that detects a restarted
    /// server while it is closed.
    pub probe_interval: Duration,
    /// How often each node's entries on the server are compared with what it holds.
    pub reconcile_interval: Duration,
}

impl Default for RedisOptions {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(1),
            lookup_timeout: Duration::from_millis(100),
            write_timeout: Duration::from_secs(1),
            breaker_failures: 3,
            probe_interval: Duration::from_secs(1),
            reconcile_interval: Duration::from_secs(30),
        }
    }
}
