//! [`CudaOptions`]: how a [`super::CudaDevice`] issues copies, with the measured defaults.

use std::time::Duration;

use super::plan::CopyPath;

/// How a [`super::CudaDevice`] issues copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct CudaOptions {
    pub copy_path: CopyPath,
    /// Bytes of one staging chunk of the staged path (rounded down to 256, at least 4 KiB);
    /// 0 turns the staged path off.
    pub staging_chunk_bytes: u64,
    /// Staging chunks per direction (at least 2): while one is scattered on the device, the
    /// copy engines fill the next.
    pub staging_chunks: u32,
    /// How long a lane's completion thread polls a batch's event before sleeping on it
    /// (zero: sleep at once). Polling notices the end of a copy tens of microseconds
    /// sooner, which is most of a small load's cost; it keeps a core busy (yielding) for
    /// at most this long per batch.
    pub completion_spin: Duration,
}

/// Default completion polling: 5 ms covers every batch of up to about 256 MiB (a
/// 128-block load of 28 layers at 64 KiB), the sizes where tens of microseconds count.
pub const DEFAULT_COMPLETION_SPIN: Duration = Duration::from_millis(5);

/// Default staging: two 32 MiB chunks per direction, allocated on the first fragmented
/// batch. A chunk takes the copy engines ~0.6 ms at PCIe 5 speed and its scatter ~30 us,
/// so two keep the engines busy and the last scatter adds little.
pub const DEFAULT_STAGING_CHUNK_BYTES: u64 = 32 << 20;
pub const DEFAULT_STAGING_CHUNKS: u32 = 2;

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            copy_path: CopyPath::Auto,
            staging_chunk_bytes: DEFAULT_STAGING_CHUNK_BYTES,
            staging_chunks: DEFAULT_STAGING_CHUNKS,
            completion_spin: DEFAULT_COMPLETION_SPIN,
        }
    }
}

impl CudaOptions {
    pub fn with_copy_path(copy_path: CopyPath) -> Self {
        Self {
            copy_path,
            ..Self::default()
        }
    }

    /// Staging of `chunks` chunks of `chunk_bytes` each (see the fields).
    pub fn with_staging(mut self, chunk_bytes: u64, chunks: u32) -> Self {
        self.staging_chunk_bytes = chunk_bytes;
        self.staging_chunks = chunks;
        self
    }

    /// The chunk size in use, 0 where staging is off.
    pub(super) fn stage_chunk(&self) -> u64 {
        match self.staging_chunk_bytes {
            0 => 0,
            n => (n & !255).max(4096),
        }
    }
}
