//! The whole file: [`NodeConfig`], its defaults, and the rules across its sections.

use serde::{Deserialize, Serialize};

use crate::config::device::MAX_COMPLETION_SPIN_US;
use crate::config::limits::{check_socket_dir, check_token, check_ttl};
use crate::config::{
    ByteSize, ClusterConfig, ConfigError, DeviceConfig, DirectoryConfig, EngineConfig, HostMemory,
    LeaseConfig, MetricsConfig, PoolConfig, TlsConfig, TlsListener, MAX_SLOT_BYTES,
};

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
    /// RAM quotas per namespace and the namespaces metrics name (`[tenants]`).
    pub tenants: crate::config::TenantsConfig,
    /// TLS on the TCP listeners and between nodes (`[tls]`); absent: plaintext.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsConfig>,
    /// KV events for routers (`[events]`); absent: no event log, nothing published.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub events: Option<crate::events::EventsConfig>,
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
            tenants: crate::config::TenantsConfig::default(),
            tls: None,
            events: None,
        }
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

    /// Reads, parses and validates the file at `path`; relative `[tls]` paths are taken
    /// from the file's directory.
    pub fn load(path: &str) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let mut cfg: NodeConfig = toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        if let Some(t) = &mut cfg.tls {
            let base = std::path::Path::new(path)
                .parent()
                .unwrap_or(std::path::Path::new(""));
            t.resolve_relative(base);
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Whether `listener` speaks TLS in this config.
    pub fn tls_on(&self, listener: TlsListener) -> bool {
        self.tls.as_ref().is_some_and(|t| t.covers(listener))
    }

    /// A listener reachable from other hosts must authenticate its callers: the engine
    /// listener by `engine.token` or required client certificates, the peer listener by
    /// `cluster.token` or mutual TLS, unless the section says `allow-unauthenticated`.
    fn check_exposed_listeners(&self) -> Result<(), ConfigError> {
        let exposed = |a: &str| {
            a.parse::<std::net::SocketAddr>()
                .is_ok_and(|a| !a.ip().is_loopback())
        };
        if let Some(e) = &self.engine {
            let mutual = self.tls.as_ref().is_some_and(TlsConfig::engine_mutual);
            if exposed(&e.listen) && e.token.is_empty() && !mutual && !e.allow_unauthenticated {
                return Err(ConfigError::Invalid {
                    key: "engine.listen",
                    reason: format!(
                        "{} is reachable from other hosts but nothing authenticates its \
                         callers: set engine.token, or [tls] with \"engine\" in listeners and \
                         engine-client-cert = \"required\", or bind a loopback address \
                         (engine.allow-unauthenticated = true serves it open, for labs)",
                        e.listen
                    ),
                });
            }
        }
        if let Some(c) = &self.cluster {
            let mutual = self.tls_on(TlsListener::Peer);
            if exposed(&c.peer_listen) && c.token.is_empty() && !mutual && !c.allow_unauthenticated
            {
                return Err(ConfigError::Invalid {
                    key: "cluster.peer-listen",
                    reason: format!(
                        "{} is reachable from other hosts but nothing authenticates peers: \
                         set cluster.token, or [tls] with \"peer\" in listeners (mutual TLS), \
                         or bind a loopback address (cluster.allow-unauthenticated = true \
                         serves it open, for labs)",
                        c.peer_listen
                    ),
                });
            }
        }
        Ok(())
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
            if !(1..=super::cluster::MAX_DATA_LANES).contains(&c.data_lanes) {
                return invalid(
                    "cluster.data-lanes",
                    format!(
                        "{} must be 1 to {} (connections to each peer's data port)",
                        c.data_lanes,
                        super::cluster::MAX_DATA_LANES
                    ),
                );
            }
            if let Some(n) = c.tls_data_lanes {
                if !(1..=super::cluster::MAX_DATA_LANES).contains(&n) {
                    return invalid(
                        "cluster.tls-data-lanes",
                        format!(
                            "{n} must be 1 to {} (connections to each peer's data port over TLS)",
                            super::cluster::MAX_DATA_LANES
                        ),
                    );
                }
            }
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
            ssd.validate(self.pool.slot_bytes.0)
                .map_err(|e| ConfigError::Invalid {
                    key: e.key,
                    reason: e.reason,
                })?;
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
        let ssd = self.ssd.as_ref().map(|c| {
            let stride = crate::tier::ssd::format::slot_stride(self.pool.slot_bytes.0);
            let slots: u64 = c
                .dir
                .iter()
                .map(|d| crate::tier::ssd::format::slots_for(d.capacity.0, stride))
                .fold(0, u64::saturating_add);
            (slots.saturating_mul(stride), stride)
        });
        self.tenants
            .validate(self.pool.size.0, self.pool.slot_bytes.0, ssd)?;
        if let Some(ev) = &self.events {
            ev.validate().map_err(|e| ConfigError::Invalid {
                key: e.key,
                reason: e.reason,
            })?;
        }
        self.check_listeners_differ()?;
        if let Some(t) = &self.tls {
            t.validate()?;
            if let Some(c) = &self.cluster {
                for p in &c.peers {
                    if t.covers(TlsListener::Peer)
                        && crate::tls::peer_server_name(&p.node_id).is_err()
                    {
                        return invalid(
                            "cluster.peers",
                            format!(
                                "node id {:?} is not a DNS name: with TLS a peer's certificate \
                                 must name its node id",
                                p.node_id
                            ),
                        );
                    }
                }
            }
        }
        self.check_exposed_listeners()?;
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
