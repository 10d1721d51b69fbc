//! Deterministic KV contents and device KV with canaries, for the demo, the benchmarks and
//! the tests: every byte a load writes is predictable from (block, rank, layer, segment,
//! offset), and every byte it must not write holds a canary.

use std::sync::Arc;

use kvferry_gpu::{
    Device, DeviceBuffer, DeviceError, GroupKind, KvLayoutSpec, KvShape, LayerLayout,
};

/// The byte every untouched device byte holds.
pub const CANARY: u8 = 0xA5;

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fills `out` with the pattern of one segment (offsets are multiples of 8 within it).
pub fn fill_segment(out: &mut [u8], block: u64, rank: u32, layer: u32, seg: u32) {
    let seed =
        mix(block ^ (u64::from(rank) << 48) ^ (u64::from(layer) << 32) ^ (u64::from(seg) << 24));
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let w = mix(seed ^ i as u64).to_le_bytes();
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
}

/// One rank's part of a block in host layout (layer → segment), as `PutBlocks` takes it.
pub fn rank_part(shape: &KvShape, block: u64, rank: u32) -> Vec<u8> {
    let seg = shape.segment_bytes() as usize;
    let mut out = vec![0u8; shape.rank_bytes() as usize];
    for layer in 0..shape.layers() {
        for s in 0..shape.segments() {
            let i = (layer * shape.segments() + s) as usize;
            fill_segment(&mut out[i * seg..(i + 1) * seg], block, rank, layer, s);
        }
    }
    out
}

/// Puts pattern blocks `ids` (hash = pattern block = id) for `rank`, 16 blocks per call.
pub async fn put_pattern(
    node: &crate::Node,
    instance: &crate::InstanceId,
    shape: &KvShape,
    rank: u32,
    ids: std::ops::Range<u64>,
) -> Result<(), crate::NodeError> {
    let ids: Vec<u64> = ids.collect();
    for chunk in ids.chunks(16) {
        let blocks = chunk
            .iter()
            .map(|&i| (crate::BlockHash::from_u64(i), rank_part(shape, i, rank)))
            .collect();
        node.put_blocks(crate::PutBlocks {
            instance: instance.clone(),
            rank,
            blocks,
        })
        .await?;
    }
    Ok(())
}

/// How a test lays out its device KV: the layouts engines allocate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvKind {
    /// K and V in separate buffers per layer.
    Split,
    /// One buffer per layer, K plane then V plane (vLLM FlashAttention; with a one-segment
    /// shape, MLA).
    Contiguous,
    /// One buffer per layer, K and V interleaved per block (FlashInfer); the block stride
    /// holds both.
    FlashInfer,
    /// One buffer for every layer, a block holding each layer's K and V in turn (vLLM's
    /// cross-layer KV); the block stride holds the whole block.
    CrossLayer,
}

/// Device KV for one rank, allocated by us, every byte set to [`CANARY`].
pub struct DeviceKv {
    pub device: Arc<dyn Device>,
    pub shape: KvShape,
    pub kind: KvKind,
    pub num_blocks: u32,
    pub block_stride: u64,
    pub view_offset: u64,
    /// Where each K, V or KV plane buffer lies (with its canary tail).
    buffers: Vec<Span>,
    plane: u64,
    /// What owns the memory of `buffers`.
    _memory: Vec<DeviceBuffer>,
}

/// One plane buffer of a [`DeviceKv`]: `len` bytes at device address `ptr`.
#[derive(Clone, Copy, Debug)]
struct Span {
    ptr: u64,
    len: u64,
}

impl Span {
    fn ptr(&self) -> u64 {
        self.ptr
    }

    fn len(&self) -> u64 {
        self.len
    }
}

/// Bytes of canary after each plane, so a write past the last block is caught.
const TAIL: u64 = 4096;

impl DeviceKv {
    pub fn alloc(
        device: Arc<dyn Device>,
        shape: KvShape,
        kind: KvKind,
        num_blocks: u32,
        block_stride: u64,
        view_offset: u64,
    ) -> Result<Self, DeviceError> {
        let dev = Arc::clone(&device);
        Self::alloc_with(
            device,
            shape,
            kind,
            num_blocks,
            block_stride,
            view_offset,
            |len| dev.alloc(len),
        )
    }

