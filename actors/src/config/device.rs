//! `[device]`: which devices a node opens and how a GPU copies.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::ByteSize;

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
pub(super) const MAX_COMPLETION_SPIN_US: u32 = 1_000_000;

impl DeviceConfig {
    /// The GPU options this section names (after [`crate::config::NodeConfig::validate`]).
    pub fn cuda_options(&self) -> kvferry_gpu::cuda::CudaOptions {
        let path = kvferry_gpu::cuda::CopyPath::from_name(&self.copy_path).unwrap_or_default();
        let mut o = kvferry_gpu::cuda::CudaOptions::with_copy_path(path)
            .with_staging(self.staging_chunk.0, self.staging_chunks);
        o.completion_spin = Duration::from_micros(u64::from(self.completion_spin_us));
        o
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
