//! Errors of the CUDA driver layer.

use thiserror::Error;

/// `CUDA_ERROR_NOT_SUPPORTED`: what consumer GPUs answer for DMA-BUF export, among others.
pub const CODE_NOT_SUPPORTED: u32 = 801;

/// One failed interaction with the CUDA driver library.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CudaError {
    /// No `libcuda.so` could be loaded: no NVIDIA driver on this machine.
    #[error("libcuda could not be loaded (no NVIDIA driver installed)")]
    NoLibrary,
    /// The loaded driver predates a call kvferry needs.
    #[error("the CUDA driver does not export {symbol} (driver too old)")]
    MissingSymbol { symbol: &'static str },
    /// A driver call returned an error code.
    #[error("{call} failed: {name} ({code})")]
    Driver {
        call: &'static str,
        code: u32,
        name: String,
    },
}

impl CudaError {
    /// The driver's error code, where the error came from a call.
    pub fn code(&self) -> Option<u32> {
        match self {
            CudaError::Driver { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// True where the driver said the operation is not supported on this device or system,
    /// which callers report as a missing capability rather than a failure.
    pub fn is_not_supported(&self) -> bool {
        matches!(self, CudaError::MissingSymbol { .. }) || self.code() == Some(CODE_NOT_SUPPORTED)
    }
}