    /// [`DeviceKv::alloc`] with each buffer's memory from `alloc(bytes)`.
    fn alloc_with(
        device: Arc<dyn Device>,
        shape: KvShape,
        kind: KvKind,
        num_blocks: u32,
        block_stride: u64,
        view_offset: u64,
        mut alloc: impl FnMut(u64) -> Result<DeviceBuffer, DeviceError>,
    ) -> Result<Self, DeviceError> {
        let (count, per_buffer) =
            Self::buffers_needed(shape, kind, num_blocks, block_stride, view_offset);
        let memory = (0..count)
            .map(|_| alloc(per_buffer))
            .collect::<Result<Vec<_>, _>>()?;
        let spans = memory
            .iter()
            .map(|b| Span {
                ptr: b.ptr(),
                len: b.len(),
            })
            .collect();
        Self::over(
            device,
            shape,
            kind,
            num_blocks,
            block_stride,
            view_offset,
            spans,
            memory,
        )
    }

    /// Split K/V planes one after another in a single allocation (block stride = one
    /// segment), as an engine worker that hands over one CUDA IPC handle has them.
    pub fn alloc_in_one(
        device: Arc<dyn Device>,
        shape: KvShape,
        num_blocks: u32,
        view_offset: u64,
    ) -> Result<Self, DeviceError> {
        let memory = device.alloc(Self::in_one_bytes(shape, num_blocks, view_offset))?;
        Self::in_one(device, memory, shape, num_blocks, view_offset)
    }

    /// Bytes of memory [`DeviceKv::in_one`] lays a KV of this geometry out in.
    fn in_one_bytes(shape: KvShape, num_blocks: u32, view_offset: u64) -> u64 {
        let (count, per) = Self::buffers_needed(
            shape,
            KvKind::Split,
            num_blocks,
            shape.segment_bytes(),
            view_offset,
        );
        u64::from(count) * per
    }

    /// Split K/V planes one after another in `memory` (block stride = one segment).
    fn in_one(
        device: Arc<dyn Device>,
        memory: DeviceBuffer,
        shape: KvShape,
        num_blocks: u32,
        view_offset: u64,
    ) -> Result<Self, DeviceError> {
        let stride = shape.segment_bytes();
        let (count, per) =
            Self::buffers_needed(shape, KvKind::Split, num_blocks, stride, view_offset);
        let spans = (0..u64::from(count))
            .map(|i| Span {
                ptr: memory.ptr() + i * per,
                len: per,
            })
            .collect();
        Self::over(
            device,
            shape,
            KvKind::Split,
            num_blocks,
            stride,
            view_offset,
            spans,
            vec![memory],
        )
    }

    /// Where the first plane buffer starts (the allocation of [`DeviceKv::alloc_in_one`]).
    pub fn base(&self) -> u64 {
        self.buffers.first().map_or(0, |b| b.ptr)
    }

    /// [`DeviceKv::spec`] with every address made an offset from `base`.
    pub fn spec_from(&self, base: u64) -> KvLayoutSpec {
        let mut spec = self.spec();
        for layer in &mut spec.layers {
            match layer {
                LayerLayout::Split { k_base, v_base } => {
                    *k_base -= base;
                    *v_base -= base;
                }
                LayerLayout::Contiguous { base: b, .. } => *b -= base,
            }
        }
        spec
    }

    /// How many plane buffers of how many bytes a KV of this geometry takes.
    fn buffers_needed(
        shape: KvShape,
        kind: KvKind,
        num_blocks: u32,
        block_stride: u64,
        view_offset: u64,
    ) -> (u32, u64) {
        let plane = u64::from(num_blocks) * block_stride;
        match kind {
            KvKind::Split => (
                shape.layers() * shape.segments(),
                view_offset + plane + TAIL,
            ),
            KvKind::Contiguous => (
                shape.layers(),
                view_offset + u64::from(shape.segments()) * plane + TAIL,
            ),
            KvKind::FlashInfer => (shape.layers(), view_offset + plane + TAIL),
            KvKind::CrossLayer => (1, view_offset + plane + TAIL),
        }
    }

    /// The KV over plane buffers `spans` (owned by `memory`), every byte set to the canary.
    #[allow(clippy::too_many_arguments)]
    fn over(
        device: Arc<dyn Device>,
        shape: KvShape,
        kind: KvKind,
        num_blocks: u32,
        block_stride: u64,
        view_offset: u64,
        spans: Vec<Span>,
        memory: Vec<DeviceBuffer>,
    ) -> Result<Self, DeviceError> {
        let kv = Self {
            device,
            shape,
            kind,
            num_blocks,
            block_stride,
            view_offset,
            buffers: spans,
            plane: u64::from(num_blocks) * block_stride,
            _memory: memory,
        };
        kv.reset()?;
        Ok(kv)
    }

