//! The requester's link to one owner: pinning on the owner, and one-sided reads of the
//! owner's host pool into local host memory (staged) or device memory (direct).

use std::fmt;
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use kvferry_gpu::{
    CopyBatch, CopyDirection, CopyList, CopyOp, Device, HostMemory, HostRegistration, HostSpan,
};

use crate::model::{BlockHash, Namespace};
use crate::peer::error::LinkError;
use crate::peer::pin_service::PinService;
use crate::peer::plane_regs::PlaneRegs;
use crate::peer::RemoteError;

/// The futures links and directories return (object-safe traits); the name stays for the
/// many signatures that use it.
pub type BoxFut<T> = BoxFuture<'static, T>;

/// Where a direct read lands: one rank's device memory, valid while this lives, and the
/// rank's registrations of it with the NICs. A read holds it (an `Arc`) until every byte
/// has landed or the read has drained, as a read into host memory holds its [`HostSpan`]'s
/// guard; the load's rank handle is the one implementation.
pub trait DeviceDest: Send + Sync + fmt::Debug {
    /// The device the destination planes are on (direct writes are fenced on it).
    fn device(&self) -> &Arc<dyn Device>;
    /// The planes' registrations with verbs NICs, kept for the rank's life.
    fn plane_regs(&self) -> &PlaneRegs;
}

/// Every op's destination `[dst, dst + len)` lies inside `into`: refused before anything is
/// read where one does not (a local bounds check: no peer is at fault).
pub(crate) fn check_into(into: &HostSpan, ops: &[CopyOp]) -> Result<(), LinkError> {
    for op in ops {
        let off = op.dst.checked_sub(into.addr()).unwrap_or(u64::MAX);
        into.sub(off, op.len)
            .map_err(|e| LinkError::span("remote read", e))?;
    }
    Ok(())
}

/// One pinned block on an owner: where its bytes are in the owner's address space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteBlock {
    pub hash: BlockHash,
    pub addr: u64,
}

/// What an owner answered to a pin request: possibly fewer blocks than asked (blocks that
/// vanished between lookup and pin shorten the hit; they are not an error).
#[derive(Clone, Debug)]
pub struct PinnedRemote {
    pub pin_id: u64,
    pub blocks: Vec<RemoteBlock>,
}

/// What one read batch did, with the time its stages took (seconds).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ReadStats {
    pub bytes: u64,
    /// Making destinations (or the owner's mapping) usable by the provider or device.
    pub register: f64,
    /// Handing the batch to the provider or device.
    pub post: f64,
    /// Until every byte landed.
    pub wire: f64,
}

/// A link to one owner.
pub trait PeerLink: Send + Sync + fmt::Debug {
    fn node_id(&self) -> &str;
    fn provider(&self) -> &'static str;
    /// How many reads the link runs side by side (connections or QPs to the owner): callers
    /// cut a plan's reads into batches of equal size, as many per lane
    /// ([`crate::peer::batches::even_batches`]).
    fn lanes(&self) -> usize {
        1
    }
    /// The owner no longer accepts this link (its data grant was revoked or expired): the
    /// peers make a new one, with a new handshake, for the next plan.
    fn stale(&self) -> bool {
        false
    }
    /// Pins the present prefix of `hashes` on the owner.
    fn pin(&self, ns: Namespace, hashes: Vec<BlockHash>)
        -> BoxFut<Result<PinnedRemote, LinkError>>;
    /// Releases a pin (control: fire and forget).
    fn unpin(&self, pin_id: u64);
    /// Reads `(owner address → local host address, len)` ranges into `into`, which every
    /// destination must lie inside (`check_into`); `into` (its guard: the pool memory and
    /// what pins its slots) lives until every read has landed.
    fn read_host(&self, ops: Vec<CopyOp>, into: HostSpan) -> BoxFut<Result<ReadStats, LinkError>>;
    /// Reads owner ranges straight into `dest`'s device memory (`src` = owner address);
    /// `regions` are the destination planes `(base, len)` (registered for local write where
    /// the provider needs it; a verbs NIC's registrations are made once and kept in the
    /// destination's [`DeviceDest::plane_regs`]); `dest` is held until the device reports
    /// the batch landed.
    fn read_device(
        &self,
        dest: Arc<dyn DeviceDest>,
        list: CopyList,
        regions: Vec<(u64, u64)>,
    ) -> BoxFut<Result<ReadStats, LinkError>>;
    /// [`PeerLink::read_device`] with the NIC each block's read goes through, as the
    /// planner striped them. Links with a single data path (loopback, shm, tcp) have nothing
    /// to choose and ignore it.
    fn read_device_routed(
        &self,
        dest: Arc<dyn DeviceDest>,
        list: CopyList,
        regions: Vec<(u64, u64)>,
        route: Option<crate::nic::ReadRoute>,
    ) -> BoxFut<Result<ReadStats, LinkError>> {
        let _ = route;
        self.read_device(dest, list, regions)
    }
}

