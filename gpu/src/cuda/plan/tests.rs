use super::*;

#[test]
fn copy_paths_by_name_round_trip_and_unknown_names_are_none() {
    for (name, path) in CopyPath::NAMES {
        assert_eq!(CopyPath::from_name(name), Some(path));
    }
    assert_eq!(CopyPath::from_name("Auto"), None);
    assert_eq!(CopyPath::from_name("dma"), None);
}

fn paths(kernel: bool, batch: bool, stage_chunk: u64) -> Paths {
    Paths {
        kernel,
        batch,
        stage_chunk,
    }
}

/// Device memory: one allocation at [1M, 2M); host: registered [10M, 11M) mapped at 50M.
struct Fake;

impl Resolver for Fake {
    fn device_alloc(&self, ptr: u64, len: u64) -> Result<(u64, u64), DeviceError> {
        if ptr >= 1 << 20 && ptr + len <= 2 << 20 {
            Ok((1 << 20, 2 << 20))
        } else {
            Err(DeviceError::NotDeviceMemory {
                ordinal: 0,
                ptr,
                len,
            })
        }
    }
    fn host_map(&self, addr: u64, _len: u64) -> Option<HostMap> {
        ((10 << 20..11 << 20).contains(&addr)).then_some(HostMap {
            start: 10 << 20,
            end: 11 << 20,
            device: 50 << 20,
        })
    }
}

fn fragmented(n: u64, host: u64) -> CopyList {
    let mut l = CopyList::default();
    for i in 0..n {
        l.push(host + i * 4096, (1 << 20) + i * 8192, 4096);
    }
    l
}

/// Two allocations, [1M, 2M) and [4M, 5M); counts the driver queries.
struct Counting(std::cell::Cell<usize>);

impl Resolver for Counting {
    fn device_alloc(&self, ptr: u64, len: u64) -> Result<(u64, u64), DeviceError> {
        self.0.set(self.0.get() + 1);
        [(1u64 << 20, 2u64 << 20), (4 << 20, 5 << 20)]
            .into_iter()
            .find(|&(s, e)| ptr >= s && ptr + len <= e)
            .ok_or(DeviceError::NotDeviceMemory {
                ordinal: 0,
                ptr,
                len,
            })
    }
    fn host_map(&self, _: u64, _: u64) -> Option<HostMap> {
        None
    }
}

#[test]
fn validation_queries_each_allocation_once_per_batch() {
    // Alternating between two tensors, as a split K/V load does.
    let mut l = CopyList::default();
    for i in 0..64u64 {
        let dst = if i % 2 == 0 { 1 << 20 } else { 4 << 20 };
        l.push(10 << 20 | (i * 8192), dst + i * 4096, 1024);
    }
    let r = Counting(std::cell::Cell::new(0));
    let per_op = |l: &CopyList| {
        plan(
            CopyDirection::HostToDevice,
            l,
            CopyPath::PerOp,
            paths(false, false, 0),
            &r,
        )
    };
    per_op(&l).unwrap();
    assert_eq!(r.0.get(), 2);
    // Met in the other order (a block's segments, last tensor first): still one query
    // each.
    let mut rev = CopyList::default();
    for op in l.ops().iter().rev() {
        rev.push(op.src, op.dst, op.len);
    }
    r.0.set(0);
    per_op(&rev).unwrap();
    assert_eq!(r.0.get(), 2);
    // A range that starts inside a known tensor and runs past its end is refused.
    let mut past = l.clone();
    past.push(0, (2 << 20) - 512, 1024);
    assert!(per_op(&past).is_err());
    // A range outside both is still refused.
    l.push(0, 3 << 20, 64);
    assert!(per_op(&l).is_err());
}

#[test]
fn fragmented_mapped_batches_go_to_the_kernel() {
    let l = fragmented(16, 10 << 20);
    let p = plan(
        CopyDirection::HostToDevice,
        &l,
        CopyPath::Auto,
        paths(true, true, 0),
        &Fake,
    )
    .unwrap();
    assert_eq!(p.kernel.len(), 16);
    assert!(p.engine.is_empty());
    assert_eq!(
        p.kernel[3],
        Desc {
            src: (50 << 20) + 3 * 4096,
            dst: (1 << 20) + 3 * 8192,
            len: 4096
        }
    );
}

