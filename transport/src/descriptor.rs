//! What a read names: one remote range and the local pieces it lands in.

use crate::mr_table::MrKey;

/// A range of a peer's registered memory, as the owner advertised it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteDescriptor {
    /// Address in the owner's address space (as RDMA uses it).
    pub addr: u64,
    pub len: u64,
    pub rkey: MrKey,
}

/// One local destination piece inside a locally registered region (host or device).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LocalSegment {
    pub lkey: MrKey,
    /// Host virtual address, or device address for a device region.
    pub addr: u64,
    pub len: u64,
}

/// One one-sided read: `remote` scattered in order into `local` (at most `max_sge` pieces whose
/// lengths sum to `remote.len`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadRequest {
    /// Caller's id, echoed on the completion.
    pub wr_id: u64,
    pub remote: RemoteDescriptor,
    pub local: Vec<LocalSegment>,
}
