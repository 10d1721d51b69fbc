//! Identity of a queue pair: QP numbers are only unique per (peer, NIC), so a QP is always
//! addressed by the triple.

use std::fmt;

/// A node of the cluster (as exchanged in `Hello`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u64);

/// Index of a local NIC in the node's NIC list.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NicId(pub u16);

/// A QP number as the local side allocated it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QpNum(pub u32);

/// The key of a QP in a NIC worker's table and on every completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QpKey {
    pub peer: NodeId,
    pub nic: NicId,
    pub qp: QpNum,
}

impl QpKey {
    pub fn new(peer: NodeId, nic: NicId, qp: QpNum) -> Self {
        QpKey { peer, nic, qp }
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "node-{}", self.0)
    }
}

impl fmt::Display for QpKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/nic{}/qp{}", self.peer, self.nic.0, self.qp.0)
    }
}
