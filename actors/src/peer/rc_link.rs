//! The RC link: reads go through the transport's RC queue contract, driven by this node's
//! NIC worker. Over tcp (a TCP connection to the owner, which checks key and bounds on every
//! read) or, with a connector of another provider, over verbs (the NIC reads the owner's
//! pool MRs). Host destinations are pool slots registered for local write; device
//! destinations are registered per load (local write only) in the MR table, written through
//! a sink over the device, and, on an RDMA NIC, registered with the NIC as a DMA-BUF so the
//! NIC writes them itself (once per rank and NIC: the rank keeps those, see
//! [`crate::peer::plane_regs`]).

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use actix::Addr;
use kvferry_gpu::{CopyList, CopyOp, HostSpan};
use kvferry_transport::fault::{Fault, FaultyConnector};
use kvferry_transport::tcp::TcpConnector;
use kvferry_transport::verbs::RdmaNic;
use kvferry_transport::{
    CompletionStatus, Connector, DeviceSink, LinkGrant, LocalSegment, MrHandle, MrKey, MrTable,
    NodeId, ReadRequest, RemoteDescriptor,
};
use tokio::sync::oneshot;

use crate::model::{BlockHash, Namespace};
use crate::nic::worker::{Connect, FailureKind, NicWorker, PostReads};
use crate::peer::batches::{even_batches, even_reads};
use crate::peer::bounce::{BounceSink, RingPool};
use crate::peer::error::LinkError;
use crate::peer::error::RemoteError;
use crate::peer::link::{
    check_into, BoxFut, Control, DeviceDest, PeerLink, PinnedRemote, ReadStats,
};
use crate::peer::plane_regs::{NicPlane, PlaneRegistration};

/// `cluster.data-lanes` by default: how many connections a link opens to each owner (what a
/// tcp NIC's `qps-per-peer` has always been).
pub const DEFAULT_DATA_LANES: u32 = 2;
/// Most `cluster.data-lanes`: each lane is a connection and a thread on both sides.
pub const MAX_DATA_LANES: u32 = 16;

/// Most bytes of one direct read where its pieces allow: one bounce slot, which a read then
/// fills at once.
const DIRECT_READ_BYTES: u64 = crate::peer::bounce::SLOT_BYTES as u64;

/// Most reads per batch of a direct load (a read is a block's rank part, or an equal share of
/// a run of adjacent blocks): the staged path's chunk, for the same spread over QPs.
const DIRECT_BATCH: usize = crate::peer::batches::STAGED_CHUNK;

/// A link to one owner through the transport's RC queue contract on one local NIC: a tcp
/// connection per lane, or (with a verbs connector) RC QPs on an RDMA NIC.
pub struct RcLink {
    node_id: String,
    control: Control,
    rkey: MrKey,
    local: NodeId,
    peer: NodeId,
    addr: std::net::SocketAddr,
    worker: Addr<NicWorker>,
    table: MrTable,
    pool_lkey: MrKey,
    max_sge: usize,
    qps: usize,
    faults: Vec<Fault>,
    connector: Option<Arc<dyn Connector>>,
    rdma: Option<Arc<dyn RdmaNic>>,
    grant: Option<LinkGrant>,
    connected: Arc<AtomicBool>,
    /// The owner refused this link's grant (revoked or expired): a new handshake is needed.
    refused: Arc<AtomicBool>,
    next_wr: AtomicU64,
    /// Pinned bounce rings for reads into device memory, kept for later loads.
    rings: RingPool,
}

impl std::fmt::Debug for RcLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RcLink")
            .field("node", &self.node_id)
            .field("addr", &self.addr)
            .finish()
    }
}

/// Where an RC link reaches its owner and how it addresses local memory.
pub struct RcEndpoints {
    pub control: Control,
    pub rkey: MrKey,
    pub local: NodeId,
    pub peer: NodeId,
    pub addr: std::net::SocketAddr,
    pub worker: Addr<NicWorker>,
    pub table: MrTable,
    pub pool_lkey: MrKey,
    pub max_sge: usize,
    /// QPs (connections over tcp) the NIC opens to each peer: reads run on that many lanes.
    pub qps: usize,
    /// Faults injected into this link's connection (tests: the transport fault matrix end
    /// to end); empty in service.
    pub faults: Vec<Fault>,
    /// Another provider's connector (verbs) instead of a tcp connection to `addr`.
    pub connector: Option<Arc<dyn Connector>>,
    /// Verbs: the NIC device destinations are registered with (DMA-BUF, local write).
    pub rdma: Option<Arc<dyn RdmaNic>>,
    /// tcp: the data link the owner's Handshake authorised; without one a tcp connection
    /// is refused by the owner.
    pub grant: Option<LinkGrant>,
}