#[test]
fn pageable_or_unaligned_ranges_fall_back_to_engines() {
    let mut l = fragmented(8, 10 << 20);
    l.push(20 << 20, (1 << 20) + 200_000, 64); // host not mapped
    l.push((10 << 20) + 500_001, (1 << 20) + 300_000, 64); // unaligned
    let p = plan(
        CopyDirection::HostToDevice,
        &l,
        CopyPath::Auto,
        paths(true, true, 0),
        &Fake,
    )
    .unwrap();
    assert_eq!(p.kernel.len(), 8);
    assert_eq!(p.engine.len(), 2);
    assert!(!p.engine_batched, "two leftovers go one call each");
    let p = plan(
        CopyDirection::HostToDevice,
        &l,
        CopyPath::Auto,
        paths(false, true, 0),
        &Fake,
    )
    .unwrap();
    assert!(p.kernel.is_empty());
    assert_eq!(p.engine.len(), 10);
    assert!(p.engine_batched);
}

#[test]
fn long_contiguous_ranges_use_engines() {
    let mut l = CopyList::default();
    l.push(10 << 20, 1 << 20, 512 << 10);
    let p = plan(
        CopyDirection::HostToDevice,
        &l,
        CopyPath::Auto,
        paths(true, true, 0),
        &Fake,
    )
    .unwrap();
    assert!(p.kernel.is_empty());
    assert_eq!(p.engine.len(), 1);
    let p = plan(
        CopyDirection::HostToDevice,
        &l,
        CopyPath::Kernel,
        paths(true, true, 0),
        &Fake,
    )
    .unwrap();
    assert_eq!(p.kernel.len(), 8, "cut into 64 KiB chunks");
}

#[test]
fn d2h_maps_the_destination() {
    let mut l = CopyList::default();
    for i in 0..8u64 {
        l.push((1 << 20) + i * 8192, (10 << 20) + i * 4096, 4096);
    }
    let p = plan(
        CopyDirection::DeviceToHost,
        &l,
        CopyPath::Auto,
        paths(true, true, 0),
        &Fake,
    )
    .unwrap();
    assert_eq!(p.kernel.len(), 8);
    assert_eq!(p.kernel[1].dst, (50 << 20) + 4096);
    assert_eq!(p.kernel[1].src, (1 << 20) + 8192);
}

#[test]
fn one_bad_device_range_refuses_the_batch() {
    let mut l = fragmented(8, 10 << 20);
    l.push(10 << 20, (2 << 20) - 32, 64); // runs past the allocation
    let err = plan(
        CopyDirection::HostToDevice,
        &l,
        CopyPath::Auto,
        paths(true, true, 0),
        &Fake,
    )
    .unwrap_err();
    assert!(
        matches!(err, DeviceError::NotDeviceMemory { len: 64, .. }),
        "{err}"
    );
}

#[test]
fn forced_paths() {
    let l = fragmented(16, 10 << 20);
    let p = plan(
        CopyDirection::HostToDevice,
        &l,
        CopyPath::Batch,
        paths(true, true, 0),
        &Fake,
    )
    .unwrap();
    assert!(p.kernel.is_empty() && p.engine_batched && p.engine.len() == 16);
    let p = plan(
        CopyDirection::HostToDevice,
        &l,
        CopyPath::PerOp,
        paths(true, true, 0),
        &Fake,
    )
    .unwrap();
    assert!(p.kernel.is_empty() && !p.engine_batched);
    let p = plan(
        CopyDirection::HostToDevice,
        &l,
        CopyPath::Batch,
        paths(true, false, 0),
        &Fake,
    )
    .unwrap();
    assert!(!p.engine_batched, "no batch call in this driver");
}

/// Device memory: everything in [4G, 8G); host: [16G, 20G) pinned and mapped at 64G, the
/// rest pageable.
struct Big;

const DEV: u64 = 4 << 30;
const HOST: u64 = 16 << 30;

