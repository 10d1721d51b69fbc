//! The node's view of one RDMA NIC, compiled with or without rdma-core: its port address
//! (what Hello and Handshake advertise) and chunk-by-chunk registration of the host pool,
//! split at the configured size. [`open_nic`] opens a real device under the `verbs` feature
//! and answers [`NicOpenError`] otherwise, so the actors wire NICs without knowing how the
//! crate was built, and tests drive the same code with fakes.

use std::any::Any;
use std::io;
use std::os::fd::BorrowedFd;
use std::sync::Arc;

use thiserror::Error;

use super::config::VerbsConfig;
use super::gid::PortAddress;
use super::qp_attrs::QpEndpoint;
use super::registration::{split, Chunk, KeyMap, NicKeys, RegistrationError};
use super::sysfs::Sysfs;
use crate::config::NicConfig;
use crate::connection::{ConnectionError, Connector};
use crate::qp_key::{NodeId, QpKey};
use crate::region::HostRegion;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RegistrarError {
    #[error("nic {nic}: the registration plan was refused")]
    Split {
        nic: String,
        #[source]
        source: RegistrationError,
    },
    #[error("nic {nic}: registering {addr:#x}+{len} failed")]
    Register {
        nic: String,
        addr: u64,
        len: u64,
        #[source]
        source: io::Error,
    },
    #[error("nic {nic}: chunk {addr:#x}+{len} is outside the region")]
    OutsideRegion { nic: String, addr: u64, len: u64 },
    #[error("nic {nic} is not usable: {reason}")]
    Unavailable { nic: String, reason: String },
    #[error(
        "nic {nic}: registering {need} bytes needs RLIMIT_MEMLOCK of at least that, the \
         limit is {limit} (raise `LimitMEMLOCK=` in the unit or `ulimit -l`, or run with \
         CAP_IPC_LOCK)"
    )]
    Memlock { nic: String, need: u64, limit: u64 },
}

impl RegistrarError {
    /// A low-cardinality label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            RegistrarError::Split { .. } => "split",
            RegistrarError::Register { .. } => "nic_refused",
            RegistrarError::OutsideRegion { .. } => "bad_range",
            RegistrarError::Unavailable { .. } => "nic_unavailable",
            RegistrarError::Memlock { .. } => "memlock",
        }
    }
}

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum NicOpenError {
    #[error("nic {nic}: this build has no verbs provider (enable cargo feature `verbs`)")]
    NotCompiled { nic: String },
    #[error("nic {nic} could not be opened: {reason}")]
    Device { nic: String, reason: String },
}

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum AcceptError {
    #[error("nic {nic}: {what} failed: {reason}")]
    Setup {
        nic: String,
        what: &'static str,
        reason: String,
    },
    #[error("nic {nic} cannot serve queue pairs (no rdma-core provider behind it)")]
    Unsupported { nic: String },
}

/// Trades QP endpoints with the peer (over the peer RPC's handshake): ours goes out, theirs
/// and the keys of their registered host pool on the matching NIC come back.
pub trait EndpointExchange: Send + Sync {
    fn exchange(
        &self,
        qp: QpKey,
        local: QpEndpoint,
    ) -> Result<(QpEndpoint, KeyMap), ConnectionError>;
}

/// One NIC memory region of the host pool; dropping it deregisters the chunk.
pub struct ChunkMr {
    pub chunk: Chunk,
    pub keys: NicKeys,
    _hold: Box<dyn Any + Send + Sync>,
}

impl ChunkMr {
    /// `hold` owns the registration (and keeps the memory mapped) until dropped.
    pub fn new(chunk: Chunk, keys: NicKeys, hold: impl Any + Send + Sync) -> Self {
        ChunkMr {
            chunk,
            keys,
            _hold: Box::new(hold),
        }
    }
}

/// A NIC registration of memory for local write only (a GPU plane's DMA-BUF, or host memory
/// standing in for one on the software device); dropping it deregisters the memory.
pub struct LocalMr {
    _hold: Box<dyn Any + Send + Sync>,
}

impl LocalMr {
    /// `hold` owns the registration until dropped.
    pub fn new(hold: impl Any + Send + Sync) -> Self {
        LocalMr {
            _hold: Box::new(hold),
        }
    }
}

impl std::fmt::Debug for LocalMr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalMr").finish_non_exhaustive()
    }
}

impl std::fmt::Debug for ChunkMr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkMr")
            .field("chunk", &self.chunk)
            .field("keys", &self.keys)
            .finish()
    }
}

