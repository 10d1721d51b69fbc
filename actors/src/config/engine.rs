//! `[engine]`: the gRPC engine API and its fd socket.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::limits::{check_socket_dir, check_token, check_ttl};
use crate::config::redact::Redacted;
use crate::config::{ByteSize, ConfigError};

/// Where and how `kvferry node` serves `kvferry.v1.Engine` and its fd socket.
#[derive(Clone, Deserialize, Serialize, PartialEq)]
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
    /// Completed load results kept per instance rank until polled.
    pub completion_retention: u32,
    /// Memory handles no RegisterInstance used within this long are closed.
    pub handle_ttl_secs: u64,
    /// How long a request mailbox's node thread keeps polling after a request before it
    /// sleeps on the doorbell (a woken thread answers tens of microseconds later; a polling
    /// one at once, for a core's time while it polls). 0: sleep at once. At most 1 s.
    pub mailbox_spin_us: u64,
    /// Serve a listener reachable from other hosts without a token or client certificates
    /// (labs only; a non-loopback `listen` is refused otherwise).
    pub allow_unauthenticated: bool,
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
            allow_unauthenticated: false,
        }
    }
}

impl fmt::Debug for EngineConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Taken apart so that a new field is a compile error here, not a silent leak.
        let Self {
            listen,
            fd_dir,
            token,
            max_message_bytes,
            completion_retention,
            handle_ttl_secs,
            mailbox_spin_us,
            allow_unauthenticated,
        } = self;
        f.debug_struct("EngineConfig")
            .field("listen", listen)
            .field("fd_dir", fd_dir)
            .field("token", &Redacted(token))
            .field("max_message_bytes", max_message_bytes)
            .field("completion_retention", completion_retention)
            .field("handle_ttl_secs", handle_ttl_secs)
            .field("mailbox_spin_us", mailbox_spin_us)
            .field("allow_unauthenticated", allow_unauthenticated)
            .finish()
    }
}

impl EngineConfig {
    pub fn handle_ttl(&self) -> Duration {
        Duration::from_secs(self.handle_ttl_secs)
    }

    pub fn mailbox_spin(&self) -> Duration {
        Duration::from_micros(self.mailbox_spin_us)
    }

    pub(super) fn validate(&self, node_id: &str) -> Result<(), ConfigError> {
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
