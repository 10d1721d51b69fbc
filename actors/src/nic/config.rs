//! The `[[nic]]` section of the node config: kebab-case keys, unknown keys refused, defaults
//! from the transport's [`NicConfig`], and `validate()` whose errors name the offending key.

use std::time::Duration;

use kvferry_transport::{ConfigError, NicConfig, ProviderKind};
use serde::Deserialize;
use thiserror::Error;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum NicSectionError {
    #[error("nic config: {message}")]
    Parse { message: String },
    #[error("nic {nic}: key `{key}` is invalid")]
    Invalid {
        nic: String,
        key: &'static str,
        #[source]
        source: ConfigError,
    },
}

/// One `[[nic]]` table.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct NicSection {
    pub name: String,
    /// `loopback`, `tcp`, `shm` or `verbs`.
    pub provider: String,
    pub qps_per_peer: u32,
    pub max_send_wr: u32,
    pub max_rd_atomic: u32,
    pub max_sge: u32,
    pub completion_timeout_ms: u64,
}

impl Default for NicSection {
    fn default() -> Self {
        let d = NicConfig::default();
        NicSection {
            name: d.name,
            provider: d.provider.as_str().to_string(),
            qps_per_peer: d.qps_per_peer,
            max_send_wr: d.max_send_wr,
            max_rd_atomic: d.max_rd_atomic,
            max_sge: d.max_sge,
            completion_timeout_ms: u64::try_from(d.completion_timeout.as_millis())
                .unwrap_or(u64::MAX),
        }
    }
}

/// Which TOML key a transport config error is about.
fn key_of(e: &ConfigError) -> &'static str {
    match e {
        ConfigError::UnknownProvider { .. } | ConfigError::ProviderUnavailable { .. } => "provider",
        ConfigError::InvalidName { .. } => "name",
        ConfigError::OutOfRange { field, .. } => field,
        ConfigError::ReadsExceedWindow { .. } => "max-rd-atomic",
        _ => "nic",
    }
}

impl NicSection {
    fn invalid(&self, source: ConfigError) -> NicSectionError {
        NicSectionError::Invalid {
            nic: self.name.clone(),
            key: key_of(&source),
            source,
        }
    }

    /// The transport's config, without range checks (see [`NicSection::validate`]).
    pub fn to_nic_config(&self) -> Result<NicConfig, NicSectionError> {
        let provider = ProviderKind::parse(&self.provider).map_err(|e| self.invalid(e))?;
        Ok(NicConfig {
            name: self.name.clone(),
            provider,
            qps_per_peer: self.qps_per_peer,
            max_send_wr: self.max_send_wr,
            max_rd_atomic: self.max_rd_atomic,
            max_sge: self.max_sge,
            completion_timeout: Duration::from_millis(self.completion_timeout_ms),
        })
    }

    /// Cross-field and range rules, delegated to [`NicConfig::validate`].
    pub fn validate(&self) -> Result<NicConfig, NicSectionError> {
        let cfg = self.to_nic_config()?;
        cfg.validate().map_err(|e| self.invalid(e))?;
        Ok(cfg)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NicDocument {
    #[serde(default)]
    nic: Vec<NicSection>,
}

/// Parses a TOML document made of `[[nic]]` tables (unknown keys are refused with their line
/// and column) and validates each one. Names must be unique: they label metrics.
pub fn parse_nics(text: &str) -> Result<Vec<NicConfig>, NicSectionError> {
    let doc: NicDocument = toml::from_str(text).map_err(|e| NicSectionError::Parse {
        message: e.to_string(),
    })?;
    let mut out: Vec<NicConfig> = Vec::with_capacity(doc.nic.len());
    for s in &doc.nic {
        let cfg = s.validate()?;
        if out.iter().any(|c| c.name == cfg.name) {
            return Err(NicSectionError::Parse {
                message: format!("nic name {:?} appears twice", cfg.name),
            });
        }
        out.push(cfg);
    }
    Ok(out)
}