    /// The layout to register (the view starts `view_offset` into each buffer).
    pub fn spec(&self) -> KvLayoutSpec {
        let layers = (0..self.shape.layers() as usize)
            .map(|l| match self.kind {
                KvKind::Split => LayerLayout::Split {
                    k_base: self.buffers[2 * l].ptr(),
                    v_base: self.buffers[2 * l + 1].ptr(),
                },
                KvKind::Contiguous => LayerLayout::Contiguous {
                    base: self.buffers[l].ptr(),
                    kv_stride: self.plane,
                },
                KvKind::FlashInfer => LayerLayout::Contiguous {
                    base: self.buffers[l].ptr(),
                    kv_stride: self.shape.segment_bytes(),
                },
                KvKind::CrossLayer => LayerLayout::Contiguous {
                    base: self.buffers[0].ptr()
                        + l as u64 * u64::from(self.shape.segments()) * self.shape.segment_bytes(),
                    kv_stride: self.shape.segment_bytes(),
                },
            })
            .collect();
        KvLayoutSpec {
            kind: match self.kind {
                KvKind::CrossLayer => GroupKind::CrossLayer,
                _ => GroupKind::Attention,
            },
            layers,
            block_stride: self.block_stride,
            num_blocks: self.num_blocks,
            view_offset: self.view_offset,
        }
    }

    /// Buffer index and byte offset of one segment of one block.
    fn locate(&self, layer: u32, seg: u32, block: u32) -> (usize, u64) {
        let at = self.view_offset + u64::from(block) * self.block_stride;
        let seg_bytes = self.shape.segment_bytes();
        match self.kind {
            KvKind::Split => ((layer * self.shape.segments() + seg) as usize, at),
            KvKind::Contiguous => (layer as usize, at + u64::from(seg) * self.plane),
            KvKind::FlashInfer => (layer as usize, at + u64::from(seg) * seg_bytes),
            KvKind::CrossLayer => (
                0,
                at + u64::from(layer * self.shape.segments() + seg) * seg_bytes,
            ),
        }
    }

    /// Each layer's planes as (buffer index, offset of block 0 inside that buffer, the view
    /// offset included): the regions of a registration where every buffer is its own memory.
    pub fn placements(&self) -> Vec<crate::rpc::RegionLayer> {
        let at = |layer, seg| {
            let (buffer, offset) = self.locate(layer, seg, 0);
            crate::rpc::PlanePlacement {
                region: buffer as u32,
                offset,
            }
        };
        (0..self.shape.layers())
            .map(|l| crate::rpc::RegionLayer {
                k: at(l, 0),
                v: (self.shape.segments() == 2).then(|| at(l, 1)),
            })
            .collect()
    }

    /// The bytes of each buffer.
    pub fn buffer_lens(&self) -> Vec<u64> {
        self.buffers.iter().map(Span::len).collect()
    }

    /// Where each buffer starts.
    pub fn buffer_ptrs(&self) -> Vec<u64> {
        self.buffers.iter().map(Span::ptr).collect()
    }

    /// Registers this KV as `rank` of `instance` on `node` (model `model`, dtype bf16).
    pub async fn register(
        &self,
        node: &crate::Node,
        instance: &str,
        model: &str,
        rank: u32,
    ) -> Result<crate::InstanceId, crate::NodeError> {
        let instance = crate::InstanceId::new(instance)?;
        node.register_instance(crate::RegisterInstance {
            instance: instance.clone(),
            model: model.into(),
            dtype: "bf16".into(),
            shape: self.shape,
            rank,
            device: self.device.ordinal(),
            layout: self.spec(),
        })
        .await?;
        Ok(instance)
    }

    /// Sets every byte back to [`CANARY`] (between loads that reuse the destinations).
    pub fn reset(&self) -> Result<(), DeviceError> {
        for b in &self.buffers {
            self.device
                .write(b.ptr(), &vec![CANARY; b.len() as usize])?;
        }
        Ok(())
    }

