//! `[cluster]`: how a node serves its pool to peers and reaches theirs.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::config::redact::{Redacted, RedactedUrl};

pub use crate::peer::rc_link::{DEFAULT_DATA_LANES, MAX_DATA_LANES};

/// How a node serves its pool to peers and reaches theirs.
#[derive(Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case", default)]
pub struct ClusterConfig {
    /// Data path between nodes: `tcp` or `shm` (same host).
    pub provider: String,
    /// Where this node serves `kvferry.v1.Peer`.
    pub peer_listen: String,
    /// Where the tcp data server listens (port 0: any).
    pub data_listen: String,
    /// Connections a tcp link opens to each peer's data port, read side by side (1 to
    /// [`MAX_DATA_LANES`]). Over TLS each connection is encrypted and decrypted on its own
    /// thread, so more lanes spread the cipher over more cores.
    pub data_lanes: u32,
    /// Connections a tcp link opens to each peer's data port when the data plane is
    /// encrypted (`tls.listeners` has `data`); unset: [`TLS_LANES_FACTOR`] × `data-lanes`, at
    /// most [`MAX_DATA_LANES`]. AES-GCM and the record copies cost about as much CPU per byte
    /// as the socket itself, so at equal connections TLS moves about half of what clear tcp
    /// does; more connections, each a thread on both sides, make up for it on spare cores.
    pub tls_data_lanes: Option<u32>,
    /// Where the shm socket is created.
    pub shm_dir: String,
    /// Shared secret every peer RPC must carry; empty: not checked.
    pub token: String,
    /// `static` (ask the listed peers in order) or `redis://host:port`.
    pub directory: String,
    pub peers: Vec<PeerConfig>,
    /// Serve a peer listener reachable from other hosts without a token or mutual TLS (labs
    /// only; a non-loopback `peer-listen` is refused otherwise).
    pub allow_unauthenticated: bool,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct PeerConfig {
    pub node_id: String,
    /// The peer's `peer-listen` address.
    pub address: String,
}

impl fmt::Debug for ClusterConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Taken apart so that a new field is a compile error here, not a silent leak.
        let Self {
            provider,
            peer_listen,
            data_listen,
            data_lanes,
            tls_data_lanes,
            shm_dir,
            token,
            directory,
            peers,
            allow_unauthenticated,
        } = self;
        f.debug_struct("ClusterConfig")
            .field("provider", provider)
            .field("peer_listen", peer_listen)
            .field("data_listen", data_listen)
            .field("data_lanes", data_lanes)
            .field("tls_data_lanes", tls_data_lanes)
            .field("shm_dir", shm_dir)
            .field("token", &Redacted(token))
            .field("directory", &RedactedUrl(directory))
            .field("peers", peers)
            .field("allow_unauthenticated", allow_unauthenticated)
            .finish()
    }
}

/// Connections per link over TLS, per connection in clear, unless `cluster.tls-data-lanes`
/// says otherwise: on the H200 machine's 16 cores TLS moved 0.46–0.53 of clear at equal lanes
/// and scaled with lanes as clear does (`kvferry bench remote --provider tcp --tls`).
pub const TLS_LANES_FACTOR: u32 = 3;

impl ClusterConfig {
    /// The connections a tcp link opens to each peer: `data-lanes` in clear; over TLS
    /// (`tls`), `tls-data-lanes` or [`TLS_LANES_FACTOR`] × `data-lanes`, at most
    /// [`MAX_DATA_LANES`].
    pub fn lanes(&self, tls: bool) -> u32 {
        if tls {
            tls_lanes(self.data_lanes, self.tls_data_lanes)
        } else {
            self.data_lanes
        }
    }
}

/// Lanes over TLS: `explicit`, or [`TLS_LANES_FACTOR`] × `clear` lanes, at most
/// [`MAX_DATA_LANES`] (never fewer than `clear`).
pub fn tls_lanes(clear: u32, explicit: Option<u32>) -> u32 {
    explicit.unwrap_or_else(|| {
        clear
            .saturating_mul(TLS_LANES_FACTOR)
            .min(MAX_DATA_LANES)
            .max(clear)
    })
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            provider: "tcp".into(),
            peer_listen: "127.0.0.1:7100".into(),
            data_listen: "127.0.0.1:0".into(),
            data_lanes: DEFAULT_DATA_LANES,
            tls_data_lanes: None,
            shm_dir: std::env::temp_dir().join("kvferry").display().to_string(),
            token: String::new(),
            directory: "static".into(),
            peers: Vec::new(),
            allow_unauthenticated: false,
        }
    }
}