/// What a NIC's device allows, as the handshake checks a peer's endpoint against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NicLimits {
    pub max_sge: u32,
    pub max_qp_wr: u32,
    pub max_qp_rd_atom: u32,
    pub max_msg_sz: u64,
    pub mtu: super::gid::Mtu,
    /// Entries of the CQ every QP of this NIC reports to (the requested size clamped to the
    /// device's `max_cqe`): completions outstanding across the NIC's QPs must stay below it,
    /// or the CQ overruns.
    pub cq_entries: u32,
}

/// An RDMA NIC as the node uses it.
pub trait RdmaNic: Send + Sync {
    /// The device name (`mlx5_0`), also the `nic` metrics label.
    fn name(&self) -> &str;
    /// The chosen port's address: GID, LID, MTU.
    fn address(&self) -> PortAddress;

    /// The read depth this NIC answers with: the configured depth clamped to the device's
    /// `max_qp_rd_atom`; `None` where the NIC does not know its device.
    fn responder_depth(&self) -> Option<u8> {
        None
    }

    /// The device's limits; `None` where the NIC does not know its device.
    fn limits(&self) -> Option<NicLimits> {
        None
    }

    /// Whether registrations on this NIC pin memory (count against `RLIMIT_MEMLOCK`).
    fn pins_memory(&self) -> bool {
        true
    }

    /// Registers host memory standing in for device memory (local write only): only the
    /// software device does, for tests of direct loads without a GPU.
    fn register_host_local(&self, addr: u64, len: u64) -> Result<LocalMr, RegistrarError> {
        let _ = (addr, len);
        Err(RegistrarError::Unavailable {
            nic: self.name().to_string(),
            reason: "device memory must be registered as a DMA-BUF".into(),
        })
    }
    /// Registers one chunk of `region` for local write and remote read.
    fn register_chunk(
        &self,
        region: &Arc<HostRegion>,
        chunk: Chunk,
    ) -> Result<ChunkMr, RegistrarError>;

    /// Registers device memory exported as a DMA-BUF (`fd`, bytes `offset..offset+len` of it,
    /// addressed at `iova`, the device address) for local write only; dropping the result
    /// deregisters it. NICs without rdma-core behind them cannot.
    fn register_device(
        &self,
        fd: BorrowedFd<'_>,
        offset: u64,
        len: u64,
        iova: u64,
    ) -> Result<LocalMr, RegistrarError> {
        let _ = (fd, offset, len, iova);
        Err(RegistrarError::Unavailable {
            nic: self.name().to_string(),
            reason: "no rdma-core provider behind this nic".into(),
        })
    }

    /// A connector for RC QPs to `peer` on this NIC, trading endpoints through `exchange`;
    /// `None` where there is no rdma-core provider behind the NIC.
    fn connector(
        self: Arc<Self>,
        peer: NodeId,
        exchange: Arc<dyn EndpointExchange>,
    ) -> Option<Arc<dyn Connector>> {
        let _ = (peer, exchange);
        None
    }

    /// Owner side of a connection: a new QP brought to ready-to-send against a requester's
    /// `remote` QP, so the requester can read the pool through it. The QP lives as long as
    /// the returned guard.
    fn accept(
        self: Arc<Self>,
        remote: QpEndpoint,
    ) -> Result<(QpEndpoint, Box<dyn Any + Send + Sync>), AcceptError> {
        let _ = remote;
        Err(AcceptError::Unsupported {
            nic: self.name().to_string(),
        })
    }
}

/// A host region registered on one NIC, as one or more MRs.
#[derive(Debug)]
pub struct NicHostMr {
    nic: String,
    chunks: Vec<ChunkMr>,
}

impl NicHostMr {
    pub fn nic(&self) -> &str {
        &self.nic
    }

    pub fn chunks(&self) -> usize {
        self.chunks.len()
    }

    /// What peers need to read the region through this NIC: each MR's range and keys.
    pub fn advertised(&self) -> Vec<(Chunk, NicKeys)> {
        self.chunks.iter().map(|c| (c.chunk, c.keys)).collect()
    }

    /// The advertised MRs as a key map (how a requester looks rkeys up).
    pub fn key_map(&self) -> Result<KeyMap, RegistrationError> {
        let mut m = KeyMap::new();
        for c in &self.chunks {
            m.insert(c.chunk, c.keys)?;
        }
        Ok(m)
    }
}