/// The control path to an owner: its block store's pins (same process) or its Peer service
/// (another process).
#[derive(Clone, Debug)]
pub enum Control {
    Local(Arc<dyn PinService>),
    Grpc {
        client: crate::peer::client::PeerClient,
        /// The runtime unpins are spawned on (they are fire and forget, often from `Drop`).
        runtime: tokio::runtime::Handle,
    },
}

impl Control {
    pub fn pin(
        &self,
        peer: &str,
        ns: Namespace,
        hashes: Vec<BlockHash>,
    ) -> BoxFut<Result<PinnedRemote, LinkError>> {
        let peer = peer.to_owned();
        match self.clone() {
            Control::Local(owner) => Box::pin(async move {
                owner.pin(ns, hashes).await.map_err(|_| {
                    LinkError::remote(
                        peer,
                        RemoteError::Connect {
                            what: "the owner's block store is gone".into(),
                            source: None,
                        },
                    )
                })
            }),
            Control::Grpc { client, .. } => Box::pin(async move {
                client
                    .pin_blocks(&ns, &hashes)
                    .await
                    .map(|p| p.to_remote())
                    .map_err(|e| LinkError::remote(peer, RemoteError::lost("a pin", e)))
            }),
        }
    }

    pub fn unpin(&self, pin_id: u64) {
        if pin_id == 0 {
            return;
        }
        match self {
            Control::Local(owner) => owner.unpin_detached(pin_id),
            Control::Grpc { client, runtime } => {
                let client = client.clone();
                // An unpin that fails leaves the pin to expire on the owner (its TTL).
                runtime.spawn(async move {
                    let _ = client.unpin(pin_id).await;
                });
            }
        }
    }
}

/// Releases an owner pin when the last holder (the lease or a transfer's share) drops it.
pub struct RemotePin {
    pub link: Arc<dyn PeerLink>,
    pub pin_id: u64,
}

impl Drop for RemotePin {
    fn drop(&mut self) {
        self.link.unpin(self.pin_id);
    }
}

impl fmt::Debug for RemotePin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RemotePin({}@{})", self.pin_id, self.link.node_id())
    }
}

/// What keeps a [`MappedView`]'s memory mapped.
pub enum ViewOwner {
    /// The owner's own pool (in-process loopback).
    Pool(Arc<kvferry_transport::HostRegion>),
    /// A read-only mapping of the owner's memfd (same host).
    Shm(kvferry_transport::shm::ShmMapping),
}

/// An owner pool this process can address: the owner's own mapping (in-process loopback) or
/// a read-only shm mapping of its memfd. Reads are copies out of the view.
pub struct MappedView {
    /// Keeps the mapping alive.
    pub holder: Arc<ViewOwner>,
    pub remote_base: u64,
    pub local_base: u64,
    pub len: u64,
}

impl MappedView {
    /// Where `[addr, addr + len)` of the owner's pool lies in this mapping; a range outside it
    /// is refused (the caller names the owner).
    fn translate(&self, addr: u64, len: u64) -> Result<u64, RemoteError> {
        let off = addr.checked_sub(self.remote_base);
        match off {
            Some(o) if o.checked_add(len).is_some_and(|e| e <= self.len) => Ok(self.local_base + o),
            _ => Err(RemoteError::refused(format!(
                "range {addr:#x}+{len} is outside the owner's pool"
            ))),
        }
    }
}

/// A link whose data path is a mapping (loopback in one process, shm across processes) and
/// whose control path is the owner's block store.
pub struct MappedLink {
    pub node_id: String,
    pub provider: &'static str,
    pub control: Control,
    pub view: Arc<MappedView>,
    /// Device registrations of the view (read-only), made lazily once per device.
    registered: Mutex<Vec<(u32, HostRegistration)>>,
}

impl MappedLink {
    pub fn new(
        node_id: String,
        provider: &'static str,
        control: Control,
        view: MappedView,
    ) -> Self {
        Self {
            node_id,
            provider,
            control,
            view: Arc::new(view),
            registered: Mutex::new(Vec::new()),
        }
    }

    fn register_with(&self, device: &dyn Device) -> Result<(), LinkError> {
        let mut regs = self
            .registered
            .lock()
            .map_err(|_| LinkError::Stopped { what: "link" })?;
        if !regs.iter().any(|(o, _)| *o == device.ordinal()) {
            let r = device.register_host(self.view.local_base, self.view.len, true)?;
            regs.push((device.ordinal(), r));
        }
        Ok(())
    }

    fn remote_err(&self, e: LinkError) -> LinkError {
        match e {
            LinkError::Remote { source, .. } => LinkError::remote(self.node_id.clone(), source),
            other => other,
        }
    }
}

impl fmt::Debug for MappedLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MappedLink")
            .field("node", &self.node_id)
            .field("provider", &self.provider)
            .finish()
    }
}

impl PeerLink for MappedLink {
    fn node_id(&self) -> &str {
        &self.node_id
    }

