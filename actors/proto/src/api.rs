//! Requests and replies of the engine API, shared by the `Node` handle and (later) gRPC.

use kvferry_gpu::{KvLayoutSpec, KvShape};

use crate::model::{BlockHash, InstanceId, LeaseId, Namespace};

/// One TP rank of an engine instance registering its GPU KV.
#[derive(Clone, Debug)]
pub struct RegisterInstance {
    pub instance: InstanceId,
    pub model: String,
    pub dtype: String,
    pub shape: KvShape,
    pub rank: u32,
    /// Device ordinal on this node.
    pub device: u32,
    pub layout: KvLayoutSpec,
}

/// Asks what this node can hand over for a prompt.
#[derive(Clone, Debug)]
pub struct QueryRequest {
    pub instance: InstanceId,
    pub hashes: Vec<BlockHash>,
    /// Ask for remote blocks to be read straight into GPU KV.
    pub direct_gpu: bool,
    /// The tenant of the instance's model (see [`crate::Namespace::with_tenant`]); None:
    /// the model's own blocks.
    pub tenant: Option<String>,
}

/// The answer to a `direct_gpu` request: never silently downgraded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DirectGrant {
    NotRequested,
    Granted,
    Refused { reason: String },
}

impl DirectGrant {
    pub fn is_granted(&self) -> bool {
        matches!(self, DirectGrant::Granted)
    }
}

#[derive(Clone, Debug)]
pub struct QueryResponse {
    /// Absent when nothing hits.
    pub lease: Option<LeaseId>,
    pub namespace: Namespace,
    pub local_blocks: usize,
    /// How many of `local_blocks` (the last ones) came from this node's SSD tier; the others
    /// were in RAM. RAM, SSD, remote and missed blocks sum to the queried hashes.
    pub ssd_blocks: usize,
    pub remote_blocks: usize,
    pub direct: DirectGrant,
}

impl QueryResponse {
    pub fn hit_blocks(&self) -> usize {
        self.local_blocks + self.remote_blocks
    }
}

/// Loads one rank's share of a lease into the given destination blocks, in prefix order.
#[derive(Clone, Debug)]
pub struct LoadRequest {
    pub lease: LeaseId,
    pub instance: InstanceId,
    pub rank: u32,
    pub dest_blocks: Vec<u32>,
    /// The local prefix lands one layer at a time (one copy batch per layer), for an engine
    /// whose forward waits layer by layer; otherwise as a few long batches, which the copy
    /// path and a save running beside it prefer. Cross-layer KV and a remote suffix land
    /// every layer at once either way.
    pub per_layer: bool,
}

/// How a transfer moved its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TransferPath {
    /// Host pool → device only.
    Local,
    /// A remote suffix read into local pool slots, then host → device.
    Staged,
    /// A remote suffix read straight into the device KV.
    Direct,
    /// Device → host pool.
    Save,
}

impl TransferPath {
    /// The name metrics, logs and load completions use.
    pub fn as_str(self) -> &'static str {
        match self {
            TransferPath::Local => "local",
            TransferPath::Staged => "staged",
            TransferPath::Direct => "direct",
            TransferPath::Save => "save",
        }
    }
}

/// One stage of a transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StageName {
    Plan,
    Pin,
    Register,
    Post,
    Wire,
    H2d,
    D2h,
    Fence,
    /// Time a load waited on SSD reads that its copies did not hide.
    Disk,
}

impl StageName {
    /// The name metrics, logs and load completions use.
    pub fn as_str(self) -> &'static str {
        match self {
            StageName::Plan => "plan",
            StageName::Pin => "pin",
            StageName::Register => "register",
            StageName::Post => "post",
            StageName::Wire => "wire",
            StageName::H2d => "h2d",
            StageName::D2h => "d2h",
            StageName::Fence => "fence",
            StageName::Disk => "disk",
        }
    }
}

macro_rules! named {
    ($t:ty) => {
        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl PartialEq<&str> for $t {
            fn eq(&self, other: &&str) -> bool {
                self.as_str() == *other
            }
        }
    };
}
named!(TransferPath);
named!(StageName);

/// Seconds spent in one stage of a transfer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stage {
    pub name: StageName,
    pub seconds: f64,
}

/// What one transfer did.
#[derive(Clone, Debug, PartialEq)]
pub struct TransferReport {
    pub path: TransferPath,
    pub blocks: usize,
    pub bytes: u64,
    /// Copies after merging adjacent ranges.
    pub copies: usize,
    pub seconds: f64,
    pub stages: Vec<Stage>,
    /// When the transfer's parts ran: `local` (the device batches) and `remote` (a load's
    /// suffix), in seconds since the transfer started. They overlap: the parts run at once.
    pub spans: Vec<Span>,
}

/// One part of a transfer on its timeline (seconds since the transfer started).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Span {
    pub name: &'static str,
    pub start: f64,
    pub end: f64,
}

impl TransferReport {
    pub fn span(&self, name: &str) -> Option<Span> {
        self.spans.iter().find(|s| s.name == name).copied()
    }

    pub fn stage(&self, name: &str) -> Option<f64> {
        self.stages
            .iter()
            .find(|s| s.name.as_str() == name)
            .map(|s| s.seconds)
    }
}

/// Saves one rank's device KV blocks into host blocks.
#[derive(Clone, Debug)]
pub struct SaveRequest {
    pub instance: InstanceId,
    pub rank: u32,
    pub hashes: Vec<BlockHash>,
    pub src_blocks: Vec<u32>,
    /// As [`QueryRequest::tenant`].
    pub tenant: Option<String>,
}

/// Puts one rank's bytes of whole blocks from host memory (clients without a GPU).
#[derive(Clone, Debug)]
pub struct PutBlocks {
    pub instance: InstanceId,
    pub rank: u32,
    /// `(hash, bytes)`; each buffer holds exactly one rank's part of one block.
    pub blocks: Vec<(BlockHash, Vec<u8>)>,
}

/// What a save or put stored.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StoreReport {
    /// Rank parts written now.
    pub written: usize,
    /// Rank parts that were already present.
    pub present: usize,
    /// Blocks sealed by this call (every rank now present).
    pub sealed: usize,
    pub bytes: u64,
    pub seconds: f64,
    /// Blocks at the request's end not stored: no slot left that the request did not hold
    /// itself, or the namespace's quota reached (the blocks before them are stored).
    pub not_stored: usize,
}

/// Gauges and counters an operator asks about.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub leases_live: usize,
    pub leases_expired: u64,
    pub blocks: usize,
    pub sealed_blocks: usize,
    pub pinned_blocks: usize,
    pub pins: u64,
    pub pool_slots: usize,
    pub evictions: u64,
    pub instances: usize,
    pub transfers_in_flight: usize,
    pub loads_ok: u64,
    pub loads_failed: u64,
    pub bytes_loaded: u64,
}
