//! `[ssd]`: the directories (one per disk) the SSD tier keeps blocks in, and how it writes.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use thiserror::Error;

use crate::bytes::ByteSize;

use crate::tier::ssd::format;

/// A value of the `[ssd]` section that does not hold, naming its key (the node's config
/// reports it as that key's error).
#[derive(Debug, Error)]
#[error("config key {key}: {reason}")]
pub struct InvalidSsdConfig {
    pub key: &'static str,
    pub reason: String,
}

/// The deepest io_uring queue a directory may ask for (a ring of this many entries is a few
/// hundred KiB of kernel memory; deeper queues buy nothing on one NVMe disk).
pub const MAX_QUEUE_DEPTH: u32 = 1024;

/// The most directories one node spreads its blocks over.
pub const MAX_DIRS: usize = 64;

/// The default write backlog never exceeds this (an eighth of a large pool would be more
/// than the disks need queued: 1 GiB is 512 blocks of 2 MiB, 16 disks at queue depth 32).
pub const DEFAULT_MAX_WRITE_BACKLOG: u64 = 1 << 30;

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case", default)]
pub struct SsdConfig {
    /// One `[[ssd.dir]]` per disk; blocks are spread over them.
    pub dir: Vec<SsdDir>,
    /// Reads and writes in flight per directory.
    pub queue_depth: u32,
    /// Write every sealed block to disk as it seals (not only when RAM evicts it), and answer
    /// a put or save only once its sealed blocks are written: a restart or a process crash
    /// (SIGKILL, panic, OOM kill) then loses nothing acknowledged, at the cost of writing
    /// every block once and waiting for it. Not a power loss or a kernel crash: there is no
    /// fsync per write.
    pub write_through: bool,
    /// Open block files with `O_DIRECT` where the filesystem allows it (tmpfs does not: there
    /// the tier falls back to buffered I/O and says so in the log).
    pub direct_io: bool,
    /// The most memory that copies of blocks queued for the disks may take (each queued
    /// write holds one). Past it a write-behind block is not written (counted, logged) and
    /// a write-through answer waits for room. Default: an eighth of `pool.size`, or what
    /// keeps every directory's queue full if that is more, at most
    /// [`DEFAULT_MAX_WRITE_BACKLOG`] (see [`Self::backlog_bytes`]).
    pub write_backlog: Option<ByteSize>,
    /// A fault injection point for tests, not a config key: every block write waits this
    /// long on its I/O thread before it starts (a slow disk).
    #[serde(skip)]
    pub test_write_delay: Option<Duration>,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct SsdDir {
    /// Created if missing; holds one block file (`kvferry-blocks.dat`).
    pub path: PathBuf,
    /// The most this directory's block file may take (whole block slots of it are used).
    pub capacity: ByteSize,
}

impl Default for SsdConfig {
    fn default() -> Self {
        Self {
            dir: Vec::new(),
            queue_depth: 32,
            write_through: false,
            direct_io: true,
            write_backlog: None,
            test_write_delay: None,
        }
    }
}

impl SsdConfig {
    /// The write backlog's bound in bytes: `write-backlog`, or by default an eighth of the
    /// pool or a full queue of block slots on every directory (`queue-depth` each), whichever
    /// is more, at most [`DEFAULT_MAX_WRITE_BACKLOG`] and at least two block slots.
    pub fn backlog_bytes(&self, pool_bytes: u64, slot_bytes: u64) -> u64 {
        let stride = format::slot_stride(slot_bytes);
        let queues = stride
            .saturating_mul(self.queue_depth as u64)
            .saturating_mul(self.dir.len() as u64);
        match self.write_backlog {
            Some(b) => b.0,
            None => (pool_bytes / 8)
                .max(queues)
                .min(DEFAULT_MAX_WRITE_BACKLOG)
                .max(stride.saturating_mul(2)),
        }
    }

