use super::*;
use crate::HostDevice;

fn shape(layers: u32, segs: u32) -> KvShape {
    KvShape::new(layers, 1, segs, 256).unwrap()
}

fn split_spec(layers: u32, stride: u64, blocks: u32) -> KvLayoutSpec {
    let plane = stride * u64::from(blocks);
    KvLayoutSpec {
        kind: GroupKind::Attention,
        layers: (0..u64::from(layers))
            .map(|l| LayerLayout::Split {
                k_base: 0x10_0000 + 2 * l * plane,
                v_base: 0x10_0000 + (2 * l + 1) * plane,
            })
            .collect(),
        block_stride: stride,
        num_blocks: blocks,
        view_offset: 0,
    }
}

#[test]
fn split_and_contiguous_addresses() {
    let l = KvLayout::new(split_spec(2, 256, 8), &shape(2, 2)).unwrap();
    assert_eq!(l.segment_addr(0, 0, 0), 0x10_0000);
    assert_eq!(l.segment_addr(0, 1, 3), 0x10_0000 + 2048 + 3 * 256);
    assert_eq!(l.segment_addr(1, 1, 7), 0x10_0000 + 3 * 2048 + 7 * 256);

    let spec = KvLayoutSpec {
        kind: GroupKind::Attention,
        layers: vec![LayerLayout::Contiguous {
            base: 0x1000,
            kv_stride: 4096,
        }],
        block_stride: 512,
        num_blocks: 8,
        view_offset: 64,
    };
    let l = KvLayout::new(spec, &shape(1, 2)).unwrap();
    assert_eq!(l.segment_addr(0, 0, 2), 0x1000 + 64 + 1024);
    assert_eq!(l.segment_addr(0, 1, 2), 0x1000 + 64 + 4096 + 1024);
}

#[test]
fn refuses_recurrent_by_name() {
    let mut spec = split_spec(1, 256, 4);
    spec.kind = GroupKind::Recurrent;
    let err = KvLayout::new(spec, &shape(1, 2)).unwrap_err();
    assert_eq!(err, LayoutError::Unsupported { group: "recurrent" });
    assert!(err.to_string().contains("recurrent"));
}

/// Every byte of `bytes` bytes from `base` belongs to exactly one (layer, segment, block),
/// and the addresses are where the engine's tensor puts them.
fn assert_tiles(l: &KvLayout, base: u64, bytes: u64, addr: impl Fn(u32, u32, u32) -> u64) {
    let mut seen = vec![false; (bytes / l.segment_bytes()) as usize];
    for layer in 0..l.num_layers() {
        for seg in 0..l.segments() {
            for block in 0..l.num_blocks() {
                let a = l.segment_addr(layer, seg, block);
                assert_eq!(
                    a,
                    addr(layer, seg, block),
                    "layer {layer} seg {seg} block {block}"
                );
                let i = ((a - base) / l.segment_bytes()) as usize;
                assert!(!seen[i], "segment at {a:#x} addressed twice");
                seen[i] = true;
            }
        }
    }
    assert!(
        seen.iter().all(|&s| s),
        "a segment of the tensor is never addressed"
    );
}

