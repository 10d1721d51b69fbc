//! Key names of the data model (see the module header of `peer::redis`).

use crate::model::{BlockHash, Namespace};

pub(super) fn block_key(prefix: &str, ns: &Namespace, h: &BlockHash) -> String {
    let mut k = format!("{prefix}:blk:{}:", ns.as_str());
    for b in h.as_bytes() {
        k.push_str(&format!("{b:02x}"));
    }
    k
}

pub(super) fn node_key(prefix: &str, node: &str) -> String {
    format!("{prefix}:node:{node}")
}
