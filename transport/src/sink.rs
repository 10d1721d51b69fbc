//! The device side of a read: transport never touches GPU memory itself; the actors crate
//! implements this over the gpu copier.

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SinkError {
    #[error("device write of {len} bytes at {dst:#x} failed: {reason}")]
    Write { dst: u64, len: u64, reason: String },
    #[error("device flush failed: {reason}")]
    Flush { reason: String },
}

/// Where bytes for a device destination go.
///
/// Providers call `write` for each piece as it arrives (possibly from a provider thread, so
/// implementations must not block on the caller's actor) and `flush` once per read before they
/// report it successful; after `flush` returns `Ok` the bytes must be visible to the device.
pub trait DeviceSink: Send + Sync {
    fn write(&self, dst: u64, data: &[u8]) -> Result<(), SinkError>;
    fn flush(&self) -> Result<(), SinkError>;
}
