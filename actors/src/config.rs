//! Node configuration: one TOML file, kebab-case keys, unknown keys refused.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use thiserror::Error;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ConfigError {
    #[error("config {path}: {message}")]
    Parse { path: String, message: String },
    #[error("config key {key}: {reason}")]
    Invalid { key: &'static str, reason: String },
    #[error("reading config {path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// A byte count written as an integer or a string with a unit ("64MiB", "1 GiB", "4096").
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl ByteSize {
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (num, unit) = s.split_at(split);
        let n: u64 = num
            .parse()
            .map_err(|_| format!("{s:?} is not a byte size"))?;
        let mult: u64 = match unit.trim() {
            "" | "B" => 1,
            "KiB" => 1 << 10,
            "MiB" => 1 << 20,
            "GiB" => 1 << 30,
            "TiB" => 1 << 40,
            u => return Err(format!("unknown unit {u:?} (use B, KiB, MiB, GiB or TiB)")),
        };
        n.checked_mul(mult)
            .map(ByteSize)
            .ok_or_else(|| format!("{s:?} overflows"))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v = self.0;
        for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
            if v >= 1 << shift && v.is_multiple_of(1 << shift) {
                return write!(f, "{}{unit}", v >> shift);
            }
        }
        write!(f, "{v}")
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => Ok(ByteSize(n)),
            Raw::S(s) => ByteSize::parse(&s).map_err(serde::de::Error::custom),
        }
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case", default)]
pub struct NodeConfig {
    /// This node's id in the cluster.
    pub node_id: String,
    pub pool: PoolConfig,
    pub lease: LeaseConfig,
    pub device: DeviceConfig,
    pub metrics: MetricsConfig,
    /// Peers in other processes; absent: a node on its own.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster: Option<ClusterConfig>,
    /// The gRPC engine API; absent: not served.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine: Option<EngineConfig>,
    /// NICs the pool is registered on at start (`[[nic]]`); none: no NIC actors.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub nic: Vec<crate::nic::NicSection>,
    /// Settings of the verbs NICs (`[verbs]`); absent: defaults.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verbs: Option<crate::nic::VerbsSection>,
    /// Deadlines, breaker and reconcile of a Redis directory (`[directory]`).
    pub directory: DirectoryConfig,
}

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
    pub fn redis_options(&self) -> crate::remote::RedisOptions {
        crate::remote::RedisOptions {
            connect_timeout: Duration::from_millis(self.connect_timeout_ms),
            lookup_timeout: Duration::from_millis(self.lookup_timeout_ms),
            write_timeout: Duration::from_millis(self.write_timeout_ms),
            breaker_failures: self.breaker_failures,
            probe_interval: Duration::from_millis(self.probe_interval_ms),
            reconcile_interval: Duration::from_secs(self.reconcile_interval_secs),
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
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

/// Where and how `kvferry node` serves `kvferry.v1.Engine` and its fd socket.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case", default)]
pub struct EngineConfig {
    /// "host:port" of the gRPC service.
    pub listen: String,
    /// Directory of the Unix socket that takes memory fds (`<node-id>.engine.sock`, mode
    /// 0600; the directory is created 0700 if missing). Empty: no fd socket.
    pub fd_dir: String,
    /// Bearer token every call must carry (`authorization: Bearer <token>`, and last on
    /// fd socket lines); empty: not checked.
    pub token: String,
    /// Largest gRPC message decoded or sent (PutBlocks carries block bytes).
    pub max_message_bytes: ByteSize,
    /// Completed load results kept per instance rank until polled or streamed.
    pub completion_retention: u32,
    /// Memory handles no RegisterInstance used within this long are closed.
    pub handle_ttl_secs: u64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:7200".into(),
            fd_dir: std::env::temp_dir().join("kvferry").display().to_string(),
            token: String::new(),
            max_message_bytes: ByteSize(64 << 20),
            completion_retention: 1024,
            handle_ttl_secs: 30,
        }
    }
}

