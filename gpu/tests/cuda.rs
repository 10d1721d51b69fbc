//! The `cuda` backend. Without a GPU only the "no driver" behaviour runs; everything else is
//! `#[ignore = "needs a CUDA GPU"]` and runs on the GPU machine with `--ignored`.
//!
//! Every load fills host blocks with a pattern derived from (host block, rank, layer,
//! segment, offset), fills GPU KV with a canary, and checks every byte of the GPU allocations
//! afterwards: loaded segments hold the pattern, everything else still holds the canary.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

use kvferry_gpu::cuda::{self, CopyPath, CudaDevice, CudaOptions};
use kvferry_gpu::{
    open_device, CopyDirection, CopyEvent, CopyList, CopyStats, Device, DeviceBuffer, DeviceError,
    DeviceKind, GroupKind, KvLayout, KvLayoutSpec, KvShape, LayerLayout, LayoutError,
};

const CANARY: u8 = 0xCD;

fn pat(block: u32, rank: u32, layer: u32, seg: u32, off: u64) -> u8 {
    ((u64::from(block) * 131
        + u64::from(rank) * 53
        + u64::from(layer) * 31
        + u64::from(seg) * 17
        + off * 7)
        % 251) as u8
}

fn wait(ev: CopyEvent) -> Result<CopyStats, DeviceError> {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime")
        .block_on(ev)
}

/// Page-aligned anonymous host memory, unmapped on drop.
struct HostMem {
    ptr: *mut u8,
    len: usize,
}

impl HostMem {
    fn new(len: usize) -> Self {
        // SAFETY: anonymous private mapping, no fd; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED, "mmap");
        Self { ptr: p.cast(), len }
    }