impl RcLink {
    pub fn new(node_id: String, e: RcEndpoints) -> Self {
        Self {
            node_id,
            control: e.control,
            rkey: e.rkey,
            local: e.local,
            peer: e.peer,
            addr: e.addr,
            worker: e.worker,
            table: e.table,
            pool_lkey: e.pool_lkey,
            max_sge: e.max_sge.max(1),
            qps: e.qps.max(1),
            faults: e.faults,
            connector: e.connector,
            rdma: e.rdma,
            grant: e.grant,
            connected: Arc::new(AtomicBool::new(false)),
            refused: Arc::new(AtomicBool::new(false)),
            next_wr: AtomicU64::new(1),
            rings: RingPool::default(),
        }
    }

    fn err(&self, e: RemoteError) -> LinkError {
        LinkError::remote(self.node_id.clone(), e)
    }

    fn wr(&self) -> u64 {
        self.next_wr.fetch_add(1, Ordering::Relaxed)
    }

    /// Posts `batches` (each an ordered batch of reads; the worker puts each on the least
    /// busy QP, so several run side by side) and waits until every request was reported
    /// (successful, failed or flushed): nothing they touch is released before that. With
    /// `drain`, also waits for the device copies of what they received, before `keep` (the
    /// destinations' guards) is let go.
    fn post(
        &self,
        batches: Vec<Vec<ReadRequest>>,
        keep: Held,
        register: f64,
        drain: Option<Arc<BounceSink>>,
    ) -> BoxFut<Result<ReadStats, LinkError>> {
        let worker = self.worker.clone();
        let (peer, local, addr) = (self.peer, self.local, self.addr);
        let connected = Arc::clone(&self.connected);
        let refused = Arc::clone(&self.refused);
        let name = self.node_id.clone();
        let faults = self.faults.clone();
        let given = self.connector.clone();
        let grant = self.grant.clone();
        Box::pin(async move {
            let err = |e: RemoteError| LinkError::remote(name.clone(), e);
            let stopped = || LinkError::Stopped { what: "nic worker" };
            if !connected.load(Ordering::Acquire) {
                let base: Arc<dyn Connector> = match (given, grant) {
                    (Some(c), _) => c,
                    (None, Some(g)) => Arc::new(TcpConnector::new(local, peer, addr, g)),
                    (None, None) => {
                        return Err(err(RemoteError::no_path(
                            "the owner authorised no tcp data link",
                        )))
                    }
                };
                let connector: Arc<dyn Connector> = if faults.is_empty() {
                    base
                } else {
                    let faulty = FaultyConnector::new(base, peer);
                    for f in faults {
                        faulty.inject(f);
                    }
                    Arc::new(faulty)
                };
                worker
                    .send(Connect {
                        peer,
                        connector,
                        qps: None,
                    })
                    .await
                    .map_err(|_| stopped())?
                    .map_err(|e| {
                        if unauthorized(&e) {
                            refused.store(true, Ordering::Release);
                        }
                        err(RemoteError::connect("the data connection", e))
                    })?;
                connected.store(true, Ordering::Release);
            }
            let t = std::time::Instant::now();
            // All batches go to the worker at once (in order: each send is queued on its
            // first poll); a batch the worker never got answers as stopped below.
            let (sends, replies): (Vec<_>, Vec<_>) = batches
                .into_iter()
                .map(|reads| {
                    let (tx, rx) = oneshot::channel();
                    let send = worker.send(PostReads {
                        peer,
                        reads,
                        reply: tx,
                    });
                    (send, rx)
                })
                .unzip();
            futures::future::join_all(sends).await;
            let post = t.elapsed().as_secs_f64();
            let t = std::time::Instant::now();
            let mut done = Vec::with_capacity(replies.len());
            for rx in replies {
                done.push(rx.await.map_err(|_| stopped()));
            }
            // Received device bytes may still be on their way from the bounce ring: they
            // land before the destinations are let go, whatever became of the reads.
            let drained = match drain {
                Some(sink) => tokio::task::spawn_blocking(move || sink.drain())
                    .await
                    .map_err(|_| stopped())?
                    .map_err(|e| {
                        err(RemoteError::local(
                            "copying received bytes to the device",
                            e,
                        ))
                    }),
                None => Ok(()),
            };
            let wire = t.elapsed().as_secs_f64();
            drop(keep);
            // The worker says what kind of failure it was; each reaches the caller as such.
            // Of several failed batches, the one that says most: a refusal or a local failure
            // can flush the reads queued behind it, which then report a broken link.
            let rank = |k: &FailureKind| match k {
                FailureKind::Remote => 0,
                FailureKind::Local => 1,
                FailureKind::Connection => 2,
                _ => 3,
            };
            let mut wcs = Vec::new();
            let mut failed = None;
            for d in done {
                match d? {
                    Ok(w) => wcs.extend(w),
                    Err(e) => {
                        if failed
                            .as_ref()
                            .is_none_or(|f: &crate::nic::worker::WorkerError| {
                                rank(&e.kind()) < rank(&f.kind())
                            })
                        {
                            failed = Some(e);
                        }
                    }
                }
            }
            if let Some(e) = failed {
                // A rebuilt connection the owner refused: the link's grant is gone.
                if unauthorized(&e) {
                    refused.store(true, Ordering::Release);
                }
                return Err(match e.kind() {
                    FailureKind::Connection => err(RemoteError::lost("a read", e)),
                    FailureKind::Local => err(RemoteError::local("posting the reads", e)),
                    FailureKind::Remote => err(RemoteError::refused(format!(
                        "the owner refused a read: {e}"
                    ))),
                    _ => stopped(),
                });
            }
            drained?;
            // A flushed read only reports that another one failed first: name that one.
            let bad = wcs
                .iter()
                .find(|wc| {
                    wc.status != CompletionStatus::Success && wc.status != CompletionStatus::Flushed
                })
                .or_else(|| wcs.iter().find(|wc| wc.status != CompletionStatus::Success));
            if let Some(wc) = bad {
                let what = format!("read {} completed with {}", wc.wr_id, wc.status);
                return Err(err(match FailureKind::of_status(wc.status) {
                    FailureKind::Remote => {
                        RemoteError::refused(format!("the owner refused it: {what}"))
                    }
                    FailureKind::Local => RemoteError::local("a read", what),
                    _ => RemoteError::lost("a read", what),
                }));
            }
            Ok(ReadStats {
                bytes: wcs.iter().map(|wc| wc.bytes).sum(),
                register,
                post,
                wire,
            })
        })
    }
}

