//! [`CudaDevice`]: one GPU through the driver API, with a dedicated stream and completion
//! thread per copy direction.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::fmt;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUdevice_attribute as Attr;

use crate::device::Release;
use crate::{
    CopyDirection, CopyDone, CopyEvent, CopyList, CopyStats, Device, DeviceBuffer, DeviceCaps,
    DeviceError, DeviceKind, DmaBuf, HostRegistration, Landed,
};

use super::error::CudaError;
use super::ffi;
use super::kernel::{Desc, GatherKernel};
use super::plan::{plan, CopyPath, HostMap, Paths, Plan, Resolver, Staged, ENGINE_MAX_OPS};
use super::shared;
use super::vmm::{self, VmmMap};

/// How a [`CudaDevice`] issues copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct CudaOptions {
    pub copy_path: CopyPath,
    /// Bytes of one staging chunk of the staged path (rounded down to 256, at least 4 KiB);
    /// 0 turns the staged path off.
    pub staging_chunk_bytes: u64,
    /// Staging chunks per direction (at least 2): while one is scattered on the device, the
    /// copy engines fill the next.
    pub staging_chunks: u32,
    /// How long a lane's completion thread polls a batch's event before sleeping on it
    /// (zero: sleep at once). Polling notices the end of a copy tens of microseconds
    /// sooner, which is most of a small load's cost; it keeps a core busy (yielding) for
    /// at most this long per batch.
    pub completion_spin: Duration,
}

/// Default completion polling: 5 ms covers every batch of up to about 256 MiB (a
/// 128-block load of 28 layers at 64 KiB), the sizes where tens of microseconds count.
pub const DEFAULT_COMPLETION_SPIN: Duration = Duration::from_millis(5);

/// Default staging: two 32 MiB chunks per direction, allocated on the first fragmented
/// batch. A chunk takes the copy engines ~0.6 ms at PCIe 5 speed and its scatter ~30 us,
/// so two keep the engines busy and the last scatter adds little.
pub const DEFAULT_STAGING_CHUNK_BYTES: u64 = 32 << 20;
pub const DEFAULT_STAGING_CHUNKS: u32 = 2;

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            copy_path: CopyPath::Auto,
            staging_chunk_bytes: DEFAULT_STAGING_CHUNK_BYTES,
            staging_chunks: DEFAULT_STAGING_CHUNKS,
            completion_spin: DEFAULT_COMPLETION_SPIN,
        }
    }
}

impl CudaOptions {
    pub fn with_copy_path(copy_path: CopyPath) -> Self {
        Self {
            copy_path,
            ..Self::default()
        }
    }

    /// Staging of `chunks` chunks of `chunk_bytes` each (see the fields).
    pub fn with_staging(mut self, chunk_bytes: u64, chunks: u32) -> Self {
        self.staging_chunk_bytes = chunk_bytes;
        self.staging_chunks = chunks;
        self
    }

    /// The chunk size in use, 0 where staging is off.
    fn stage_chunk(&self) -> u64 {
        match self.staging_chunk_bytes {
            0 => 0,
            n => (n & !255).max(4096),
        }
    }
}

/// A CUDA IPC handle of one allocation and the offset of the exported address inside it: what
/// an engine worker sends so that kvferry can map its KV tensors ([`Device::import_ipc`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcHandle {
    pub bytes: [u8; 64],
    pub offset: u64,
}

/// A POSIX fd of a VMM allocation of this process (the exporting side of
/// [`Device::import_vmm_fd`]): the allocation's mapping is `[base, base + len)` here, and the
/// address asked about lies `offset` bytes into it. An importer maps all `len` bytes.
#[derive(Debug)]
pub struct VmmExport {
    pub fd: OwnedFd,
    pub base: u64,
    pub len: u64,
    pub offset: u64,
}

/// One NVIDIA GPU. Copies run on two non-blocking streams (host→device and device→host); a
/// thread per stream waits on each batch's event and completes its [`CopyEvent`], so no
/// caller ever blocks on the GPU. Large batches are planned and queued by a second thread per
/// stream, so no caller's thread spends long in a submission either.
pub struct CudaDevice {
    inner: Arc<Inner>,
    lanes: [Lane; 2],
}

/// Batches of at least this many ranges are planned and queued on the lane's submit thread
/// rather than the caller's. Planning costs about 0.1 us per range on the H200's host (a
/// 2,048-range save batch took its thread 0.23 ms, a 256-block load's 4,800-range layer
/// batch about 0.5 ms), time in which an actor thread shared by the keeper, the store and
/// the load transfers serves nobody: a save issued beside a 256-block load waited 1.3 ms
/// for the store. Smaller batches (a load of up to 16 blocks) stay on the caller's thread,
/// where they start without waking another.
pub const DEFER_MIN_OPS: usize = 1024;

struct Lane {
    /// Held while a batch is queued on the stream or handed to the submit thread: batches
    /// reach the stream in submission order.
    order: Arc<Mutex<LaneOrder>>,
    thread: Option<JoinHandle<()>>,
    submitter: Option<JoinHandle<()>>,
}

/// A lane's stream order: the completion thread's queue, the submit thread's queue, and the
/// batches handed to the submit thread but not yet queued (while there are any, later batches
/// follow them there).
struct LaneOrder {
    tx: Option<mpsc::Sender<Pending>>,
    jobs: Option<mpsc::Sender<Job>>,
    deferred: usize,
}

/// A batch for the submit thread.
struct Job {
    dir: CopyDirection,
    list: CopyList,
    done: CopyDone,
    submitted: Instant,
}

fn lock_order(order: &Mutex<LaneOrder>) -> MutexGuard<'_, LaneOrder> {
    // The guarded data is a queue handle and a count that stay consistent at every step.
    order
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Everything that must outlive the device handle while buffers, registrations or in-flight
/// batches still use it; dropped (streams destroyed, context released) with the last of them.
struct Inner {
    ordinal: u32,
    ctx: ffi::CUcontext,
    dev: ffi::CUdevice,
    name: String,
    sm_count: u32,
    caps: DeviceCaps,
    options: CudaOptions,
    kernel: Option<GatherKernel>,
    streams: Vec<ffi::CUstream>,
    events: Mutex<Vec<ffi::CUevent>>,
    descs: Mutex<Vec<PinnedDescs>>,
    /// Registered host spans: start → mapping.
    hosts: RwLock<BTreeMap<u64, HostMap>>,
    /// VMM mappings this device made (imported or allocated): start → end. Checked before
    /// the driver's pointer attributes, whose allocation range is not the mapping's.
    vmms: RwLock<BTreeMap<u64, u64>>,
    /// Errors of teardown (frees, unregistrations) that had no caller to return them to.
    teardown: Mutex<Vec<DeviceError>>,
    /// Staging buffers per lane, allocated on the lane's first fragmented batch. Only used
    /// under the lane's sender lock, so batches of one lane never share them concurrently.
    staging: [Mutex<Option<Staging>>; 2],
    staged_batches: AtomicU64,
}

