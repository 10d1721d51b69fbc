//! Per-NIC settings: a plain struct with defaults and `validate()`. The actors crate owns the
//! TOML side (kebab-case keys) and converts into this.

use std::fmt;
use std::time::Duration;

use thiserror::Error;

use crate::rc_queue::QueueLimits;

/// Which provider carries a NIC's reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProviderKind {
    /// In-process copies between two MR tables; deterministic, for tests and single-node runs.
    Loopback,
    /// Any hosts: the owner validates each request and streams the bytes over TCP.
    Tcp,
    /// Same host: the owner's pool memfd is mapped read-only by the requester.
    Shm,
    /// RDMA NICs through rdma-core (cargo feature `verbs`).
    Verbs,
}

impl ProviderKind {
    pub fn as_str(&self) -> &'static str {
        match self {
            ProviderKind::Loopback => "loopback",
            ProviderKind::Tcp => "tcp",
            ProviderKind::Shm => "shm",
            ProviderKind::Verbs => "verbs",
        }
    }

    /// Parses the config spelling (`loopback`, `tcp`, `shm`, `verbs`).
    pub fn parse(s: &str) -> Result<Self, ConfigError> {
        match s {
            "loopback" => Ok(ProviderKind::Loopback),
            "tcp" => Ok(ProviderKind::Tcp),
            "shm" => Ok(ProviderKind::Shm),
            "verbs" => Ok(ProviderKind::Verbs),
            other => Err(ConfigError::UnknownProvider {
                value: other.to_string(),
            }),
        }
    }
}

impl fmt::Display for ProviderKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    #[error("unknown provider {value:?} (expected loopback, tcp, shm or verbs)")]
    UnknownProvider { value: String },
    #[error("nic name {name:?} is invalid: {reason}")]
    InvalidName { name: String, reason: &'static str },
    #[error("nic {nic}: {field} = {value} is out of range {min}..={max}")]
    OutOfRange {
        nic: String,
        field: &'static str,
        value: u64,
        min: u64,
        max: u64,
    },
    #[error("nic {nic}: max-rd-atomic ({max_rd_atomic}) exceeds max-send-wr ({max_send_wr})")]
    ReadsExceedWindow {
        nic: String,
        max_rd_atomic: u32,
        max_send_wr: u32,
    },
    #[error(
        "nic {nic}: provider {provider} is not compiled in (enable cargo feature `{feature}`)"
    )]
    ProviderUnavailable {
        nic: String,
        provider: ProviderKind,
        feature: &'static str,
    },
}

/// One NIC as the node sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NicConfig {
    /// Label used in QP keys' logs and metrics (`nic` label); `[A-Za-z0-9_.-]`, 1..=64 bytes.
    pub name: String,
    pub provider: ProviderKind,
    /// Queue pairs opened to each peer on this NIC.
    pub qps_per_peer: u32,
    /// Send window: work requests posted on one QP and not yet completed.
    pub max_send_wr: u32,
    /// Reads in flight on one QP (the initiator depth).
    pub max_rd_atomic: u32,
    /// Local pieces one read may scatter into.
    pub max_sge: u32,
    /// A read issued longer ago than this without completion moves its QP to error.
    pub completion_timeout: Duration,
}

impl Default for NicConfig {
    fn default() -> Self {
        NicConfig {
            name: "nic0".to_string(),
            provider: ProviderKind::Tcp,
            qps_per_peer: 2,
            max_send_wr: 128,
            max_rd_atomic: 16,
            max_sge: 16,
            completion_timeout: Duration::from_secs(5),
        }
    }
}

impl NicConfig {
    /// Ranges follow what RC hardware accepts (`max_rd_atomic` is a u8 on the wire, verbs
    /// devices cap SGEs at a few dozen) so a config valid here is valid on real NICs.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let name_ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.');
        if self.name.is_empty() || self.name.len() > 64 {
            return Err(ConfigError::InvalidName {
                name: self.name.clone(),
                reason: "must be 1..=64 bytes",
            });
        }
        if !self.name.chars().all(name_ok) {
            return Err(ConfigError::InvalidName {
                name: self.name.clone(),
                reason: "only letters, digits, '_', '-' and '.' are allowed",
            });
        }
        let range = |field: &'static str, value: u64, min: u64, max: u64| {
            if (min..=max).contains(&value) {
                Ok(())
            } else {
                Err(ConfigError::OutOfRange {
                    nic: self.name.clone(),
                    field,
                    value,
                    min,
                    max,
                })
            }
        };
        range("qps-per-peer", self.qps_per_peer.into(), 1, 64)?;
        range("max-send-wr", self.max_send_wr.into(), 1, 32_768)?;
        range("max-rd-atomic", self.max_rd_atomic.into(), 1, 255)?;
        range("max-sge", self.max_sge.into(), 1, 64)?;
        let timeout_ms = u64::try_from(self.completion_timeout.as_millis()).unwrap_or(u64::MAX);
        range("completion-timeout-ms", timeout_ms, 1, 3_600_000)?;
        if self.max_rd_atomic > self.max_send_wr {
            return Err(ConfigError::ReadsExceedWindow {
                nic: self.name.clone(),
                max_rd_atomic: self.max_rd_atomic,
                max_send_wr: self.max_send_wr,
            });
        }
        // A verbs NIC is a valid config in every build: where the build or the host has no
        // RDMA device, the node starts, refuses `direct_gpu` naming why (the capability gate)
        // and counts the registrations it could not make.
        Ok(())
    }

    /// The queue bounds every QP on this NIC runs with.
    pub fn queue_limits(&self) -> QueueLimits {
        QueueLimits {
            max_send_wr: self.max_send_wr,
            max_rd_atomic: self.max_rd_atomic,
            max_sge: self.max_sge,
            completion_timeout: self.completion_timeout,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate() {
        NicConfig::default().validate().unwrap();
    }

    #[test]
    fn rejects_bad_values() {
        let c = NicConfig {
            max_sge: 0,
            ..NicConfig::default()
        };
        assert!(matches!(
            c.validate(),
            Err(ConfigError::OutOfRange {
                field: "max-sge",
                ..
            })
        ));
        let c = NicConfig {
            max_rd_atomic: 64,
            max_send_wr: 8,
            ..NicConfig::default()
        };
        assert!(matches!(
            c.validate(),
            Err(ConfigError::ReadsExceedWindow { .. })
        ));
        let c = NicConfig {
            name: "eth 0".into(),
            ..NicConfig::default()
        };
        assert!(matches!(c.validate(), Err(ConfigError::InvalidName { .. })));
        assert_eq!(ProviderKind::parse("shm").unwrap(), ProviderKind::Shm);
        assert!(ProviderKind::parse("udp").is_err());
    }

    #[test]
    fn verbs_is_valid_in_every_build() {
        let c = NicConfig {
            provider: ProviderKind::Verbs,
            ..NicConfig::default()
        };
        c.validate().unwrap();
    }
}