/// What a batch of reads writes into, held until every request was reported (and, for a
/// device destination, its received bytes copied): the host span of a staged read, or a
/// direct read's destination with its memory-table handles and NIC registrations (fields
/// drop in order: the table's handles before the NICs').
enum Held {
    Host {
        _into: HostSpan,
    },
    Device {
        _dest: Arc<dyn DeviceDest>,
        _mrs: Vec<MrHandle>,
        _nic_mrs: Vec<PlaneRegistration>,
    },
}

impl PeerLink for RcLink {
    fn node_id(&self) -> &str {
        &self.node_id
    }

    fn provider(&self) -> &'static str {
        if self.rdma.is_some() {
            "verbs"
        } else {
            "tcp"
        }
    }

    fn lanes(&self) -> usize {
        self.qps
    }

    fn stale(&self) -> bool {
        self.refused.load(Ordering::Acquire)
    }

    fn pin(
        &self,
        ns: Namespace,
        hashes: Vec<BlockHash>,
    ) -> BoxFut<Result<PinnedRemote, LinkError>> {
        self.control.pin(&self.node_id, ns, hashes)
    }

    fn unpin(&self, pin_id: u64) {
        self.control.unpin(pin_id);
    }

    fn read_host(&self, ops: Vec<CopyOp>, into: HostSpan) -> BoxFut<Result<ReadStats, LinkError>> {
        if let Err(e) = check_into(&into, &ops) {
            return Box::pin(async move { Err(e) });
        }
        let reads = ops
            .iter()
            .map(|op| ReadRequest {
                wr_id: self.wr(),
                remote: RemoteDescriptor {
                    addr: op.src,
                    len: op.len,
                    rkey: self.rkey,
                },
                local: vec![LocalSegment {
                    lkey: self.pool_lkey,
                    addr: op.dst,
                    len: op.len,
                }],
            })
            .collect();
        self.post(vec![reads], Held::Host { _into: into }, 0.0, None)
    }

    fn read_device(
        &self,
        dest: Arc<dyn DeviceDest>,
        list: CopyList,
        regions: Vec<(u64, u64)>,
    ) -> BoxFut<Result<ReadStats, LinkError>> {
        let device = Arc::clone(dest.device());
        let held = dest.plane_regs();
        let t = std::time::Instant::now();
        // Register the destination planes for local write for this load only; the handles
        // live until the batch has drained, then deregistration completes.
        // Received device pieces go through a pinned bounce ring as async copy batches.
        let bounce = match BounceSink::new(Arc::clone(&device), Arc::clone(&self.rings)) {
            Ok(s) => Arc::new(s),
            Err(e) => {
                let e = self.err(RemoteError::local("pinning the bounce ring", e));
                return Box::pin(async move { Err(e) });
            }
        };
        let sink: Arc<dyn DeviceSink> = bounce.clone();
        let mut mrs = Vec::with_capacity(regions.len());
        // On an RDMA NIC the planes are registered with the NIC too (as DMA-BUFs), or the
        // read fails: a direct load is never staged. The rank keeps them for later loads;
        // this one holds its own reference until its reads have drained.
        let mut nic_mrs: Vec<PlaneRegistration> = Vec::new();
        if let Some(nic) = &self.rdma {
            for (base, len) in &regions {
                let register = || -> Result<PlaneRegistration, String> {
                    match device.export_dmabuf(*base, *len) {
                        Ok(buf) => {
                            let offset = buf.offset_of(*base, *len).ok_or_else(|| {
                                format!("plane {base:#x}+{len} is outside its DMA-BUF")
                            })?;
                            let r = nic
                                .register_device(buf.fd(), offset, *len, *base)
                                .map_err(|e| e.to_string())?;
                            Ok(Arc::new(NicPlane::DmaBuf { mr: r, buf }))
                        }
                        // Host memory standing in for a GPU (the software verbs device
                        // only; a real NIC refuses and the load fails as before).
                        Err(e) => nic
                            .register_host_local(*base, *len)
                            .map(|r| Arc::new(NicPlane::StandIn(r)))
                            .map_err(|h| format!("{e}; {h}")),
                    }
                };
                match held.get_or_register(nic.name(), *base, *len, register) {
                    Ok(r) => nic_mrs.push(r),
                    Err(reason) => {
                        let e = self.err(RemoteError::local(
                            format!("registering device memory on nic {}", nic.name()),
                            reason,
                        ));
                        return Box::pin(async move { Err(e) });
                    }
                }
            }
        }
        for (base, len) in &regions {
            match self.table.register_device(*base, *len, Arc::clone(&sink)) {
                Ok(h) => mrs.push(h),
                Err(e) => {
                    let e = self.err(RemoteError::local("registering device memory", e));
                    return Box::pin(async move { Err(e) });
                }
            }
        }
        let mut keys = PlaneKeys::new(mrs.iter().map(|h| (h.addr(), h.len(), h.key())));
        // Runs of source-contiguous ops (a block's rank part, or several where the owner's
        // blocks are adjacent), each read as equal reads of at most `max_sge` pieces and a
        // bounce slot's bytes. The pieces and their sizes are laid out once, flat; a run is
        // its owner address and its range of pieces.
        let mut pieces: Vec<LocalSegment> = Vec::with_capacity(list.len());
        let mut sizes: Vec<u64> = Vec::with_capacity(list.len());
        let mut runs: Vec<(u64, Range<usize>)> = Vec::new();
        let mut run_end: Option<u64> = None;
        for op in list.ops() {
            let Some(key) = keys.key(op.dst, op.len) else {
                let e = self.err(RemoteError::Local {
                    what: format!(
                        "destination {:#x}+{} is not in a registered plane",
                        op.dst, op.len
                    ),
                    source: None,
                });
                return Box::pin(async move { Err(e) });
            };
            let at = pieces.len();
            match runs.last_mut() {
                Some((_, run)) if run_end == Some(op.src) => run.end = at + 1,
                _ => runs.push((op.src, at..at + 1)),
            }
            run_end = Some(op.src.saturating_add(op.len));
            pieces.push(LocalSegment {
                lkey: key,
                addr: op.dst,
                len: op.len,
            });
            sizes.push(op.len);
        }
        // A load that is one run (one block, or adjacent ones) is cut into a read per lane at
        // least, so a one-block load runs on every connection, not on one; several runs are
        // already spread over the lanes by the batches below.
        let min_reads = if runs.len() == 1 { self.qps } else { 1 };
        let mut reads: Vec<ReadRequest> = Vec::new();
        for (src, run) in runs {
            let cuts = even_reads(
                &sizes[run.clone()],
                self.qps,
                self.max_sge,
                DIRECT_READ_BYTES,
                min_reads,
            );
            let mut addr = src;
            for cut in cuts {
                let at = run.start + cut.start..run.start + cut.end;
                let len = sizes[at.clone()].iter().sum();
                reads.push(ReadRequest {
                    wr_id: self.wr(),
                    remote: RemoteDescriptor {
                        addr,
                        len,
                        rkey: self.rkey,
                    },
                    local: pieces[at].to_vec(),
                });
                addr = addr.saturating_add(len);
            }
        }
        // Batches of a few blocks each, so that a large load runs on every QP of the link
        // (one connection and receive thread each over tcp) as a staged load does with its
        // chunks; a single batch kept a direct load on one connection, at about half the
        // rate of a staged one. Equal batches, as many per QP: every QP carries the same
        // share to the end.
        let batches: Vec<Vec<ReadRequest>> = {
            let cuts = even_batches(reads.len(), self.qps, DIRECT_BATCH);
            let mut it = reads.into_iter();
            cuts.iter()
                .map(|r| it.by_ref().take(r.len()).collect())
                .collect()
        };
        // The NIC registrations drop after the table's (the batch has drained by then).
        self.post(
            batches,
            Held::Device {
                _dest: dest,
                _mrs: mrs,
                _nic_mrs: nic_mrs,
            },
            t.elapsed().as_secs_f64(),
            Some(bounce),
        )
    }
}

