//! Node configuration: one TOML file, kebab-case keys, unknown keys refused.

pub mod log;

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

/// The longest any TTL of the config may be (`lease.ttl-secs`, `lease.peer-pin-ttl-secs`,
/// `engine.handle-ttl-secs`): a day. Longer ones are mistakes, and near `u64::MAX` they
/// overflow the clock.
pub const MAX_TTL_SECS: u64 = 86_400;

/// The largest `pool.slot-bytes`: one block of every TP rank of the largest models is far
/// smaller.
pub const MAX_SLOT_BYTES: u64 = 1 << 30;

/// The longest Unix socket path (`sun_path` is 108 bytes with its terminating NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// The memory a host pool must fit in: physical memory and this process's cgroup limit,
/// each where it can be read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostMemory {
    /// `MemTotal` of `/proc/meminfo`.
    pub total: Option<u64>,
    /// `memory.max` of this process's cgroup (v2) or `memory.limit_in_bytes` (v1);
    /// `None` where unlimited.
    pub cgroup: Option<u64>,
    /// `HugePages_Free` of `/proc/meminfo` (2 MiB pages), for `pool.hugepages`.
    pub hugepages_free: Option<u64>,
}

impl HostMemory {
    pub fn read() -> Self {
        let info = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let field = |name: &str| -> Option<u64> {
            let line = info.lines().find(|l| l.starts_with(name))?;
            line.split_whitespace().nth(1)?.parse().ok()
        };
        Self {
            total: field("MemTotal:").and_then(|kib| kib.checked_mul(1024)),
            cgroup: cgroup_limit(),
            hugepages_free: field("HugePages_Free:"),
        }
    }

    /// The tighter of the two limits, and where it comes from.
    fn limit(&self) -> Option<(u64, &'static str)> {
        match (self.total, self.cgroup) {
            (Some(t), Some(c)) if c < t => Some((c, "the cgroup memory limit")),
            (Some(t), _) => Some((t, "physical memory")),
            (None, Some(c)) => Some((c, "the cgroup memory limit")),
            (None, None) => None,
        }
    }
}

/// This process's cgroup memory limit: v2 `memory.max` of its own cgroup (or the root
/// of the namespace), else v1 `memory.limit_in_bytes`.
fn cgroup_limit() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("0::").map(|p| p.trim().to_owned()))
        })
        .map(|p| format!("/sys/fs/cgroup{}/memory.max", p.trim_end_matches('/')));
    let candidates = own
        .into_iter()
        .chain(["/sys/fs/cgroup/memory.max".to_owned()])
        .chain(["/sys/fs/cgroup/memory/memory.limit_in_bytes".to_owned()]);
    for path in candidates {
        if let Ok(t) = std::fs::read_to_string(&path) {
            // "max" (v2) or a huge page-rounded number (v1): no limit.
            return t.trim().parse::<u64>().ok().filter(|&n| n < 1 << 62);
        }
    }
    None
}

/// A token's rule (engine and cluster): what goes on a header and a socket line.
fn check_token(key: &'static str, token: &str) -> Result<(), ConfigError> {
    if token.chars().all(|c| c.is_ascii_graphic()) && token.len() <= 256 {
        return Ok(());
    }
    Err(ConfigError::Invalid {
        key,
        reason: "must be at most 256 printable ASCII characters without spaces".into(),
    })
}

/// A TTL's rule: 1 s to [`MAX_TTL_SECS`].
fn check_ttl(key: &'static str, secs: u64) -> Result<(), ConfigError> {
    if (1..=MAX_TTL_SECS).contains(&secs) {
        return Ok(());
    }
    Err(ConfigError::Invalid {
        key,
        reason: format!("{secs} must be 1 to {MAX_TTL_SECS} (a day)"),
    })
}

/// A Unix socket `name` in `dir` must fit `sun_path`.
fn check_socket_dir(key: &'static str, dir: &str, name: &str) -> Result<(), ConfigError> {
    let path = std::path::Path::new(dir).join(name);
    let len = path.as_os_str().len();
    if len <= MAX_SOCKET_PATH {
        return Ok(());
    }
    Err(ConfigError::Invalid {
        key,
        reason: format!(
            "the socket path {} is {len} bytes; a Unix socket path holds at most \
             {MAX_SOCKET_PATH}: use a shorter directory",
            path.display()
        ),
    })
}