impl Resolver for Big {
    fn device_alloc(&self, ptr: u64, len: u64) -> Result<(u64, u64), DeviceError> {
        if ptr >= DEV && ptr + len <= 2 * DEV {
            Ok((DEV, 2 * DEV))
        } else {
            Err(DeviceError::NotDeviceMemory {
                ordinal: 0,
                ptr,
                len,
            })
        }
    }
    fn host_map(&self, addr: u64, len: u64) -> Option<HostMap> {
        (addr >= HOST && addr + len <= HOST + (4 << 30)).then_some(HostMap {
            start: HOST,
            end: HOST + (4 << 30),
            device: 64 << 30,
        })
    }
}

/// A load as the keeper builds it: `blocks` host blocks of `layers` x 2 segments of
/// `seg` bytes each, block `i` from host slot `slot(i)` (each block's rank part one host
/// run), every segment to its own place on the device.
fn load(blocks: u64, layers: u64, seg: u64, slot: impl Fn(u64) -> u64) -> CopyList {
    let mut l = CopyList::default();
    for b in 0..blocks {
        for i in 0..layers * 2 {
            l.push(
                HOST + slot(b) * layers * 2 * seg + i * seg,
                DEV + i * (64 << 20) + b * 3 * seg,
                seg,
            );
        }
    }
    l
}

#[test]
fn host_runs_join_adjacent_host_ranges() {
    let l = load(3, 2, 4096, |b| [0, 1, 5][b as usize]);
    // Blocks 0 and 1 are adjacent slots: one run; block 2 its own.
    assert_eq!(
        host_runs(CopyDirection::HostToDevice, l.ops()),
        vec![(HOST, 2 * 16384), (HOST + 5 * 16384, 16384)]
    );
    let mut d = CopyList::default();
    d.push(DEV, HOST, 100);
    d.push(DEV + 500, HOST + 100, 100);
    d.push(DEV + 100, HOST + 300, 100);
    assert_eq!(
        host_runs(CopyDirection::DeviceToHost, d.ops()),
        vec![(HOST, 200), (HOST + 300, 100)]
    );
}

#[test]
fn auto_stages_long_pinned_host_runs_only() {
    let all = paths(true, true, 32 << 20);
    let h2d = CopyDirection::HostToDevice;
    // The bench's load: 3.5 MiB runs, 64 KiB device segments.
    let l = load(16, 28, 64 << 10, |b| b * 2);
    let p = plan(h2d, &l, CopyPath::Auto, all, &Big).unwrap();
    let st = p.staged.as_ref().expect("staged");
    assert!(p.kernel.is_empty() && p.engine.is_empty());
    assert_eq!(st.chunks.len(), 2, "56 MiB in 32 MiB chunks");
    assert_eq!(
        st.chunks[0].spans.len(),
        10,
        "nine whole runs and a cut one"
    );
    // The mirror save stages too.
    let mut save = CopyList::default();
    for op in l.ops() {
        save.push(op.dst, op.src, op.len);
    }
    let p = plan(
        CopyDirection::DeviceToHost,
        &save,
        CopyPath::Auto,
        all,
        &Big,
    )
    .unwrap();
    assert!(p.staged.is_some());
    // 128 KiB runs: too short to pay; the kernel takes them.
    let l = load(64, 1, 64 << 10, |b| b * 2);
    let p = plan(h2d, &l, CopyPath::Auto, all, &Big).unwrap();
    assert!(p.staged.is_none() && p.kernel.len() == 128);
    // Small batches stay on the kernel.
    let l = load(2, 3, 64 << 10, |b| b * 2);
    assert!(l.bytes() < STAGE_MIN_BYTES);
    let p = plan(h2d, &l, CopyPath::Auto, all, &Big).unwrap();
    assert!(p.staged.is_none() && !p.kernel.is_empty());
    // Pageable host memory: neither staged nor the kernel.
    let mut l = CopyList::default();
    for i in 0..64u64 {
        l.push((1 << 40) + i * 65536, DEV + i * 3 * 65536, 65536);
    }
    let p = plan(h2d, &l, CopyPath::Auto, all, &Big).unwrap();
    assert!(p.staged.is_none() && p.kernel.is_empty() && p.engine_batched);
    // Without staging buffers or without the kernel: the old paths.
    let l = load(16, 28, 64 << 10, |b| b);
    let p = plan(h2d, &l, CopyPath::Auto, paths(true, true, 0), &Big).unwrap();
    assert!(p.staged.is_none() && !p.kernel.is_empty());
    let p = plan(
        h2d,
        &l,
        CopyPath::Staged,
        paths(false, true, 32 << 20),
        &Big,
    )
    .unwrap();
    assert!(p.staged.is_none() && p.engine_batched && p.engine.len() == l.len());
    // Forced: staged even for pageable, short or tiny batches.
    let mut l = CopyList::default();
    l.push(1 << 40, DEV, 100);
    let p = plan(h2d, &l, CopyPath::Staged, all, &Big).unwrap();
    assert_eq!(p.staged.unwrap().chunks.len(), 1);
    // Other forced paths never stage.
    let l = load(16, 28, 64 << 10, |b| b);
    let p = plan(h2d, &l, CopyPath::Kernel, all, &Big).unwrap();
    assert!(p.staged.is_none());
}

