//! `[tls]`: the node's certificate, the cluster CA, and which TCP listeners speak TLS.
//!
//! Between nodes TLS is mutual: a node presents `cert` to the peers it calls, and accepts on
//! its peer listener only clients whose certificate `ca` signed. Engines are authenticated
//! by `engine.token`; a client certificate on the engine listener is optional unless
//! `engine-client-cert = "required"`. Relative paths are taken from the directory of the
//! config file (`NodeConfig::load`). `validate()` reads the files: they must parse as PEM,
//! the key must be the certificate's, and the certificate must not have expired.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::ConfigError;
pub use crate::tls::ClientAuth;

/// The TCP listeners TLS can be put on.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "kebab-case")]
pub enum TlsListener {
    /// `engine.listen`: `kvferry.v1.Engine`.
    Engine,
    /// `cluster.peer-listen`: `kvferry.v1.Peer`, and this node's calls to its peers.
    Peer,
    /// `cluster.data-listen`: the tcp data plane, and this node's reads from its peers.
    Data,
    /// `metrics.listen`: `/metrics` and `/health`.
    Metrics,
}

impl TlsListener {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Engine => "engine",
            Self::Peer => "peer",
            Self::Data => "data",
            Self::Metrics => "metrics",
        }
    }
}

/// Longest TLS handshake a listener waits for before it closes the connection.
pub const MAX_HANDSHAKE_TIMEOUT_MS: u64 = 60_000;

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case", default)]
pub struct TlsConfig {
    /// This node's certificate chain (PEM, leaf first). Peers see it, as servers and as
    /// clients, so it must name the node id (a DNS subject alternative name).
    pub cert: PathBuf,
    /// The certificate's private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The cluster CA (PEM, one or more certificates): peers must present a certificate it
    /// signed, and so must engines that present one.
    pub ca: PathBuf,
    /// Which listeners speak TLS (`engine`, `peer`, `metrics`, `data`). `peer` also makes
    /// this node's own Peer calls TLS; `data` serves the tcp data port requiring a
    /// certificate the CA signed, and makes this node's reads from its peers TLS.
    pub listeners: Vec<TlsListener>,
    /// Whether the engine listener asks engines for a certificate.
    pub engine_client_cert: ClientAuth,
    /// Reread `cert`, `key` and `ca` on SIGHUP (the `kvferry` binary).
    pub reload_on_sighup: bool,
    /// Also reread them when one of their modification times changes, checked this often;
    /// 0: not polled.
    pub reload_poll_secs: u64,
    /// A connection that has not finished its handshake this long after it was accepted is
    /// closed (slow or silent clients cannot hold a listener's slots).
    pub handshake_timeout_ms: u64,
    /// Warn (at start and at each reload) when this node's certificate expires within this
    /// many days; 0: never.
    pub expiry_warn_days: u32,
}

/// Most days `tls.expiry-warn-days` takes (ten years).
pub const MAX_EXPIRY_WARN_DAYS: u32 = 3650;

impl Default for TlsConfig {
    fn default() -> Self {
        Self {
            cert: PathBuf::new(),
            key: PathBuf::new(),
            ca: PathBuf::new(),
            listeners: vec![TlsListener::Engine, TlsListener::Peer],
            engine_client_cert: ClientAuth::Optional,
            reload_on_sighup: true,
            reload_poll_secs: 0,
            handshake_timeout_ms: 5_000,
            expiry_warn_days: 14,
        }
    }
}

impl TlsConfig {
    pub fn covers(&self, listener: TlsListener) -> bool {
        self.listeners.contains(&listener)
    }

    /// Whether every engine that connects must show a certificate the CA signed.
    pub fn engine_mutual(&self) -> bool {
        self.covers(TlsListener::Engine) && self.engine_client_cert == ClientAuth::Required
    }

    /// The files, as the TLS context reads them.
    pub fn files(&self) -> crate::tls::TlsFiles {
        crate::tls::TlsFiles {
            cert: self.cert.clone(),
            key: self.key.clone(),
            ca: self.ca.clone(),
        }
    }

    pub fn expiry_warning(&self) -> std::time::Duration {
        std::time::Duration::from_secs(u64::from(self.expiry_warn_days) * 86_400)
    }

    pub fn handshake_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.handshake_timeout_ms)
    }

    /// Relative paths made relative to `base` (the config file's directory).
    pub fn resolve_relative(&mut self, base: &Path) {
        for p in [&mut self.cert, &mut self.key, &mut self.ca] {
            if !p.as_os_str().is_empty() && p.is_relative() {
                *p = base.join(&*p);
            }
        }
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key, reason: String| Err(ConfigError::Invalid { key, reason });
        for (key, path) in [
            ("tls.cert", &self.cert),
            ("tls.key", &self.key),
            ("tls.ca", &self.ca),
        ] {
            if path.as_os_str().is_empty() {
                return invalid(key, "is required in a [tls] section (a PEM file)".into());
            }
        }
        let mut seen = std::collections::HashSet::new();
        for l in &self.listeners {
            if !seen.insert(l) {
                return invalid("tls.listeners", format!("{:?} is listed twice", l.as_str()));
            }
        }
        if !(100..=MAX_HANDSHAKE_TIMEOUT_MS).contains(&self.handshake_timeout_ms) {
            return invalid(
                "tls.handshake-timeout-ms",
                format!(
                    "{} must be 100 to {MAX_HANDSHAKE_TIMEOUT_MS}",
                    self.handshake_timeout_ms
                ),
            );
        }
        if self.reload_poll_secs > 86_400 {
            return invalid(
                "tls.reload-poll-secs",
                format!("{} must be 0 (off) to 86400", self.reload_poll_secs),
            );
        }
        if self.expiry_warn_days > MAX_EXPIRY_WARN_DAYS {
            return invalid(
                "tls.expiry-warn-days",
                format!(
                    "{} must be 0 (never) to {MAX_EXPIRY_WARN_DAYS}",
                    self.expiry_warn_days
                ),
            );
        }
        // What the node would load at start, loaded now: a config that passes starts. A
        // certificate already expired would be refused by every peer.
        let refused = |e: crate::tls::TlsError| ConfigError::Invalid {
            key: e.key(),
            reason: e.to_string(),
        };
        crate::tls::TlsMaterial::load(&self.files())
            .map_err(refused)?
            .check_unexpired(&self.cert, std::time::SystemTime::now())
            .map_err(refused)?;
        Ok(())
    }
}
