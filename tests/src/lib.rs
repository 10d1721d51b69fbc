//! Shared helpers for the integration tests: a node over a host-emulated device, instances
//! with canaried device KV (allocated by the node's device, or held by the test in a memfd
//! as a client without a GPU does: [`MemfdKv`]), and gauge checks.

use std::sync::Arc;
use std::time::Duration;

use kvferry_actors::config::ByteSize;
use kvferry_actors::fixture::{DeviceKv, KvKind};
use kvferry_actors::{BlockHash, Clock, InstanceId, Node, NodeConfig, Stats};
use kvferry_gpu::{Device, HostDevice, KvShape};

pub fn config(slot: u64, slots: u64) -> NodeConfig {
    let mut cfg = NodeConfig {
        node_id: "test".into(),
        ..Default::default()
    };
    cfg.pool.slot_bytes = ByteSize(slot);
    cfg.pool.size = ByteSize(slot * slots);
    cfg
}

/// A node over one host-emulated device.
pub fn node(slot: u64, slots: u64, clock: Clock) -> (Node, Arc<dyn Device>) {
    let dev: Arc<dyn Device> = HostDevice::new(0);
    let node = Node::start_with(config(slot, slots), vec![Arc::clone(&dev)], clock).unwrap();
    (node, dev)
}

pub fn hashes(range: std::ops::Range<u64>) -> Vec<BlockHash> {
    range.map(BlockHash::from_u64).collect()
}

/// Registers `rank` of `instance` over freshly allocated device KV.
// Every argument is one knob a test turns; a builder would only hide them.
#[allow(clippy::too_many_arguments)]
pub async fn register(
    node: &Node,
    dev: &Arc<dyn Device>,
    instance: &str,
    shape: KvShape,
    rank: u32,
    kind: KvKind,
    num_blocks: u32,
    view_offset: u64,
) -> DeviceKv {
    let kv = DeviceKv::alloc(
        Arc::clone(dev),
        shape,
        kind,
        num_blocks,
        shape.segment_bytes(),
        view_offset,
    )
    .unwrap();
    kv.register(node, instance, "m", rank).await.unwrap();
    kv
}

/// Puts pattern blocks `ids` (pattern block = hash value) for one rank.
pub async fn put(
    node: &Node,
    instance: &str,
    shape: &KvShape,
    rank: u32,
    ids: std::ops::Range<u64>,
) {
    kvferry_actors::fixture::put_pattern(node, &id(instance), shape, rank, ids)
        .await
        .unwrap();
}

pub fn id(s: &str) -> InstanceId {
    InstanceId::new(s).unwrap()
}