/// A lane's staging chunks and the stream on which the device side of the staged path runs
/// (the scatter for H2D, the gather for D2H); the lane's own stream drives the copy engines.
///
/// Ordering, per chunk `i` in buffer `b = i % n`: the filling stream waits `free[b]`, fills
/// and records `filled[b]`; the draining stream waits `filled[b]`, drains and records
/// `free[b]`. `entry` (lane → aux, host→device batches) orders a batch's scatters after
/// what the lane queued before it; `join` (aux → lane) makes the batch's completion event,
/// recorded on the lane stream, come after the last scatter or gather.
struct Staging {
    aux: ffi::CUstream,
    bufs: Vec<u64>,
    filled: Vec<ffi::CUevent>,
    free: Vec<ffi::CUevent>,
    entry: ffi::CUevent,
    join: ffi::CUevent,
}

impl Staging {
    fn empty() -> Self {
        Self {
            aux: std::ptr::null_mut(),
            bufs: Vec::new(),
            filled: Vec::new(),
            free: Vec::new(),
            entry: std::ptr::null_mut(),
            join: std::ptr::null_mut(),
        }
    }

    /// Allocates `n` chunks of `chunk` bytes, their events and the aux stream in the bound
    /// context; on failure frees what it made.
    fn create(inner: &Inner, chunk: u64, n: u32) -> Result<Self, DeviceError> {
        let mut st = Self::empty();
        let r = (|| {
            st.aux = ffi::stream_create().map_err(|e| inner.driver("cuStreamCreate", e))?;
            let ev = || ffi::event_create(false).map_err(|e| inner.driver("cuEventCreate", e));
            st.entry = ev()?;
            st.join = ev()?;
            for _ in 0..n.max(2) {
                let size = usize::try_from(chunk).unwrap_or(usize::MAX);
                let p = ffi::mem_alloc(size).map_err(|e| DeviceError::Alloc {
                    ordinal: inner.ordinal,
                    bytes: chunk,
                    reason: format!("staging buffer: {e}"),
                })?;
                st.bufs.push(p);
                st.filled.push(ev()?);
                st.free.push(ev()?);
            }
            Ok(())
        })();
        match r {
            Ok(()) => Ok(st),
            Err(e) => {
                st.destroy();
                Err(e)
            }
        }
    }

    /// Waits for the aux stream and frees everything; best-effort (teardown or a failed
    /// create). The context is bound and the lane stream holds no work on these buffers.
    fn destroy(&mut self) {
        // SAFETY: every handle is ours and created in the bound context; null ones were never
        // created. The aux stream is drained first, so no queued work uses the buffers or
        // events when they go.
        unsafe {
            if !self.aux.is_null() {
                let _ = ffi::stream_synchronize(self.aux);
                let _ = ffi::stream_destroy(self.aux);
            }
            for e in [self.entry, self.join]
                .into_iter()
                .chain(self.filled.drain(..))
                .chain(self.free.drain(..))
            {
                if !e.is_null() {
                    let _ = ffi::event_destroy(e);
                }
            }
            for p in self.bufs.drain(..) {
                let _ = ffi::mem_free(p);
            }
        }
        self.aux = std::ptr::null_mut();
        self.entry = std::ptr::null_mut();
        self.join = std::ptr::null_mut();
    }
}

// SAFETY: the raw handles (context, streams, events, module) are driver objects usable from
// any thread once the context is bound there, which every entry point does first (`bind`);
// the mutable collections are behind locks; streams are only enqueued under the lane lock.
unsafe impl Send for Inner {}
// SAFETY: as above; shared access only reads the handles or goes through the locks.
unsafe impl Sync for Inner {}

/// A pinned, device-mapped array of kernel descriptors, reused across batches.
struct PinnedDescs {
    host: *mut Desc,
    cap: usize,
    device: u64,
}

// SAFETY: plain pinned memory owned by exactly one batch (or the pool) at a time; moving it
// between the submitting thread and the lane thread is the hand-over.
unsafe impl Send for PinnedDescs {}

struct Pending {
    event: Option<ffi::CUevent>,
    done: CopyDone,
    submitted: Instant,
    bytes: u64,
    ops: usize,
    descs: Option<PinnedDescs>,
    error: Option<DeviceError>,
}

// SAFETY: the event handle is handed from the submitting thread to the lane thread, which is
// then its only user; driver handles are valid from any thread of the bound context.
unsafe impl Send for Pending {}

fn lane_index(dir: CopyDirection) -> usize {
    match dir {
        CopyDirection::HostToDevice => 0,
        CopyDirection::DeviceToHost => 1,
    }
}

fn no_driver(e: CudaError) -> DeviceError {
    DeviceError::NoDriver {
        reason: e.to_string(),
    }
}

/// True where the CUDA driver library can be loaded (says nothing about GPUs).
pub fn driver_present() -> bool {
    ffi::init().is_ok() || ffi::has_symbol("cuInit")
}

impl CudaDevice {
    /// Opens GPU `ordinal` with default options. Fails with [`DeviceError::NoDriver`] where
    /// no driver is installed and [`DeviceError::NoSuchDevice`] where the GPU is missing.
    pub fn open(ordinal: u32) -> Result<Arc<Self>, DeviceError> {
        Self::open_with(ordinal, CudaOptions::default())
    }

    pub fn open_with(ordinal: u32, options: CudaOptions) -> Result<Arc<Self>, DeviceError> {
        ffi::init().map_err(no_driver)?;
        let count = ffi::device_count().map_err(no_driver)?;
        if ordinal >= count.max(0) as u32 {
            return Err(DeviceError::NoSuchDevice {
                ordinal,
                count: count.max(0) as u32,
            });
        }
        let drv = |call: &'static str| {
            move |e: CudaError| DeviceError::Driver {
                ordinal,
                call,
                reason: e.to_string(),
            }
        };
        let dev = ffi::device_get(ordinal as i32).map_err(drv("cuDeviceGet"))?;
        let name = ffi::device_name(dev).map_err(drv("cuDeviceGetName"))?;
        let sm_count = ffi::device_attribute(dev, Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(drv("cuDeviceGetAttribute"))? as u32;
        let ctx = ffi::primary_ctx_retain(dev).map_err(drv("cuDevicePrimaryCtxRetain"))?;
        let mut inner = Inner {
            ordinal,
            ctx,
            dev,
            name,
            sm_count,
            caps: DeviceCaps::default(),
            options,
            kernel: None,
            streams: Vec::new(),
            events: Mutex::new(Vec::new()),
            descs: Mutex::new(Vec::new()),
            hosts: RwLock::new(BTreeMap::new()),
            vmms: RwLock::new(BTreeMap::new()),
            teardown: Mutex::new(Vec::new()),
            staging: [Mutex::new(None), Mutex::new(None)],
            staged_batches: AtomicU64::new(0),
        };
        // From here on, dropping `inner` releases whatever was set up.
        inner.bind()?;
        for _ in 0..2 {
            inner
                .streams
                .push(ffi::stream_create().map_err(drv("cuStreamCreate"))?);
        }
        inner.caps = probe_caps(dev);
        match GatherKernel::load() {
            Ok(k) => {
                inner.kernel = Some(k);
                inner.caps.gather_kernel = true;
            }
            Err(e) => inner
                .caps
                .notes
                .push(format!("gather kernel unavailable: {e}")),
        }
        let inner = Arc::new(inner);
        let lanes = [Lane::start(&inner, 0)?, Lane::start(&inner, 1)?];
        Ok(Arc::new(Self { inner, lanes }))
    }