/// `Some(limit)` when registering `need` more bytes would exceed `RLIMIT_MEMLOCK` (`limit`
/// bytes, `None` = unlimited) without the privilege to ignore it.
pub fn memlock_shortfall(need: u64, limit: Option<u64>, privileged: bool) -> Option<u64> {
    match limit {
        Some(l) if !privileged && need > l => Some(l),
        _ => None,
    }
}

/// This process's `RLIMIT_MEMLOCK` soft limit (`None`: unlimited or unreadable).
pub fn memlock_limit() -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `r` is a valid out-pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } != 0
        || r.rlim_cur == libc::RLIM_INFINITY
    {
        return None;
    }
    Some(r.rlim_cur)
}

/// `CAP_IPC_LOCK` (linux/capability.h; not in libc).
const CAP_IPC_LOCK: u32 = 14;

/// Whether this process may lock memory beyond its limit (CAP_IPC_LOCK; root has it).
fn may_lock_beyond_limit() -> bool {
    // The effective capability set, from procfs (no capability crate for one bit).
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
}

/// Registers the whole of `region` on `nic`, split into MRs of at most `chunk_size` bytes.
/// All or nothing: on a failure the chunks registered so far are deregistered (dropped).
/// A NIC that pins memory is checked against `RLIMIT_MEMLOCK` first, so a too-small limit is
/// one clear error at start instead of an `ENOMEM` from the kernel part-way.
pub fn register_host_split(
    nic: &dyn RdmaNic,
    region: &Arc<HostRegion>,
    chunk_size: u64,
) -> Result<NicHostMr, RegistrarError> {
    let need = region.len() as u64;
    if nic.pins_memory() {
        if let Some(limit) = memlock_shortfall(need, memlock_limit(), may_lock_beyond_limit()) {
            tracing::warn!(
                nic = nic.name(),
                need,
                limit,
                "verbs: RLIMIT_MEMLOCK too low"
            );
            return Err(RegistrarError::Memlock {
                nic: nic.name().to_string(),
                need,
                limit,
            });
        }
    }
    let plan = split(region.addr(), region.len() as u64, chunk_size).map_err(|source| {
        RegistrarError::Split {
            nic: nic.name().to_string(),
            source,
        }
    })?;
    let mut chunks = Vec::with_capacity(plan.len());
    for c in plan {
        chunks.push(nic.register_chunk(region, c)?);
    }
    Ok(NicHostMr {
        nic: nic.name().to_string(),
        chunks,
    })
}

/// Checks that `chunk` lies inside `region` (what every registrar must do before handing
/// the range to the kernel).
pub fn check_chunk(nic: &str, region: &HostRegion, chunk: Chunk) -> Result<(), RegistrarError> {
    let end = chunk.addr.checked_add(chunk.len);
    let inside = chunk.len > 0
        && chunk.addr >= region.addr()
        && end.is_some_and(|e| e <= region.addr() + region.len() as u64);
    if inside {
        Ok(())
    } else {
        Err(RegistrarError::OutsideRegion {
            nic: nic.to_string(),
            addr: chunk.addr,
            len: chunk.len,
        })
    }
}

/// Whether this build carries the rdma-core provider (the software device is always there).
pub const fn compiled() -> bool {
    cfg!(feature = "verbs")
}