impl EngineConfig {
    pub fn handle_ttl(&self) -> Duration {
        Duration::from_secs(self.handle_ttl_secs)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key, reason: String| Err(ConfigError::Invalid { key, reason });
        if self.listen.parse::<std::net::SocketAddr>().is_err() {
            return invalid(
                "engine.listen",
                format!("{:?} is not host:port", self.listen),
            );
        }
        if !self.fd_dir.is_empty() && !std::path::Path::new(&self.fd_dir).is_absolute() {
            return invalid(
                "engine.fd-dir",
                format!("{:?} must be an absolute path (or empty)", self.fd_dir),
            );
        }
        if !self.token.chars().all(|c| c.is_ascii_graphic()) || self.token.len() > 256 {
            return invalid(
                "engine.token",
                "must be at most 256 printable characters without spaces".into(),
            );
        }
        let max = self.max_message_bytes;
        if !(ByteSize(64 << 10)..=ByteSize(1 << 30)).contains(&max) {
            return invalid(
                "engine.max-message-bytes",
                format!("{max} must be between 64KiB and 1GiB"),
            );
        }
        if !(1..=65536).contains(&self.completion_retention) {
            return invalid(
                "engine.completion-retention",
                format!("{} must be 1 to 65536", self.completion_retention),
            );
        }
        if self.handle_ttl_secs == 0 {
            return invalid("engine.handle-ttl-secs", "must be at least 1".into());
        }
        Ok(())
    }
}

/// Where `kvferry node` serves `/metrics` (Prometheus) and `/health`.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case", default)]
pub struct MetricsConfig {
    /// "host:port"; empty: not served.
    pub listen: String,
}

