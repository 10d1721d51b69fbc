//! `[lease]`: how long leases and peer pins live.

use std::time::Duration;

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case", default)]
pub struct LeaseConfig {
    pub ttl_secs: u64,
    pub sweep_interval_secs: u64,
    /// How long an owner keeps blocks pinned for a peer that has not unpinned them.
    pub peer_pin_ttl_secs: u64,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        Self {
            ttl_secs: 600,
            sweep_interval_secs: 30,
            peer_pin_ttl_secs: 120,
        }
    }
}

impl LeaseConfig {
    pub fn ttl(&self) -> Duration {
        Duration::from_secs(self.ttl_secs)
    }

    pub fn sweep_interval(&self) -> Duration {
        Duration::from_secs(self.sweep_interval_secs)
    }

    pub fn peer_pin_ttl(&self) -> Duration {
        Duration::from_secs(self.peer_pin_ttl_secs)
    }
}