/// Whether `e` (or what caused it) is the owner refusing this link's grant.
fn unauthorized(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut at = Some(e);
    while let Some(e) = at {
        if matches!(
            e.downcast_ref::<kvferry_transport::ConnectionError>(),
            Some(kvferry_transport::ConnectionError::Unauthorized { .. })
        ) {
            return true;
        }
        at = e.source();
    }
    false
}

/// The key of the registered plane that holds each destination piece of a direct load. The
/// pieces come plane after plane (layer by layer, K then V, block after block), so the plane
/// after the last one that held a piece, or that one again, nearly always holds the next:
/// one or two looks per piece. A scan of every plane for every piece made the cut cost
/// pieces x planes (13 million comparisons for 1,024 blocks of an 80-layer model).
struct PlaneKeys {
    /// `(base, len, key)` of each plane, in the layout's order.
    planes: Vec<(u64, u64, MrKey)>,
    last: usize,
}

impl PlaneKeys {
    fn new(planes: impl IntoIterator<Item = (u64, u64, MrKey)>) -> Self {
        Self {
            planes: planes.into_iter().collect(),
            last: 0,
        }
    }

    fn key(&mut self, dst: u64, len: u64) -> Option<MrKey> {
        let n = self.planes.len();
        let holds = |&(base, plen, _): &(u64, u64, MrKey)| {
            dst >= base && dst.saturating_add(len) <= base.saturating_add(plen)
        };
        let at = [(self.last + 1) % n.max(1), self.last]
            .into_iter()
            .find(|&i| self.planes.get(i).is_some_and(holds))
            .or_else(|| self.planes.iter().position(holds))?;
        self.last = at;
        Some(self.planes[at].2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plane_keys_find_the_holding_plane_in_any_order() {
        // Four planes of 1 MiB, the last two overlapping (a K/V pair sharing an allocation).
        let mib = 1u64 << 20;
        let planes = vec![
            (0x1000_0000, mib, MrKey(1)),
            (0x2000_0000, mib, MrKey(2)),
            (0x3000_0000, 2 * mib, MrKey(3)),
            (0x3000_0000 + mib, mib, MrKey(4)),
        ];
        let mut k = PlaneKeys::new(planes.clone());
        // In layout order, block after block (wrapping from the last plane to the first).
        for block in 0..3u64 {
            for (i, (base, _, key)) in planes.iter().enumerate().take(3) {
                assert_eq!(k.key(base + block * 4096, 4096), Some(*key), "plane {i}");
            }
        }
        // Out of order, and a piece only the wider of two overlapping planes holds.
        assert_eq!(k.key(0x2000_0000 + 100, 10), Some(MrKey(2)));
        assert_eq!(k.key(0x3000_0000, 4096), Some(MrKey(3)));
        assert_eq!(k.key(0x1000_0000 + mib - 16, 16), Some(MrKey(1)));
        // Any plane that holds it will do; one that holds only part of it will not.
        assert!(matches!(
            k.key(0x3000_0000 + mib + 8, 8),
            Some(MrKey(3 | 4))
        ));
        assert_eq!(k.key(0x1000_0000 + mib - 16, 32), None);
        assert_eq!(k.key(0x0fff_ffff, 2), None);
        assert_eq!(k.key(u64::MAX - 1, 4), None);
        assert_eq!(PlaneKeys::new(Vec::new()).key(0x1000_0000, 1), None);
    }
}
