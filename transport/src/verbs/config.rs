//! Verbs-only settings on top of [`crate::NicConfig`]: RC retry behaviour, registration
//! splitting, relaxed ordering and the NIC choice override.

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum VerbsConfigError {
    #[error("verbs: {field} = {value} is out of range {min}..={max}")]
    OutOfRange {
        field: &'static str,
        value: u64,
        min: u64,
        max: u64,
    },
    #[error("verbs: registration-chunk ({chunk}) must be a multiple of the page size ({page})")]
    ChunkNotAligned { chunk: u64, page: u64 },
}

/// Page granule registrations are split on.
pub const PAGE: u64 = 4096;

/// What every verbs QP and registration on a node runs with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerbsConfig {
    /// Transport retries before a read fails with a retry-exceeded error (3 bits: 0..=7).
    pub retry_count: u8,
    /// RNR retries (3 bits; 7 means retry forever).
    pub rnr_retry: u8,
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout (5 bits; 0 disables the timeout).
    pub timeout: u8,
    /// Minimal RNR NAK timer code (5 bits).
    pub min_rnr_timer: u8,
    /// IP hop limit for RoCE v2 / global routes.
    pub hop_limit: u8,
    /// Service level / traffic class used on every QP.
    pub service_level: u8,
    pub traffic_class: u8,
    /// Registrations longer than this are split into several MRs (NICs cap one MR's size and
    /// a smaller MR keeps `ibv_reg_mr` latency bounded). Default 4 GiB.
    pub registration_chunk: u64,
    /// Ask for PCIe relaxed ordering on registrations (an optional access flag, so devices
    /// that cannot do it ignore it).
    pub relaxed_ordering: bool,
    /// Plans at least this long are striped across every NIC near the destination.
    pub stripe_min_bytes: u64,
    /// Explicit NIC names (e.g. `mlx5_0`) to use instead of affinity from sysfs.
    pub nic_override: Vec<String>,
}

impl Default for VerbsConfig {
    fn default() -> Self {
        VerbsConfig {
            retry_count: 7,
            rnr_retry: 7,
            timeout: 14,
            min_rnr_timer: 12,
            hop_limit: 64,
            service_level: 0,
            traffic_class: 0,
            registration_chunk: 4 << 30,
            relaxed_ordering: true,
            stripe_min_bytes: 4 << 20,
            nic_override: Vec::new(),
        }
    }
}

impl VerbsConfig {
    pub fn validate(&self) -> Result<(), VerbsConfigError> {
        let range = |field, value: u64, min, max| {
            if (min..=max).contains(&value) {
                Ok(())
            } else {
                Err(VerbsConfigError::OutOfRange {
                    field,
                    value,
                    min,
                    max,
                })
            }
        };
        range("retry-count", self.retry_count.into(), 0, 7)?;
        range("rnr-retry", self.rnr_retry.into(), 0, 7)?;
        range("timeout", self.timeout.into(), 0, 31)?;
        range("min-rnr-timer", self.min_rnr_timer.into(), 0, 31)?;
        range("service-level", self.service_level.into(), 0, 15)?;
        range("registration-chunk", self.registration_chunk, PAGE, 1 << 40)?;
        if !self.registration_chunk.is_multiple_of(PAGE) {
            return Err(VerbsConfigError::ChunkNotAligned {
                chunk: self.registration_chunk,
                page: PAGE,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_ranges() {
        VerbsConfig::default().validate().unwrap();
        assert_eq!(VerbsConfig::default().registration_chunk, 4 << 30);
        let c = VerbsConfig {
            retry_count: 8,
            ..VerbsConfig::default()
        };
        assert!(matches!(
            c.validate(),
            Err(VerbsConfigError::OutOfRange {
                field: "retry-count",
                ..
            })
        ));
        let c = VerbsConfig {
            registration_chunk: PAGE + 1,
            ..VerbsConfig::default()
        };
        assert!(matches!(
            c.validate(),
            Err(VerbsConfigError::ChunkNotAligned { .. })
        ));
    }
}
