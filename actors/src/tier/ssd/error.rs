//! What the SSD tier reports. Opening a directory fails a caller (the node does not start);
//! errors of single reads and writes are logged and counted: a read is a miss, a
//! write-behind block (already out of RAM) is lost to this node, and a write-through
//! block's error fails the answer of the put or save that sealed it (the block stays in RAM).

use std::path::PathBuf;

use thiserror::Error;

use crate::model::BlockHash;
use crate::tier::ssd::format::Damage;

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
    /// The directory is not private to the node's user (or cannot be made so).
    #[error("ssd directory {source}")]
    Directory {
        #[source]
        source: crate::private_fs::PrivateDirError,
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
    /// Nothing was queued for a block that had to be written (write-through).
    #[error("ssd: the block was not written ({reason})")]
    NotWritten {
        reason: crate::tier::ssd::tier::WriteSkip,
    },
    /// A load's SSD blocks that did not come back intact: their destinations were not
    /// written (never wrong bytes); the engine recomputes them.
    #[error("ssd: {} block(s) of this load could not be read intact: {}", blocks.len(), list(blocks))]
    Unreadable {
        blocks: Vec<(BlockHash, ReadFailure)>,
        /// The first I/O error among them, if any was one.
        #[source]
        source: Option<Box<SsdError>>,
    },
}

/// Why one block of a load could not be read from disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReadFailure {
    /// It left the tier since the query (found damaged by another read).
    Vanished,
    /// Its slot did not hold its bytes (torn, overwritten, checksum): dropped from the tier.
    Damaged(Damage),
    /// The read itself failed (an I/O error, or the directory's thread stopped).
    Io,
}

impl ReadFailure {
    pub fn as_str(self) -> &'static str {
        match self {
            ReadFailure::Vanished => "vanished",
            ReadFailure::Damaged(d) => d.as_str(),
            ReadFailure::Io => "io",
        }
    }
}

fn list(blocks: &[(BlockHash, ReadFailure)]) -> String {
    let mut s = String::new();
    for (i, (h, f)) in blocks.iter().enumerate() {
        if i == 8 {
            s.push_str(&format!(", and {} more", blocks.len() - 8));
            break;
        }
        if i > 0 {
            s.push_str(", ");
        }
        s.push_str(&format!("{h:?} ({})", f.as_str()));
    }
    s
}

impl SsdError {
    /// Whether the disk ran out of space (the directory stops taking new slots).
    pub fn is_disk_full(&self) -> bool {
        matches!(self, SsdError::DiskFull { .. })
    }

    /// The same write outcome for another waiter (errors are not `Clone`: an I/O source
    /// keeps its errno).
    pub(crate) fn again(&self) -> SsdError {
        match self {
            SsdError::DiskFull {
                path,
                offset,
                bytes,
            } => SsdError::DiskFull {
                path: path.clone(),
                offset: *offset,
                bytes: *bytes,
            },
            SsdError::Io {
                path,
                op,
                offset,
                bytes,
                source,
            } => SsdError::Io {
                path: path.clone(),
                op,
                offset: *offset,
                bytes: *bytes,
                source: source.raw_os_error().map_or_else(
                    || std::io::Error::from(source.kind()),
                    std::io::Error::from_raw_os_error,
                ),
            },
            SsdError::NotWritten { reason } => SsdError::NotWritten { reason: *reason },
            SsdError::Stopped { path } => SsdError::Stopped { path: path.clone() },
            // Not outcomes of a write.
            _ => SsdError::Stopped {
                path: PathBuf::new(),
            },
        }
    }
}

/// Whether an errno means "no room" (space, quota or the file size limit).
pub(crate) fn is_no_space(errno: i32) -> bool {
    errno == libc::ENOSPC || errno == libc::EDQUOT || errno == libc::EFBIG
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unreadable_names_its_blocks_and_how_they_failed() {
        let blocks: Vec<(BlockHash, ReadFailure)> = (0..10u64)
            .map(|i| {
                let f = match i {
                    0 => ReadFailure::Damaged(Damage::Checksum),
                    1 => ReadFailure::Vanished,
                    _ => ReadFailure::Io,
                };
                (BlockHash::from_u64(i), f)
            })
            .collect();
        let e = SsdError::Unreadable {
            blocks,
            source: None,
        };
        let s = e.to_string();
        assert!(s.starts_with("ssd: 10 block(s) of this load"), "{s}");
        assert!(
            s.contains(&format!("{:?} (checksum)", BlockHash::from_u64(0))),
            "{s}"
        );
        assert!(
            s.contains(&format!("{:?} (vanished)", BlockHash::from_u64(1))),
            "{s}"
        );
        // A long list is cut: the message stays bounded whatever a load held.
        assert!(s.ends_with(", and 2 more"), "{s}");
        assert!(!s.contains(&format!("{:?}", BlockHash::from_u64(9))), "{s}");
    }
}