#[test]
fn the_layouts_real_engines_allocate() {
    // 3 layers, 5 blocks, 128-byte segments (e.g. block_size 4 x 1 head x 16 dims x fp16).
    let (layers, blocks, seg) = (3u32, 5u32, 128u64);
    let per_layer = 2 * u64::from(blocks) * seg;
    // Per-layer tensors in separate allocations, far apart and out of order.
    let bases = [0x9_0000u64, 0x1_0000, 0x5_0000];
    let pos = |l: u32| bases[l as usize];

    // FlashAttention (2, blocks, ...): K plane, then V plane.
    let fa = KvLayout::new(
        KvLayoutSpec::flash_attn(&bases, blocks, seg),
        &shape_of(layers, 2, seg),
    )
    .unwrap();
    for (l, &b) in bases.iter().enumerate() {
        let one = KvLayout::new(
            KvLayoutSpec::flash_attn(&[b], blocks, seg),
            &shape_of(1, 2, seg),
        )
        .unwrap();
        assert_tiles(&one, b, per_layer, |_, s, k| {
            b + u64::from(s) * u64::from(blocks) * seg + u64::from(k) * seg
        });
        assert_eq!(fa.segment_addr(l as u32, 1, 2), one.segment_addr(0, 1, 2));
    }
    // FlashInfer (blocks, 2, ...): K and V interleaved per block.
    let fi = KvLayout::new(
        KvLayoutSpec::flashinfer(&bases, blocks, seg),
        &shape_of(layers, 2, seg),
    )
    .unwrap();
    assert_eq!(fi.segment_addr(2, 1, 4), pos(2) + (4 * 2 + 1) * seg);
    let one = KvLayout::new(
        KvLayoutSpec::flashinfer(&[bases[0]], blocks, seg),
        &shape_of(1, 2, seg),
    )
    .unwrap();
    assert_tiles(&one, bases[0], per_layer, |_, s, k| {
        bases[0] + (2 * u64::from(k) + u64::from(s)) * seg
    });
    // MLA (blocks, block_size, dim): one segment.
    let one = KvLayout::new(
        KvLayoutSpec::mla(&[bases[1]], blocks, seg),
        &shape_of(1, 1, seg),
    )
    .unwrap();
    assert_tiles(&one, bases[1], u64::from(blocks) * seg, |_, _, k| {
        bases[1] + u64::from(k) * seg
    });
    // Cross-layer (blocks, layers, 2, ...): a block is one contiguous range in host order.
    let cl = KvLayout::new(
        KvLayoutSpec::cross_layer(0x4000, layers, 2, blocks, seg),
        &shape_of(layers, 2, seg),
    )
    .unwrap();
    let block = u64::from(layers) * 2 * seg;
    assert_tiles(&cl, 0x4000, u64::from(blocks) * block, |l, s, k| {
        0x4000 + u64::from(k) * block + (u64::from(l) * 2 + u64::from(s)) * seg
    });
    let mut list = crate::CopyList::default();
    let shape = shape_of(layers, 2, seg);
    for (i, dst) in [3u32, 0, 4].into_iter().enumerate() {
        let src = 0x100_0000 + i as u64 * 0x10_0000;
        for layer in 0..layers {
            for s in 0..2 {
                list.push(
                    src + shape.segment_offset(0, layer, s),
                    cl.segment_addr(layer, s, dst),
                    seg,
                );
            }
        }
    }
    assert_eq!(list.len(), 3, "one copy per cross-layer block");
    assert_eq!(list.bytes(), 3 * block);
    // MLA cross-layer (one segment) is accepted too.
    assert!(KvLayout::new(
        KvLayoutSpec::cross_layer(0, layers, 1, blocks, seg),
        &shape_of(layers, 1, seg)
    )
    .is_ok());
    // A FlashInfer layer shifted by one segment into its neighbour's V: refused.
    let mut bad = KvLayoutSpec::flashinfer(&[0, 0], blocks, seg);
    bad.layers[1] = LayerLayout::Contiguous {
        base: seg,
        kv_stride: seg,
    };
    assert!(matches!(
        KvLayout::new(bad, &shape_of(2, 2, seg)),
        Err(LayoutError::Overlap { .. })
    ));
}

fn shape_of(layers: u32, segs: u32, seg: u64) -> KvShape {
    KvShape::new(layers, 1, segs, seg).unwrap()
}

#[test]
fn refuses_small_strides_and_bad_counts() {
    let err = KvLayout::new(split_spec(1, 128, 4), &shape(1, 2)).unwrap_err();
    assert!(matches!(
        err,
        LayoutError::StrideTooSmall {
            layer: 0,
            stride: 128,
            segment: 256
        }
    ));
    let err = KvLayout::new(split_spec(2, 256, 4), &shape(3, 2)).unwrap_err();
    assert_eq!(
        err,
        LayoutError::LayerCount {
            expected: 3,
            got: 2
        }
    );
    let err = KvLayout::new(split_spec(1, 256, 0), &shape(1, 2)).unwrap_err();
    assert_eq!(err, LayoutError::NoBlocks);
    let err = KvLayout::new(split_spec(1, 256, 4), &shape(1, 1)).unwrap_err();
    assert!(matches!(err, LayoutError::SplitNeedsTwoSegments { .. }));
    // K and V planes 512 bytes apart with a 256-byte stride: block 2 of K is block 0 of V.
    let spec = KvLayoutSpec {
        kind: GroupKind::Attention,
        layers: vec![LayerLayout::Contiguous {
            base: 0x1000,
            kv_stride: 512,
        }],
        block_stride: 256,
        num_blocks: 4,
        view_offset: 0,
    };
    assert!(matches!(
        KvLayout::new(spec, &shape(1, 2)),
        Err(LayoutError::Overlap {
            first: 0,
            second: 0,
            ..
        })
    ));
}