    /// Range and cross-field checks; `slot_bytes` is the host pool's slot size (the largest
    /// block the node holds, so the size of one block slot on disk).
    pub fn validate(&self, slot_bytes: u64) -> Result<(), InvalidSsdConfig> {
        let invalid = |key, reason: String| Err(InvalidSsdConfig { key, reason });
        if self.dir.is_empty() {
            return invalid(
                "ssd.dir",
                "[ssd] needs at least one [[ssd.dir]] with a path and a capacity".into(),
            );
        }
        if self.dir.len() > MAX_DIRS {
            return invalid(
                "ssd.dir",
                format!("{} directories, at most {MAX_DIRS}", self.dir.len()),
            );
        }
        if self.queue_depth == 0 || self.queue_depth > MAX_QUEUE_DEPTH {
            return invalid(
                "ssd.queue-depth",
                format!(
                    "{} must be between 1 and {MAX_QUEUE_DEPTH}",
                    self.queue_depth
                ),
            );
        }
        let stride = format::slot_stride(slot_bytes);
        if let Some(b) = self.write_backlog {
            if b.0 < stride {
                return invalid(
                    "ssd.write-backlog",
                    format!(
                        "{b} holds no block: one queued write takes {} (pool.slot-bytes \
                         and a 4 KiB header)",
                        ByteSize(stride)
                    ),
                );
            }
        }
        for (i, d) in self.dir.iter().enumerate() {
            if !d.path.is_absolute() {
                return invalid(
                    "ssd.dir.path",
                    format!("{} is not an absolute path", d.path.display()),
                );
            }
            if self.dir[..i].iter().any(|o| o.path == d.path) {
                return invalid(
                    "ssd.dir.path",
                    format!("{} is listed twice", d.path.display()),
                );
            }
            if format::slots_for(d.capacity.0, stride) == 0 {
                return invalid(
                    "ssd.dir.capacity",
                    format!(
                        "{} of {} holds no block: one takes {} on disk (pool.slot-bytes and \
                         a 4 KiB header), plus a 4 KiB file header",
                        d.capacity,
                        d.path.display(),
                        ByteSize(stride)
                    ),
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<SsdConfig, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }

    #[test]
    fn keys_are_kebab_case_and_unknown_ones_refused() {
        let c = parse(
            "queue-depth = 8\nwrite-through = true\n[[dir]]\npath = \"/d\"\ncapacity = \"1GiB\"\n",
        )
        .unwrap();
        assert_eq!(c.queue_depth, 8);
        assert!(c.write_through && c.direct_io);
        assert_eq!(c.dir[0].capacity, ByteSize(1 << 30));
        c.validate(1 << 20).unwrap();
        assert_eq!(c.write_backlog, None);
        let c = parse("write-backlog = \"3MiB\"\n").unwrap();
        assert_eq!(c.write_backlog, Some(ByteSize(3 << 20)));
        let e = parse("test-write-delay = 1\n").unwrap_err();
        assert!(
            e.contains("unknown field"),
            "a test hook is no config key: {e}"
        );
        let e = parse("queue_depth = 8\n").unwrap_err();
        assert!(e.contains("unknown field"), "{e}");
        let e = parse("[[dir]]\npath = \"/d\"\ncapacity = 1\nsize = 2\n").unwrap_err();
        assert!(e.contains("unknown field"), "{e}");
    }

    #[test]
    fn validate_names_the_key() {
        let ok = SsdConfig {
            dir: vec![SsdDir {
                path: "/d".into(),
                capacity: ByteSize(1 << 30),
            }],
            ..Default::default()
        };
        let key = |c: &SsdConfig| match c.validate(1 << 20) {
            Err(InvalidSsdConfig { key, .. }) => key,
            other => panic!("{other:?}"),
        };
        assert_eq!(key(&SsdConfig::default()), "ssd.dir");
        let mut c = ok.clone();
        c.queue_depth = 0;
        assert_eq!(key(&c), "ssd.queue-depth");
        c.queue_depth = MAX_QUEUE_DEPTH + 1;
        assert_eq!(key(&c), "ssd.queue-depth");
        let mut c = ok.clone();
        c.dir[0].path = "rel".into();
        assert_eq!(key(&c), "ssd.dir.path");
        let mut c = ok.clone();
        c.dir.push(c.dir[0].clone());
        assert_eq!(key(&c), "ssd.dir.path");
        let mut c = ok.clone();
        c.dir[0].capacity = ByteSize(1 << 20);
        assert_eq!(
            key(&c),
            "ssd.dir.capacity",
            "one 1 MiB block needs more than 1 MiB"
        );
        let mut c = ok.clone();
        c.write_backlog = Some(ByteSize(1 << 20));
        assert_eq!(
            key(&c),
            "ssd.write-backlog",
            "a backlog must hold one queued write (1 MiB and its header)"
        );
        c.write_backlog = Some(ByteSize((1 << 20) + 4096));
        c.validate(1 << 20).unwrap();
        // Huge values do not overflow.
        let mut c = ok;
        c.write_backlog = Some(ByteSize(u64::MAX));
        c.dir[0].capacity = ByteSize(u64::MAX);
        c.validate(crate::config::MAX_SLOT_BYTES).unwrap();
    }

    #[test]
    fn the_default_backlog_follows_the_pool_within_bounds() {
        let dir = |n: usize| {
            (0..n)
                .map(|i| SsdDir {
                    path: format!("/d{i}").into(),
                    capacity: ByteSize(1 << 30),
                })
                .collect()
        };
        let stride = format::slot_stride(2 << 20);
        let c = SsdConfig {
            dir: dir(1),
            queue_depth: 4,
            ..Default::default()
        };
        // An eighth of a 256 MiB pool.
        assert_eq!(c.backlog_bytes(256 << 20, 2 << 20), 32 << 20);
        // A small pool still fills the disk's queue; a huge one gets at most the cap.
        assert_eq!(c.backlog_bytes(4 << 20, 2 << 20), 4 * stride);
        assert_eq!(c.backlog_bytes(1 << 40, 2 << 20), DEFAULT_MAX_WRITE_BACKLOG);
        // Two disks at queue depth 32: 64 blocks in flight.
        let c = SsdConfig {
            dir: dir(2),
            ..Default::default()
        };
        assert_eq!(c.backlog_bytes(256 << 20, 2 << 20), 64 * stride);
        // At least two blocks, whatever the cap (1 GiB slots).
        assert_eq!(
            c.backlog_bytes(1 << 30, 1 << 30),
            DEFAULT_MAX_WRITE_BACKLOG.max(2 * (4096 + (1 << 30)))
        );
        assert_eq!(c.backlog_bytes(u64::MAX, u64::MAX), u64::MAX, "no overflow");
        let c = SsdConfig {
            write_backlog: Some(ByteSize(5 << 20)),
            ..Default::default()
        };
        assert_eq!(c.backlog_bytes(1 << 40, 2 << 20), 5 << 20);
    }
}
