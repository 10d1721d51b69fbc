//! `[directory]`: deadlines, breaker and reconcile of a Redis directory.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::ConfigError;

/// How a node uses a Redis directory (`cluster.directory = "redis://…"`): queries never
/// wait on it longer than `lookup-timeout-ms`, a failing or slow one is skipped by a
/// breaker, and what the node holds is re-announced after an outage or a restart.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case", default)]
pub struct DirectoryConfig {
    /// Prefix of every key the directory writes (nodes sharing blocks share it).
    pub key_prefix: String,
    /// The longest a query waits on the directory; past it the query plans without it.
    pub lookup_timeout_ms: u64,
    /// Deadline of one batch of publishes / withdraws, a probe, or a reconcile step.
    pub write_timeout_ms: u64,
    /// Deadline of one connection attempt.
    pub connect_timeout_ms: u64,
    /// Failed calls in a row that open the breaker (one call past its deadline opens it).
    pub breaker_failures: u32,
    /// The breaker's cool-down before its probe; also how often a closed breaker checks
    /// that the server has not restarted.
    pub probe_interval_ms: u64,
    /// How often the server's entries of this node are compared with what it holds.
    pub reconcile_interval_secs: u64,
}

impl Default for DirectoryConfig {
    fn default() -> Self {
        Self {
            key_prefix: "kvf".into(),
            lookup_timeout_ms: 100,
            write_timeout_ms: 1000,
            connect_timeout_ms: 1000,
            breaker_failures: 3,
            probe_interval_ms: 1000,
            reconcile_interval_secs: 30,
        }
    }
}

impl DirectoryConfig {
    pub fn redis_options(&self) -> crate::peer::RedisOptions {
        crate::peer::RedisOptions {
            connect_timeout: Duration::from_millis(self.connect_timeout_ms),
            lookup_timeout: Duration::from_millis(self.lookup_timeout_ms),
            write_timeout: Duration::from_millis(self.write_timeout_ms),
            breaker_failures: self.breaker_failures,
            probe_interval: Duration::from_millis(self.probe_interval_ms),
            reconcile_interval: Duration::from_secs(self.reconcile_interval_secs),
        }
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key, reason: String| Err(ConfigError::Invalid { key, reason });
        if self.key_prefix.is_empty() || !self.key_prefix.chars().all(|c| c.is_ascii_graphic()) {
            return invalid(
                "directory.key-prefix",
                format!("{:?} must be printable and nonempty", self.key_prefix),
            );
        }
        for (key, ms) in [
            ("directory.lookup-timeout-ms", self.lookup_timeout_ms),
            ("directory.write-timeout-ms", self.write_timeout_ms),
            ("directory.connect-timeout-ms", self.connect_timeout_ms),
            ("directory.probe-interval-ms", self.probe_interval_ms),
        ] {
            if ms == 0 || ms > 600_000 {
                return invalid(key, format!("{ms} must be 1 to 600000 (ten minutes)"));
            }
        }
        if self.breaker_failures == 0 || self.breaker_failures > 1000 {
            return invalid(
                "directory.breaker-failures",
                format!("{} must be 1 to 1000", self.breaker_failures),
            );
        }
        if self.reconcile_interval_secs == 0 || self.reconcile_interval_secs > 86_400 {
            return invalid(
                "directory.reconcile-interval-secs",
                format!(
                    "{} must be 1 to 86400 (a day)",
                    self.reconcile_interval_secs
                ),
            );
        }
        Ok(())
    }
}