    /// Checks that every byte outside the segments of `blocks` still holds [`CANARY`]
    /// (after a failed load: whatever it wrote, it wrote only into its destinations).
    pub fn untouched_outside(&self, blocks: &[u32]) -> Result<(), String> {
        let seg = self.shape.segment_bytes() as usize;
        for (bi, b) in self.buffers.iter().enumerate() {
            let mut img = vec![0u8; b.len() as usize];
            self.device
                .read(b.ptr(), &mut img)
                .map_err(|e| e.to_string())?;
            for &dst in blocks {
                for layer in 0..self.shape.layers() {
                    for s in 0..self.shape.segments() {
                        let (buf, off) = self.locate(layer, s, dst);
                        if buf == bi {
                            img[off as usize..off as usize + seg].fill(CANARY);
                        }
                    }
                }
            }
            if let Some(i) = img.iter().position(|x| *x != CANARY) {
                return Err(format!(
                    "buffer {bi} byte {i} written outside the destinations"
                ));
            }
        }
        Ok(())
    }

    /// Writes the pattern of `block` for `rank` into device block `dst` (to be saved).
    pub fn write_block(&self, dst: u32, block: u64, rank: u32) -> Result<(), DeviceError> {
        let mut buf = vec![0u8; self.shape.segment_bytes() as usize];
        for layer in 0..self.shape.layers() {
            for seg in 0..self.shape.segments() {
                fill_segment(&mut buf, block, rank, layer, seg);
                let (b, off) = self.locate(layer, seg, dst);
                self.device.write(self.buffers[b].ptr() + off, &buf)?;
            }
        }
        Ok(())
    }

    /// Checks every byte of every buffer: the segments of `expected` `(device block,
    /// pattern block)` hold that block's pattern for `rank`; every other byte is a canary.
    /// Returns the bytes of pattern checked.
    pub fn verify(&self, expected: &[(u32, u64)], rank: u32) -> Result<u64, String> {
        let seg = self.shape.segment_bytes() as usize;
        let mut images: Vec<Vec<u8>> = Vec::with_capacity(self.buffers.len());
        for b in &self.buffers {
            let mut img = vec![0u8; b.len() as usize];
            self.device
                .read(b.ptr(), &mut img)
                .map_err(|e| e.to_string())?;
            images.push(img);
        }
        let mut want = vec![0u8; seg];
        let mut checked = 0u64;
        for &(dst, block) in expected {
            for layer in 0..self.shape.layers() {
                for s in 0..self.shape.segments() {
                    fill_segment(&mut want, block, rank, layer, s);
                    let (b, off) = self.locate(layer, s, dst);
                    let off = off as usize;
                    let got = &images[b][off..off + seg];
                    if got != &want[..] {
                        let i = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
                        return Err(format!(
                            "device block {dst} (pattern block {block}) layer {layer} segment {s}: \
                             byte {i} is {:#04x}, expected {:#04x}",
                            got[i], want[i]
                        ));
                    }
                    // Checked: reset to canary so the sweep below flags only stray writes.
                    images[b][off..off + seg].fill(CANARY);
                    checked += seg as u64;
                }
            }
        }
        for (bi, img) in images.iter().enumerate() {
            if let Some(i) = img.iter().position(|b| *b != CANARY) {
                return Err(format!(
                    "buffer {bi} byte {i} was overwritten ({:#04x}): a write outside the destinations",
                    img[i]
                ));
            }
        }
        Ok(checked)
    }
}

/// Host KV in a memfd, as an engine without a GPU hands it to a node over the node's fd
/// socket: split K/V planes one after another inside the memfd (block stride = one
/// segment), mapped in this process too, with the pattern and canaries of [`DeviceKv`]
/// (which it dereferences to).
pub struct MemfdKv {
    kv: DeviceKv,
    fd: std::os::fd::OwnedFd,
    base: u64,
    len: u64,
}