    /// Submits a batch: planned and queued here, or by the lane's submit thread where it is
    /// large, `detach`ed, or behind batches handed there (see [`DEFER_MIN_OPS`]).
    ///
    /// # Safety
    /// As for [`Device::submit`].
    unsafe fn submit_on(
        &self,
        dir: CopyDirection,
        list: CopyList,
        landed: Option<Landed>,
        detach: bool,
    ) -> Result<CopyEvent, DeviceError> {
        let inner = &self.inner;
        let ordinal = inner.ordinal;
        let (done, event) = CopyEvent::channel(ordinal);
        let done = done.then(landed);
        let submitted = Instant::now();
        if list.is_empty() {
            let _ = done.send(Ok(CopyStats {
                bytes: 0,
                ops: 0,
                seconds: 0.0,
            }));
            return Ok(event);
        }
        let lane = &self.lanes[lane_index(dir)];
        let mut order = lock_order(&lane.order);
        if detach || list.len() >= DEFER_MIN_OPS || order.deferred > 0 {
            let order = &mut *order;
            let jobs = order
                .jobs
                .as_ref()
                .ok_or(DeviceError::Stopped { ordinal })?;
            order.deferred += 1;
            let job = Job {
                dir,
                list,
                done,
                submitted,
            };
            if let Err(mpsc::SendError(job)) = jobs.send(job) {
                order.deferred -= 1;
                let _ = job.done.send(Err(DeviceError::Stopped { ordinal }));
            }
            return Ok(event);
        }
        inner.bind()?;
        let plan = inner.plan_batch(dir, &list);
        inner.queue(dir, plan, &list, done, submitted, &mut order);
        Ok(event)
    }

    /// The CUDA IPC handle of the allocation holding `ptr` (the exporting side; engine
    /// workers normally do this through their framework).
    pub fn ipc_handle(&self, ptr: u64) -> Result<IpcHandle, DeviceError> {
        self.inner.bind()?;
        let (start, _) = self.inner.device_alloc(ptr, 1)?;
        let bytes =
            ffi::ipc_get_handle(start).map_err(|e| self.inner.driver("cuIpcGetMemHandle", e))?;
        Ok(IpcHandle {
            bytes,
            offset: ptr - start,
        })
    }

    /// Allocates `bytes` (rounded up to the allocation granularity) of VMM memory exportable
    /// as a POSIX fd ([`Self::export_vmm`]): device memory the way vLLM 0.34's extensible KV
    /// cache allocates it, for tests and embedders that share KV with another process.
    pub fn alloc_vmm(&self, bytes: u64) -> Result<DeviceBuffer, DeviceError> {
        let inner = &self.inner;
        inner.vmm_supported("VMM allocation")?;
        let ordinal = inner.ordinal;
        let fail = |reason: String| DeviceError::Alloc {
            ordinal,
            bytes,
            reason,
        };
        if bytes == 0 {
            return Err(fail("zero-sized allocation".into()));
        }
        inner.bind()?;
        let g = ffi::vmm_granularity(ordinal as i32).map_err(|e| fail(e.to_string()))? as u64;
        let size = bytes
            .checked_next_multiple_of(g.max(1))
            .ok_or_else(|| fail("size overflows".into()))?;
        let map =
            VmmMap::create(size, ordinal).map_err(|(call, e)| fail(format!("{call}: {e}")))?;
        Ok(inner.vmm_buffer(map))
    }

    /// A POSIX fd of the VMM allocation mapped at `ptr` in this process (the exporting side
    /// of [`Device::import_vmm_fd`]; engine workers do the same through the driver).
    pub fn export_vmm(&self, ptr: u64) -> Result<VmmExport, DeviceError> {
        let inner = &self.inner;
        inner.vmm_supported("VMM fd export")?;
        inner.bind()?;
        let (fd, info) = vmm::export_fd(ptr).map_err(|(call, e)| {
            if e.is_not_supported() {
                DeviceError::Unsupported {
                    what: "VMM fd export",
                    reason: e.to_string(),
                }
            } else {
                inner.driver(call, e)
            }
        })?;
        Ok(VmmExport {
            fd,
            base: info.base,
            len: info.size,
            offset: ptr - info.base,
        })
    }

    /// Errors that teardown (freeing, unmapping, unregistering) met since the last call.
    pub fn take_teardown_errors(&self) -> Vec<DeviceError> {
        match self.inner.teardown.lock() {
            Ok(mut v) => std::mem::take(&mut *v),
            Err(p) => std::mem::take(&mut *p.into_inner()),
        }
    }

    /// The driver's CUDA version (13000 for 13.0).
    pub fn driver_version(&self) -> Result<i32, DeviceError> {
        ffi::driver_version().map_err(|e| self.inner.driver("cuDriverGetVersion", e))
    }

    pub fn options(&self) -> CudaOptions {
        self.inner.options
    }

    /// Number of streaming multiprocessors (sizes the gather kernel's grid).
    pub fn sm_count(&self) -> u32 {
        self.inner.sm_count
    }

    /// Batches that took the staged path since the device opened.
    pub fn staged_batches(&self) -> u64 {
        self.inner.staged_batches.load(Ordering::Relaxed)
    }
}

fn probe_caps(dev: ffi::CUdevice) -> DeviceCaps {
    let mut caps = DeviceCaps {
        ipc_import: true,
        ..DeviceCaps::default()
    };
    let attr = |a: Attr| ffi::device_attribute(dev, a).unwrap_or(0);
    if !ffi::has_symbol("cuMemGetHandleForAddressRange") {
        caps.notes
            .push("dmabuf: driver lacks cuMemGetHandleForAddressRange".into());
    } else if attr(Attr::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED) != 1 {
        caps.notes
            .push("dmabuf: the device does not support DMA-BUF export".into());
    } else {
        caps.dmabuf_export = true;
    }
    caps.read_only_host_register =
        attr(Attr::CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED) == 1;
    if !caps.read_only_host_register {
        caps.notes
            .push("read-only host registration unsupported".into());
    }
    caps.batch_copy = ffi::has_memcpy_batch();
    if !caps.batch_copy {
        caps.notes
            .push("batched copies need a CUDA 13 driver".into());
    }
    match ffi::vmm_missing() {
        Err(e) => caps.notes.push(format!("vmm fd import: {e}")),
        Ok(()) if attr(Attr::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) != 1 => caps
            .notes
            .push("vmm fd import: the device does not support virtual memory management".into()),
        Ok(())
            if attr(Attr::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED) != 1 =>
        {
            caps.notes
                .push("vmm fd import: the device cannot share allocations by POSIX fd".into())
        }
        Ok(()) => caps.vmm_import = true,
    }
    // Bit 0: CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST (cuFlushGPUDirectRDMAWrites works).
    caps.direct_write_flush = ffi::has_symbol("cuFlushGPUDirectRDMAWrites")
        && attr(Attr::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS) & 1 == 1;
    caps
}

