//! The destination of a load: one registered rank's device KV ([`RankHandle`]), held by
//! every transfer that reads or writes it until the transfer has drained.

use std::sync::{Arc, OnceLock};

use kvferry_gpu::{Device, DeviceSpan, KvLayout, KvShape, Scatter, SpanError};
use tokio::sync::oneshot;

use crate::model::{InstanceId, Namespace};
use crate::peer::link::DeviceDest;
use crate::peer::plane_regs::PlaneRegs;

/// Sends once when dropped: the drain signal of a rank handle.
#[derive(Debug)]
struct DrainSignal(Option<oneshot::Sender<()>>);

impl Drop for DrainSignal {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

/// Memory a registration keeps alive for as long as any transfer may touch it.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Memory {
    /// A client's memfd, a VMM allocation or a CUDA IPC allocation, mapped as device memory.
    Mapped(Arc<kvferry_gpu::DeviceBuffer>),
    /// An imported DMA-BUF.
    DmaBuf(Arc<kvferry_gpu::DmaBuf>),
}

/// One registered rank: what a transfer needs to address its device KV. Transfers hold an
/// `Arc` of it for their whole life.
pub struct RankHandle {
    pub instance: InstanceId,
    pub rank: u32,
    pub namespace: Namespace,
    pub shape: KvShape,
    pub layout: KvLayout,
    pub device: Arc<dyn Device>,
    /// The planes' registrations with verbs NICs, made by the first direct load through
    /// each. Declared before the memory: deregistered before it is let go.
    pub plane_regs: PlaneRegs,
    /// This rank's planes as checked device spans, checked on the device once (a driver query
    /// per plane on CUDA) by the first load that scatters into them.
    planes: OnceLock<Vec<DeviceSpan>>,
    // Declared before the drain signal: fields drop in order, so the memory is released
    // before an unregister waiting on the signal returns.
    _memory: Vec<Memory>,
    _drain: DrainSignal,
}

impl std::fmt::Debug for RankHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankHandle")
            .field("instance", &self.instance)
            .field("rank", &self.rank)
            .field("namespace", &self.namespace)
            .field("memory_regions", &self._memory.len())
            .field("plane_regs", &self.plane_regs)
            .finish()
    }
}

/// What a registration resolved a rank's KV to, for [`RankHandle::new`].
pub struct RankKv {
    pub instance: InstanceId,
    pub rank: u32,
    pub namespace: Namespace,
    pub shape: KvShape,
    pub layout: KvLayout,
    pub device: Arc<dyn Device>,
}

impl DeviceDest for RankHandle {
    fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    fn plane_regs(&self) -> &PlaneRegs {
        &self.plane_regs
    }
}

impl RankHandle {
    /// A handle over `kv` that keeps `memory` alive and sends on `drained` once the last
    /// holder has let it go (after the memory was released).
    pub fn new(kv: RankKv, memory: Vec<Memory>, drained: oneshot::Sender<()>) -> Self {
        Self {
            instance: kv.instance,
            rank: kv.rank,
            namespace: kv.namespace,
            shape: kv.shape,
            layout: kv.layout,
            device: kv.device,
            plane_regs: PlaneRegs::default(),
            planes: OnceLock::new(),
            _memory: memory,
            _drain: DrainSignal(Some(drained)),
        }
    }

    /// This rank's device planes as checked spans, for `Scatter::push_block_into`: checked
    /// once, then shared by every load into this rank (the memory stays mapped while the
    /// handle lives).
    pub fn device_planes(&self) -> Result<&[DeviceSpan], SpanError> {
        if let Some(p) = self.planes.get() {
            return Ok(p);
        }
        let checked = Scatter::new(&self.shape, &self.layout, self.rank)
            .device_planes(self.device.as_ref())?;
        Ok(self.planes.get_or_init(|| checked))
    }
}