/// A memfd of `len` bytes, and its mapping as memory of `device`.
fn memfd(
    device: &kvferry_gpu::HostDevice,
    len: u64,
) -> Result<(std::os::fd::OwnedFd, DeviceBuffer), DeviceError> {
    use std::os::fd::FromRawFd;
    let fail = |what: &str| DeviceError::Import {
        ordinal: 0,
        what: "memfd",
        reason: format!("{what}: {}", std::io::Error::last_os_error()),
    };
    // SAFETY: a NUL-terminated name and valid flags; the result is checked.
    let raw = unsafe {
        libc::memfd_create(
            c"kvferry-client-kv".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if raw < 0 {
        return Err(fail("memfd_create"));
    }
    // SAFETY: `raw` is a descriptor we just created and own from here on.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
    // SAFETY: ftruncate on a descriptor we own.
    if unsafe { libc::ftruncate(raw, len as libc::off_t) } < 0 {
        return Err(fail("ftruncate"));
    }
    let mine = fd.try_clone().map_err(|_| fail("dup"))?;
    let memory = device.import_memfd(mine, len)?;
    Ok((fd, memory))
}

impl MemfdKv {
    pub fn create(shape: KvShape, num_blocks: u32, view_offset: u64) -> Result<Self, DeviceError> {
        let len = DeviceKv::in_one_bytes(shape, num_blocks, view_offset);
        let device = kvferry_gpu::HostDevice::new(0);
        let (fd, memory) = memfd(&device, len)?;
        let base = memory.ptr();
        let kv = DeviceKv::in_one(device, memory, shape, num_blocks, view_offset)?;
        Ok(Self { kv, fd, base, len })
    }

    /// The memfd to pass to the node.
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.fd.as_fd()
    }

    /// Bytes of the memfd.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The layout to register: offsets inside the memfd.
    pub fn spec(&self) -> KvLayoutSpec {
        self.kv.spec_from(self.base)
    }

    /// The registration of this KV as `rank` of `instance` (model `model`, dtype bf16).
    pub fn register_request(
        &self,
        instance: &crate::InstanceId,
        model: &str,
        rank: u32,
    ) -> crate::RegisterInstance {
        crate::RegisterInstance {
            instance: instance.clone(),
            model: model.into(),
            dtype: "bf16".into(),
            shape: self.kv.shape,
            rank,
            device: 0,
            layout: self.spec(),
        }
    }
}

impl MemfdKv {
    /// Passes this KV to a node through `client` (its fd socket) and registers it as `rank`
    /// of `instance`. Returns the namespace the node answered.
    pub async fn register_with(
        &self,
        client: &crate::rpc::EngineClient,
        instance: &crate::InstanceId,
        model: &str,
        rank: u32,
    ) -> Result<String, crate::rpc::EngineClientError> {
        let handle = client
            .send_memfd(instance, rank, 0, self.fd(), self.len())
            .await?;
        client
            .register(&self.register_request(instance, model, rank), handle)
            .await
    }
}

impl std::ops::Deref for MemfdKv {
    type Target = DeviceKv;

    fn deref(&self) -> &DeviceKv {
        &self.kv
    }
}

/// Host KV in one memfd per buffer — an engine's one tensor per layer (or per plane) — in
/// any [`KvKind`], registered with one memory region per memfd (engine protocol 2), with the
/// pattern and canaries of [`DeviceKv`] (which it dereferences to).
pub struct MemfdRegionsKv {
    kv: DeviceKv,
    fds: Vec<std::os::fd::OwnedFd>,
}

impl MemfdRegionsKv {
    pub fn create(
        shape: KvShape,
        kind: KvKind,
        num_blocks: u32,
        block_stride: u64,
        view_offset: u64,
    ) -> Result<Self, DeviceError> {
        let device = kvferry_gpu::HostDevice::new(0);
        let mut fds = Vec::new();
        let host = Arc::clone(&device);
        let kv = DeviceKv::alloc_with(
            device,
            shape,
            kind,
            num_blocks,
            block_stride,
            view_offset,
            |len| {
                let (fd, mem) = memfd(&host, len)?;
                fds.push(fd);
                Ok(mem)
            },
        )?;
        Ok(Self { kv, fds })
    }

    /// The registration of this KV as `rank` of `instance`, region i being memory handle
    /// `handles[i]` (memfd i sent on the fd socket).
    pub fn registration(
        &self,
        instance: &crate::InstanceId,
        model: &str,
        rank: u32,
        handles: &[u64],
    ) -> crate::rpc::RegisterRegions {
        crate::rpc::RegisterRegions {
            instance: instance.clone(),
            model: model.into(),
            dtype: "bf16".into(),
            shape: self.kv.shape,
            rank,
            device: 0,
            kind: self.kv.spec().kind,
            block_stride: self.kv.block_stride,
            num_blocks: self.kv.num_blocks,
            regions: handles
                .iter()
                .map(|&h| crate::rpc::MemoryRegion::Handle(h))
                .collect(),
            layers: self.kv.placements(),
        }
    }

    /// Memfd `i` (buffer `i`'s memory).
    pub fn fd_of(&self, i: usize) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.fds[i].as_fd()
    }

    /// Sends every memfd through `client` and registers them as `rank` of `instance`.
    pub async fn register_with(
        &self,
        client: &crate::rpc::EngineClient,
        instance: &crate::InstanceId,
        model: &str,
        rank: u32,
    ) -> Result<String, crate::rpc::EngineClientError> {
        let mut handles = Vec::with_capacity(self.fds.len());
        for (fd, len) in self.fds.iter().zip(self.kv.buffer_lens()) {
            use std::os::fd::AsFd;
            handles.push(
                client
                    .send_memfd(instance, rank, 0, fd.as_fd(), len)
                    .await?,
            );
        }
        client
            .register_regions(&self.registration(instance, model, rank, &handles))
            .await
    }
}