/// Waits (briefly) until the leak gauges are back to zero, then returns the stats.
pub async fn settled(node: &Node) -> Stats {
    for _ in 0..200 {
        let s = node.stats().await.unwrap();
        if s.leases_live == 0 && s.pinned_blocks == 0 && s.pins == 0 && s.transfers_in_flight == 0 {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let s = node.stats().await.unwrap();
    panic!("gauges did not return to zero: {s:?}");
}

/// A real `redis-server` on a free loopback port, killed on drop.
pub struct RedisServer {
    child: std::process::Child,
    pub addr: String,
}

impl RedisServer {
    pub fn start() -> Self {
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free loopback port")
                .port();
            let child = std::process::Command::new("redis-server")
                .args([
                    "--port",
                    &port.to_string(),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ])
                .args(["--bind", "127.0.0.1"])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap_or_else(|e| {
                    panic!(
                        "redis-server could not start ({e}): run ./scripts/test, which installs it"
                    )
                });
            let mut s = RedisServer {
                child,
                addr: format!("127.0.0.1:{port}"),
            };
            for _ in 0..500 {
                if matches!(s.child.try_wait(), Ok(Some(_))) {
                    break; // the port was taken meanwhile: try another
                }
                if std::net::TcpStream::connect(&s.addr).is_ok() {
                    return s;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        panic!("redis-server did not come up");
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Host KV of a client without a GPU, as the test plays that client: a memfd (created with
/// `MFD_ALLOW_SEALING`, the node seals it against shrinking), mapped shared here and every
/// byte set to [`kvferry_actors::fixture::CANARY`]. One rank, split K/V: segment `s` of layer
/// `l` has its own plane at offset `(l * segments + s) * plane_span`, the view starting
/// `view_offset` into it, with canary bytes after the last block.
pub struct MemfdKv {
    pub fd: std::os::fd::OwnedFd,
    pub len: u64,
    pub shape: KvShape,
    pub num_blocks: u32,
    pub view_offset: u64,
    map: *mut u8,
    plane_span: u64,
}

// SAFETY: the mapping is owned by this value alone (unmapped on drop) and only read through
// `&self` after loads completed; the raw pointer is the only reason the type is not `Send`.
unsafe impl Send for MemfdKv {}
// SAFETY: as above; `&self` methods only read the mapping.
unsafe impl Sync for MemfdKv {}

/// Canary bytes after each plane's last block.
const MEMFD_TAIL: u64 = 4096;

impl MemfdKv {
    pub fn new(shape: KvShape, num_blocks: u32, view_offset: u64) -> Self {
        use std::os::fd::{AsRawFd, FromRawFd};
        let plane_span = view_offset + u64::from(num_blocks) * shape.segment_bytes() + MEMFD_TAIL;
        let len = plane_span * u64::from(shape.layers() * shape.segments());
        // SAFETY: a NUL-terminated name; the result is checked before use.
        let raw = unsafe {
            libc::memfd_create(
                c"kvferry-test-kv".as_ptr(),
                libc::MFD_ALLOW_SEALING | libc::MFD_CLOEXEC,
            )
        };
        assert!(
            raw >= 0,
            "memfd_create: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: `raw` was just created and nobody else owns it.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate on the descriptor we own.
        let sized = unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) };
        assert_eq!(sized, 0);
        // SAFETY: a fresh shared mapping of the whole memfd; the kernel picks the address.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(map, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
        // SAFETY: the mapping is `len` bytes, writable, and ours.
        unsafe {
            std::ptr::write_bytes(
                map.cast::<u8>(),
                kvferry_actors::fixture::CANARY,
                len as usize,
            )
        };
        Self {
            fd,
            len,
            shape,
            num_blocks,
            view_offset,
            map: map.cast(),
            plane_span,
        }
    }

    /// The layout to register, in offsets inside the memfd.
    pub fn spec(&self) -> kvferry_gpu::KvLayoutSpec {
        let segs = u64::from(self.shape.segments());
        let layers = (0..u64::from(self.shape.layers()))
            .map(|l| kvferry_gpu::LayerLayout::Split {
                k_base: l * segs * self.plane_span,
                v_base: (l * segs + 1) * self.plane_span,
            })
            .collect();
        kvferry_gpu::KvLayoutSpec {
            kind: kvferry_gpu::GroupKind::Attention,
            layers,
            block_stride: self.shape.segment_bytes(),
            num_blocks: self.num_blocks,
            view_offset: self.view_offset,
        }
    }

    /// A registration of this KV as `rank` of `instance` (model "m", dtype bf16, device 0).
    pub fn register_request(&self, instance: &str, rank: u32) -> kvferry_actors::RegisterInstance {
        kvferry_actors::RegisterInstance {
            instance: id(instance),
            model: "m".into(),
            dtype: "bf16".into(),
            shape: self.shape,
            rank,
            device: 0,
            layout: self.spec(),
        }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping is `len` bytes and lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.map, self.len as usize) }
    }

    /// Byte offset inside the memfd of one segment of block `dst`.
    fn segment_offset(&self, layer: u32, seg: u32, dst: u32) -> usize {
        let plane = u64::from(layer * self.shape.segments() + seg) * self.plane_span;
        (plane + self.view_offset + u64::from(dst) * self.shape.segment_bytes()) as usize
    }

    /// Writes the pattern of `block` for `rank` into block `dst` (to be saved), as the
    /// client's engine would have computed it.
    pub fn write_block(&mut self, dst: u32, block: u64, rank: u32) {
        let seg = self.shape.segment_bytes() as usize;
        // SAFETY: the mapping is `len` bytes, writable, and `&mut self` makes this the only
        // view of it in this process.
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.map, self.len as usize) };
        for layer in 0..self.shape.layers() {
            for s in 0..self.shape.segments() {
                let off = self.segment_offset(layer, s, dst);
                kvferry_actors::fixture::fill_segment(
                    &mut bytes[off..off + seg],
                    block,
                    rank,
                    layer,
                    s,
                );
            }
        }
    }

    /// Checks every byte: the segments of `expected` `(block, pattern block)` hold that
    /// block's pattern for `rank`; every other byte is still a canary.
    pub fn verify(&self, expected: &[(u32, u64)], rank: u32) -> Result<(), String> {
        use kvferry_actors::fixture::{fill_segment, CANARY};
        let mut img = self.bytes().to_vec();
        let seg = self.shape.segment_bytes() as usize;
        let mut want = vec![0u8; seg];
        for &(dst, block) in expected {
            for layer in 0..self.shape.layers() {
                for s in 0..self.shape.segments() {
                    fill_segment(&mut want, block, rank, layer, s);
                    let off = self.segment_offset(layer, s, dst);
                    if img[off..off + seg] != want[..] {
                        return Err(format!(
                            "block {dst} (pattern {block}) layer {layer} segment {s} differs"
                        ));
                    }
                    img[off..off + seg].fill(CANARY);
                }
            }
        }
        match img.iter().position(|b| *b != CANARY) {
            Some(i) => Err(format!(
                "byte {i} of the memfd was written outside the destinations"
            )),
            None => Ok(()),
        }
    }
}

impl Drop for MemfdKv {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in `new`.
        unsafe { libc::munmap(self.map.cast(), self.len as usize) };
    }
}