/// A byte count written as an integer or a string with a unit ("64MiB", "1 GiB", "4096").
///
/// Parsing is the `bytesize` crate's; this type keeps what a config needs around it: an exact
/// display (`3MiB`, or plain bytes where no unit divides), so a printed config reads back the
/// same, and the bound below.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// The largest size accepted: what a TOML integer can hold. `bytesize` saturates where a
    /// size overflows; a bound well inside u64 keeps arithmetic on sizes from overflowing too.
    pub const MAX: u64 = i64::MAX as u64;

    /// Parses a size: plain bytes, binary units (KiB, MiB, GiB, TiB; also Ki, Mi, …) or decimal
    /// ones (KB, MB, GB, TB; also K, M, …), in any case, with an optional space and fraction
    /// ("1.5GiB").
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let v: bytesize::ByteSize = s.parse().map_err(|e| {
            format!("{s:?} is not a byte size ({e}); write e.g. \"64MiB\" or a number of bytes")
        })?;
        if v.0 > Self::MAX {
            return Err(format!("{s:?} is larger than {} bytes", Self::MAX));
        }
        Ok(ByteSize(v.0))
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
        struct Bytes;
        impl serde::de::Visitor<'_> for Bytes {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size like \"64MiB\" or a number of bytes")
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(n))
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<ByteSize, E> {
                u64::try_from(n).map(ByteSize).map_err(|_| {
                    E::custom(format!(
                        "{n} is negative: expected a size like \"64MiB\" or a number of bytes"
                    ))
                })
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<ByteSize, E> {
                ByteSize::parse(s).map_err(E::custom)
            }
        }
        d.deserialize_any(Bytes)
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
    /// The SSD tier behind the host pool (`[ssd]`); absent: RAM only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ssd: Option<crate::tier::ssd::SsdConfig>,
    /// The `kvferry` binary's log level and format (`[log]`).
    pub log: crate::config::log::LogSection,
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
    /// How long a request mailbox's node thread keeps polling after a request before it
    /// sleeps on the doorbell (a woken thread answers tens of microseconds later; a polling
    /// one at once, for a core's time while it polls). 0: sleep at once. At most 1 s.
    pub mailbox_spin_us: u64,
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
            mailbox_spin_us: 2000,
        }
    }
}

impl EngineConfig {
    pub fn handle_ttl(&self) -> Duration {
        Duration::from_secs(self.handle_ttl_secs)
    }

    pub fn mailbox_spin(&self) -> Duration {
        Duration::from_micros(self.mailbox_spin_us)
    }

