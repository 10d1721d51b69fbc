//! `[pool]`: the host pool's size and slots.

use serde::{Deserialize, Serialize};

use crate::config::ByteSize;

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case", default)]
pub struct PoolConfig {
    /// Total host pool size.
    pub size: ByteSize,
    /// Bytes per slot: the largest block (every TP rank) the node can hold.
    pub slot_bytes: ByteSize,
    /// Back the pool with 2 MiB hugepages (fails clearly where none are reserved).
    pub hugepages: bool,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            size: ByteSize(256 << 20),
            slot_bytes: ByteSize(1 << 20),
            hugepages: false,
        }
    }
}