impl Lane {
    fn start(inner: &Arc<Inner>, index: usize) -> Result<Self, DeviceError> {
        let (tx, rx) = mpsc::channel::<Pending>();
        let worker = Arc::clone(inner);
        let dir = if index == 0 { "h2d" } else { "d2h" };
        let spawn_failed = |what: &'static str| {
            move |e: std::io::Error| DeviceError::Driver {
                ordinal: inner.ordinal,
                call: what,
                reason: e.to_string(),
            }
        };
        let thread = std::thread::Builder::new()
            .name(format!("kvferry-cuda{}-{dir}", inner.ordinal))
            .spawn(move || worker.complete_loop(rx))
            .map_err(spawn_failed("spawning the completion thread"))?;
        let (jobs, rx) = mpsc::channel::<Job>();
        let order = Arc::new(Mutex::new(LaneOrder {
            tx: Some(tx),
            jobs: Some(jobs),
            deferred: 0,
        }));
        let (worker, o) = (Arc::clone(inner), Arc::clone(&order));
        let submitter = std::thread::Builder::new()
            .name(format!("kvferry-cuda{}-{dir}-submit", inner.ordinal))
            .spawn(move || worker.submit_loop(&rx, &o));
        let mut lane = Self {
            order,
            thread: Some(thread),
            submitter: None,
        };
        // On failure `lane` drops: its completion thread is stopped and joined.
        lane.submitter = Some(submitter.map_err(spawn_failed("spawning the submit thread"))?);
        Ok(lane)
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        // The submit thread queues what it was handed and exits; then closing the completion
        // queue lets that thread finish the batches already queued (their events still
        // resolve) and exit; joining keeps streams alive until then.
        // (The submit thread holds the order too: its queue must be taken out of it.)
        lock_order(&self.order).jobs.take();
        if let Some(t) = self.submitter.take() {
            let _ = t.join();
        }
        lock_order(&self.order).tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Inner {
    fn bind(&self) -> Result<(), DeviceError> {
        // SAFETY: `ctx` stays retained for as long as `self` lives.
        unsafe { ffi::ctx_set_current(self.ctx) }.map_err(|e| self.driver("cuCtxSetCurrent", e))
    }

    fn driver(&self, call: &'static str, e: CudaError) -> DeviceError {
        DeviceError::Driver {
            ordinal: self.ordinal,
            call,
            reason: e.to_string(),
        }
    }

    fn record_teardown(&self, e: DeviceError) {
        match self.teardown.lock() {
            Ok(mut v) => v.push(e),
            Err(p) => p.into_inner().push(e),
        }
    }

    fn check(&self, ptr: u64, len: u64) -> Result<(), DeviceError> {
        self.device_alloc(ptr, len).map(|_| ())
    }

    /// The VMM mapping of this device holding all of `[ptr, ptr + len)`.
    fn vmm_range(&self, ptr: u64, len: u64) -> Option<(u64, u64)> {
        let end = ptr.checked_add(len)?;
        let vmms = self.vmms.read().ok()?;
        let (&start, &stop) = vmms.range(..=ptr).next_back()?;
        (end <= stop).then_some((start, stop))
    }

    /// A buffer owning `map`, known to [`Self::vmm_range`] until it drops.
    fn vmm_buffer(self: &Arc<Self>, map: VmmMap) -> DeviceBuffer {
        let (ptr, len) = (map.ptr(), map.size());
        if let Ok(mut vmms) = self.vmms.write() {
            vmms.insert(ptr, ptr + len);
        }
        let owner = CudaRelease {
            inner: Arc::clone(self),
            held: Some(Held::Vmm(map)),
        };
        DeviceBuffer::new(ptr, len, self.ordinal, Box::new(owner))
    }

    /// Refuses VMM sharing where the device cannot do it, naming why.
    fn vmm_supported(&self, what: &'static str) -> Result<(), DeviceError> {
        if self.caps.vmm_import {
            return Ok(());
        }
        let reason = self
            .caps
            .notes
            .iter()
            .find(|n| n.starts_with("vmm"))
            .cloned()
            .unwrap_or_else(|| "unsupported".into());
        Err(DeviceError::Unsupported { what, reason })
    }

    fn take_event(&self) -> Result<ffi::CUevent, DeviceError> {
        if let Some(e) = self.events.lock().ok().and_then(|mut v| v.pop()) {
            return Ok(e);
        }
        ffi::event_create(false).map_err(|e| self.driver("cuEventCreate", e))
    }

    fn take_descs(&self, n: usize) -> Result<PinnedDescs, DeviceError> {
        if let Ok(mut pool) = self.descs.lock() {
            if let Some(i) = pool.iter().position(|d| d.cap >= n) {
                return Ok(pool.swap_remove(i));
            }
        }
        let cap = n.next_power_of_two().max(4096);
        let bytes = cap * std::mem::size_of::<Desc>();
        let host = ffi::mem_host_alloc(bytes).map_err(|e| self.driver("cuMemHostAlloc", e))?;
        let info = ffi::pointer_info(host as u64).unwrap_or_default();
        let device = if info.device_pointer != 0 {
            info.device_pointer
        } else {
            host as u64
        };
        Ok(PinnedDescs {
            host: host.cast(),
            cap,
            device,
        })
    }

    /// Queues a batch's work on `stream`. On error, whatever was queued before it is still in
    /// flight; the caller records the event anyway so the batch resolves only after it.
    fn enqueue(
        &self,
        dir: CopyDirection,
        stream: ffi::CUstream,
        plan: &Plan,
        pending: &mut Pending,
    ) -> Result<(), DeviceError> {
        if let Some(staged) = &plan.staged {
            let index = lane_index(dir);
            let guard = self.lock_staging(index);
            let st = guard.as_ref().ok_or(DeviceError::Unsupported {
                what: "staged copies",
                reason: "no staging buffers".into(),
            })?;
            self.staged_batches.fetch_add(1, Ordering::Relaxed);
            return self.enqueue_staged(dir, stream, st, staged, pending);
        }
        if !plan.kernel.is_empty() {
            let kernel = self.kernel.as_ref().ok_or(DeviceError::Unsupported {
                what: "gather kernel",
                reason: "not loaded".into(),
            })?;
            let n = plan.kernel.len();
            let count = u32::try_from(n).map_err(|_| DeviceError::Copy {
                ordinal: self.ordinal,
                ops: n,
                reason: "too many ranges for one launch".into(),
            })?;
            let descs = self.take_descs(n)?;
            // SAFETY: the buffer holds `cap >= n` descriptors, is owned by this batch alone,
            // and no earlier launch still reads it (buffers return to the pool only after
            // their batch's event completed).
            unsafe { std::ptr::copy_nonoverlapping(plan.kernel.as_ptr(), descs.host, n) };
            let device = descs.device;
            pending.descs = Some(descs);
            // SAFETY: the descriptors stay untouched until the batch completes (held by
            // `pending`); device ranges were validated by the planner and host ranges are
            // mapped registrations the caller of `submit` keeps valid; context is bound.
            unsafe { kernel.launch(stream, device, count, self.sm_count) }
                .map_err(|e| self.driver("cuLaunchKernel", e))?;
        }
        if plan.engine.is_empty() {
            return Ok(());
        }
        let ops = plan.engine.iter().map(|o| (o.dst, o.src, o.len));
        // SAFETY: device sides validated, host sides kept valid by the caller of `submit`
        // until the batch completes; `engine_batched` only where the driver has the call.
        unsafe { self.copy_ranges(stream, plan.engine_batched, ops) }?;
        Ok(())
    }

    /// Queues `(dst, src, len)` copies on `stream`: one `cuMemcpyBatchAsync` where
    /// `batched`, otherwise one `cuMemcpyAsync` each.
    ///
    /// # Safety
    /// Every range stays valid until the work on `stream` completes; `stream` is live in the
    /// bound context; `batched` only where the driver has the batched call.
    unsafe fn copy_ranges(
        &self,
        stream: ffi::CUstream,
        batched: bool,
        ops: impl ExactSizeIterator<Item = (u64, u64, u64)>,
    ) -> Result<(), DeviceError> {
        if batched {
            let n = ops.len();
            let (mut dsts, mut srcs, mut sizes) = (
                Vec::with_capacity(n),
                Vec::with_capacity(n),
                Vec::with_capacity(n),
            );
            for (dst, src, len) in ops {
                dsts.push(dst);
                srcs.push(src);
                sizes.push(len as usize);
            }
            // SAFETY: as the caller guarantees.
            return unsafe { ffi::memcpy_batch_async(&mut dsts, &mut srcs, &mut sizes, stream) }
                .map_err(|e| self.driver("cuMemcpyBatchAsync", e));
        }
        for (dst, src, len) in ops {
            // SAFETY: as the caller guarantees, one range at a time.
            unsafe { ffi::memcpy_async(dst, src, len as usize, stream) }
                .map_err(|e| self.driver("cuMemcpyAsync", e))?;
        }
        Ok(())
    }

    fn lock_staging(&self, index: usize) -> MutexGuard<'_, Option<Staging>> {
        match self.staging[index].lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Allocates the lane's staging on first use. False where staging is off or could not
    /// be allocated (the error is returned for a forced staged path).
    fn ensure_staging(&self, index: usize) -> Result<bool, DeviceError> {
        let chunk = self.options.stage_chunk();
        if chunk == 0 || self.kernel.is_none() {
            return Ok(false);
        }
        let mut g = self.lock_staging(index);
        if g.is_none() {
            *g = Some(Staging::create(self, chunk, self.options.staging_chunks)?);
        }
        Ok(true)
    }

    /// Queues the staged path: per chunk, the copy engines between host runs and a staging
    /// buffer on the lane stream, the scatter (H2D) or gather (D2H) kernel on the aux stream,
    /// handed over by events (see [`Staging`]). However it ends, the lane stream waits for
    /// the aux stream, so the batch's event covers everything queued.
    fn enqueue_staged(
        &self,
        dir: CopyDirection,
        lane: ffi::CUstream,
        st: &Staging,
        staged: &Staged,
        pending: &mut Pending,
    ) -> Result<(), DeviceError> {
        let kernel = self.kernel.as_ref().ok_or(DeviceError::Unsupported {
            what: "gather kernel",
            reason: "not loaded".into(),
        })?;
        let descs = staged.relocate(dir, &st.bufs);
        let pinned = self.take_descs(descs.len().max(1))?;
        // SAFETY: the buffer holds `cap >= descs.len()` descriptors and is owned by this batch
        // alone (pooled buffers return only after their batch completed).
        unsafe { std::ptr::copy_nonoverlapping(descs.as_ptr(), pinned.host, descs.len()) };
        let table = pinned.device;
        pending.descs = Some(pinned);
        let wait = |s: ffi::CUstream, e: ffi::CUevent| {
            // SAFETY: both are live handles of the bound context, owned by this lane.
            unsafe { ffi::stream_wait_event(s, e) }.map_err(|e| self.driver("cuStreamWaitEvent", e))
        };
        let record = |e: ffi::CUevent, s: ffi::CUstream| {
            // SAFETY: as above.
            unsafe { ffi::event_record(e, s) }.map_err(|e| self.driver("cuEventRecord", e))
        };
        // One batched call per chunk where the driver has it: the copy engines then cost
        // ~1 us per host run instead of ~3.5 (H200: a 256-block load in 15 layer batches,
        // 128 KiB runs, went from 22.5 to 48 GB/s).
        let batched = self.caps.batch_copy;
        let copies = |chunk: &super::plan::StageChunk, base: u64| {
            let ops = chunk.spans.iter().map(|sp| match dir {
                CopyDirection::HostToDevice => (base + sp.offset, sp.host, sp.len),
                CopyDirection::DeviceToHost => (sp.host, base + sp.offset, sp.len),
            });
            // SAFETY: the staging side lies inside one of this lane's buffers (offsets below
            // the chunk size), which no other batch touches until this one's `free` event;
            // the host side is the caller's, kept valid until the batch completes as
            // `submit` requires; `batched` only where the driver has the call.
            unsafe { self.copy_ranges(lane, batched && chunk.spans.len() > 1, ops) }
        };
        let scatter = |chunk: &super::plan::StageChunk, s: ffi::CUstream| {
            let n = chunk.descs.len();
            let count = u32::try_from(n).map_err(|_| DeviceError::Copy {
                ordinal: self.ordinal,
                ops: n,
                reason: "too many ranges for one launch".into(),
            })?;
            let at = table + (chunk.descs.start * std::mem::size_of::<Desc>()) as u64;
            // SAFETY: the descriptors stay untouched until the batch completes (held by
            // `pending`); their device sides were validated by the planner and their staging
            // sides lie inside this lane's buffers; the stream is live and the context bound.
            unsafe { kernel.launch(s, at, count, self.sm_count) }
                .map_err(|e| self.driver("cuLaunchKernel", e))
        };
        let queued = (|| {
            // Host→device: the scatters wait for what the lane queued before (they follow
            // their own chunk's copy anyway). Device→host: the gathers start at once, each
            // only on its buffer's `free` event, so a batch's first gather overlaps the
            // previous batch's last copy (a save runs as several batches back to back).
            if dir == CopyDirection::HostToDevice {
                record(st.entry, lane)?;
                wait(st.aux, st.entry)?;
            }
            for (i, chunk) in staged.chunks.iter().enumerate() {
                let b = i % st.bufs.len();
                match dir {
                    CopyDirection::HostToDevice => {
                        wait(lane, st.free[b])?;
                        copies(chunk, st.bufs[b])?;
                        record(st.filled[b], lane)?;
                        wait(st.aux, st.filled[b])?;
                        scatter(chunk, st.aux)?;
                        record(st.free[b], st.aux)?;
                    }
                    CopyDirection::DeviceToHost => {
                        wait(st.aux, st.free[b])?;
                        scatter(chunk, st.aux)?;
                        record(st.filled[b], st.aux)?;
                        wait(lane, st.filled[b])?;
                        copies(chunk, st.bufs[b])?;
                        record(st.free[b], lane)?;
                    }
                }
            }
            Ok(())
        })();
        let joined = record(st.join, st.aux).and_then(|()| wait(lane, st.join));
        if joined.is_err() {
            // Without the hand-over, wait here so no queued work outlives the batch.
            // SAFETY: the aux stream is live.
            let _ = unsafe { ffi::stream_synchronize(st.aux) };
        }
        queued.and(joined)
    }

    /// Plans one batch: the lane's staging buffers on first use, then the path and its
    /// pieces. An error refuses the batch before anything is queued.
    fn plan_batch(&self, dir: CopyDirection, list: &CopyList) -> Result<Plan, DeviceError> {
        let index = lane_index(dir);
        let path = self.options.copy_path;
        // Staging buffers come with the lane's first batch that might use them; a forced
        // staged path without them is refused, nothing copied.
        let staging = match path {
            CopyPath::Staged => self.ensure_staging(index)?,
            CopyPath::Auto if list.len() > ENGINE_MAX_OPS => {
                self.ensure_staging(index).unwrap_or(false)
            }
            _ => false,
        };
        let paths = Paths {
            kernel: self.kernel.is_some(),
            batch: self.caps.batch_copy,
            stage_chunk: if staging {
                self.options.stage_chunk()
            } else {
                0
            },
        };
        plan(dir, list, path, paths, self)
    }

    /// Queues a planned batch on its lane's stream and hands it to the completion thread,
    /// or resolves it with the planning error (nothing was copied). Called with the lane's
    /// order held and the context bound.
    fn queue(
        &self,
        dir: CopyDirection,
        plan: Result<Plan, DeviceError>,
        list: &CopyList,
        done: CopyDone,
        submitted: Instant,
        order: &mut LaneOrder,
    ) {
        let ordinal = self.ordinal;
        let plan = match plan {
            Ok(p) => p,
            Err(e) => {
                let _ = done.send(Err(e));
                return;
            }
        };
        let Some(tx) = order.tx.as_ref() else {
            let _ = done.send(Err(DeviceError::Stopped { ordinal }));
            return;
        };
        let stream = self.streams[lane_index(dir)];
        let mut pending = Pending {
            event: None,
            done,
            submitted,
            bytes: list.bytes(),
            ops: list.len(),
            descs: None,
            error: None,
        };
        pending.error = self.enqueue(dir, stream, &plan, &mut pending).err();
        let recorded = self.take_event().and_then(|ev| {
            // SAFETY: the event and stream are live handles of the bound context.
            unsafe { ffi::event_record(ev, stream) }
                .map(|()| ev)
                .map_err(|e| self.driver("cuEventRecord", e))
        });
        match recorded {
            Ok(ev) => pending.event = Some(ev),
            Err(e) => {
                // Without an event, wait here so no queued copy outlives the batch.
                // SAFETY: the stream is live.
                let _ = unsafe { ffi::stream_synchronize(stream) };
                pending.error.get_or_insert(e);
            }
        }
        if let Err(mpsc::SendError(p)) = tx.send(pending) {
            if let Some(ev) = p.event {
                // SAFETY: the event was recorded on a live stream.
                let _ = unsafe { ffi::event_synchronize(ev) };
            }
            let _ = p.done.send(Err(DeviceError::Stopped { ordinal }));
        }
    }

    /// A lane's submit thread: plans each batch it is handed without holding the lane (the
    /// long part), then queues it in turn. Ends when the device drops the queue, after
    /// queueing what was handed before.
    fn submit_loop(&self, jobs: &mpsc::Receiver<Job>, order: &Mutex<LaneOrder>) {
        let bound = self.bind();
        while let Ok(job) = jobs.recv() {
            let plan = match &bound {
                Ok(()) => self.plan_batch(job.dir, &job.list),
                Err(e) => Err(e.clone()),
            };
            let mut o = lock_order(order);
            self.queue(job.dir, plan, &job.list, job.done, job.submitted, &mut o);
            o.deferred -= 1;
        }
    }

    /// Waits for `ev`: polled for up to [`CudaOptions::completion_spin`], then slept on.
    /// A blocking-sync event wakes its waiter through an interrupt, tens of microseconds
    /// after the copies ended (about 40 us on the H200, as long as a 1.75 MiB copy takes
    /// itself); polling sees the end within a microsecond. The poll yields the core between
    /// queries, and a batch still running after the spin is slept on, so a long copy does
    /// not hold a core for its whole length.
    ///
    /// # Safety
    /// `ev` is a live event of the bound context, used by no other thread meanwhile.
    unsafe fn wait_event(&self, ev: ffi::CUevent) -> Result<(), CudaError> {
        let spin = self.options.completion_spin;
        if !spin.is_zero() {
            let start = Instant::now();
            loop {
                // SAFETY: as the caller guarantees.
                if unsafe { ffi::event_query(ev) }? {
                    return Ok(());
                }
                if start.elapsed() >= spin {
                    break;
                }
                std::thread::yield_now();
            }
        }
        // SAFETY: as the caller guarantees.
        unsafe { ffi::event_synchronize(ev) }
    }

    fn complete_loop(&self, rx: mpsc::Receiver<Pending>) {
        let bound = self.bind();
        while let Ok(mut p) = rx.recv() {
            let mut error = p.error.take();
            if let Some(ev) = p.event {
                let waited = match &bound {
                    Ok(()) => {
                        // SAFETY: the event is live (taken from the pool, recorded by
                        // `submit`) and only this thread uses it until it returns to the pool.
                        let r = unsafe { self.wait_event(ev) };
                        r.map_err(|e| DeviceError::Copy {
                            ordinal: self.ordinal,
                            ops: p.ops,
                            reason: e.to_string(),
                        })
                    }
                    Err(e) => Err(e.clone()),
                };
                match waited {
                    Ok(()) => {
                        if let Ok(mut pool) = self.events.lock() {
                            pool.push(ev);
                        }
                    }
                    // The context is likely unusable (a sticky fault); do not reuse its event.
                    Err(e) => {
                        error.get_or_insert(e);
                    }
                }
            }
            if let Some(d) = p.descs.take() {
                if let Ok(mut pool) = self.descs.lock() {
                    pool.push(d);
                }
            }
            let r = match error {
                Some(e) => Err(e),
                None => Ok(CopyStats {
                    bytes: p.bytes,
                    ops: p.ops,
                    seconds: p.submitted.elapsed().as_secs_f64(),
                }),
            };
            // The waiter may have gone away (a cancelled load); nothing to report then.
            let _ = p.done.send(r);
        }
    }
}

impl Resolver for Inner {
    fn device_alloc(&self, ptr: u64, len: u64) -> Result<(u64, u64), DeviceError> {
        let ordinal = self.ordinal;
        let not_dev = || DeviceError::NotDeviceMemory { ordinal, ptr, len };
        if let Some(found) = self.vmm_range(ptr, len) {
            return Ok(found);
        }
        let info = ffi::pointer_info(ptr).map_err(|_| not_dev())?;
        if info.memory_type != ffi::MEMORYTYPE_DEVICE {
            return Err(not_dev());
        }
        if info.device_ordinal != ordinal as i32 {
            return Err(DeviceError::WrongDevice {
                ordinal,
                found: info.device_ordinal.max(0) as u32,
                ptr,
                len,
            });
        }
        let end = info
            .range_start
            .checked_add(info.range_size)
            .ok_or_else(not_dev)?;
        match ptr.checked_add(len) {
            Some(e) if ptr >= info.range_start && e <= end => Ok((info.range_start, end)),
            _ => Err(not_dev()),
        }
    }