#[test]
fn overlap_detection_is_exact() {
    // Two layers interleaved inside one stride: legal (no byte shared).
    let spec = KvLayoutSpec {
        kind: GroupKind::Attention,
        layers: vec![
            LayerLayout::Split {
                k_base: 0,
                v_base: 256,
            },
            LayerLayout::Split {
                k_base: 512,
                v_base: 768,
            },
        ],
        block_stride: 1024,
        num_blocks: 16,
        view_offset: 0,
    };
    assert!(KvLayout::new(spec.clone(), &shape(2, 2)).is_ok());
    // Shift layer 1's K by 64 bytes into layer 0's V: refused, naming both.
    let mut bad = spec;
    bad.layers[1] = LayerLayout::Split {
        k_base: 256 + 64 + 1024 * 3,
        v_base: 768,
    };
    let err = KvLayout::new(bad, &shape(2, 2)).unwrap_err();
    assert_eq!(
        err,
        LayoutError::Overlap {
            first: 0,
            first_seg: "V",
            second: 1,
            second_seg: "K"
        }
    );
    // Same base for two layers.
    let err = KvLayout::new(
        KvLayoutSpec {
            kind: GroupKind::Attention,
            layers: vec![
                LayerLayout::Contiguous {
                    base: 0,
                    kv_stride: 4096,
                },
                LayerLayout::Contiguous {
                    base: 4096 * 2 - 256,
                    kv_stride: 4096,
                },
            ],
            block_stride: 256,
            num_blocks: 16,
            view_offset: 0,
        },
        &shape(2, 2),
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            LayoutError::Overlap {
                first: 0,
                second: 1,
                ..
            }
        ),
        "{err}"
    );
}

/// The pairwise definition the sweep must agree with: segments `a + i*S` and `c + j*S`
/// (length `L`, `0 <= i, j < n`) overlap iff some `k = i - j` with `|k| < n` puts `k*S`
/// strictly within `L` of `c - a`.
fn pairwise_overlap(l: &KvLayout, planes: &[Plane]) -> bool {
    let (s, len, n) = (
        i128::from(l.block_stride),
        i128::from(l.segment_bytes),
        i128::from(l.num_blocks),
    );
    planes.iter().enumerate().any(|(x, a)| {
        planes[x + 1..].iter().any(|b| {
            let d = i128::from(b.start) - i128::from(a.start);
            let k0 = d.div_euclid(s);
            [k0, k0 + 1]
                .iter()
                .any(|&k| k.abs() < n && (k * s - d).abs() < len)
        })
    })
}

fn bare(stride: u64, seg: u64, blocks: u32) -> KvLayout {
    KvLayout {
        layers: Vec::new(),
        block_stride: stride,
        num_blocks: blocks,
        view_offset: 0,
        segments: 2,
        segment_bytes: seg,
    }
}