/// Opens the RDMA device `nic.name` (its CQ sized for `qps` QPs) through the verbs table
/// that serves it: the software device for `soft_*` names (every build), rdma-core
/// otherwise (cargo feature `verbs`). A typed error, never a panic, where the build or the
/// host has none.
pub fn open_nic(
    sysfs: &Sysfs,
    nic: NicConfig,
    cfg: VerbsConfig,
    qps: u32,
) -> Result<Arc<dyn RdmaNic>, NicOpenError> {
    let name = nic.name.clone();
    if super::ops::ops_for(&name).is_none() {
        return Err(NicOpenError::NotCompiled { nic: name });
    }
    super::provider::VerbsNic::open(&name, sysfs, nic, cfg, qps)
        .map(|n| n as Arc<dyn RdmaNic>)
        .map_err(|e| {
            tracing::warn!(nic = %name, error = %e, "verbs: opening the nic failed");
            NicOpenError::Device {
                nic: name,
                reason: e.to_string(),
            }
        })
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Mutex;

    use super::*;
    use crate::verbs::gid::{Gid, Mtu};

    struct Fake {
        next: AtomicU32,
        fail_at: Option<u32>,
        live: Arc<Mutex<Vec<u64>>>,
    }

    struct Hold(Arc<Mutex<Vec<u64>>>, u64);
    impl Drop for Hold {
        fn drop(&mut self) {
            self.0.lock().unwrap().retain(|a| *a != self.1);
        }
    }

    impl RdmaNic for Fake {
        fn name(&self) -> &str {
            "fake0"
        }
        fn address(&self) -> PortAddress {
            PortAddress {
                port: 1,
                gid_index: 3,
                gid: Gid([1; 16]),
                lid: 0,
                global: true,
                mtu: Mtu::M4096,
            }
        }
        fn register_chunk(
            &self,
            region: &Arc<HostRegion>,
            chunk: Chunk,
        ) -> Result<ChunkMr, RegistrarError> {
            check_chunk(self.name(), region, chunk)?;
            let n = self.next.fetch_add(1, Ordering::Relaxed);
            if Some(n) == self.fail_at {
                return Err(RegistrarError::Register {
                    nic: self.name().into(),
                    addr: chunk.addr,
                    len: chunk.len,
                    source: io::Error::from_raw_os_error(libc::ENOMEM),
                });
            }
            self.live.lock().unwrap().push(chunk.addr);
            let keys = NicKeys {
                lkey: 100 + n,
                rkey: 200 + n,
            };
            Ok(ChunkMr::new(
                chunk,
                keys,
                Hold(self.live.clone(), chunk.addr),
            ))
        }
    }

    #[test]
    fn splits_at_the_configured_size_all_or_nothing() {
        let region = Arc::new(HostRegion::anonymous(10 * 4096).unwrap());
        let live = Arc::new(Mutex::new(Vec::new()));
        let nic = Fake {
            next: AtomicU32::new(0),
            fail_at: None,
            live: live.clone(),
        };
        let mr = register_host_split(&nic, &region, 4 * 4096).unwrap();
        assert_eq!(mr.chunks(), 3);
        let adv = mr.advertised();
        assert_eq!(adv[0].0.addr, region.addr());
        assert_eq!(adv[2].0.len, 2 * 4096);
        assert_eq!(adv[1].1.rkey, 201);
        let keys = mr.key_map().unwrap();
        assert_eq!(keys.remote_key(region.addr() + 5 * 4096, 100), Ok(201));
        assert_eq!(live.lock().unwrap().len(), 3);
        drop(mr);
        assert!(live.lock().unwrap().is_empty());

        let nic = Fake {
            next: AtomicU32::new(0),
            fail_at: Some(2),
            live: live.clone(),
        };
        let e = register_host_split(&nic, &region, 4 * 4096).unwrap_err();
        assert_eq!(e.kind(), "nic_refused");
        assert!(live.lock().unwrap().is_empty(), "partial work undone");
        let e = register_host_split(&nic, &region, 0).unwrap_err();
        assert_eq!(e.kind(), "split");
    }

    #[test]
    fn memlock_is_checked_before_registering() {
        assert_eq!(
            memlock_shortfall(8 << 30, Some(64 << 10), false),
            Some(64 << 10)
        );
        assert_eq!(memlock_shortfall(8 << 30, Some(64 << 10), true), None);
        assert_eq!(memlock_shortfall(8 << 30, None, false), None);
        assert_eq!(memlock_shortfall(4096, Some(64 << 10), false), None);
        let e = RegistrarError::Memlock {
            nic: "mlx5_0".into(),
            need: 8 << 30,
            limit: 65536,
        };
        assert_eq!(e.kind(), "memlock");
        assert!(e.to_string().contains("LimitMEMLOCK"), "{e}");
    }

    #[test]
    fn chunks_outside_the_region_are_refused() {
        let region = HostRegion::anonymous(4096).unwrap();
        let c = |addr, len| Chunk { addr, len };
        assert!(check_chunk("n", &region, c(region.addr(), 4096)).is_ok());
        for bad in [
            c(region.addr(), 4097),
            c(region.addr() - 1, 10),
            c(region.addr(), 0),
            c(u64::MAX, 2),
        ] {
            assert_eq!(
                check_chunk("n", &region, bad).unwrap_err().kind(),
                "bad_range"
            );
        }
    }

    #[test]
    fn open_without_the_feature_is_typed() {
        if compiled() {
            return;
        }
        let e = open_nic(
            &Sysfs::new("/nonexistent"),
            NicConfig::default(),
            VerbsConfig::default(),
            1,
        )
        .err()
        .unwrap();
        assert!(matches!(e, NicOpenError::NotCompiled { .. }), "{e}");
    }
}