    fn addr(&self) -> u64 {
        self.ptr as u64
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is `len` bytes, readable and writable, owned by `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for HostMem {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `new`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// A host pool of `slots` blocks of `shape`, each block filled with the pattern of its own
/// slot number for every rank.
fn fill_pool(mem: &mut HostMem, shape: &KvShape, slots: u32) {
    let bb = shape.block_bytes() as usize;
    let seg = shape.segment_bytes();
    let buf = mem.bytes();
    for slot in 0..slots {
        for rank in 0..shape.tp_size() {
            for layer in 0..shape.layers() {
                for s in 0..shape.segments() {
                    let o = slot as usize * bb + shape.segment_offset(rank, layer, s) as usize;
                    for off in 0..seg {
                        buf[o + off as usize] = pat(slot, rank, layer, s, off);
                    }
                }
            }
        }
    }
}

/// `(host slot, destination block)` pairs → one copy list for one rank.
fn load_list(
    pool: u64,
    shape: &KvShape,
    layout: &KvLayout,
    rank: u32,
    pairs: &[(u32, u32)],
) -> CopyList {
    let mut l = CopyList::default();
    for &(slot, block) in pairs {
        for layer in 0..shape.layers() {
            for s in 0..shape.segments() {
                l.push(
                    pool + u64::from(slot) * shape.block_bytes()
                        + shape.segment_offset(rank, layer, s),
                    layout.segment_addr(layer, s, block),
                    shape.segment_bytes(),
                );
            }
        }
    }
    l
}

/// The reverse: GPU blocks → host slots.
fn save_list(
    pool: u64,
    shape: &KvShape,
    layout: &KvLayout,
    rank: u32,
    pairs: &[(u32, u32)],
) -> CopyList {
    let mut l = CopyList::default();
    for &(slot, block) in pairs {
        for layer in 0..shape.layers() {
            for s in 0..shape.segments() {
                l.push(
                    layout.segment_addr(layer, s, block),
                    pool + u64::from(slot) * shape.block_bytes()
                        + shape.segment_offset(rank, layer, s),
                    shape.segment_bytes(),
                );
            }
        }
    }
    l
}

/// Reads every buffer back and checks: segment `(layer, s)` of a loaded block holds the
/// pattern of its source slot, every other byte the canary.
fn verify(
    dev: &dyn Device,
    bufs: &[&DeviceBuffer],
    shape: &KvShape,
    layout: &KvLayout,
    rank: u32,
    pairs: &[(u32, u32)],
) {
    let mut expect: Vec<Vec<u8>> = bufs
        .iter()
        .map(|b| vec![CANARY; b.len() as usize])
        .collect();
    for &(slot, block) in pairs {
        for layer in 0..shape.layers() {
            for s in 0..shape.segments() {
                let a = layout.segment_addr(layer, s, block);
                let (i, b) = bufs
                    .iter()
                    .enumerate()
                    .find(|(_, b)| a >= b.ptr() && a < b.ptr() + b.len())
                    .expect("segment inside a buffer");
                let o = (a - b.ptr()) as usize;
                for off in 0..shape.segment_bytes() {
                    expect[i][o + off as usize] = pat(slot, rank, layer, s, off);
                }
            }
        }
    }
    for (i, b) in bufs.iter().enumerate() {
        let mut got = vec![0u8; b.len() as usize];
        dev.read(b.ptr(), &mut got).expect("read back");
        if got != expect[i] {
            let at = got
                .iter()
                .zip(&expect[i])
                .position(|(g, e)| g != e)
                .unwrap_or(0);
            panic!(
                "buffer {i} (rank {rank}): first mismatch at byte {at}: got {:#x}, expected {:#x}",
                got[at], expect[i][at]
            );
        }
    }
}

fn canary(dev: &dyn Device, b: &DeviceBuffer) {
    dev.write(b.ptr(), &vec![CANARY; b.len() as usize])
        .expect("canary fill");
}

fn open(path: CopyPath) -> Arc<CudaDevice> {
    CudaDevice::open_with(0, CudaOptions::with_copy_path(path)).expect("open CUDA device 0")
}

#[test]
fn opening_without_a_driver_is_a_typed_error() {
    if cuda::driver_present() {
        // A GPU machine: auto picks cuda there when a device is present.
        let d = open_device("auto", 0).expect("auto");
        assert!(matches!(d.kind(), DeviceKind::Cuda | DeviceKind::Host));
        return;
    }
    let err = CudaDevice::open(0).unwrap_err();
    assert!(matches!(err, DeviceError::NoDriver { .. }), "{err}");
    let err = open_device("cuda", 0).unwrap_err();
    assert!(matches!(err, DeviceError::NoDriver { .. }), "{err}");
    let d = open_device("auto", 0).expect("auto falls back to host");
    assert_eq!(d.kind(), DeviceKind::Host);
    let err = open_device("tpu", 0).unwrap_err();
    assert!(
        matches!(
            err,
            DeviceError::Unsupported {
                what: "device kind",
                ..
            }
        ),
        "{err}"
    );
    // The host backend keeps its defaults for the new trait methods.
    let h = open_device("host", 0).unwrap();
    assert!(!h.capabilities().dmabuf_export);
    assert!(h.flush_direct_writes().is_ok());
    assert!(matches!(
        h.export_dmabuf(0, 1),
        Err(DeviceError::Unsupported { .. })
    ));
}

/// One rank, one load of `pairs`, then a save of those blocks into fresh slots, a canary
/// refill, and a load of the saved slots into other blocks: the round trip.
fn load_save_load(
    dev: &Arc<CudaDevice>,
    shape: KvShape,
    split: bool,
    view: u64,
    pairs: &[(u32, u32)],
) {
    let blocks = 16u32;
    let stride = shape.segment_bytes() * 2; // room between blocks: fragmented destinations
    let plane = u64::from(blocks) * stride;
    let mut bufs = Vec::new();
    let mut layers = Vec::new();
    for _ in 0..shape.layers() {
        if split {
            let k = dev.alloc(plane + view).unwrap();
            let v = dev.alloc(plane + view).unwrap();
            layers.push(LayerLayout::Split {
                k_base: k.ptr(),
                v_base: v.ptr(),
            });
            bufs.push(k);
            bufs.push(v);
        } else {
            let kv_stride = plane + 4096;
            let b = dev
                .alloc(view + kv_stride * u64::from(shape.segments()))
                .unwrap();
            layers.push(LayerLayout::Contiguous {
                base: b.ptr(),
                kv_stride,
            });
            bufs.push(b);
        }
    }
    let spec = KvLayoutSpec {
        kind: GroupKind::Attention,
        layers,
        block_stride: stride,
        num_blocks: blocks,
        view_offset: view,
    };
    let layout = KvLayout::new_on(spec, &shape, dev.as_ref()).expect("layout on the GPU");
    for b in &bufs {
        canary(dev.as_ref(), b);
    }
    let slots = 8u32;
    let mut pool = HostMem::new((shape.block_bytes() * u64::from(slots * 2)) as usize);
    fill_pool(&mut pool, &shape, slots);
    let _reg = dev
        .register_host(pool.addr(), pool.len as u64, false)
        .unwrap();
    let refs: Vec<&DeviceBuffer> = bufs.iter().collect();

    // SAFETY: `pool` outlives the awaited event.
    let ev = unsafe {
        dev.submit(
            CopyDirection::HostToDevice,
            load_list(pool.addr(), &shape, &layout, 0, pairs),
        )
    };
    let st = wait(ev.unwrap()).unwrap();
    assert_eq!(st.bytes, pairs.len() as u64 * shape.rank_bytes());
    verify(dev.as_ref(), &refs, &shape, &layout, 0, pairs);

    // Save: GPU blocks → slots `slots..2*slots` (after a canary fill of those slots).
    let saved: Vec<(u32, u32)> = pairs
        .iter()
        .enumerate()
        .map(|(i, &(_, b))| (slots + i as u32, b))
        .collect();
    let hb = shape.block_bytes() as usize;
    pool.bytes()[slots as usize * hb..].fill(CANARY);
    // SAFETY: `pool` outlives the awaited event and nobody else touches it meanwhile.
    let ev = unsafe {
        dev.submit(
            CopyDirection::DeviceToHost,
            save_list(pool.addr(), &shape, &layout, 0, &saved),
        )
    };
    wait(ev.unwrap()).unwrap();
    for (i, &(src_slot, _)) in pairs.iter().enumerate() {
        let (a, b) = pool.bytes().split_at_mut((slots as usize + i) * hb);
        assert_eq!(
            &b[..hb],
            &a[src_slot as usize * hb..src_slot as usize * hb + hb],
            "saved block {i}"
        );
    }
    // Everything past the saved slots is untouched.
    let tail = (slots as usize + pairs.len()) * hb;
    assert!(
        pool.bytes()[tail..].iter().all(|&b| b == CANARY),
        "save wrote outside its slots"
    );

    // Load the saved copies into other blocks: the round trip.
    for b in &bufs {
        canary(dev.as_ref(), b);
    }
    let back: Vec<(u32, u32)> = saved
        .iter()
        .map(|&(slot, b)| (slot, (b + 5) % blocks))
        .collect();
    // SAFETY: `pool` outlives the awaited event.
    let ev = unsafe {
        dev.submit(
            CopyDirection::HostToDevice,
            load_list(pool.addr(), &shape, &layout, 0, &back),
        )
    };
    wait(ev.unwrap()).unwrap();
    // Saved slot `slots + i` holds the pattern of source slot pairs[i].0.
    let expect: Vec<(u32, u32)> = back
        .iter()
        .zip(pairs)
        .map(|(&(_, b), &(s, _))| (s, b))
        .collect();
    verify(dev.as_ref(), &refs, &shape, &layout, 0, &expect);
    assert!(dev.take_teardown_errors().is_empty());
}

const FRAGMENTED: &[(u32, u32)] = &[(0, 9), (3, 2), (1, 14), (7, 5), (2, 0), (5, 11)];
const CONTIGUOUS: &[(u32, u32)] = &[(0, 4), (1, 5), (2, 6), (3, 7)];

#[test]
#[ignore = "needs a CUDA GPU"]
fn split_kv_fragmented_every_path() {
    let shape = KvShape::new(2, 1, 2, 4096).unwrap();
    for path in [
        CopyPath::Auto,
        CopyPath::Kernel,
        CopyPath::Batch,
        CopyPath::PerOp,
        CopyPath::Staged,
    ] {
        let dev = open(path);
        load_save_load(&dev, shape, true, 0, FRAGMENTED);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn contiguous_kv_with_view_offset() {
    let shape = KvShape::new(3, 1, 2, 2048).unwrap();
    for path in [
        CopyPath::Auto,
        CopyPath::Kernel,
        CopyPath::Batch,
        CopyPath::Staged,
    ] {
        let dev = open(path);
        load_save_load(&dev, shape, false, 768, FRAGMENTED);
        load_save_load(&dev, shape, false, 768, CONTIGUOUS);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn mla_single_segment_and_multilayer() {
    let dev = open(CopyPath::Auto);
    load_save_load(
        &dev,
        KvShape::new(4, 1, 1, 1024).unwrap(),
        false,
        64,
        FRAGMENTED,
    );
    load_save_load(
        &dev,
        KvShape::new(32, 1, 2, 512).unwrap(),
        true,
        128,
        FRAGMENTED,
    );
    load_save_load(
        &dev,
        KvShape::new(32, 1, 2, 512).unwrap(),
        true,
        0,
        CONTIGUOUS,
    );
}

fn open_staged(path: CopyPath, chunk: u64, chunks: u32) -> Arc<CudaDevice> {
    CudaDevice::open_with(
        0,
        CudaOptions::with_copy_path(path).with_staging(chunk, chunks),
    )
    .expect("open CUDA device 0")
}

/// The staged path with chunks far smaller than a block, so runs are cut mid-segment and
/// every staging buffer is reused several times within one batch.
#[test]
#[ignore = "needs a CUDA GPU"]
fn staged_small_chunks_split_contiguous_and_views() {
    for (chunk, n) in [(4096, 2), (12288, 3), (1 << 20, 2)] {
        let dev = open_staged(CopyPath::Staged, chunk, n);
        load_save_load(
            &dev,
            KvShape::new(2, 1, 2, 4096).unwrap(),
            true,
            0,
            FRAGMENTED,
        );
        let shape = KvShape::new(3, 1, 2, 2048).unwrap();
        load_save_load(&dev, shape, false, 768, FRAGMENTED);
        load_save_load(&dev, shape, false, 768, CONTIGUOUS);
        load_save_load(
            &dev,
            KvShape::new(32, 1, 2, 512).unwrap(),
            true,
            128,
            FRAGMENTED,
        );
        assert_eq!(dev.staged_batches(), 12, "chunk {chunk}");
    }
}

/// The bench's shape (28 layers, split K/V, 64 KiB segments): `Auto` stages the loads and the
/// save with the default chunks and with 4 MiB ones (runs of 3.5 MiB cut across chunks).
#[test]
#[ignore = "needs a CUDA GPU"]
fn staged_auto_on_the_bench_shape() {
    let shape = KvShape::new(28, 1, 2, 64 << 10).unwrap();
    let dev = open(CopyPath::Auto);
    load_save_load(&dev, shape, true, 0, FRAGMENTED);
    assert_eq!(dev.staged_batches(), 3, "Auto took the staged path");
    let dev = open_staged(CopyPath::Auto, 4 << 20, 2);
    load_save_load(&dev, shape, true, 4096, FRAGMENTED);
    load_save_load(&dev, shape, false, 4096, CONTIGUOUS);
    assert_eq!(dev.staged_batches(), 6);
    // With staging off, Auto keeps the kernel.
    let dev = open_staged(CopyPath::Auto, 0, 2);
    load_save_load(&dev, shape, true, 0, FRAGMENTED);
    assert_eq!(dev.staged_batches(), 0);
}

/// Odd offsets and lengths on both sides (the kernel's byte path), runs cut by small chunks,
/// pinned and pageable host memory, both directions, byte for byte with canaries; and a
/// staged batch with one bad range copies nothing.
#[test]
#[ignore = "needs a CUDA GPU"]
fn staged_unaligned_ranges_both_directions() {
    const N: usize = 1 << 20;
    for pinned in [true, false] {
        for chunk in [4096u64, 8192 + 256, 32 << 20] {
            let dev = open_staged(CopyPath::Staged, chunk, 2);
            let buf = dev.alloc(N as u64).unwrap();
            canary(dev.as_ref(), &buf);
            let mut host = HostMem::new(N);
            for (i, b) in host.bytes().iter_mut().enumerate() {
                *b = (i * 13 % 241) as u8;
            }
            let _reg = pinned.then(|| dev.register_host(host.addr(), N as u64, false).unwrap());
            // (host offset, device offset, len): two host runs, the second at an odd start.
            let ops: Vec<(u64, u64, u64)> = vec![
                (5, 3, 1000),
                (1005, 2000, 77),
                (1082, 4096, 20000),
                (21082, 30001, 16),
                (21098, 40000, 9),
                (50003, 60000, 70001),
                (120004, 140000, 4096),
                (124100, 150001, 33333),
            ];
            let mut l = CopyList::default();
            let mut want = vec![CANARY; N];
            for &(h, d, n) in &ops {
                l.push(host.addr() + h, buf.ptr() + d, n);
                let (h, d, n) = (h as usize, d as usize, n as usize);
                want[d..d + n].copy_from_slice(&host.bytes()[h..h + n]);
            }
            assert!(l.len() >= 7);
            // SAFETY: `host` outlives the awaited event.
            wait(unsafe { dev.submit(CopyDirection::HostToDevice, l) }.unwrap()).unwrap();
            let mut got = vec![0u8; N];
            dev.read(buf.ptr(), &mut got).unwrap();
            let at = got.iter().zip(&want).position(|(g, w)| g != w);
            assert_eq!(at, None, "H2D pinned {pinned} chunk {chunk}");

            // Back into a canary-filled host buffer at the same offsets.
            let mut back = HostMem::new(N);
            back.bytes().fill(CANARY);
            let _reg2 = pinned.then(|| dev.register_host(back.addr(), N as u64, false).unwrap());
            let mut l = CopyList::default();
            let mut expect = vec![CANARY; N];
            for &(h, d, n) in &ops {
                l.push(buf.ptr() + d, back.addr() + h, n);
                let (h, d, n) = (h as usize, d as usize, n as usize);
                expect[h..h + n].copy_from_slice(&want[d..d + n]);
            }
            // SAFETY: `back` outlives the awaited event.
            wait(unsafe { dev.submit(CopyDirection::DeviceToHost, l) }.unwrap()).unwrap();
            let at = back.bytes().iter().zip(&expect).position(|(g, w)| g != w);
            assert_eq!(at, None, "D2H pinned {pinned} chunk {chunk}");
            assert_eq!(dev.staged_batches(), 2);

            // One bad range: refused, nothing copied.
            canary(dev.as_ref(), &buf);
            let mut l = CopyList::default();
            l.push(host.addr(), buf.ptr(), 4096);
            l.push(host.addr() + 4096, buf.ptr() + N as u64 - 16, 64);
            // SAFETY: `host` outlives the awaited event.
            let err =
                wait(unsafe { dev.submit(CopyDirection::HostToDevice, l) }.unwrap()).unwrap_err();
            assert!(matches!(err, DeviceError::NotDeviceMemory { .. }), "{err}");
            dev.read(buf.ptr(), &mut got).unwrap();
            assert!(got.iter().all(|&b| b == CANARY), "refused batch wrote");
            assert_eq!(dev.staged_batches(), 2);
            drop(_reg2);
            drop(_reg);
            assert!(dev.take_teardown_errors().is_empty());
        }
    }
}

/// Many batches in flight on one lane at once reuse the staging buffers: each load's bytes
/// must still land whole (the events order refills after scatters).
#[test]
#[ignore = "needs a CUDA GPU"]
fn staged_batches_in_flight_together() {
    const SEG: u64 = 64 << 10;
    let dev = open_staged(CopyPath::Staged, 1 << 20, 2);
    let rounds = 12u64;
    let per = 40u64; // 2.5 MiB per batch: three chunks
    let host_len = (rounds * per * SEG) as usize;
    let mut host = HostMem::new(host_len);
    for (i, b) in host.bytes().iter_mut().enumerate() {
        *b = ((i / 4096) * 7 + i) as u8;
    }
    let _reg = dev
        .register_host(host.addr(), host_len as u64, false)
        .unwrap();
    let buf = dev.alloc(rounds * per * SEG * 2).unwrap();
    canary(dev.as_ref(), &buf);
    // Segment k of the host side at device slot `2 * (n - 1 - k)`: device side descending
    // inside a batch, a canary gap after each. Every batch is submitted before any is
    // awaited.
    let in_flight = |dir: CopyDirection, host: u64| {
        let events: Vec<CopyEvent> = (0..rounds)
            .map(|r| {
                let mut l = CopyList::default();
                for k in r * per..(r + 1) * per {
                    let dev_side = buf.ptr() + (rounds * per - 1 - k) * 2 * SEG;
                    let host_side = host + k * SEG;
                    match dir {
                        CopyDirection::HostToDevice => l.push(host_side, dev_side, SEG),
                        CopyDirection::DeviceToHost => l.push(dev_side, host_side, SEG),
                    }
                }
                // SAFETY: both host buffers outlive every awaited event, and nothing else
                // writes the device-to-host one meanwhile.
                unsafe { dev.submit(dir, l) }.unwrap()
            })
            .collect();
        for ev in events {
            wait(ev).unwrap();
        }
    };
    in_flight(CopyDirection::HostToDevice, host.addr());
    let mut got = vec![0u8; (rounds * per * SEG * 2) as usize];
    dev.read(buf.ptr(), &mut got).unwrap();
    for k in 0..rounds * per {
        let slot = ((rounds * per - 1 - k) * 2 * SEG) as usize;
        let h = (k * SEG) as usize;
        assert!(
            got[slot..slot + SEG as usize] == host.bytes()[h..h + SEG as usize],
            "segment {k}"
        );
        assert!(
            got[slot + SEG as usize..slot + 2 * SEG as usize]
                .iter()
                .all(|&b| b == CANARY),
            "gap after segment {k}"
        );
    }
    assert_eq!(dev.staged_batches(), rounds);
    // And back, device → host, the batches again all in flight at once: a batch's first
    // gather may start while the previous batch's last copy drains, never into a buffer
    // that copy still reads.
    let mut back = HostMem::new(host_len + 2 * SEG as usize);
    back.bytes().fill(CANARY);
    let _reg_back = dev
        .register_host(back.addr(), back.bytes().len() as u64, false)
        .unwrap();
    in_flight(CopyDirection::DeviceToHost, back.addr() + SEG);
    let seg = SEG as usize;
    assert!(back.bytes()[..seg].iter().all(|&b| b == CANARY), "before");
    assert!(
        back.bytes()[seg + host_len..].iter().all(|&b| b == CANARY),
        "after"
    );
    for k in 0..(rounds * per) as usize {
        assert!(
            back.bytes()[seg + k * seg..seg + (k + 1) * seg]
                == host.bytes()[k * seg..(k + 1) * seg],
            "segment {k} back"
        );
    }
    assert_eq!(dev.staged_batches(), 2 * rounds);
}

/// Batches of `DEFER_MIN_OPS` ranges and more go to the lane's submit thread; the caller's
/// later batches follow them there while any wait, so each lane still copies and reports in
/// submission order: a small batch submitted after a large one over the same bytes lands
/// last, and the batches' hooks run in order. A large batch refused by the planner fails
/// through its event alone, and the batch after it lands. A small batch handed over
/// detached is followed by the next one the same way.
#[test]
#[ignore = "needs a CUDA GPU"]
fn large_batches_are_queued_in_submission_order() {
    use std::sync::Mutex;
    const SEG: u64 = 4 << 10;
    let big = cuda::DEFER_MIN_OPS as u64 + 100;
    for path in [CopyPath::Auto, CopyPath::Batch] {
        let dev = open(path);
        let len = (big * SEG) as usize;
        // Two host sources: pattern A and pattern B.
        let mut host = HostMem::new(2 * len);
        for (i, b) in host.bytes().iter_mut().enumerate() {
            *b = if i < len {
                (i % 251) as u8
            } else {
                0xB0 | (i % 13) as u8
            };
        }
        let _reg = dev
            .register_host(host.addr(), 2 * len as u64, false)
            .unwrap();
        let buf = dev.alloc(len as u64 + 2 * SEG).unwrap();
        canary(dev.as_ref(), &buf);
        // Segment k's device slot: descending, so no two ranges of a batch merge.
        let slot = |k: u64| SEG + (big - 1 - k) * SEG;
        let order = Arc::new(Mutex::new(Vec::new()));
        let hook = |tag: usize| -> Option<kvferry_gpu::Landed> {
            let order = Arc::clone(&order);
            Some(Box::new(move |r: &Result<CopyStats, DeviceError>| {
                order.lock().unwrap().push((tag, r.is_ok()));
            }))
        };
        let seg_list = |src: u64, segs: std::ops::Range<u64>| {
            let mut l = CopyList::default();
            for k in segs {
                l.push(src + k * SEG, buf.ptr() + slot(k), SEG);
            }
            l
        };
        let mut events = Vec::new();
        for round in 0..3u64 {
            // Large: pattern A everywhere; then small: pattern B over segments of this round.
            let a = seg_list(host.addr(), 0..big);
            let b = seg_list(host.addr() + len as u64, round * 8..round * 8 + 8);
            assert!(a.len() >= cuda::DEFER_MIN_OPS && b.len() < cuda::DEFER_MIN_OPS);
            // SAFETY: `host` outlives every awaited event.
            unsafe {
                events.push(
                    dev.submit_then(CopyDirection::HostToDevice, a, hook(2 * round as usize))
                        .unwrap(),
                );
                events.push(
                    dev.submit_then(CopyDirection::HostToDevice, b, hook(2 * round as usize + 1))
                        .unwrap(),
                );
            }
        }
        for ev in events {
            wait(ev).unwrap();
        }
        let tags: Vec<(usize, bool)> = order.lock().unwrap().clone();
        assert_eq!(
            tags,
            (0..6).map(|t| (t, true)).collect::<Vec<_>>(),
            "{path:?}"
        );
        let mut got = vec![0u8; len + 2 * SEG as usize];
        dev.read(buf.ptr(), &mut got).unwrap();
        let seg = SEG as usize;
        assert!(got[..seg].iter().all(|&b| b == CANARY), "{path:?}: before");
        assert!(
            got[seg + len..].iter().all(|&b| b == CANARY),
            "{path:?}: after"
        );
        let h = host.bytes().to_vec();
        // The last round's small batch landed after the last large one.
        for k in 0..big as usize {
            let want = if (16..24).contains(&k) {
                &h[len + k * seg..len + (k + 1) * seg]
            } else {
                &h[k * seg..(k + 1) * seg]
            };
            let at = slot(k as u64) as usize;
            assert!(&got[at..at + seg] == want, "{path:?}: segment {k}");
        }
        // A large batch with one range outside device memory: refused through its event;
        // the small batch after it (queued behind it) lands.
        let mut bad = seg_list(host.addr(), 0..big);
        bad.push(host.addr(), host.addr() + len as u64, SEG);
        // SAFETY: as above.
        let (e1, e2) = unsafe {
            (
                dev.submit(CopyDirection::HostToDevice, bad).unwrap(),
                dev.submit(
                    CopyDirection::HostToDevice,
                    seg_list(host.addr() + len as u64, 0..8),
                )
                .unwrap(),
            )
        };
        let err = wait(e1).unwrap_err();
        assert!(matches!(err, DeviceError::NotDeviceMemory { .. }), "{err}");
        wait(e2).unwrap();
        dev.read(buf.ptr(), &mut got).unwrap();
        for k in 0..8 {
            let at = slot(k as u64) as usize;
            let want = &h[len + k * seg..len + (k + 1) * seg];
            assert!(
                &got[at..at + seg] == want,
                "{path:?}: segment {k} after a refusal"
            );
        }
        // A small batch handed over detached, then a small one over the same slots: the
        // second follows the first (pattern A over B).
        // SAFETY: as above.
        let (e1, e2) = unsafe {
            (
                dev.submit_detached(
                    CopyDirection::HostToDevice,
                    seg_list(host.addr() + len as u64, 40..48),
                )
                .unwrap(),
                dev.submit(CopyDirection::HostToDevice, seg_list(host.addr(), 40..48))
                    .unwrap(),
            )
        };
        wait(e1).unwrap();
        wait(e2).unwrap();
        dev.read(buf.ptr(), &mut got).unwrap();
        for k in 40..48 {
            let at = slot(k as u64) as usize;
            let want = &h[k * seg..(k + 1) * seg];
            assert!(
                &got[at..at + seg] == want,
                "{path:?}: segment {k} after a detached batch"
            );
        }
        assert!(dev.take_teardown_errors().is_empty());
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pageable_host_memory_still_copies() {
    // Not registered: the planner sends those ranges to the copy engines.
    let dev = open(CopyPath::Auto);
    let shape = KvShape::new(2, 1, 2, 1024).unwrap();
    let layout_buf = dev.alloc(64 * 1024).unwrap();
    canary(dev.as_ref(), &layout_buf);
    let spec = KvLayoutSpec {
        kind: GroupKind::Attention,
        layers: vec![
            LayerLayout::Split {
                k_base: layout_buf.ptr(),
                v_base: layout_buf.ptr() + 16384,
            },
            LayerLayout::Split {
                k_base: layout_buf.ptr() + 32768,
                v_base: layout_buf.ptr() + 49152,
            },
        ],
        block_stride: 2048,
        num_blocks: 8,
        view_offset: 0,
    };
    let layout = KvLayout::new_on(spec, &shape, dev.as_ref()).unwrap();
    let mut pool = HostMem::new(shape.block_bytes() as usize * 8);
    fill_pool(&mut pool, &shape, 8);
    let pairs = [(0, 3), (1, 1), (2, 7), (3, 5), (4, 0)];
    // SAFETY: `pool` outlives the awaited event.
    let ev = unsafe {
        dev.submit(
            CopyDirection::HostToDevice,
            load_list(pool.addr(), &shape, &layout, 0, &pairs),
        )
    };
    wait(ev.unwrap()).unwrap();
    verify(dev.as_ref(), &[&layout_buf], &shape, &layout, 0, &pairs);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn two_tp_ranks_on_one_gpu() {
    let shape = KvShape::new(4, 2, 2, 2048).unwrap();
    let slots = 6u32;
    let mut pool = HostMem::new((shape.block_bytes() * u64::from(slots)) as usize);
    fill_pool(&mut pool, &shape, slots);
    let ranks: Vec<Arc<CudaDevice>> = (0..2).map(|_| open(CopyPath::Auto)).collect();
    // Both handles register the same pool: the driver registers it once, counted.
    let _regs: Vec<_> = ranks
        .iter()
        .map(|d| {
            d.register_host(pool.addr(), pool.len as u64, false)
                .unwrap()
        })
        .collect();
    let pairs = [(0, 7), (4, 1), (2, 3), (5, 6), (1, 0)];
    let mut state = Vec::new();
    for (rank, dev) in ranks.iter().enumerate() {
        let mut bufs = Vec::new();
        let mut layers = Vec::new();
        for _ in 0..shape.layers() {
            let k = dev.alloc(8 * 4096).unwrap();
            let v = dev.alloc(8 * 4096).unwrap();
            canary(dev.as_ref(), &k);
            canary(dev.as_ref(), &v);
            layers.push(LayerLayout::Split {
                k_base: k.ptr(),
                v_base: v.ptr(),
            });
            bufs.push(k);
            bufs.push(v);
        }
        let spec = KvLayoutSpec {
            kind: GroupKind::Attention,
            layers,
            block_stride: 4096,
            num_blocks: 8,
            view_offset: 0,
        };
        let layout = KvLayout::new_on(spec, &shape, dev.as_ref()).unwrap();
        let list = load_list(pool.addr(), &shape, &layout, rank as u32, &pairs);
        // SAFETY: `pool` outlives the awaited events.
        let ev = unsafe { dev.submit(CopyDirection::HostToDevice, list) }.unwrap();
        state.push((bufs, layout, ev));
    }
    // Both ranks' batches were in flight together.
    for (rank, (bufs, layout, ev)) in state.into_iter().enumerate() {
        wait(ev).unwrap();
        let refs: Vec<&DeviceBuffer> = bufs.iter().collect();
        verify(
            ranks[rank].as_ref(),
            &refs,
            &shape,
            &layout,
            rank as u32,
            &pairs,
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn validation_names_the_layer_and_refuses_foreign_memory() {
    let dev = open(CopyPath::Auto);
    let shape = KvShape::new(2, 1, 2, 1024).unwrap();
    let k = dev.alloc(8192).unwrap();
    let v = dev.alloc(8192).unwrap();
    let host = vec![0u8; 8192];
    // Layer 1's V is host memory.
    let spec = KvLayoutSpec {
        kind: GroupKind::Attention,
        layers: vec![
            LayerLayout::Split {
                k_base: k.ptr(),
                v_base: v.ptr(),
            },
            LayerLayout::Split {
                k_base: k.ptr() + 4096,
                v_base: host.as_ptr() as u64,
            },
        ],
        block_stride: 1024,
        num_blocks: 4,
        view_offset: 0,
    };
    let err = KvLayout::new_on(spec, &shape, dev.as_ref()).unwrap_err();
    assert!(
        matches!(
            err,
            LayoutError::Memory {
                layer: 1,
                segment: "V",
                source: DeviceError::NotDeviceMemory { .. }
            }
        ),
        "{err}"
    );
    // Runs past the end of its allocation.
    let err = dev.check_range(k.ptr() + 4096, 8192).unwrap_err();
    assert!(matches!(err, DeviceError::NotDeviceMemory { .. }), "{err}");
    assert!(dev.check_range(k.ptr() + 100, 8000).is_ok());
    // A batch with one bad range copies nothing.
    canary(dev.as_ref(), &k);
    let src = vec![7u8; 16384];
    let mut l = CopyList::default();
    l.push(src.as_ptr() as u64, k.ptr(), 64);
    l.push(src.as_ptr() as u64 + 4096, k.ptr() + 8190, 64);
    // SAFETY: `src` outlives the awaited event.
    let err = wait(unsafe { dev.submit(CopyDirection::HostToDevice, l) }.unwrap()).unwrap_err();
    assert!(matches!(err, DeviceError::NotDeviceMemory { .. }), "{err}");
    let mut back = vec![0u8; 64];
    dev.read(k.ptr(), &mut back).unwrap();
    assert!(
        back.iter().all(|&b| b == CANARY),
        "refused batch wrote nothing"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn capabilities_dmabuf_flush_and_read_only_peer_mapping() {
    let dev = open(CopyPath::Auto);
    let caps = dev.capabilities();
    println!(
        "caps: {caps:?}; driver {:?}; {}",
        dev.driver_version(),
        dev.name()
    );
    assert!(caps.gather_kernel, "{caps:?}");
    dev.flush_direct_writes().expect("flush");

    let buf = dev.alloc(4 << 20).unwrap();
    match dev.export_dmabuf(buf.ptr() + 8192, 65536) {
        Ok(d) => {
            println!(
                "dmabuf: fd {:?} base {:#x} len {}",
                d.fd(),
                d.base(),
                d.len()
            );
            assert_eq!(
                d.offset_of(buf.ptr() + 8192, 65536),
                Some(buf.ptr() + 8192 - d.base())
            );
            // The owning process hands the fd over: accepted as a DMA-BUF of this device.
            let fd = d.fd().try_clone_to_owned().unwrap();
            let imported = dev
                .import_dmabuf(fd, d.base(), d.len())
                .expect("import dmabuf");
            assert_eq!(imported.len(), d.len());
        }
        Err(DeviceError::Unsupported { what, reason }) => {
            assert!(!caps.dmabuf_export || reason.contains("801") || reason.contains("SUPPORTED"));
            println!("dmabuf unsupported here: {what}: {reason}");
        }
        Err(e) => panic!("dmabuf export: {e}"),
    }
    // A non-DMA-BUF fd is refused.
    let f = std::fs::File::open("/proc/self/stat").unwrap();
    let err = dev.import_dmabuf(f.into(), buf.ptr(), 4096).unwrap_err();
    assert!(matches!(err, DeviceError::Import { .. }), "{err}");

    // A peer's pool, mapped read-only (memfd, PROT_READ), registered read-only and copied from.
    let len = 1 << 20;
    // SAFETY: creates a new anonymous file; the name is NUL-terminated.
    let fd = unsafe { libc::memfd_create(c"kvferry-peer".as_ptr(), 0) };
    assert!(fd >= 0);
    // SAFETY: `fd` is ours; sizes the file.
    assert_eq!(unsafe { libc::ftruncate(fd, len as i64) }, 0);
    // SAFETY: maps the file read-write once to fill it; checked.
    let w = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    assert_ne!(w, libc::MAP_FAILED);
    // SAFETY: `w` maps `len` writable bytes.
    unsafe { std::slice::from_raw_parts_mut(w.cast::<u8>(), len) }
        .iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = (i % 253) as u8);
    // SAFETY: the read-only view a peer would have.
    let r = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    assert_ne!(r, libc::MAP_FAILED);
    match dev.register_host(r as u64, len as u64, true) {
        Ok(reg) => {
            let mut l = CopyList::default();
            for i in 0..16u64 {
                l.push(r as u64 + i * 65536, buf.ptr() + i * 131072, 65536);
            }
            // SAFETY: the mapping outlives the awaited event.
            wait(unsafe { dev.submit(CopyDirection::HostToDevice, l) }.unwrap()).unwrap();
            let mut back = vec![0u8; 65536];
            dev.read(buf.ptr() + 3 * 131072, &mut back).unwrap();
            assert!(back
                .iter()
                .enumerate()
                .all(|(i, &b)| b == ((3 * 65536 + i) % 253) as u8));
            drop(reg);
        }
        Err(e) => {
            assert!(!caps.read_only_host_register, "{e}");
            println!("read-only registration unsupported: {e}");
        }
    }
    // SAFETY: unmaps the two mappings made above and closes the fd.
    unsafe {
        libc::munmap(w, len);
        libc::munmap(r, len);
        libc::close(fd);
    }
    assert!(dev.take_teardown_errors().is_empty());
}

fn gbps(bytes: u64, s: f64) -> f64 {
    bytes as f64 / s / 1e9
}

/// Median seconds of `iters` submit-to-completion runs of the same list, after three
/// warm-up runs (clocks ramp up, pools fill).
fn time_submit(dev: &CudaDevice, dir: CopyDirection, list: &CopyList, iters: usize) -> f64 {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let mut t = Vec::new();
    for i in 0..iters + 3 {
        let t0 = Instant::now();
        // SAFETY: the caller's host memory outlives the awaited event.
        let ev = unsafe { dev.submit(dir, list.clone()) }.unwrap();
        rt.block_on(ev).unwrap();
        if i >= 3 {
            t.push(t0.elapsed().as_secs_f64());
        }
    }
    kvferry_testkit::median(&mut t)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fragmented_and_contiguous_bandwidth() {
    const SEG: u64 = 64 << 10;
    const N: u64 = 3584; // 224 MiB
    const BIG: u64 = 1 << 30;
    let total = SEG * N;
    let host = HostMem::new(BIG as usize);
    let auto = open(CopyPath::Auto);
    let _reg = auto.register_host(host.addr(), BIG, false).unwrap();
    let dst = auto.alloc(2 * BIG + total * 2).unwrap();

    // SAFETY: `host` is mapped for the whole call.
    let raw_224 =
        unsafe { kvferry_testkit::bench_raw_h2d(auto.as_ref(), host.addr(), dst.ptr(), total, 10) }
            .unwrap();
    // SAFETY: as above.
    let raw_1g =
        unsafe { kvferry_testkit::bench_raw_h2d(auto.as_ref(), host.addr(), dst.ptr(), BIG, 5) }
            .unwrap();
    println!(
        "raw H2D 224 MiB: {:.2} GB/s ({:.3} ms)",
        gbps(total, raw_224),
        raw_224 * 1e3
    );
    println!(
        "raw H2D 1 GiB:   {:.2} GB/s ({:.3} ms)",
        gbps(BIG, raw_1g),
        raw_1g * 1e3
    );

    // Contiguous host source, every other 64 KiB slot of the destination.
    let mut frag = CopyList::default();
    for i in 0..N {
        frag.push(host.addr() + i * SEG, dst.ptr() + i * 2 * SEG, SEG);
    }
    assert_eq!(frag.len() as u64, N);
    let mut back = CopyList::default();
    for i in 0..N {
        back.push(dst.ptr() + i * 2 * SEG, host.addr() + i * SEG, SEG);
    }
    let mut ratio_auto = 0.0;
    for path in [
        CopyPath::Auto,
        CopyPath::Staged,
        CopyPath::Kernel,
        CopyPath::Batch,
        CopyPath::PerOp,
    ] {
        let dev = if path == CopyPath::Auto {
            Arc::clone(&auto)
        } else {
            open(path)
        };
        let s = time_submit(&dev, CopyDirection::HostToDevice, &frag, 20);
        let d = time_submit(&dev, CopyDirection::DeviceToHost, &back, 5);
        let ratio = raw_224 / s;
        println!(
            "fragmented {path:?}: H2D {:.2} GB/s ({:.3} ms, {:.2} of raw), D2H {:.2} GB/s",
            gbps(total, s),
            s * 1e3,
            ratio,
            gbps(total, d)
        );
        if path == CopyPath::Auto {
            ratio_auto = ratio;
        }
    }
    // ~1 GiB fragmented, as the bench's 293-block hit set: host runs of 3.5 MiB (a 64 KiB gap
    // between blocks), 64 KiB device segments; the staged path with several chunk sizes.
    let per_block = 56u64;
    let blocks = BIG / ((per_block + 1) * SEG);
    let mut big_frag = CopyList::default();
    for b in 0..blocks {
        for i in 0..per_block {
            let k = b * per_block + i;
            big_frag.push(
                host.addr() + (b * (per_block + 1) + i) * SEG,
                dst.ptr() + k * 2 * SEG,
                SEG,
            );
        }
    }
    let big_bytes = big_frag.bytes();
    // SAFETY: as above.
    let raw_big = unsafe {
        kvferry_testkit::bench_raw_h2d(auto.as_ref(), host.addr(), dst.ptr(), big_bytes, 5)
    }
    .unwrap();
    let s = time_submit(
        &open(CopyPath::Kernel),
        CopyDirection::HostToDevice,
        &big_frag,
        5,
    );
    println!(
        "fragmented {} MiB, 3.5 MiB host runs, Kernel: {:.2} GB/s ({:.3} of raw)",
        big_bytes >> 20,
        gbps(big_bytes, s),
        raw_big / s
    );
    for (chunk, n) in [
        (8u64 << 20, 2u32),
        (16 << 20, 2),
        (32 << 20, 2),
        (32 << 20, 3),
        (64 << 20, 2),
    ] {
        let dev = open_staged(CopyPath::Auto, chunk, n);
        let s = time_submit(&dev, CopyDirection::HostToDevice, &frag, 20);
        let b = time_submit(&dev, CopyDirection::HostToDevice, &big_frag, 7);
        let d = time_submit(&dev, CopyDirection::DeviceToHost, &back, 5);
        println!(
            "staged {} MiB x {n}: 224 MiB {:.3} of raw, {} MiB {:.3} of raw ({:.2} GB/s), D2H {:.2} GB/s",
            chunk >> 20,
            raw_224 / s,
            big_bytes >> 20,
            raw_big / b,
            gbps(big_bytes, b),
            gbps(total, d)
        );
        assert!(dev.staged_batches() > 0);
    }

    let mut one = CopyList::default();
    one.push(host.addr(), dst.ptr(), BIG);
    let s = time_submit(&auto, CopyDirection::HostToDevice, &one, 5);
    let ratio_big = raw_1g / s;
    println!(
        "contiguous 1 GiB via submit: {:.2} GB/s ({:.2} of raw)",
        gbps(BIG, s),
        ratio_big
    );
    assert!(
        ratio_auto >= 0.8,
        "fragmented batch at {ratio_auto:.2} of raw"
    );
    assert!(
        ratio_big >= 0.9,
        "contiguous batch at {ratio_big:.2} of raw"
    );
}

const TORCH_OWNER: &str = r#"
import sys, json, torch
CANARY = 0xCD
layers, blocks, stride, seg, view = [int(a) for a in sys.argv[1:6]]
def pat(block, layer, s, n):
    off = torch.arange(n, dtype=torch.int64)
    return ((block * 131 + layer * 31 + s * 17 + off * 7) % 251).to(torch.uint8)
bases, views, out = [], [], []
for layer in range(layers):
    for s in range(2):
        base = torch.full((view + blocks * stride,), CANARY, dtype=torch.uint8, device="cuda")
        t = base[view:]
        st = t.untyped_storage()
        dev, handle, size, offset = st._share_cuda_()[:4]
        assert t.data_ptr() == st.data_ptr() + view
        bases.append(base); views.append(t)
        out.append({"handle": handle.hex(), "alloc_offset": offset, "view": view, "size": size})
torch.cuda.synchronize()
print(json.dumps(out), flush=True)
pairs = json.loads(sys.stdin.readline())
torch.cuda.synchronize()
loaded = {b: slot for slot, b in pairs}
bad = []
for layer in range(layers):
    for s in range(2):
        base = bases[layer * 2 + s].cpu()
        if not bool((base[:view] == CANARY).all()):
            bad.append(f"layer {layer} seg {s}: bytes before the view changed")
        for b in range(blocks):
            got = base[view + b * stride: view + b * stride + stride]
            if b in loaded:
                if not torch.equal(got[:seg], pat(loaded[b], layer, s, seg)):
                    bad.append(f"layer {layer} seg {s} block {b}: wrong bytes")
                if not bool((got[seg:] == CANARY).all()):
                    bad.append(f"layer {layer} seg {s} block {b}: canary after segment")
            elif not bool((got == CANARY).all()):
                bad.append(f"layer {layer} seg {s} block {b}: written but not loaded")
print("OK" if not bad else "FAIL " + "; ".join(bad[:5]), flush=True)
"#;

/// A separate PyTorch process allocates the KV tensors (views at an offset into larger
/// tensors) with its own caching allocator, hands their IPC handles over, and checks the
/// loaded bytes itself.
#[test]
#[ignore = "needs a CUDA GPU and PyTorch"]
fn pytorch_owned_kv_through_ipc() {
    let (layers, blocks, stride, seg, view) = (3u32, 12u32, 8192u64, 4096u64, 512u64);
    let mut child = Command::new("python3")
        .args(["-c", TORCH_OWNER])
        .args([layers, blocks].map(|v| v.to_string()))
        .args([stride, seg, view].map(|v| v.to_string()))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let tensors = parse_torch(&line);
    assert_eq!(tensors.len(), (layers * 2) as usize, "{line}");

    let dev = open(CopyPath::Auto);
    let mut maps = Vec::new();
    let mut layer_specs = Vec::new();
    for l in 0..layers as usize {
        let mut bases = [0u64; 2];
        for s in 0..2 {
            let (handle, alloc_offset) = &tensors[l * 2 + s];
            let m = dev.import_ipc(handle).expect("import IPC handle");
            // The view offset is applied by the layout; the storage offset inside the
            // caching allocator's block is where the storage starts.
            bases[s] = m.ptr() + alloc_offset;
            maps.push(m);
        }
        layer_specs.push(LayerLayout::Split {
            k_base: bases[0],
            v_base: bases[1],
        });
    }
    let shape = KvShape::new(layers, 1, 2, seg).unwrap();
    let spec = KvLayoutSpec {
        kind: GroupKind::Attention,
        layers: layer_specs,
        block_stride: stride,
        num_blocks: blocks,
        view_offset: view,
    };
    let layout = KvLayout::new_on(spec, &shape, dev.as_ref()).expect("layout over torch memory");
    let slots = 6u32;
    let mut pool = HostMem::new((shape.block_bytes() * u64::from(slots)) as usize);
    fill_pool(&mut pool, &shape, slots);
    let _reg = dev
        .register_host(pool.addr(), pool.len as u64, false)
        .unwrap();
    let pairs = [(0u32, 10u32), (3, 1), (5, 4), (1, 7), (2, 0)];
    // SAFETY: `pool` outlives the awaited event.
    let ev = unsafe {
        dev.submit(
            CopyDirection::HostToDevice,
            load_list(pool.addr(), &shape, &layout, 0, &pairs),
        )
    };
    wait(ev.unwrap()).unwrap();

    let mut stdin = child.stdin.take().unwrap();
    let msg: Vec<String> = pairs.iter().map(|(s, b)| format!("[{s},{b}]")).collect();
    writeln!(stdin, "[{}]", msg.join(",")).unwrap();
    let mut verdict = String::new();
    out.read_line(&mut verdict).unwrap();
    drop(maps);
    let status = child.wait().unwrap();
    assert_eq!(verdict.trim(), "OK", "torch says: {verdict}");
    assert!(status.success());
    assert!(dev.take_teardown_errors().is_empty());
}

/// `[{"handle": hex, "alloc_offset": n, ...}, ...]` without a JSON dependency.
fn parse_torch(line: &str) -> Vec<(Vec<u8>, u64)> {
    line.split('{')
        .skip(1)
        .map(|obj| {
            let field = |name: &str| {
                let i = obj.find(&format!("\"{name}\": ")).expect(name) + name.len() + 4;
                obj[i..]
                    .split([',', '}'])
                    .next()
                    .unwrap()
                    .trim()
                    .trim_matches('"')
                    .to_string()
            };
            let hex = field("handle");
            let bytes = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                .collect();
            (bytes, field("alloc_offset").parse().unwrap())
        })
        .collect()
}

/// Two GPUs of one host: each refuses the other's memory by ordinal (ranges, layouts and
/// whole batches, which then write nothing), copies into its own, and exports DMA-BUFs.
#[test]
#[ignore = "needs two CUDA GPUs"]
fn two_devices_refuse_each_others_memory_and_export_dmabuf() {
    let devs = [CudaDevice::open(0).unwrap(), CudaDevice::open(1).unwrap()];
    let bufs = [
        devs[0].alloc(1 << 20).unwrap(),
        devs[1].alloc(1 << 20).unwrap(),
    ];
    let shape = KvShape::new(1, 1, 2, 1024).unwrap();
    for (me, other) in [(0usize, 1usize), (1, 0)] {
        let dev = &devs[me];
        let foreign = &bufs[other];
        let err = dev.check_range(foreign.ptr(), 4096).unwrap_err();
        assert!(
            matches!(err, DeviceError::WrongDevice { ordinal, found, .. }
                if ordinal == me as u32 && found == other as u32),
            "{err}"
        );
        let spec = KvLayoutSpec {
            kind: GroupKind::Attention,
            layers: vec![LayerLayout::Split {
                k_base: bufs[me].ptr(),
                v_base: foreign.ptr(),
            }],
            block_stride: 1024,
            num_blocks: 4,
            view_offset: 0,
        };
        let err = KvLayout::new_on(spec, &shape, dev.as_ref()).unwrap_err();
        assert!(
            matches!(
                err,
                LayoutError::Memory {
                    layer: 0,
                    segment: "V",
                    source: DeviceError::WrongDevice { .. }
                }
            ),
            "{err}"
        );
        // A batch naming the other GPU's memory copies nothing, not even its good part.
        canary(dev.as_ref(), &bufs[me]);
        canary(devs[other].as_ref(), foreign);
        let src: Vec<u8> = (0..8192u32).map(|i| i as u8).collect();
        let mut l = CopyList::default();
        l.push(src.as_ptr() as u64, bufs[me].ptr(), 4096);
        l.push(src.as_ptr() as u64 + 4096, foreign.ptr(), 4096);
        // SAFETY: `src` outlives the awaited event.
        let err = wait(unsafe { dev.submit(CopyDirection::HostToDevice, l) }.unwrap()).unwrap_err();
        assert!(matches!(err, DeviceError::WrongDevice { .. }), "{err}");
        for (d, b) in [(dev, &bufs[me]), (&devs[other], foreign)] {
            let mut back = vec![0u8; 4096];
            d.read(b.ptr(), &mut back).unwrap();
            assert!(back.iter().all(|&x| x == CANARY), "a refused batch wrote");
        }
        // Its own memory copies, byte for byte.
        let mut l = CopyList::default();
        l.push(src.as_ptr() as u64, bufs[me].ptr() + 4096, 8192);
        // SAFETY: `src` outlives the awaited event.
        wait(unsafe { dev.submit(CopyDirection::HostToDevice, l) }.unwrap()).unwrap();
        let mut back = vec![0u8; 8192 + 8192];
        dev.read(bufs[me].ptr(), &mut back).unwrap();
        assert!(back[..4096].iter().all(|&x| x == CANARY));
        assert_eq!(&back[4096..4096 + 8192], &src[..]);
        assert!(back[4096 + 8192..].iter().all(|&x| x == CANARY));
        // DMA-BUF export of this GPU's memory.
        let dmabuf = dev.export_dmabuf(bufs[me].ptr(), bufs[me].len()).unwrap();
        assert_eq!(dmabuf.ordinal(), me as u32);
        assert!(dmabuf.len() >= bufs[me].len());
        assert!(dmabuf.offset_of(bufs[me].ptr(), bufs[me].len()).is_some());
    }
}

/// vLLM 0.34's extensible KV cache in miniature: one VMM allocation per layer (K plane then V
/// plane), created exportable as a POSIX fd the way vLLM creates it for a connector that
/// declares `EXPORTS_FD`. Returns the buffers and the flash-attention layout over them.
fn vmm_kv(dev: &CudaDevice, shape: &KvShape, blocks: u32) -> (Vec<DeviceBuffer>, KvLayoutSpec) {
    let plane = u64::from(blocks) * shape.segment_bytes();
    let bufs: Vec<DeviceBuffer> = (0..shape.layers())
        .map(|_| {
            dev.alloc_vmm(plane * 2)
                .expect("cuMemCreate an exportable allocation")
        })
        .collect();
    let bases: Vec<u64> = bufs.iter().map(|b| b.ptr()).collect();
    let spec = KvLayoutSpec::flash_attn(&bases, blocks, shape.segment_bytes());
    (bufs, spec)
}

/// The same layout moved onto other bases (the importer's mappings of the same memory).
fn rebased(spec: &KvLayoutSpec, from: &[DeviceBuffer], to: &[DeviceBuffer]) -> KvLayoutSpec {
    let mut out = spec.clone();
    for (l, layer) in out.layers.iter_mut().enumerate() {
        if let LayerLayout::Contiguous { base, .. } = layer {
            *base = *base - from[l].ptr() + to[l].ptr();
        }
    }
    out
}

const VMM_PAIRS: &[(u32, u32)] = &[(0, 9), (3, 1), (5, 4), (1, 7), (2, 0), (4, 11)];

/// A host pool with `slots` pattern blocks, registered; loads `pairs` into `layout` and checks
/// the batch's byte count.
fn load_pairs(dev: &CudaDevice, shape: &KvShape, layout: &KvLayout, pairs: &[(u32, u32)]) {
    let slots = 6u32;
    let mut pool = HostMem::new((shape.block_bytes() * u64::from(slots)) as usize);
    fill_pool(&mut pool, shape, slots);
    let _reg = dev
        .register_host(pool.addr(), pool.len as u64, false)
        .unwrap();
    // SAFETY: `pool` outlives the awaited event.
    let ev = unsafe {
        dev.submit(
            CopyDirection::HostToDevice,
            load_list(pool.addr(), shape, layout, 0, pairs),
        )
    };
    let st = wait(ev.unwrap()).unwrap();
    assert_eq!(st.bytes, pairs.len() as u64 * shape.rank_bytes());
}

/// VMM memory exported by POSIX fd and imported again (here in one process, as a node and an
/// engine worker sharing a GPU would across two): the import is a second mapping of the same
/// physical memory, loads into it land byte for byte in the exporter's allocation with every
/// other byte still the canary, on every copy path, and teardown reports no error. Bad fds
/// and sizes are typed errors.
#[test]
#[ignore = "needs a CUDA GPU"]
fn vmm_kv_exported_by_fd_imported_and_loaded_byte_for_byte() {
    let shape = KvShape::new(3, 1, 2, 4096).unwrap();
    let blocks = 12u32;
    for path in [CopyPath::Auto, CopyPath::Kernel, CopyPath::PerOp] {
        let dev = open(path);
        let caps = dev.capabilities();
        assert!(caps.vmm_import, "no VMM fd import: {:?}", caps.notes);
        let (orig, spec) = vmm_kv(&dev, &shape, blocks);
        for b in &orig {
            canary(dev.as_ref(), b);
        }
        let mut imported = Vec::new();
        for b in &orig {
            let e = dev
                .export_vmm(b.ptr() + 4096)
                .expect("export the allocation's fd");
            assert_eq!((e.base, e.len, e.offset), (b.ptr(), b.len(), 4096));
            let m = dev
                .import_vmm_fd(e.fd, e.len)
                .expect("import the allocation by fd");
            assert_ne!(m.ptr(), b.ptr(), "a mapping of its own");
            assert_eq!(m.len(), b.len());
            imported.push(m);
        }
        let spec_imported = rebased(&spec, &orig, &imported);
        let layout = KvLayout::new_on(spec_imported, &shape, dev.as_ref())
            .expect("a layout over the imported mappings");
        load_pairs(&dev, &shape, &layout, VMM_PAIRS);
        let refs: Vec<&DeviceBuffer> = imported.iter().collect();
        verify(dev.as_ref(), &refs, &shape, &layout, 0, VMM_PAIRS);
        // The exporter sees the same bytes: one physical allocation, two mappings.
        let layout_orig = KvLayout::new_on(spec.clone(), &shape, dev.as_ref()).unwrap();
        let refs: Vec<&DeviceBuffer> = orig.iter().collect();
        verify(dev.as_ref(), &refs, &shape, &layout_orig, 0, VMM_PAIRS);
        // Unmapping the import leaves the exporter's memory as it was.
        let ends: Vec<(u64, u64)> = imported.iter().map(|m| (m.ptr(), m.len())).collect();
        drop(imported);
        for (p, len) in ends {
            assert!(
                dev.check_range(p, len).is_err(),
                "an unmapped import is no device memory any more"
            );
        }
        verify(dev.as_ref(), &refs, &shape, &layout_orig, 0, VMM_PAIRS);
        assert!(dev.take_teardown_errors().is_empty());
        eprintln!("vmm fd import ({path:?}): loads landed in the exporter's memory");
    }

    // Typed errors, no panic.
    let dev = open(CopyPath::Auto);
    let (orig, _) = vmm_kv(&dev, &KvShape::new(1, 1, 2, 4096).unwrap(), 4);
    let e = dev.export_vmm(orig[0].ptr()).unwrap();
    let err = dev.import_vmm_fd(e.fd, e.len - 4096).unwrap_err();
    assert!(
        matches!(err, DeviceError::Import { .. }) && err.to_string().contains("granularity"),
        "{err}"
    );
    let e = dev.export_vmm(orig[0].ptr()).unwrap();
    let err = dev.import_vmm_fd(e.fd, e.len * 2).unwrap_err();
    assert!(
        matches!(err, DeviceError::Import { .. }),
        "longer than the allocation: {err}"
    );
    let not_vmm = std::fs::File::open("/dev/null").unwrap();
    let err = dev
        .import_vmm_fd(not_vmm.into(), orig[0].len())
        .unwrap_err();
    assert!(
        matches!(err, DeviceError::Import { .. }),
        "not an exported fd: {err}"
    );
    let plain = dev.alloc(1 << 20).unwrap();
    let err = dev.export_vmm(plain.ptr()).unwrap_err();
    eprintln!("cuMemAlloc memory refused for fd export: {err}");
    drop(orig);
    assert!(dev.take_teardown_errors().is_empty());
}

const VMM_CHILD_FD: &str = "KVFERRY_VMM_CHILD_FD";
const VMM_CHILD_LEN: &str = "KVFERRY_VMM_CHILD_LEN";

/// The importing process of `vmm_kv_of_another_process_loaded_through_its_fd` (a node's role):
/// maps the inherited fd, loads the pattern into it and exits. A no-op when not started by it.
#[test]
#[ignore = "runs only as the child process of vmm_kv_of_another_process_loaded_through_its_fd"]
fn vmm_import_child() {
    use std::os::fd::{FromRawFd, OwnedFd};
    let (Some(fd), Some(len)) = (
        std::env::var(VMM_CHILD_FD)
            .ok()
            .and_then(|v| v.parse::<i32>().ok()),
        std::env::var(VMM_CHILD_LEN)
            .ok()
            .and_then(|v| v.parse::<u64>().ok()),
    ) else {
        return;
    };
    // SAFETY: the parent left this fd open for us, and nothing else in this process owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let dev = open(CopyPath::Auto);
    let shape = KvShape::new(1, 1, 2, 4096).unwrap();
    let m = dev.import_vmm_fd(fd, len).expect("import the parent's KV");
    let spec = KvLayoutSpec::flash_attn(&[m.ptr()], 12, shape.segment_bytes());
    let layout = KvLayout::new_on(spec, &shape, dev.as_ref()).unwrap();
    load_pairs(&dev, &shape, &layout, VMM_PAIRS);
    drop(m);
    assert!(dev.take_teardown_errors().is_empty());
    println!("VMM_CHILD_OK");
}

/// An engine's VMM KV shared with another process the way kvferry's fd socket shares it: the
/// fd of the allocation crosses the process boundary (inherited here, SCM_RIGHTS there), the
/// other process maps it and loads into it, and this process finds the pattern in its own
/// allocation and the canary everywhere else — after the other process has unmapped and
/// exited.
#[test]
#[ignore = "needs a CUDA GPU"]
fn vmm_kv_of_another_process_loaded_through_its_fd() {
    use std::os::fd::AsRawFd;
    let dev = open(CopyPath::Auto);
    let shape = KvShape::new(1, 1, 2, 4096).unwrap();
    let (orig, spec) = vmm_kv(&dev, &shape, 12);
    canary(dev.as_ref(), &orig[0]);
    let e = dev.export_vmm(orig[0].ptr()).unwrap();
    // A duplicate without close-on-exec, for the child to inherit.
    // SAFETY: dup of an fd we own; the result is checked and closed below.
    let inherit = unsafe { libc::dup(e.fd.as_raw_fd()) };
    assert!(inherit >= 0, "dup");
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "vmm_import_child", "--ignored", "--nocapture"])
        .args(["--test-threads", "1"])
        .env(VMM_CHILD_FD, inherit.to_string())
        .env(VMM_CHILD_LEN, e.len.to_string())
        .output()
        .expect("start the importing process");
    // SAFETY: our duplicate, closed once.
    unsafe { libc::close(inherit) };
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("VMM_CHILD_OK"),
        "importing process failed: {text}"
    );
    let layout = KvLayout::new_on(spec, &shape, dev.as_ref()).unwrap();
    verify(dev.as_ref(), &[&orig[0]], &shape, &layout, 0, VMM_PAIRS);
    assert!(dev.take_teardown_errors().is_empty());
    eprintln!("vmm fd: another process loaded into this one's KV");
}

/// A client's memfd of `len` bytes (created sealable unless `flags` says otherwise), and its
/// own shared mapping of it (the client's view).
fn client_memfd(len: usize, flags: libc::c_uint) -> (std::os::fd::OwnedFd, HostMem) {
    use std::os::fd::FromRawFd;
    // SAFETY: creates a new anonymous file; the name is NUL-terminated.
    let fd = unsafe { libc::memfd_create(c"kvferry-client".as_ptr(), flags) };
    assert!(fd >= 0);
    // SAFETY: `fd` is ours; sizes the file.
    assert_eq!(unsafe { libc::ftruncate(fd, len as i64) }, 0);
    // SAFETY: a shared mapping of the whole file; checked.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    // SAFETY: a fresh descriptor nobody else owns.
    (
        unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) },
        HostMem { ptr: p.cast(), len },
    )
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_client_memfd_is_copied_into_and_out_of_like_device_memory() {
    // SGLang's HiCache host pool, or a CPU engine's KV: a memfd the client keeps mapped.
    for path in [CopyPath::Auto, CopyPath::Kernel] {
        let dev = open(path);
        const LEN: usize = 1 << 20;
        const CHUNK: u64 = 4096;
        let (fd, mut client) = client_memfd(LEN, libc::MFD_ALLOW_SEALING);
        client.bytes().fill(CANARY);
        let mut pool = HostMem::new(LEN);
        pool.bytes()
            .iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = (i % 251) as u8);
        let _reg = dev
            .register_host(pool.addr(), LEN as u64, false)
            .expect("pin the pool");
        let buf = dev
            .import_memfd(fd, LEN as u64)
            .expect("import the client memfd");
        dev.check_range(buf.ptr(), LEN as u64)
            .expect("its range is the device's");
        assert!(dev.check_range(buf.ptr(), LEN as u64 + 1).is_err());

        // Pool → client: 16 chunks at unaligned offsets, as a load of 16 pages.
        let at = |i: u64| i * 65536 + 100;
        let mut l = CopyList::default();
        for i in 0..16u64 {
            l.push(pool.addr() + i * CHUNK, buf.ptr() + at(i), CHUNK);
        }
        // SAFETY: the pool and the import outlive the awaited event.
        wait(unsafe { dev.submit(CopyDirection::HostToDevice, l) }.unwrap()).unwrap();
        let seen = client.bytes();
        for (off, &b) in seen.iter().enumerate() {
            let off = off as u64;
            let chunk = (off.saturating_sub(100)) / 65536;
            let inside = off >= 100 && chunk < 16 && off < at(chunk) + CHUNK;
            let want = if inside {
                ((chunk * CHUNK + (off - at(chunk))) % 251) as u8
            } else {
                CANARY
            };
            assert_eq!(b, want, "{path:?}: byte {off} of the client's memfd");
        }

        // Client → another host buffer (a save out of the client's pages).
        let mut back = HostMem::new(LEN);
        back.bytes().fill(0);
        let _reg2 = dev
            .register_host(back.addr(), LEN as u64, false)
            .expect("pin the save buffer");
        let mut l = CopyList::default();
        for i in 0..16u64 {
            l.push(buf.ptr() + at(i), back.addr() + i * CHUNK, CHUNK);
        }
        // SAFETY: as above.
        wait(unsafe { dev.submit(CopyDirection::DeviceToHost, l) }.unwrap()).unwrap();
        assert_eq!(
            &back.bytes()[..16 * CHUNK as usize],
            &pool.bytes()[..16 * CHUNK as usize]
        );

        // Dropped: unregistered, unmapped, no longer the device's.
        let ptr = buf.ptr();
        drop(buf);
        assert!(dev.check_range(ptr, CHUNK).is_err());
        assert!(dev.take_teardown_errors().is_empty());
        // The client's own mapping is untouched by the node's unmapping.
        assert_eq!(client.bytes()[100], 0);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn client_memfds_the_device_cannot_keep_are_refused_with_a_typed_error() {
    let dev = open(CopyPath::Auto);
    let (short, _m) = client_memfd(4096, libc::MFD_ALLOW_SEALING);
    let err = dev.import_memfd(short, 8192).unwrap_err();
    assert!(matches!(err, DeviceError::Import { .. }), "{err}");
    let (unsealable, _m2) = client_memfd(4096, 0);
    let err = dev.import_memfd(unsealable, 4096).unwrap_err();
    assert!(err.to_string().contains("seal"), "{err}");
    let f = std::fs::File::open("/proc/self/stat").unwrap();
    let err = dev.import_memfd(f.into(), 16).unwrap_err();
    assert!(err.to_string().contains("not a memfd"), "{err}");
    // The next import works.
    let (fd, _m3) = client_memfd(8192, libc::MFD_ALLOW_SEALING);
    let buf = dev.import_memfd(fd, 8192).expect("import after refusals");
    drop(buf);
    assert!(dev.take_teardown_errors().is_empty());
}