    fn validate(&self, node_id: &str) -> Result<(), ConfigError> {
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
        if !self.fd_dir.is_empty() {
            check_socket_dir(
                "engine.fd-dir",
                &self.fd_dir,
                &format!("{node_id}.engine.sock"),
            )?;
        }
        check_token("engine.token", &self.token)?;
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
        check_ttl("engine.handle-ttl-secs", self.handle_ttl_secs)?;
        if self.mailbox_spin_us > 1_000_000 {
            return invalid(
                "engine.mailbox-spin-us",
                format!("{} must be 0 to 1000000", self.mailbox_spin_us),
            );
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
    /// How a GPU issues a batch of copies: `auto` (chosen per batch), `staged`, `kernel`,
    /// `batch` or `per-op` (see `kvferry_gpu::cuda::CopyPath`); the host device ignores it.
    pub copy_path: String,
    /// Bytes of one staging chunk of the staged path (0: no staging).
    pub staging_chunk: ByteSize,
    /// Staging chunks per direction (at least 2).
    pub staging_chunks: u32,
    /// Microseconds a GPU lane polls a batch's completion before sleeping on it (0: sleep
    /// at once). Polling sees a copy end tens of microseconds sooner, at the price of a
    /// core kept busy (yielding) for up to this long per batch.
    pub completion_spin_us: u32,
}

/// Longest completion polling a config may ask for: past a second a sleeping wait costs
/// nothing measurable, and a core would spin for nothing.
const MAX_COMPLETION_SPIN_US: u32 = 1_000_000;

impl DeviceConfig {
    /// The GPU options this section names (after [`NodeConfig::validate`]).
    pub fn cuda_options(&self) -> kvferry_gpu::cuda::CudaOptions {
        let path = kvferry_gpu::cuda::CopyPath::from_name(&self.copy_path).unwrap_or_default();
        let mut o = kvferry_gpu::cuda::CudaOptions::with_copy_path(path)
            .with_staging(self.staging_chunk.0, self.staging_chunks);
        o.completion_spin = Duration::from_micros(u64::from(self.completion_spin_us));
        o
    }
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
            ssd: None,
            log: crate::config::log::LogSection::default(),
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
            copy_path: "auto".into(),
            staging_chunk: ByteSize(kvferry_gpu::cuda::DEFAULT_STAGING_CHUNK_BYTES),
            staging_chunks: kvferry_gpu::cuda::DEFAULT_STAGING_CHUNKS,
            completion_spin_us: u32::try_from(
                kvferry_gpu::cuda::DEFAULT_COMPLETION_SPIN.as_micros(),
            )
            .unwrap_or(u32::MAX),
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

/// Whether two listeners would take one port: the same port (not 0) on the same address, or
/// on every address for either.
fn same_listener(a: std::net::SocketAddr, b: std::net::SocketAddr) -> bool {
    a.port() == b.port()
        && a.port() != 0
        && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}

/// Whether a peer at `peer` would be this node, listening on `own`: the same address, or
/// the same port where this node listens on every address and the peer's is a loopback.
fn is_own_address(own: std::net::SocketAddr, peer: std::net::SocketAddr) -> bool {
    own == peer
        || (own.port() == peer.port()
            && own.port() != 0
            && own.ip().is_unspecified()
            && (peer.ip().is_loopback() || peer.ip().is_unspecified()))
}

impl NodeConfig {
    /// The node's listeners take distinct ports; the second of two that collide is named.
    fn check_listeners_differ(&self) -> Result<(), ConfigError> {
        let mut listeners: Vec<(&'static str, &str)> = Vec::new();
        if let Some(e) = &self.engine {
            listeners.push(("engine.listen", &e.listen));
        }
        listeners.push(("metrics.listen", &self.metrics.listen));
        if let Some(c) = &self.cluster {
            listeners.push(("cluster.peer-listen", &c.peer_listen));
            if c.provider == "tcp" {
                listeners.push(("cluster.data-listen", &c.data_listen));
            }
        }
        let parsed: Vec<(&'static str, std::net::SocketAddr)> = listeners
            .into_iter()
            .filter_map(|(k, a)| a.parse().ok().map(|a| (k, a)))
            .collect();
        for (i, (key, addr)) in parsed.iter().enumerate() {
            if let Some((first, _)) = parsed[..i].iter().find(|(_, a)| same_listener(*a, *addr)) {
                return Err(ConfigError::Invalid {
                    key,
                    reason: format!("{addr} is also {first}: each listener needs its own port"),
                });
            }
        }
        Ok(())
    }

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

    /// Every value range-checked and the cross-field rules, against this host's memory: a
    /// config that passes starts (as far as the config decides it).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_on(&HostMemory::read())
    }

    /// [`NodeConfig::validate`] with the host's memory given.
    pub fn validate_on(&self, host: &HostMemory) -> Result<(), ConfigError> {
        let invalid = |key, reason: String| Err(ConfigError::Invalid { key, reason });
        if self.node_id.is_empty()
            || !self.node_id.chars().all(|c| c.is_ascii_graphic())
            || self.node_id.contains('/')
            || self.node_id == "."
            || self.node_id == ".."
        {
            return invalid(
                "node-id",
                format!(
                    "{:?} must be printable ASCII without spaces or '/' (it names socket files)",
                    self.node_id
                ),
            );
        }
        let (size, slot) = (self.pool.size.0, self.pool.slot_bytes.0);
        if slot == 0 || slot % 64 != 0 || slot > MAX_SLOT_BYTES {
            return invalid(
                "pool.slot-bytes",
                format!(
                    "{} must be a nonzero multiple of 64, at most {}",
                    self.pool.slot_bytes,
                    ByteSize(MAX_SLOT_BYTES)
                ),
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
        if let Some((limit, what)) = host.limit() {
            if size > limit {
                return invalid(
                    "pool.size",
                    format!(
                        "{} is more than {what} ({} bytes); the pool is populated at start",
                        self.pool.size, limit
                    ),
                );
            }
        }
        if self.pool.hugepages {
            // As the pool sizes itself: whole slots, rounded up to 2 MiB pages.
            let need = (size / slot * slot).div_ceil(2 << 20);
            let free = host.hugepages_free.unwrap_or(0);
            if free < need {
                return invalid(
                    "pool.hugepages",
                    format!(
                        "the pool needs {need} free 2 MiB hugepages, the system has {free} \
                         (raise vm.nr_hugepages or set pool.hugepages = false)"
                    ),
                );
            }
        }
        check_ttl("lease.ttl-secs", self.lease.ttl_secs)?;
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
        check_ttl("lease.peer-pin-ttl-secs", self.lease.peer_pin_ttl_secs)?;
        if !matches!(self.device.kind.as_str(), "host" | "cuda" | "auto") {
            return invalid(
                "device.kind",
                format!("{:?} is not one of host, cuda, auto", self.device.kind),
            );
        }
        if kvferry_gpu::cuda::CopyPath::from_name(&self.device.copy_path).is_none() {
            let names: Vec<&str> = kvferry_gpu::cuda::CopyPath::NAMES
                .iter()
                .map(|(n, _)| *n)
                .collect();
            return invalid(
                "device.copy-path",
                format!(
                    "{:?} is not one of {}",
                    self.device.copy_path,
                    names.join(", ")
                ),
            );
        }
        if !(2..=64).contains(&self.device.staging_chunks) {
            return invalid(
                "device.staging-chunks",
                format!("{} is not between 2 and 64", self.device.staging_chunks),
            );
        }
        if self.device.completion_spin_us > MAX_COMPLETION_SPIN_US {
            return invalid(
                "device.completion-spin-us",
                format!(
                    "{} is above {MAX_COMPLETION_SPIN_US} (one second)",
                    self.device.completion_spin_us
                ),
            );
        }
        let chunk = self.device.staging_chunk.0;
        if chunk != 0 && !(4 << 10..=1 << 30).contains(&chunk) {
            return invalid(
                "device.staging-chunk",
                format!("{chunk} bytes is not 0 (off) or between 4 KiB and 1 GiB"),
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
            check_token("cluster.token", &c.token)?;
            if c.provider == "shm" {
                if !std::path::Path::new(&c.shm_dir).is_absolute() {
                    return invalid(
                        "cluster.shm-dir",
                        format!("{:?} must be an absolute path", c.shm_dir),
                    );
                }
                check_socket_dir(
                    "cluster.shm-dir",
                    &c.shm_dir,
                    &format!("{}.sock", self.node_id),
                )?;
            }
            if c.directory != "static" {
                // A URL here (a bare word is more likely a typo than a host); then the
                // directory's own parser: what passes here, the node connects to.
                if !c.directory.contains("://") {
                    return invalid(
                        "cluster.directory",
                        format!(
                            "{:?} is not static or redis://[[user]:password@]host[:port][/db]",
                            crate::peer::redact_url(&c.directory)
                        ),
                    );
                }
                if let Err(e) = crate::peer::RedisUrl::parse(&c.directory) {
                    return invalid(
                        "cluster.directory",
                        format!("not static or a Redis address: {e}"),
                    );
                }
            }
            // Both parsed above.
            let own: std::net::SocketAddr =
                c.peer_listen.parse().map_err(|_| ConfigError::Invalid {
                    key: "cluster.peer-listen",
                    reason: format!("{:?} is not host:port", c.peer_listen),
                })?;
            let mut seen = std::collections::HashSet::new();
            let mut addresses = std::collections::HashMap::new();
            for p in &c.peers {
                if p.node_id == self.node_id || !seen.insert(&p.node_id) {
                    return invalid(
                        "cluster.peers",
                        format!("node id {:?} is listed twice or is this node", p.node_id),
                    );
                }
                let Ok(addr) = p.address.parse::<std::net::SocketAddr>() else {
                    return invalid(
                        "cluster.peers",
                        format!("{:?} of {} is not host:port", p.address, p.node_id),
                    );
                };
                if addr.port() == 0 {
                    return invalid(
                        "cluster.peers",
                        format!("{} of {} has no port", p.address, p.node_id),
                    );
                }
                if is_own_address(own, addr) {
                    return invalid(
                        "cluster.peers",
                        format!(
                            "{} of {} is this node's own cluster.peer-listen",
                            p.address, p.node_id
                        ),
                    );
                }
                if let Some(other) = addresses.insert(addr, &p.node_id) {
                    return invalid(
                        "cluster.peers",
                        format!(
                            "{} and {} have one address, {}",
                            other, p.node_id, p.address
                        ),
                    );
                }
            }
        }
        if let Some(e) = &self.engine {
            e.validate(&self.node_id)?;
        }
        self.directory.validate()?;
        if let Some(ssd) = &self.ssd {
            ssd.validate(self.pool.slot_bytes.0)?;
            // The backlog's copies come on top of the pool (the default is a share of it).
            if let (Some(b), Some((limit, what))) = (ssd.write_backlog, host.limit()) {
                if self.pool.size.0.saturating_add(b.0) > limit {
                    return invalid(
                        "ssd.write-backlog",
                        format!(
                            "{b} on top of pool.size ({}) is more than {what} ({limit} bytes)",
                            self.pool.size
                        ),
                    );
                }
            }
        }
        self.log.validate()?;
        self.check_listeners_differ()?;
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
        assert_eq!(o, crate::peer::RedisOptions::default());
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
    fn sizes_in_binary_and_decimal_units_and_their_limits() {
        let ok = |s: &str| ByteSize::parse(s).unwrap().0;
        assert_eq!(ok("2KiB"), 2048);
        assert_eq!(ok("  8 mib "), 8 << 20);
        assert_eq!(ok("1.5GiB"), 3 << 29);
        assert_eq!(ok("3 TiB"), 3 << 40);
        assert_eq!(ok("64MB"), 64_000_000);
        assert_eq!(ok("2G"), 2_000_000_000);
        assert_eq!(ok("512 B"), 512);
        for bad in ["", "MiB", "-1MiB", "1 parsec", "0x100", "1e3"] {
            let e = ByteSize::parse(bad).unwrap_err();
            assert!(e.contains("not a byte size"), "{bad:?}: {e}");
        }
        // bytesize saturates on overflow; that must be an error here, not u64::MAX.
        let e = ByteSize::parse("99999999999 TiB").unwrap_err();
        assert!(e.contains("larger than"), "{e}");
        assert_eq!(ok("8388607 TiB"), 8388607 << 40);
        // What a config prints reads back as the same size.
        for v in [0, 1, 4095, 4096, 3 << 20, (5 << 30) + 1, ByteSize::MAX] {
            assert_eq!(ok(&ByteSize(v).to_string()), v);
        }
        let cfg = NodeConfig::from_toml("[pool]\nsize = \"-5\"\n", "x.toml");
        assert!(cfg.is_err());
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
    fn the_device_section_names_the_gpu_copy_options() {
        use kvferry_gpu::cuda::{CopyPath, DEFAULT_STAGING_CHUNKS, DEFAULT_STAGING_CHUNK_BYTES};
        let o = NodeConfig::default().device.cuda_options();
        assert_eq!(o.copy_path, CopyPath::Auto);
        assert_eq!(o.staging_chunk_bytes, DEFAULT_STAGING_CHUNK_BYTES);
        assert_eq!(o.staging_chunks, DEFAULT_STAGING_CHUNKS);
        assert_eq!(
            o.completion_spin,
            kvferry_gpu::cuda::DEFAULT_COMPLETION_SPIN
        );
        let cfg = NodeConfig::from_toml(
            "[device]\ncopy-path = \"per-op\"\nstaging-chunk = \"8MiB\"\nstaging-chunks = 4\n\
             completion-spin-us = 0\n",
            "d.toml",
        )
        .unwrap();
        let o = cfg.device.cuda_options();
        assert_eq!(o.copy_path, CopyPath::PerOp);
        assert_eq!((o.staging_chunk_bytes, o.staging_chunks), (8 << 20, 4));
        assert!(o.completion_spin.is_zero());
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
            ("[device]\ncopy-path = \"dma\"\n", "device.copy-path"),
            ("[device]\nstaging-chunks = 1\n", "device.staging-chunks"),
            (
                "[device]\ncompletion-spin-us = 1000001\n",
                "device.completion-spin-us",
            ),
            (
                "[device]\nstaging-chunk = \"1KiB\"\n",
                "device.staging-chunk",
            ),
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
                "[engine]\nmailbox-spin-us = 1000001\n",
                "engine.mailbox-spin-us",
            ),
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

    fn invalid_key(text: &str, host: &HostMemory) -> (&'static str, String) {
        let cfg: NodeConfig = toml::from_str(text).unwrap();
        match cfg.validate_on(host).unwrap_err() {
            ConfigError::Invalid { key, reason } => (key, reason),
            e => panic!("{text}: {e}"),
        }
    }

    /// Issue 15: every value `--check-config` used to pass and the node then failed on
    /// (or panicked on) is refused, naming the key and saying why.
    #[test]
    fn check_config_refuses_what_would_not_start() {
        let host = HostMemory {
            total: Some(64 << 30),
            cgroup: None,
            hugepages_free: Some(0),
        };
        let long_dir = format!("/tmp/{}", "d".repeat(100));
        let peers = "[cluster]\npeer-listen = \"127.0.0.1:7100\"\n";
        let cases = [
            ("[lease]\nttl-secs = 9223372036854775807\n", "lease.ttl-secs", "86400"),
            (
                "[lease]\npeer-pin-ttl-secs = 9223372036854775807\n",
                "lease.peer-pin-ttl-secs",
                "86400",
            ),
            (
                "[engine]\nhandle-ttl-secs = 9223372036854775807\n",
                "engine.handle-ttl-secs",
                "86400",
            ),
            ("[pool]\nsize = 9223372036854775807\n", "pool.size", "physical memory"),
            ("[pool]\nsize = \"1048576TiB\"\n", "pool.size", "physical memory"),
            ("[pool]\nsize = \"65GiB\"\n", "pool.size", "physical memory"),
            (
                "[pool]\nsize = \"8GiB\"\nslot-bytes = \"2GiB\"\n",
                "pool.slot-bytes",
                "at most 1GiB",
            ),
            ("[cluster]\ndirectory = \"redis://\"\n", "cluster.directory", "redis://"),
            ("[cluster]\ndirectory = \"redis://:6379\"\n", "cluster.directory", "redis://"),
            ("[cluster]\ndirectory = \"rediss://h:1\"\n", "cluster.directory", "TLS"),
            (
                "[cluster]\ndirectory = \"redis://h:6379/db\"\n",
                "cluster.directory",
                "Invalid database number",
            ),
            (
                "[cluster]\ndirectory = \"redis://h:65536\"\n",
                "cluster.directory",
                "redis://",
            ),
            ("[cluster]\ntoken = \"two words\"\n", "cluster.token", "without spaces"),
            ("[cluster]\ntoken = \"a\\u0007b\"\n", "cluster.token", "printable"),
            ("[engine]\ntoken = \"a\\tb\"\n", "engine.token", "printable"),
            (
                &format!("[engine]\nfd-dir = \"{long_dir}\"\n"),
                "engine.fd-dir",
                "at most 107",
            ),
            (
                &format!("[cluster]\nprovider = \"shm\"\nshm-dir = \"{long_dir}\"\n"),
                "cluster.shm-dir",
                "at most 107",
            ),
            (
                &format!("{peers}[[cluster.peers]]\nnode-id = \"b\"\naddress = \"127.0.0.1:7100\"\n"),
                "cluster.peers",
                "own cluster.peer-listen",
            ),
            (
                "[cluster]\npeer-listen = \"0.0.0.0:7100\"\n[[cluster.peers]]\nnode-id = \"b\"\n\
                 address = \"127.0.0.1:7100\"\n",
                "cluster.peers",
                "own cluster.peer-listen",
            ),
            (
                &format!(
                    "{peers}[[cluster.peers]]\nnode-id = \"b\"\naddress = \"127.0.0.1:7101\"\n\
                     [[cluster.peers]]\nnode-id = \"c\"\naddress = \"127.0.0.1:7101\"\n"
                ),
                "cluster.peers",
                "b and c have one address",
            ),
            (
                &format!("{peers}[[cluster.peers]]\nnode-id = \"b\"\naddress = \"127.0.0.1:0\"\n"),
                "cluster.peers",
                "no port",
            ),
            ("node-id = \"a/b\"\n", "node-id", "'/'"),
            (
                "[pool]\nsize = \"64MiB\"\nslot-bytes = \"1MiB\"\nhugepages = true\n",
                "pool.hugepages",
                "needs 32 free 2 MiB hugepages, the system has 0",
            ),
            (
                "[engine]\nlisten = \"127.0.0.1:7200\"\n[cluster]\npeer-listen = \"0.0.0.0:7200\"\n",
                "cluster.peer-listen",
                "also engine.listen",
            ),
            (
                "[metrics]\nlisten = \"127.0.0.1:9100\"\n[cluster]\ndata-listen = \"127.0.0.1:9100\"\n",
                "cluster.data-listen",
                "also metrics.listen",
            ),
            (
                "[[nic]]\nname = \"n0\"\nprovider = \"udp\"\n",
                "nic",
                "key `provider` is invalid: unknown provider \"udp\" (expected loopback, tcp, shm or verbs)",
            ),
        ];
        for (text, key, why) in cases {
            let (k, reason) = invalid_key(text, &host);
            assert_eq!(k, key, "{text}: {reason}");
            assert!(reason.contains(why), "{text}: {reason}");
        }
        // The cgroup limit when it is the tighter one.
        let small = HostMemory {
            total: Some(64 << 30),
            cgroup: Some(1 << 30),
            hugepages_free: Some(32),
        };
        let (k, reason) = invalid_key("[pool]\nsize = \"2GiB\"\n", &small);
        assert_eq!(k, "pool.size");
        assert!(reason.contains("cgroup"), "{reason}");
        // The SSD write backlog's copies count on top of the pool.
        let ssd =
            "[ssd]\nwrite-backlog = \"512MiB\"\n[[ssd.dir]]\npath = \"/d\"\ncapacity = \"1GiB\"\n";
        let (k, reason) = invalid_key(&format!("[pool]\nsize = \"768MiB\"\n{ssd}"), &small);
        assert_eq!(k, "ssd.write-backlog");
        assert!(reason.contains("cgroup"), "{reason}");
        let ok: NodeConfig = toml::from_str(&format!("[pool]\nsize = \"256MiB\"\n{ssd}")).unwrap();
        ok.validate_on(&small).unwrap();
        // Within every limit: accepted.
        let ok: NodeConfig = toml::from_str(
            "[pool]\nsize = \"1GiB\"\n[lease]\nttl-secs = 86400\npeer-pin-ttl-secs = 86400\n\
             [cluster]\ndirectory = \"redis://h:6379/2\"\n",
        )
        .unwrap();
        ok.validate_on(&small).unwrap();
        let ok: NodeConfig = toml::from_str(
            "[pool]\nsize = \"64MiB\"\nslot-bytes = \"1MiB\"\nhugepages = true\n\
             [engine]\nlisten = \"127.0.0.1:0\"\n[metrics]\nlisten = \"127.0.0.1:0\"\n\
             [cluster]\npeer-listen = \"127.0.0.1:7100\"\ndata-listen = \"127.0.0.1:7101\"\n",
        )
        .unwrap();
        ok.validate_on(&small).unwrap();
    }

    #[test]
    fn a_size_of_the_wrong_type_says_what_a_size_is() {
        for text in [
            "[pool]\nsize = true\n",
            "[pool]\nsize = 1.5\n",
            "[pool]\nsize = [1]\n",
        ] {
            let err = NodeConfig::from_toml(text, "t.toml")
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("expected a size like \"64MiB\" or a number of bytes"),
                "{err}"
            );
            assert!(err.contains("size") && err.contains("line 2"), "{err}");
            assert!(!err.contains("untagged"), "{err}");
        }
        let err = NodeConfig::from_toml("[pool]\nsize = -1\n", "t.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("negative"), "{err}");
        let cfg = NodeConfig::from_toml("[pool]\nsize = 16777216\n", "t.toml").unwrap();
        assert_eq!(cfg.pool.size, ByteSize(16 << 20));
    }

    /// The sample configs and the defaults stay inside the limits.
    #[test]
    fn defaults_are_inside_the_limits() {
        let d = NodeConfig::default();
        assert!(d.lease.ttl_secs <= MAX_TTL_SECS);
        assert!(EngineConfig::default().handle_ttl_secs <= MAX_TTL_SECS);
        assert!(d.pool.slot_bytes.0 <= MAX_SLOT_BYTES);
    }
}
