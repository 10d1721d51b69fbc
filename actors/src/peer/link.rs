//! The requester's link to one owner: pinning on the owner, and one-sided reads of the
//! owner's host pool into local host memory (staged) or device memory (direct).

use std::any::Any;
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

/// What a provider's read keeps alive until it has fully landed (pins, slot guards, memory
/// registrations). Device copies keep theirs in their batch's guard (`ViewGuard` here).
pub type Keep = Box<dyn Any + Send>;

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
    /// Reads `(owner address → local host address, len)` ranges; `keep` lives until done.
    fn read_host(&self, ops: Vec<CopyOp>, keep: Keep) -> BoxFut<Result<ReadStats, LinkError>>;
    /// Reads owner ranges straight into device memory (`src` = owner address); `regions`
    /// are the destination planes `(base, len)` (registered for local write where the
    /// provider needs it; a verbs NIC's registrations are made once and kept in `held`, the
    /// rank's); `keep` lives until the device reports the batch landed.
    fn read_device(
        &self,
        device: Arc<dyn Device>,
        list: CopyList,
        regions: Vec<(u64, u64)>,
        held: &PlaneRegs,
        keep: Keep,
    ) -> BoxFut<Result<ReadStats, LinkError>>;
    /// [`PeerLink::read_device`] with the NIC each block's read goes through, as the
    /// planner striped them. Links with a single data path (loopback, shm, tcp) have nothing
    /// to choose and ignore it.
    fn read_device_routed(
        &self,
        device: Arc<dyn Device>,
        list: CopyList,
        regions: Vec<(u64, u64)>,
        held: &PlaneRegs,
        keep: Keep,
        route: Option<crate::nic::ReadRoute>,
    ) -> BoxFut<Result<ReadStats, LinkError>> {
        let _ = route;
        self.read_device(device, list, regions, held, keep)
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

/// An owner pool this process can address: the owner's own mapping (in-process loopback) or
/// a read-only shm mapping of its memfd. Reads are copies out of the view.
pub struct MappedView {
    /// Keeps the mapping alive.
    pub holder: Arc<dyn Any + Send + Sync>,
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

    fn read_host(&self, ops: Vec<CopyOp>, keep: Keep) -> BoxFut<Result<ReadStats, LinkError>> {
        let translated: Result<Vec<CopyOp>, LinkError> = ops
            .iter()
            .map(|op| {
                Ok(CopyOp {
                    src: self
                        .view
                        .translate(op.src, op.len)
                        .map_err(|e| LinkError::remote(self.node_id.clone(), e))?,
                    ..*op
                })
            })
            .collect();
        let view = Arc::clone(&self.view);
        let translated = translated.map_err(|e| self.remote_err(e));
        Box::pin(async move {
            let ops = translated?;
            let t = std::time::Instant::now();
            let done = tokio::task::spawn_blocking(move || {
                let mut bytes = 0;
                for op in &ops {
                    // SAFETY: the source lies inside the owner's mapping (translated and
                    // bounds-checked above; `view` keeps it mapped); the destination is local
                    // host memory whose owner (`keep`: pool memory and writer pins) outlives
                    // this closure. The two never overlap: one is the peer's pool mapping,
                    // the other this node's pool.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            op.src as usize as *const u8,
                            op.dst as usize as *mut u8,
                            op.len as usize,
                        )
                    };
                    bytes += op.len;
                }
                drop(keep);
                drop(view);
                bytes
            });
            let bytes = done.await.map_err(|_| LinkError::Stopped {
                what: "remote read thread",
            })?;
            Ok(ReadStats {
                bytes,
                wire: t.elapsed().as_secs_f64(),
                ..Default::default()
            })
        })
    }

    fn read_device(
        &self,
        device: Arc<dyn Device>,
        list: CopyList,
        _regions: Vec<(u64, u64)>,
        _held: &PlaneRegs,
        keep: Keep,
    ) -> BoxFut<Result<ReadStats, LinkError>> {
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
            _keep: Mutex::new(keep),
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

/// An owner's mapped pool as the host side of device copies, with what the caller keeps
/// until they have landed (the rank handle of the destinations).
struct ViewGuard {
    view: Arc<MappedView>,
    _keep: Mutex<Keep>,
}

// SAFETY: `[local_base, local_base + len)` is the owner's pool as mapped in this process,
// kept mapped by `view.holder` while the guard lives, and a pool is only reached through raw
// pointers. A shm view is mapped read-only: only host-to-device batches are built over it
// (here), which never write their host side.
unsafe impl HostMemory for ViewGuard {
    fn span(&self) -> (u64, u64) {
        (self.view.local_base, self.view.len)
    }
}