    fn host_map(&self, addr: u64, len: u64) -> Option<HostMap> {
        let end = addr.checked_add(len)?;
        if let Ok(hosts) = self.hosts.read() {
            if let Some((_, m)) = hosts.range(..=addr).next_back() {
                if end <= m.end {
                    return Some(*m);
                }
            }
        }
        // Pinned memory CUDA allocated itself (cuMemHostAlloc) or registered elsewhere.
        let info = ffi::pointer_info(addr).ok()?;
        if info.memory_type != ffi::MEMORYTYPE_HOST || info.device_pointer == 0 {
            return None;
        }
        if info.range_size > 0 {
            let m = HostMap {
                start: info.range_start,
                end: info.range_start + info.range_size,
                device: info.device_pointer - (addr - info.range_start),
            };
            return (addr >= m.start && end <= m.end).then_some(m);
        }
        let last = ffi::pointer_info(end - 1).ok()?;
        (last.device_pointer == info.device_pointer + (len - 1)).then_some(HostMap {
            start: addr,
            end,
            device: info.device_pointer,
        })
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Nothing can report these any more; teardown is best-effort once the handle is gone.
        if self.bind().is_err() {
            return;
        }
        for &s in &self.streams {
            // SAFETY: streams are ours; the lanes are gone, so nothing enqueues any more.
            unsafe {
                let _ = ffi::stream_synchronize(s);
                let _ = ffi::stream_destroy(s);
            }
        }
        for st in &mut self.staging {
            let st = match st.get_mut() {
                Ok(s) => s.take(),
                Err(p) => p.into_inner().take(),
            };
            if let Some(mut st) = st {
                st.destroy();
            }
        }
        if let Some(k) = &self.kernel {
            // SAFETY: the streams were drained above, so no launch is running.
            let _ = unsafe { k.unload() };
        }
        for e in self
            .events
            .get_mut()
            .map(std::mem::take)
            .unwrap_or_default()
        {
            // SAFETY: pooled events are idle and ours.
            let _ = unsafe { ffi::event_destroy(e) };
        }
        for d in self.descs.get_mut().map(std::mem::take).unwrap_or_default() {
            // SAFETY: pooled descriptor buffers are idle and ours.
            let _ = unsafe { ffi::mem_free_host(d.host.cast()) };
        }
        // SAFETY: balances the retain in `open_with`; nothing of this device is used after.
        let _ = unsafe { ffi::primary_ctx_release(self.dev) };
    }
}

/// What a [`DeviceBuffer`] or [`HostRegistration`] of this backend undoes on drop.
enum Held {
    Alloc(u64),
    Ipc([u8; 64]),
    Host(u64, u64),
    Vmm(VmmMap),
}

struct CudaRelease {
    inner: Arc<Inner>,
    held: Option<Held>,
}

impl Release for CudaRelease {
    fn release(&mut self) {
        let Some(held) = self.held.take() else { return };
        let inner = &self.inner;
        if let Err(e) = inner.bind() {
            inner.record_teardown(e);
            return;
        }
        let r = match held {
            // SAFETY: allocated by `alloc`, released once (`held` is taken); the owner of the
            // buffer guarantees no batch still uses it (buffers outlive their loads).
            Held::Alloc(p) => unsafe { ffi::mem_free(p) }.map_err(|e| inner.driver("cuMemFree", e)),
            // SAFETY: opened by `import_ipc`, closed once, same guarantee as above.
            Held::Ipc(handle) => shared::IPC.release((inner.ordinal, handle), |p| {
                // SAFETY: opened by `import_ipc`, closed by the last reference only; the
                // buffers' owners guarantee no batch still uses it.
                unsafe { ffi::ipc_close(p) }.map_err(|e| inner.driver("cuIpcCloseMemHandle", e))
            }),
            Held::Vmm(mut map) => {
                if let Ok(mut vmms) = inner.vmms.write() {
                    vmms.remove(&map.ptr());
                }
                map.teardown().map_err(|(call, e)| inner.driver(call, e))
            }
            Held::Host(p, len) => {
                if let Ok(mut hosts) = inner.hosts.write() {
                    hosts.remove(&p);
                }
                shared::HOST.release((p, len), |_| {
                    // SAFETY: registered by `register_host`, unregistered by the last
                    // reference only; the registrations' owners guarantee no batch still
                    // reads it.
                    unsafe { ffi::mem_host_unregister(p as *mut c_void) }
                        .map_err(|e| inner.driver("cuMemHostUnregister", e))
                })
            }
        };
        if let Err(e) = r {
            inner.record_teardown(e);
        }
    }
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.inner.ordinal)
            .field("name", &self.inner.name)
            .field("options", &self.inner.options)
            .finish()
    }
}