    fn provider(&self) -> &'static str {
        self.provider
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
        // The owner's ranges as spans of its mapping: a range outside it is the owner's
        // answer at fault; a destination outside `into` is a local bounds check.
        let view = ViewGuard {
            view: Arc::clone(&self.view),
            _dest: None,
        };
        let len = view.view.len;
        let spans = HostSpan::new(Arc::new(view), 0, len)
            .map_err(|e| LinkError::span("remote read", e))
            .and_then(|whole| {
                check_into(&into, &ops)?;
                ops.iter()
                    .map(|op| {
                        let src = self
                            .view
                            .translate(op.src, op.len)
                            .map_err(|e| LinkError::remote(self.node_id.clone(), e))?;
                        let span = |e| LinkError::span("remote read", e);
                        let src = whole
                            .sub(src - self.view.local_base, op.len)
                            .map_err(span)?;
                        let dst = into.sub(op.dst - into.addr(), op.len).map_err(span)?;
                        Ok((src, dst))
                    })
                    .collect::<Result<Vec<_>, LinkError>>()
            })
            .map_err(|e| self.remote_err(e));
        Box::pin(async move {
            let spans = spans?;
            let t = std::time::Instant::now();
            let done = tokio::task::spawn_blocking(move || {
                let mut bytes = 0;
                for (src, dst) in &spans {
                    kvferry_gpu::copy_host(src, dst)
                        .map_err(|e| LinkError::span("remote read", e))?;
                    bytes += src.len();
                }
                // The spans (the owner's mapping, this node's pool and its pins) are let go
                // only here, after the last copy.
                drop(spans);
                drop(into);
                Ok::<_, LinkError>(bytes)
            });
            let bytes = done.await.map_err(|_| LinkError::Stopped {
                what: "remote read thread",
            })??;
            Ok(ReadStats {
                bytes,
                wire: t.elapsed().as_secs_f64(),
                ..Default::default()
            })
        })
    }

    fn read_device(
        &self,
        dest: Arc<dyn DeviceDest>,
        list: CopyList,
        _regions: Vec<(u64, u64)>,
    ) -> BoxFut<Result<ReadStats, LinkError>> {
        let device = Arc::clone(dest.device());
        let t = std::time::Instant::now();
        let registered = self.register_with(device.as_ref());
        let register = t.elapsed().as_secs_f64();
        let prepared = (|| {
            registered?;
            let mut out = CopyList::with_capacity(list.len());
            for op in list.ops() {
                let src = self
                    .view
                    .translate(op.src, op.len)
                    .map_err(|e| LinkError::remote(self.node_id.clone(), e))?;
                out.push(src, op.dst, op.len);
            }
            Ok::<_, LinkError>(out)
        })()
        .map_err(|e| self.remote_err(e));
        let guard = ViewGuard {
            view: Arc::clone(&self.view),
            _dest: Some(dest),
        };
        Box::pin(async move {
            let list = prepared?;
            let t = std::time::Instant::now();
            let len = guard.view.len;
            let host = HostSpan::new(Arc::new(guard), 0, len)
                .map_err(|e| LinkError::span("direct read", e))?;
            let batch = CopyBatch::from_list(CopyDirection::HostToDevice, list, &host)
                .map_err(|e| LinkError::span("direct read", e))?;
            drop(host);
            let ev = batch.submit(device.as_ref(), None)?;
            let post = t.elapsed().as_secs_f64();
            let t = std::time::Instant::now();
            let bytes = ev.await?.bytes;
            Ok(ReadStats {
                bytes,
                register,
                post,
                wire: t.elapsed().as_secs_f64(),
            })
        })
    }
}

/// An owner's mapped pool as the host side of device copies, with their destination, held
/// until they have landed.
struct ViewGuard {
    view: Arc<MappedView>,
    _dest: Option<Arc<dyn DeviceDest>>,
}

// SAFETY: `[local_base, local_base + len)` is the owner's pool as mapped in this process,
// kept mapped by `view.holder` while the guard lives, and a pool is only reached through raw
// pointers. A shm view is mapped read-only: it is only ever a source (the host side of
// host-to-device batches, the `src` of `copy_host`), never written.
unsafe impl HostMemory for ViewGuard {
    fn span(&self) -> (u64, u64) {
        (self.view.local_base, self.view.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sixteen bytes at 0x1000 that nothing ever reads or writes: only the bounds matter.
    struct Bounds;

    // SAFETY: the range is never dereferenced; the test only checks spans against it.
    unsafe impl HostMemory for Bounds {
        fn span(&self) -> (u64, u64) {
            (0x1000, 16)
        }
    }

    #[test]
    fn a_read_landing_outside_its_destination_span_is_refused_before_it_runs() {
        let into = HostSpan::new(Arc::new(Bounds), 0, 16).unwrap();
        let op = |dst, len| CopyOp { src: 0, dst, len };
        assert!(check_into(&into, &[op(0x1000, 16), op(0x1008, 8)]).is_ok());
        for bad in [op(0x1008, 9), op(0xff8, 8), op(u64::MAX, 1)] {
            let e = check_into(&into, &[bad]).unwrap_err();
            assert!(
                matches!(
                    e,
                    LinkError::Span {
                        what: "remote read",
                        ..
                    }
                ),
                "{e:?}"
            );
        }
    }
}
