//! `[metrics]`: where `/metrics` and `/health` are served.

use serde::{Deserialize, Serialize};

/// Where `kvferry node` serves `/metrics` (Prometheus) and `/health`.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case", default)]
pub struct MetricsConfig {
    /// "host:port"; empty: not served.
    pub listen: String,
}