#[test]
fn staged_batches_still_validate_every_device_range() {
    let mut l = load(4, 28, 64 << 10, |b| b);
    l.push(HOST, 3 * DEV, 64);
    let err = plan(
        CopyDirection::HostToDevice,
        &l,
        CopyPath::Staged,
        paths(true, true, 1 << 20),
        &Big,
    )
    .unwrap_err();
    assert!(matches!(err, DeviceError::NotDeviceMemory { len: 64, .. }));
}

/// xorshift64: deterministic inputs without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// Random ops: runs of host-adjacent ranges at odd offsets and lengths, scattered over a
/// device region of `space` bytes without overlap.
fn random_ops(rng: &mut Rng, space: u64) -> Vec<CopyOp> {
    let mut ops = Vec::new();
    let mut host = 1000 + rng.next(64);
    let mut dev_next = rng.next(32);
    for _ in 0..1 + rng.next(6) {
        for _ in 0..1 + rng.next(8) {
            let max = if rng.next(2) == 0 { 64 } else { 9000 };
            let len = 1 + rng.next(max);
            let dev = dev_next + rng.next(3) * 16 + rng.next(2) * rng.next(16);
            dev_next = dev + len;
            assert!(dev_next <= space);
            ops.push(CopyOp {
                src: host,
                dst: dev,
                len,
            });
            host += len;
        }
        host += rng.next(100);
    }
    ops
}

fn mirror(ops: &[CopyOp]) -> Vec<CopyOp> {
    ops.iter()
        .map(|o| CopyOp {
            src: o.dst,
            dst: o.src,
            len: o.len,
        })
        .collect()
}

/// Runs a staged plan on simulated memory: engine copies into (or out of) one staging
/// buffer per chunk, then the descriptors.
fn execute(dir: CopyDirection, st: &Staged, chunk: u64, host: &mut [u8], dev: &mut [u8]) {
    for c in &st.chunks {
        let mut stage = vec![0u8; chunk as usize];
        let descs = &st.descs[c.descs.clone()];
        let copy = |from: &[u8], to: &mut [u8], d: &Desc| {
            let (s, t, n) = (d.src as usize, d.dst as usize, d.len as usize);
            to[t..t + n].copy_from_slice(&from[s..s + n]);
        };
        match dir {
            CopyDirection::HostToDevice => {
                for s in &c.spans {
                    let (h, o, n) = (s.host as usize, s.offset as usize, s.len as usize);
                    stage[o..o + n].copy_from_slice(&host[h..h + n]);
                }
                descs.iter().for_each(|d| copy(&stage, dev, d));
            }
            CopyDirection::DeviceToHost => {
                descs.iter().for_each(|d| copy(dev, &mut stage, d));
                for s in &c.spans {
                    let (h, o, n) = (s.host as usize, s.offset as usize, s.len as usize);
                    host[h..h + n].copy_from_slice(&stage[o..o + n]);
                }
            }
        }
    }
}