/// How a node serves its pool to peers and reaches theirs.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case", default)]
pub struct ClusterConfig {
    /// Data path between nodes: `tcp` or `shm` (same host).
    pub provider: String,
    /// Where this node serves `kvferry.v1.Peer`.
    pub peer_listen: String,
    /// Where the tcp data server listens (port 0: any).
    pub data_listen: String,
    /// Where the shm socket is created.
    pub shm_dir: String,
    /// Shared secret every peer RPC must carry; empty: not checked.
    pub token: String,
    /// `static` (ask the listed peers in order) or `redis://host:port`.
    pub directory: String,
    pub peers: Vec<PeerConfig>,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct PeerConfig {
    pub node_id: String,
    /// The peer's `peer-listen` address.
    pub address: String,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            provider: "tcp".into(),
            peer_listen: "127.0.0.1:7100".into(),
            data_listen: "127.0.0.1:0".into(),
            shm_dir: std::env::temp_dir().join("kvferry").display().to_string(),
            token: String::new(),
            directory: "static".into(),
            peers: Vec::new(),
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case", default)]
pub struct PoolConfig {
    /// Total host pool size.
    pub size: ByteSize,
    /// Bytes per slot: the largest block (every TP rank) the node can hold.
    pub slot_bytes: ByteSize,
    /// Back the pool with 2 MiB hugepages (fails clearly where none are reserved).
    pub hugepages: bool,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case", default)]
pub struct LeaseConfig {
    pub ttl_secs: u64,
    pub sweep_interval_secs: u64,
    /// How long an owner keeps blocks pinned for a peer that has not unpinned them.
    pub peer_pin_ttl_secs: u64,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case", default)]
pub struct DeviceConfig {
    /// `host` (emulated), `cuda`, or `auto` (cuda where a driver and GPU are present).
    pub kind: String,
    /// How many devices to open (ordinals 0..count).
    pub count: u32,
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            node_id: "node-0".into(),
            pool: PoolConfig::default(),
            lease: LeaseConfig::default(),
            device: DeviceConfig::default(),
            metrics: MetricsConfig::default(),
            cluster: None,
            engine: None,
            nic: Vec::new(),
            verbs: None,
            directory: DirectoryConfig::default(),
        }
    }
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            size: ByteSize(256 << 20),
            slot_bytes: ByteSize(1 << 20),
            hugepages: false,
        }
    }
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

impl Default for DeviceConfig {
    fn default() -> Self {
        Self {
            kind: "auto".into(),
            count: 1,
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

impl NodeConfig {
    /// Parses and validates; `path` only names the source in errors.
    pub fn from_toml(text: &str, path: &str) -> Result<Self, ConfigError> {
        let cfg: NodeConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn load(path: &str) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_toml(&text, path)
    }

    /// Cross-field rules.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key, reason: String| Err(ConfigError::Invalid { key, reason });
        if self.node_id.is_empty() || !self.node_id.chars().all(|c| c.is_ascii_graphic()) {
            return invalid(
                "node-id",
                format!("{:?} must be printable and nonempty", self.node_id),
            );
        }
        let (size, slot) = (self.pool.size.0, self.pool.slot_bytes.0);
        if slot == 0 || slot % 64 != 0 {
            return invalid(
                "pool.slot-bytes",
                format!("{slot} must be a nonzero multiple of 64"),
            );
        }
        if size < slot {
            return invalid(
                "pool.size",
                format!(
                    "{} is smaller than one slot ({})",
                    self.pool.size, self.pool.slot_bytes
                ),
            );
        }
        if self.lease.ttl_secs == 0 {
            return invalid("lease.ttl-secs", "must be at least 1".into());
        }
        if self.lease.sweep_interval_secs == 0
            || self.lease.sweep_interval_secs > self.lease.ttl_secs
        {
            return invalid(
                "lease.sweep-interval-secs",
                format!(
                    "{} must be between 1 and lease.ttl-secs ({})",
                    self.lease.sweep_interval_secs, self.lease.ttl_secs
                ),
            );
        }
        if self.lease.peer_pin_ttl_secs == 0 {
            return invalid("lease.peer-pin-ttl-secs", "must be at least 1".into());
        }
        if !matches!(self.device.kind.as_str(), "host" | "cuda" | "auto") {
            return invalid(
                "device.kind",
                format!("{:?} is not one of host, cuda, auto", self.device.kind),
            );
        }
        if !self.metrics.listen.is_empty()
            && self.metrics.listen.parse::<std::net::SocketAddr>().is_err()
        {
            return invalid(
                "metrics.listen",
                format!("{:?} is not host:port", self.metrics.listen),
            );
        }
        if let Some(c) = &self.cluster {
            match c.provider.as_str() {
                "tcp" | "shm" => {}
                // Peers are read over the node's RDMA NICs: there must be one to read with.
                "verbs" if self.nic.iter().any(|n| n.provider == "verbs") => {}
                "verbs" => {
                    return invalid(
                        "cluster.provider",
                        "\"verbs\" reads peers over this node's RDMA NICs: add a [[nic]] with \
                         provider = \"verbs\""
                            .into(),
                    )
                }
                other => {
                    return invalid(
                        "cluster.provider",
                        format!("{other:?} is not one of tcp, shm, verbs"),
                    )
                }
            }
            for (key, addr) in [
                ("cluster.peer-listen", &c.peer_listen),
                ("cluster.data-listen", &c.data_listen),
            ] {
                if addr.parse::<std::net::SocketAddr>().is_err() {
                    return invalid(key, format!("{addr:?} is not host:port"));
                }
            }
            if c.directory != "static" && !c.directory.starts_with("redis://") {
                return invalid(
                    "cluster.directory",
                    format!("{:?} is not static or redis://host:port", c.directory),
                );
            }
            let mut seen = std::collections::HashSet::new();
            for p in &c.peers {
                if p.node_id == self.node_id || !seen.insert(&p.node_id) {
                    return invalid(
                        "cluster.peers",
                        format!("node id {:?} is listed twice or is this node", p.node_id),
                    );
                }
                if p.address.parse::<std::net::SocketAddr>().is_err() {
                    return invalid(
                        "cluster.peers",
                        format!("{:?} of {} is not host:port", p.address, p.node_id),
                    );
                }
            }
        }
        if let Some(e) = &self.engine {
            e.validate()?;
        }
        self.directory.validate()?;
        crate::nic::config::validate_node_nics(&self.nic, self.verbs.as_ref())
            .map_err(|(key, reason)| ConfigError::Invalid { key, reason })?;
        if self.device.count == 0 || self.device.count > 64 {
            return invalid(
                "device.count",
                format!("{} must be 1 to 64", self.device.count),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_redis_sample_documents_the_directory_defaults() {
        let text = include_str!("../../config/cluster-redis.toml");
        let cfg = NodeConfig::from_toml(text, "cluster-redis.toml").unwrap();
        assert_eq!(cfg.directory, DirectoryConfig::default());
        let o = cfg.directory.redis_options();
        assert_eq!(o.lookup_timeout, Duration::from_millis(100));
        assert_eq!(o.reconcile_interval, Duration::from_secs(30));
        assert_eq!(o, crate::remote::RedisOptions::default());
    }

    #[test]
    fn defaults_validate_and_sizes_parse() {
        NodeConfig::default().validate().unwrap();
        assert_eq!(ByteSize::parse("64MiB").unwrap(), ByteSize(64 << 20));
        assert_eq!(ByteSize::parse("1 GiB").unwrap(), ByteSize(1 << 30));
        assert_eq!(ByteSize::parse("4096").unwrap(), ByteSize(4096));
        assert!(ByteSize::parse("12 parsecs").is_err());
        assert_eq!(ByteSize(3 << 20).to_string(), "3MiB");
    }

    #[test]
    fn unknown_key_names_line_and_column() {
        let err = NodeConfig::from_toml(
            "node-id = \"a\"\n[pool]\nsize = \"1GiB\"\nslots = 3\n",
            "x.toml",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("slots"), "{err}");
        assert!(err.contains("line 4"), "{err}");
        assert!(err.contains("column 1"), "{err}");
    }

    #[test]
    fn engine_section_defaults_and_unknown_keys() {
        let cfg = NodeConfig::from_toml("[engine]\n", "e.toml").unwrap();
        assert_eq!(cfg.engine, Some(EngineConfig::default()));
        assert!(NodeConfig::from_toml("", "e.toml")
            .unwrap()
            .engine
            .is_none());
        let err = NodeConfig::from_toml("[engine]\nlisen = \"x\"\n", "e.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("lisen") && err.contains("line 2"), "{err}");
    }

    #[test]
    fn cross_field_rules_name_the_key() {
        let cases = [
            (
                "[pool]\nsize = \"1MiB\"\nslot-bytes = \"2MiB\"\n",
                "pool.size",
            ),
            ("[pool]\nslot-bytes = 100\n", "pool.slot-bytes"),
            (
                "[lease]\nttl-secs = 10\nsweep-interval-secs = 30\n",
                "lease.sweep-interval-secs",
            ),
            ("[device]\nkind = \"tpu\"\n", "device.kind"),
            ("[cluster]\nprovider = \"verbs\"\n", "cluster.provider"),
            ("[cluster]\nprovider = \"udp\"\n", "cluster.provider"),
            (
                "[cluster]\npeer-listen = \"nowhere\"\n",
                "cluster.peer-listen",
            ),
            ("[cluster]\ndirectory = \"etcd\"\n", "cluster.directory"),
            ("[engine]\nlisten = \"nowhere\"\n", "engine.listen"),
            ("[engine]\nfd-dir = \"relative\"\n", "engine.fd-dir"),
            ("[engine]\ntoken = \"two words\"\n", "engine.token"),
            (
                "[engine]\nmax-message-bytes = \"2GiB\"\n",
                "engine.max-message-bytes",
            ),
            (
                "[engine]\ncompletion-retention = 0\n",
                "engine.completion-retention",
            ),
            ("[engine]\nhandle-ttl-secs = 0\n", "engine.handle-ttl-secs"),
            (
                "[directory]\nlookup-timeout-ms = 0\n",
                "directory.lookup-timeout-ms",
            ),
            (
                "[directory]\nbreaker-failures = 0\n",
                "directory.breaker-failures",
            ),
            (
                "[directory]\nreconcile-interval-secs = 0\n",
                "directory.reconcile-interval-secs",
            ),
            ("[directory]\nkey-prefix = \"\"\n", "directory.key-prefix"),
            (
                "[cluster]\n[[cluster.peers]]\nnode-id = \"node-0\"\naddress = \"127.0.0.1:1\"\n",
                "cluster.peers",
            ),
        ];
        for (text, key) in cases {
            let err = NodeConfig::from_toml(text, "t.toml").unwrap_err();
            assert!(
                matches!(&err, ConfigError::Invalid { key: k, .. } if *k == key),
                "{err}"
            );
        }
    }
}