impl std::ops::Deref for MemfdRegionsKv {
    type Target = DeviceKv;

    fn deref(&self) -> &DeviceKv {
        &self.kv
    }
}

/// An owner node in its own process, for multi-process tests and benchmarks: it holds every
/// rank's part of pattern blocks `blocks` of namespace `model/bf16/<shape>`, serves
/// `kvferry.v1.Peer` on 127.0.0.1 (any port) and its pool over `provider`.
#[derive(Clone, Debug)]
pub struct OwnerSpec {
    pub node_id: String,
    pub model: String,
    pub provider: crate::remote::Provider,
    pub shape: KvShape,
    pub blocks: std::ops::Range<u64>,
    pub token: String,
}

/// Runs an owner until `stdin` closes: prints `READY <peer address>` on stdout once it
/// serves. The parent process closes our stdin to stop us.
pub fn run_owner_process(spec: OwnerSpec) -> Result<(), crate::NodeError> {
    use crate::remote::{GrpcPeers, GrpcPeersConfig, StaticDirectory};
    let stopped = |what| crate::NodeError::Stopped { what };
    let peers = GrpcPeers::new(
        GrpcPeersConfig {
            node_id: spec.node_id.clone(),
            provider: spec.provider,
            token: spec.token.clone(),
            peers: Vec::new(),
            shm_dir: std::env::temp_dir().join(format!("kvferry-owner-{}", std::process::id())),
            data_listen: "127.0.0.1:0".into(),
        },
        Arc::new(StaticDirectory::new(Vec::new())),
    );
    let n = spec.blocks.end - spec.blocks.start;
    let mut cfg = crate::NodeConfig {
        node_id: spec.node_id.clone(),
        ..Default::default()
    };
    cfg.pool.slot_bytes = crate::config::ByteSize(spec.shape.block_bytes().div_ceil(64) * 64);
    cfg.pool.size = crate::config::ByteSize(cfg.pool.slot_bytes.0 * n.max(1));
    let dev: Arc<dyn Device> = kvferry_gpu::HostDevice::new(0);
    let node = crate::Node::start_in(
        cfg,
        vec![Arc::clone(&dev)],
        crate::Clock::system(),
        Some(Arc::clone(&peers)),
    )?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|_| stopped("owner runtime"))?;
    let r = rt.block_on(async {
        // Every rank's part of every block: a TP requester reads each rank's from here.
        let mut kvs = Vec::new();
        for rank in 0..spec.shape.tp_size() {
            let kv = DeviceKv::alloc(
                Arc::clone(&dev),
                spec.shape,
                KvKind::Split,
                1,
                spec.shape.segment_bytes(),
                0,
            )?;
            let instance = kv
                .register(&node, "owner-engine", &spec.model, rank)
                .await?;
            put_pattern(&node, &instance, &spec.shape, rank, spec.blocks.clone()).await?;
            kvs.push(kv);
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|_| stopped("binding the peer service"))?;
        let addr = listener
            .local_addr()
            .map_err(|_| stopped("peer service address"))?;
        let mut backend = node.peer_backend();
        if let Some(e) = peers.data_endpoint() {
            backend = backend.with_endpoint(e);
        }
        let (stop, stopped_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(crate::rpc::serve(
            listener,
            backend,
            spec.token.clone(),
            async move {
                let _ = stopped_rx.await;
            },
        ));
        println!("READY {addr}");
        use std::io::Write;
        let _ = std::io::stdout().flush();
        // Serve until the parent closes our stdin.
        let _ = tokio::task::spawn_blocking(|| {
            let mut sink = Vec::new();
            let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
        })
        .await;
        let _ = stop.send(());
        let _ = server.await;
        drop(kvs);
        Ok::<_, crate::NodeError>(())
    });
    node.shutdown();
    r
}