#[test]
fn staging_chunks_cover_every_byte_once_in_both_directions() {
    const SPACE: u64 = 1 << 20;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for round in 0..300 {
        let ops = random_ops(&mut rng, SPACE);
        let chunk = [32, 256, 4096, 12288, 1 << 20][round % 5];
        let bytes: u64 = ops.iter().map(|o| o.len).sum();
        let host_len = (ops.iter().map(|o| o.src + o.len).max().unwrap() + 64) as usize;
        let src: Vec<u8> = (0..host_len).map(|i| (i * 7 % 251) as u8 + 1).collect();

        // H2D against the plain copies.
        let st = stage(CopyDirection::HostToDevice, &ops, chunk);
        let mut want = vec![0u8; SPACE as usize];
        for o in &ops {
            let (s, d, n) = (o.src as usize, o.dst as usize, o.len as usize);
            want[d..d + n].copy_from_slice(&src[s..s + n]);
        }
        let mut got = vec![0u8; SPACE as usize];
        execute(
            CopyDirection::HostToDevice,
            &st,
            chunk,
            &mut src.clone(),
            &mut got,
        );
        assert!(got == want, "round {round}: H2D bytes differ");

        // Chunk invariants.
        let mut moved = 0;
        for c in &st.chunks {
            let mut spans = c.spans.clone();
            spans.sort_by_key(|s| s.offset);
            for w in spans.windows(2) {
                assert!(w[0].offset + w[0].len <= w[1].offset, "overlap");
            }
            for s in &spans {
                assert!(s.len > 0 && s.offset + s.len <= chunk, "round {round}");
                assert_eq!(s.offset % 16, s.host % 16, "alignment kept");
                moved += s.len;
            }
            assert!(!c.descs.is_empty());
        }
        assert_eq!(moved, bytes, "every byte staged once");
        assert!(st.descs.iter().all(|d| d.len > 0 && d.len <= 64 << 10));
        assert_eq!(st.descs.iter().map(|d| d.len).sum::<u64>(), bytes);
        let min_chunks = bytes.div_ceil(chunk) as usize;
        assert!(st.chunks.len() >= min_chunks);

        // D2H: device `want` back into a fresh host buffer.
        let back = mirror(&ops);
        let st = stage(CopyDirection::DeviceToHost, &back, chunk);
        let mut host = vec![0u8; host_len];
        execute(
            CopyDirection::DeviceToHost,
            &st,
            chunk,
            &mut host,
            &mut want.clone(),
        );
        for o in &ops {
            let (s, n) = (o.src as usize, o.len as usize);
            assert!(host[s..s + n] == src[s..s + n], "round {round}: D2H bytes");
        }
    }
}

#[test]
fn a_long_run_fills_chunks_back_to_back() {
    // One 10 MiB host run scattered in 64 KiB pieces, 4 MiB chunks: two full chunks and
    // a 2 MiB one, one span each, staging offsets from 0.
    let mut ops = Vec::new();
    for i in 0..160u64 {
        ops.push(CopyOp {
            src: HOST + i * 65536,
            dst: DEV + i * 3 * 65536,
            len: 65536,
        });
    }
    let st = stage(CopyDirection::HostToDevice, &ops, 4 << 20);
    let spans: Vec<Vec<Span>> = st.chunks.iter().map(|c| c.spans.clone()).collect();
    assert_eq!(
        spans,
        vec![
            vec![Span {
                host: HOST,
                offset: 0,
                len: 4 << 20
            }],
            vec![Span {
                host: HOST + (4 << 20),
                offset: 0,
                len: 4 << 20
            }],
            vec![Span {
                host: HOST + (8 << 20),
                offset: 0,
                len: 2 << 20
            }],
        ]
    );
    assert_eq!(st.chunks[1].descs, 64..128);
    assert_eq!(
        st.descs[64],
        Desc {
            src: 0,
            dst: DEV + 64 * 3 * 65536,
            len: 65536
        }
    );
    // Buffers in turn: chunk 2 reuses buffer 0.
    let r = st.relocate(CopyDirection::HostToDevice, &[1 << 30, 2 << 30]);
    assert_eq!(r[0].src, 1 << 30);
    assert_eq!(r[64].src, 2 << 30);
    assert_eq!(r[128].src, 1 << 30);
    assert_eq!(r[129].src, (1 << 30) + 65536);
    assert!(r.iter().zip(&st.descs).all(|(a, b)| a.dst == b.dst));
}