/// The 64-byte `cudaIpcMemHandle_t` inside `handle`: either that handle itself, or PyTorch's
/// storage handle (`storage._share_cuda_()[1]`: a version byte, the type `c` for a
/// `cudaMalloc` block, then the 64 bytes), so engines can pass what their framework gives them.
fn ipc_payload(handle: &[u8]) -> Result<&[u8; 64], String> {
    let raw = match handle {
        [_version, b'c', rest @ ..] if rest.len() == 64 => rest,
        [_version, b'e', ..] if handle.len() != 64 => {
            return Err("PyTorch expandable segments cannot be imported by CUDA IPC handle".into())
        }
        _ => handle,
    };
    raw.try_into()
        .map_err(|_| format!("{} bytes, expected a 64-byte handle", handle.len()))
}

impl Device for CudaDevice {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cuda
    }

    fn ordinal(&self) -> u32 {
        self.inner.ordinal
    }

    fn name(&self) -> String {
        format!("{} #{}", self.inner.name, self.inner.ordinal)
    }

    fn check_range(&self, ptr: u64, len: u64) -> Result<(), DeviceError> {
        self.inner.bind()?;
        self.inner.check(ptr, len)
    }

    fn alloc(&self, bytes: u64) -> Result<DeviceBuffer, DeviceError> {
        let ordinal = self.inner.ordinal;
        let fail = |reason: String| DeviceError::Alloc {
            ordinal,
            bytes,
            reason,
        };
        if bytes == 0 {
            return Err(fail("zero-sized allocation".into()));
        }
        let size =
            usize::try_from(bytes).map_err(|_| fail("size exceeds the address space".into()))?;
        self.inner.bind()?;
        let ptr = ffi::mem_alloc(size).map_err(|e| fail(e.to_string()))?;
        let owner = CudaRelease {
            inner: Arc::clone(&self.inner),
            held: Some(Held::Alloc(ptr)),
        };
        Ok(DeviceBuffer::new(ptr, bytes, ordinal, Box::new(owner)))
    }

    fn register_host(
        &self,
        addr: u64,
        len: u64,
        read_only: bool,
    ) -> Result<HostRegistration, DeviceError> {
        let fail = |reason: String| DeviceError::HostRegister { addr, len, reason };
        if len == 0 || addr.checked_add(len).is_none() {
            return Err(fail("empty or overflowing range".into()));
        }
        if read_only && !self.inner.caps.read_only_host_register {
            return Err(DeviceError::Unsupported {
                what: "read-only host registration",
                reason: "CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED is 0".into(),
            });
        }
        self.inner.bind()?;
        let size =
            usize::try_from(len).map_err(|_| fail("size exceeds the address space".into()))?;
        let device = shared::HOST.acquire((addr, len), || {
            // SAFETY: the caller owns the mapping; the returned registration is dropped (and
            // the range unregistered with the last one) before the caller unmaps it, as
            // `HostRegistration` documents.
            unsafe { ffi::mem_host_register(addr as *mut c_void, size, read_only) }
                .map_err(|e| fail(e.to_string()))?;
            let info = ffi::pointer_info(addr).unwrap_or_default();
            Ok(if info.device_pointer != 0 {
                info.device_pointer
            } else {
                addr
            })
        })?;
        if let Ok(mut hosts) = self.inner.hosts.write() {
            hosts.insert(
                addr,
                HostMap {
                    start: addr,
                    end: addr + len,
                    device,
                },
            );
        }
        let owner = CudaRelease {
            inner: Arc::clone(&self.inner),
            held: Some(Held::Host(addr, len)),
        };
        Ok(HostRegistration::new(Box::new(owner)))
    }

    unsafe fn submit_then(
        &self,
        dir: CopyDirection,
        list: CopyList,
        landed: Option<Landed>,
    ) -> Result<CopyEvent, DeviceError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.submit_on(dir, list, landed, false) }
    }

    unsafe fn submit_detached(
        &self,
        dir: CopyDirection,
        list: CopyList,
    ) -> Result<CopyEvent, DeviceError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.submit_on(dir, list, None, true) }
    }

    fn write(&self, dst: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.inner.bind()?;
        self.inner.check(dst, data.len() as u64)?;
        // SAFETY: the destination lies inside one allocation of this device (checked), and
        // `data` is a live slice for the duration of this synchronous call.
        unsafe { ffi::memcpy_htod(dst, data.as_ptr().cast(), data.len()) }
            .map_err(|e| self.inner.driver("cuMemcpyHtoD", e))
    }

    fn read(&self, src: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        self.inner.bind()?;
        self.inner.check(src, out.len() as u64)?;
        // SAFETY: the source lies inside one allocation of this device (checked), and `out`
        // is a live, exclusively borrowed slice for the duration of this synchronous call.
        unsafe { ffi::memcpy_dtoh(out.as_mut_ptr().cast(), src, out.len()) }
            .map_err(|e| self.inner.driver("cuMemcpyDtoH", e))
    }

    fn capabilities(&self) -> DeviceCaps {
        self.inner.caps.clone()
    }

    fn import_ipc(&self, handle: &[u8]) -> Result<DeviceBuffer, DeviceError> {
        let inner = &self.inner;
        let ordinal = inner.ordinal;
        let fail = |reason: String| DeviceError::Import {
            ordinal,
            what: "CUDA IPC handle",
            reason,
        };
        let bytes = ipc_payload(handle).map_err(fail)?;
        inner.bind()?;
        let base = shared::IPC
            .acquire((ordinal, *bytes), || ffi::ipc_open(bytes))
            .map_err(|e| fail(e.to_string()))?;
        let owner = CudaRelease {
            inner: Arc::clone(inner),
            held: Some(Held::Ipc(*bytes)),
        };
        let info = ffi::pointer_info(base).unwrap_or_default();
        // Dropping `owner` (through the buffer or on error) closes the mapping again.
        let buf = DeviceBuffer::new(base, info.range_size, ordinal, Box::new(owner));
        if info.memory_type != ffi::MEMORYTYPE_DEVICE || info.range_size == 0 {
            return Err(fail("the mapping is not device memory".into()));
        }
        if info.device_ordinal != ordinal as i32 {
            return Err(DeviceError::WrongDevice {
                ordinal,
                found: info.device_ordinal.max(0) as u32,
                ptr: base,
                len: info.range_size,
            });
        }
        Ok(buf)
    }

    fn import_vmm_fd(&self, fd: OwnedFd, len: u64) -> Result<DeviceBuffer, DeviceError> {
        use std::os::fd::AsFd;
        let inner = &self.inner;
        let ordinal = inner.ordinal;
        let fail = |reason: String| DeviceError::Import {
            ordinal,
            what: "VMM allocation fd",
            reason,
        };
        inner.vmm_supported("VMM fd import")?;
        inner.bind()?;
        let g = ffi::vmm_granularity(ordinal as i32)
            .map_err(|e| inner.driver("cuMemGetAllocationGranularity", e))? as u64;
        if len == 0 || !len.is_multiple_of(g.max(1)) {
            return Err(fail(format!(
                "{len} bytes is not a nonzero multiple of the allocation granularity ({g}): \
                 send the mapping's whole size"
            )));
        }
        let map = VmmMap::import(fd.as_fd(), len, ordinal)
            .map_err(|(call, e)| fail(format!("{call}: {e}")))?;
        // The driver holds the allocation now; the fd is not needed any more.
        drop(fd);
        let ptr = map.ptr();
        // Dropping the buffer (here on error, or by its owner) unmaps and releases.
        let buf = inner.vmm_buffer(map);
        let info = ffi::pointer_info(ptr).unwrap_or_default();
        if info.memory_type == ffi::MEMORYTYPE_DEVICE
            && info.device_ordinal >= 0
            && info.device_ordinal != ordinal as i32
        {
            // Mapped, but the memory lives on another GPU: copies would cross to it.
            return Err(DeviceError::WrongDevice {
                ordinal,
                found: info.device_ordinal as u32,
                ptr,
                len,
            });
        }
        Ok(buf)
    }

    fn export_dmabuf(&self, ptr: u64, len: u64) -> Result<DmaBuf, DeviceError> {
        let inner = &self.inner;
        if !inner.caps.dmabuf_export {
            let reason = inner
                .caps
                .notes
                .iter()
                .find(|n| n.starts_with("dmabuf"))
                .cloned();
            return Err(DeviceError::Unsupported {
                what: "DMA-BUF export",
                reason: reason.unwrap_or_else(|| "unsupported".into()),
            });
        }
        inner.bind()?;
        inner.check(ptr, len.max(1))?;
        // SAFETY: sysconf only reads a system constant.
        let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
            p if p > 0 => p as u64,
            _ => 4096,
        };
        let start = ptr & !(page - 1);
        let end = (ptr + len.max(1)).div_ceil(page) * page;
        match ffi::dmabuf_export(start, (end - start) as usize) {
            Ok(fd) => Ok(DmaBuf::new(fd, start, end - start, inner.ordinal)),
            Err(e) if e.is_not_supported() => Err(DeviceError::Unsupported {
                what: "DMA-BUF export",
                reason: e.to_string(),
            }),
            Err(e) => Err(inner.driver("cuMemGetHandleForAddressRange", e)),
        }
    }

    fn import_dmabuf(&self, fd: OwnedFd, base: u64, len: u64) -> Result<DmaBuf, DeviceError> {
        use std::os::fd::AsFd;
        let ordinal = self.inner.ordinal;
        let fail = |reason: String| DeviceError::Import {
            ordinal,
            what: "DMA-BUF fd",
            reason,
        };
        if !ffi::fd_is_dmabuf(fd.as_fd()) {
            return Err(fail("the fd is not a DMA-BUF".into()));
        }
        let size = ffi::dmabuf_size(fd.as_fd()).map_err(|e| fail(format!("size: {e}")))?;
        if size < len {
            return Err(fail(format!("the DMA-BUF has {size} bytes, {len} claimed")));
        }
        self.check_range(base, len)?;
        Ok(DmaBuf::new(fd, base, len, ordinal))
    }

    fn flush_direct_writes(&self) -> Result<(), DeviceError> {
        if !self.inner.caps.direct_write_flush {
            return Ok(());
        }
        self.inner.bind()?;
        ffi::flush_gpudirect_rdma_writes()
            .map_err(|e| self.inner.driver("cuFlushGPUDirectRDMAWrites", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipc_handles_raw_and_pytorch_framed() {
        let raw = [9u8; 64];
        assert_eq!(ipc_payload(&raw).unwrap(), &raw);
        let mut torch = vec![2u8, b'c'];
        torch.extend_from_slice(&raw);
        assert_eq!(ipc_payload(&torch).unwrap(), &raw);
        let mut expandable = vec![2u8, b'e'];
        expandable.extend_from_slice(&[0; 40]);
        assert!(ipc_payload(&expandable).unwrap_err().contains("expandable"));
        assert!(ipc_payload(&[1, 2, 3]).unwrap_err().contains("3 bytes"));
    }
}