#[test]
fn the_sweep_agrees_with_the_pairwise_definition() {
    // A small LCG: deterministic, no dependency.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = |m: u64| {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (x >> 33) % m
    };
    let (mut overlapping, mut disjoint) = (0, 0);
    for _ in 0..20_000 {
        let seg = 1 + next(8);
        let stride = seg + next(24);
        let blocks = 1 + next(5) as u32;
        let l = bare(stride, seg, blocks);
        let count = 2 + next(6) as usize;
        let planes: Vec<Plane> = (0..count)
            .map(|i| Plane {
                layer: i as u32 / 2,
                segment: i as u32 % 2,
                start: 1000 + next(stride * (u64::from(blocks) + 2)),
                extent: 0,
            })
            .collect();
        let want = pairwise_overlap(&l, &planes);
        let got = l.check_overlaps(&planes).is_err();
        assert_eq!(
            got, want,
            "stride {stride} seg {seg} blocks {blocks}: {planes:?}"
        );
        if want {
            overlapping += 1;
        } else {
            disjoint += 1;
        }
    }
    assert!(
        overlapping > 1000 && disjoint > 1000,
        "{overlapping} {disjoint}"
    );
}

#[test]
fn interleaved_planes_are_checked_in_n_log_n() {
    // 200,000 planes inside one stride, each a cross-layer layer: the pairwise sweep
    // compared every pair (2 x 10^10); this one sorts them.
    let planes = 200_000u64;
    let seg = 64;
    let l = bare(planes * seg, seg, 1 << 20);
    let mut ps: Vec<Plane> = (0..planes)
        .map(|i| Plane {
            layer: (i / 2) as u32,
            segment: (i % 2) as u32,
            start: i * seg,
            extent: 0,
        })
        .collect();
    let t = std::time::Instant::now();
    assert!(l.check_overlaps(&ps).is_ok());
    ps[planes as usize - 1].start -= 1;
    assert!(l.check_overlaps(&ps).is_err());
    assert!(
        t.elapsed() < std::time::Duration::from_secs(5),
        "{:?}",
        t.elapsed()
    );
}

#[test]
fn layer_counts_are_bounded() {
    let max = KvLayout::MAX_LAYERS;
    let seg = 256u64;
    let ok = KvLayoutSpec::cross_layer(0, max, 2, 64, seg);
    let t = std::time::Instant::now();
    assert!(KvLayout::new(ok, &shape(max, 2)).is_ok());
    assert!(
        t.elapsed() < std::time::Duration::from_secs(1),
        "{:?}",
        t.elapsed()
    );
    let over = KvLayoutSpec::cross_layer(0, max + 1, 2, 64, seg);
    assert_eq!(
        KvLayout::new(over, &shape(max + 1, 2)),
        Err(LayoutError::TooManyLayers {
            layers: max as usize + 1,
            max
        })
    );
}

#[test]
fn blocks_checked() {
    let l = KvLayout::new(split_spec(1, 256, 4), &shape(1, 2)).unwrap();
    assert!(l.check_blocks(&[3, 0, 2]).is_ok());
    assert_eq!(
        l.check_blocks(&[4]),
        Err(LayoutError::BlockOutOfRange {
            block: 4,
            num_blocks: 4
        })
    );
    assert_eq!(
        l.check_blocks(&[1, 1]),
        Err(LayoutError::DuplicateBlock { block: 1 })
    );
}

#[test]
fn memory_check_names_the_layer() {
    let dev = HostDevice::new(0);
    let k = dev.alloc(4 * 256).unwrap();
    let v = dev.alloc(4 * 256).unwrap();
    let spec = KvLayoutSpec {
        kind: GroupKind::Attention,
        layers: vec![
            LayerLayout::Split {
                k_base: k.ptr(),
                v_base: v.ptr(),
            },
            LayerLayout::Split {
                k_base: k.ptr() + 0x100_0000_0000,
                v_base: v.ptr() + 0x100_0000_0000,
            },
        ],
        block_stride: 256,
        num_blocks: 4,
        view_offset: 0,
    };
    let err = KvLayout::new_on(spec.clone(), &shape(2, 2), dev.as_ref()).unwrap_err();
    assert!(
        matches!(
            err,
            LayoutError::Memory {
                layer: 1,
                segment: "K",
                ..
            }
        ),
        "{err}"
    );
    // A nonzero view that runs past the allocation is refused too.
    let mut one = spec;
    one.layers.truncate(1);
    one.view_offset = 64;
    let err = KvLayout::new_on(one, &shape(1, 2), dev.as_ref()).unwrap_err();
    assert!(matches!(err, LayoutError::Memory { layer: 0, .. }), "{err}");
}
