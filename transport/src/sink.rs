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
/// report it successful. After `flush` returns `Ok` the read's bytes are the sink's: a sink
/// may still be copying them to the device (so that the provider can receive the next read
/// meanwhile), and then whoever owns it waits for those copies, and fails the load on their
/// errors, before the destination is used or let go.
pub trait DeviceSink: Send + Sync {
    fn write(&self, dst: u64, data: &[u8]) -> Result<(), SinkError>;
    fn flush(&self) -> Result<(), SinkError>;

    /// Host memory of the sink's own, up to `max` bytes, that the calling provider thread
    /// may receive into directly and then hand over, in order, with [`DeviceSink::commit`]
    /// (saving the copy `write` makes). `None`: use `write`. A new call replaces what is
    /// left of the calling thread's previous area. Several provider threads may receive for
    /// one sink at once (one load's reads spread over several connections): a sink that
    /// lends to more than one keeps an area per thread and matches each `commit` to the
    /// calling thread's.
    fn staging(&self, _max: usize) -> Option<StagingArea> {
        None
    }

    /// Hands over the next `len` received bytes of the current staging area, for `dst`.
    fn commit(&self, dst: u64, len: usize) -> Result<(), SinkError> {
        Err(SinkError::Write {
            dst,
            len: len as u64,
            reason: "this sink lends no staging memory".into(),
        })
    }
}

/// Writable host memory lent by a [`DeviceSink`]: `len` bytes at `ptr`, valid until the
/// bytes are committed or the next `staging` call.
#[derive(Clone, Copy, Debug)]
pub struct StagingArea {
    pub ptr: *mut u8,
    pub len: usize,
}
