//! The `[[nic]]` section of the node config: kebab-case keys, unknown keys refused, defaults
//! from the transport's [`NicConfig`], and `validate()` whose errors name the offending key.

use std::time::Duration;

use kvferry_transport::verbs::{VerbsConfig, VerbsConfigError};
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
    #[error("verbs: key `{key}` is invalid")]
    Verbs {
        key: &'static str,
        #[source]
        source: VerbsConfigError,
    },
}

/// One `[[nic]]` table.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, serde::Serialize)]
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

/// The `[verbs]` section: settings every verbs NIC of the node shares (RC retry behaviour,
/// registration splitting, striping, the NIC choice override) and where sysfs is read.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(default, rename_all = "kebab-case", deny_unknown_fields)]
pub struct VerbsSection {
    pub retry_count: u8,
    pub rnr_retry: u8,
    pub timeout: u8,
    pub min_rnr_timer: u8,
    pub hop_limit: u8,
    pub service_level: u8,
    pub traffic_class: u8,
    /// Host pool registrations longer than this are split into several MRs (bytes; 4 GiB).
    pub registration_chunk: u64,
    pub relaxed_ordering: bool,
    /// Remote plans of at least this many bytes are striped across the NICs nearest the
    /// destination.
    pub stripe_min_bytes: u64,
    /// RDMA device names to use instead of the ones sysfs places nearest the destination.
    pub nic_override: Vec<String>,
    /// PCI address (`0000:19:00.0`) of each GPU ordinal, for NIC choice by PCIe distance;
    /// absent: NICs are chosen as for host memory.
    pub gpu_pci: Vec<String>,
    /// Root of the sysfs tree NICs are discovered in (`/sys`; fixtures in tests).
    pub sysfs_root: String,
}

impl Default for VerbsSection {
    fn default() -> Self {
        let d = VerbsConfig::default();
        VerbsSection {
            retry_count: d.retry_count,
            rnr_retry: d.rnr_retry,
            timeout: d.timeout,
            min_rnr_timer: d.min_rnr_timer,
            hop_limit: d.hop_limit,
            service_level: d.service_level,
            traffic_class: d.traffic_class,
            registration_chunk: d.registration_chunk,
            relaxed_ordering: d.relaxed_ordering,
            stripe_min_bytes: d.stripe_min_bytes,
            nic_override: d.nic_override,
            gpu_pci: Vec::new(),
            sysfs_root: "/sys".into(),
        }
    }
}

impl VerbsSection {
    /// The transport's config, validated; errors name the key.
    pub fn validate(&self) -> Result<VerbsConfig, NicSectionError> {
        let c = VerbsConfig {
            retry_count: self.retry_count,
            rnr_retry: self.rnr_retry,
            timeout: self.timeout,
            min_rnr_timer: self.min_rnr_timer,
            hop_limit: self.hop_limit,
            service_level: self.service_level,
            traffic_class: self.traffic_class,
            registration_chunk: self.registration_chunk,
            relaxed_ordering: self.relaxed_ordering,
            stripe_min_bytes: self.stripe_min_bytes,
            nic_override: self.nic_override.clone(),
        };
        c.validate().map_err(|source| NicSectionError::Verbs {
            key: match &source {
                VerbsConfigError::OutOfRange { field, .. } => field,
                _ => "registration-chunk",
            },
            source,
        })?;
        Ok(c)
    }
}

/// The node config's `[[nic]]` tables and `[verbs]` section, checked together: each NIC
/// valid, names unique (they label metrics), the verbs settings in range. Errors name the
/// key (`nic`, `verbs`) and say what is wrong.
pub fn validate_node_nics(
    nics: &[NicSection],
    verbs: Option<&VerbsSection>,
) -> Result<(Vec<NicConfig>, VerbsConfig), (&'static str, String)> {
    let mut out: Vec<NicConfig> = Vec::with_capacity(nics.len());
    for s in nics {
        let cfg = s.validate().map_err(|e| ("nic", with_sources(&e)))?;
        if out.iter().any(|c| c.name == cfg.name) {
            return Err(("nic", format!("nic name {:?} appears twice", cfg.name)));
        }
        out.push(cfg);
    }
    let verbs = verbs
        .cloned()
        .unwrap_or_default()
        .validate()
        .map_err(|e| ("verbs", with_sources(&e)))?;
    Ok((out, verbs))
}

/// The error and its sources on one line: "key `provider` is invalid" alone does not say why.
fn with_sources(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
