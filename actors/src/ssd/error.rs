//! What the SSD tier reports. Only opening a directory fails a caller (the node does not
//! start); errors of single reads and writes are logged and counted, and the block is a miss
//! or stays in RAM only.

use std::path::PathBuf;

use thiserror::Error;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SsdError {
    #[error("ssd directory {path}: {op}")]
    Open {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("ssd directory {path}: the disk is full (writing {bytes} bytes at offset {offset})")]
    DiskFull {
        path: PathBuf,
        offset: u64,
        bytes: u64,
    },
    #[error("ssd directory {path}: {op} of {bytes} bytes at offset {offset}")]
    Io {
        path: PathBuf,
        op: &'static str,
        offset: u64,
        bytes: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("ssd directory {path}: its I/O thread has stopped")]
    Stopped { path: PathBuf },
}

impl SsdError {
    /// Whether the disk ran out of space (the directory stops taking new slots).
    pub fn is_disk_full(&self) -> bool {
        matches!(self, SsdError::DiskFull { .. })
    }
}

/// Whether an errno means "no room" (space, quota or the file size limit).
pub(crate) fn is_no_space(errno: i32) -> bool {
    errno == libc::ENOSPC || errno == libc::EDQUOT || errno == libc::EFBIG
}
