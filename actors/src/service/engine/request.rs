//! Checks engine requests field by field and turns them into the `Node`'s types, and turns
//! the node's errors into gRPC statuses. Pure functions: a request refused here never
//! reaches the node. Counts are checked against the limits in [`super`] (advertised in
//! `Capabilities`) before anything proportional to them is built: RESOURCE_EXHAUSTED.

use kvferry_gpu::{DeviceError, GroupKind, KvLayoutSpec, KvShape, LayerLayout, LayoutError};
use tonic::Status;

use crate::error::NodeError;
use crate::lease::table::LeaseError;
use crate::model::{BlockHash, InstanceId, LeaseId};
use kvferry_proto::v1 as proto;
use kvferry_proto::{MAX_ENGINE_BLOCKS, MAX_ENGINE_HASHES, MAX_ENGINE_LAYERS};

fn bad(method: &str, what: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("{method}: {what}"))
}

/// A count over one of the advertised limits.
fn over(method: &str, count: usize, what: &str, max: usize, per: &str) -> Status {
    Status::resource_exhausted(format!("{method}: {count} {what}; at most {max} per {per}"))
}

pub(crate) fn instance(method: &str, s: &str) -> Result<InstanceId, Status> {
    InstanceId::new(s).map_err(|e| bad(method, e))
}

pub(crate) fn lease(method: &str, s: &str) -> Result<LeaseId, Status> {
    LeaseId::from_hex(s).map_err(|e| bad(method, e))
}

/// 1 to [`MAX_ENGINE_HASHES`] hashes of 1 to 32 bytes.
pub(crate) fn hashes<T: AsRef<[u8]>>(method: &str, hashes: &[T]) -> Result<Vec<BlockHash>, Status> {
    if hashes.is_empty() {
        return Err(bad(method, "no block hashes given"));
    }
    if hashes.len() > MAX_ENGINE_HASHES {
        return Err(over(
            method,
            hashes.len(),
            "block hashes",
            MAX_ENGINE_HASHES,
            "request",
        ));
    }
    BlockHash::parse_all(hashes).map_err(|e| bad(method, e))
}

/// A query's hashes in either form: repeated, or packed (`hash_len` bytes each, back to
/// back). Both given, a length out of 1..=32, or bytes that are not a whole number of hashes
/// are refused.
pub(crate) fn query_hashes<T: AsRef<[u8]>>(
    method: &str,
    repeated: &[T],
    packed: &[u8],
    hash_len: u32,
) -> Result<Vec<BlockHash>, Status> {
    if packed.is_empty() {
        return hashes(method, repeated);
    }
    if !repeated.is_empty() {
        return Err(bad(method, "hashes given both repeated and packed"));
    }
    let len = hash_len as usize;
    if !(1..=crate::model::MAX_HASH_LEN).contains(&len) {
        return Err(bad(
            method,
            format!(
                "hash_len {hash_len} is not 1 to {}",
                crate::model::MAX_HASH_LEN
            ),
        ));
    }
    if !packed.len().is_multiple_of(len) {
        return Err(bad(
            method,
            format!(
                "{} packed bytes are not a whole number of {len}-byte hashes",
                packed.len()
            ),
        ));
    }
    let parts: Vec<&[u8]> = packed.chunks_exact(len).collect();
    hashes(method, &parts)
}

/// 1 to [`MAX_ENGINE_BLOCKS`] block indices.
pub(crate) fn blocks(method: &str, field: &str, blocks: &[u32]) -> Result<(), Status> {
    if blocks.is_empty() {
        return Err(bad(method, format!("no {field} given")));
    }
    if blocks.len() > MAX_ENGINE_BLOCKS {
        return Err(over(
            method,
            blocks.len(),
            field,
            MAX_ENGINE_BLOCKS,
            "request",
        ));
    }
    Ok(())
}

/// 1 to [`MAX_ENGINE_LAYERS`] layers.
pub(crate) fn shape(method: &str, s: Option<&proto::KvShape>) -> Result<KvShape, Status> {
    let s = s.ok_or_else(|| bad(method, "no KV shape given"))?;
    if s.layers > MAX_ENGINE_LAYERS {
        return Err(over(
            method,
            s.layers as usize,
            "layers in the KV shape",
            MAX_ENGINE_LAYERS as usize,
            "instance",
        ));
    }
    KvShape::new(s.layers, s.tp_size, s.segments, s.segment_bytes).map_err(|e| bad(method, e))
}

/// The shape's whole block (every rank's part) must fit one host pool slot of `slot_bytes`:
/// no block of it could ever be stored otherwise. FAILED_PRECONDITION: the request is well
/// formed, this node's configuration cannot serve it.
pub(crate) fn fits_slot(method: &str, shape: &KvShape, slot_bytes: u64) -> Result<(), Status> {
    let block = shape.block_bytes();
    if block > slot_bytes {
        return Err(Status::failed_precondition(format!(
            "{method}: a block of this shape is {block} bytes ({} layers x {} segments x {} \
             bytes x tp {}), larger than this node's {slot_bytes}-byte pool slot \
             (`pool.slot-bytes`)",
            shape.layers(),
            shape.segments(),
            shape.segment_bytes(),
            shape.tp_size()
        )));
    }
    Ok(())
}

/// Memory region of each of a layer's planes, as the request names them: `[K, V]` (or
/// `[KV, _]` with one segment).
pub(crate) type PlaneRegions = [u32; 2];

/// The layout as sent: addresses are offsets inside the memory region each plane names.
pub(crate) fn layout(
    method: &str,
    l: Option<&proto::KvLayout>,
) -> Result<(KvLayoutSpec, Vec<PlaneRegions>), Status> {
    let l = l.ok_or_else(|| bad(method, "no KV layout given"))?;
    if l.layers.len() > MAX_ENGINE_LAYERS as usize {
        return Err(over(
            method,
            l.layers.len(),
            "layers in the KV layout",
            MAX_ENGINE_LAYERS as usize,
            "instance",
        ));
    }
    let kind = match proto::GroupKind::try_from(l.kind) {
        Ok(proto::GroupKind::Attention) => GroupKind::Attention,
        Ok(proto::GroupKind::CrossLayer) => GroupKind::CrossLayer,
        Ok(proto::GroupKind::Recurrent) => GroupKind::Recurrent,
        Err(_) => return Err(bad(method, format!("unknown KV group kind {}", l.kind))),
    };
    let (layers, regions) = l
        .layers
        .iter()
        .enumerate()
        .map(|(i, layer)| match &layer.layer {
            Some(proto::layer_layout::Layer::Contiguous(c)) => Ok((
                LayerLayout::Contiguous {
                    base: c.base,
                    kv_stride: c.kv_stride,
                },
                [c.region, c.region],
            )),
            Some(proto::layer_layout::Layer::Split(s)) => Ok((
                LayerLayout::Split {
                    k_base: s.k_base,
                    v_base: s.v_base,
                },
                [s.k_region, s.v_region],
            )),
            None => Err(bad(method, format!("layer {i} has no placement"))),
        })
        .collect::<Result<(Vec<_>, Vec<_>), _>>()?;
    Ok((
        KvLayoutSpec {
            kind,
            layers,
            block_stride: l.block_stride,
            num_blocks: l.num_blocks,
            view_offset: l.view_offset,
        },
        regions,
    ))
}

/// Where one memory region of a registration lies in this process: `len` bytes from `base`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Placed {
    pub base: u64,
    pub len: u64,
}

/// Checks that every plane of `spec` (offsets) lies inside `[0, len)` of the region it names
/// and moves it to that region's base. Overlaps between planes are checked afterwards, once,
/// on the moved addresses, by the registration (`KvLayout::new_on`: two planes in different
/// regions may share offsets).
pub(crate) fn place(
    method: &str,
    spec: KvLayoutSpec,
    plane_regions: &[PlaneRegions],
    shape: &KvShape,
    regions: &[Placed],
) -> Result<KvLayoutSpec, Status> {
    if spec.num_blocks == 0 {
        return Err(bad(method, LayoutError::NoBlocks));
    }
    if spec.layers.len() != shape.layers() as usize {
        return Err(bad(
            method,
            LayoutError::LayerCount {
                expected: shape.layers(),
                got: spec.layers.len(),
            },
        ));
    }
    let extent = (u64::from(spec.num_blocks) - 1)
        .checked_mul(spec.block_stride)
        .and_then(|v| v.checked_add(shape.segment_bytes()))
        .ok_or_else(|| bad(method, "layout addresses overflow"))?;
    let segments = shape.segments();
    let seg_name = |seg: u32| match (segments, seg) {
        (1, _) => "KV",
        (_, 0) => "K",
        _ => "V",
    };
    // The plane's offset inside its region, checked against the region; returns the address.
    let put = |layer: usize, seg: u32, offset: Option<u64>| -> Result<u64, Status> {
        let index = plane_regions[layer][seg as usize];
        let region = regions.get(index as usize).ok_or_else(|| {
            bad(
                method,
                format!(
                    "layer {layer} {} plane names memory region {index}; the request has {}",
                    seg_name(seg),
                    regions.len()
                ),
            )
        })?;
        let start = offset.and_then(|o| o.checked_add(spec.view_offset));
        match start {
            Some(start) if start.checked_add(extent).is_some_and(|e| e <= region.len) => {
                Ok(region.base + start - spec.view_offset)
            }
            _ => Err(bad(
                method,
                format!(
                    "layer {layer} {} plane [{:#x}, +{extent:#x}) lies outside memory region \
                     {index} ({} bytes)",
                    seg_name(seg),
                    offset.unwrap_or(u64::MAX),
                    region.len
                ),
            )),
        }
    };
    let layers = spec
        .layers
        .iter()
        .enumerate()
        .map(|(i, l)| {
            Ok(match *l {
                LayerLayout::Contiguous { base, kv_stride } => {
                    if segments == 2 && plane_regions[i][0] != plane_regions[i][1] {
                        return Err(bad(
                            method,
                            format!("layer {i}: a contiguous K/V pair lies in one region"),
                        ));
                    }
                    let moved = put(i, 0, Some(base))?;
                    if segments == 2 {
                        put(i, 1, base.checked_add(kv_stride))?;
                    }
                    LayerLayout::Contiguous {
                        base: moved,
                        kv_stride,
                    }
                }
                LayerLayout::Split { k_base, v_base } => LayerLayout::Split {
                    k_base: put(i, 0, Some(k_base))?,
                    v_base: if segments == 2 {
                        put(i, 1, Some(v_base))?
                    } else {
                        v_base
                    },
                },
            })
        })
        .collect::<Result<Vec<_>, Status>>()?;
    Ok(KvLayoutSpec { layers, ..spec })
}

/// The node's error as the engine sees it.
pub(crate) fn status(method: &str, e: NodeError) -> Status {
    let msg = format!("{method}: {e}");
    match &e {
        NodeError::Layout(LayoutError::TooManyLayers { .. }) | NodeError::TooManyTenants { .. } => {
            Status::resource_exhausted(msg)
        }
        NodeError::Model(_)
        | NodeError::Shape(_)
        | NodeError::Layout(_)
        | NodeError::BadRequest { .. }
        | NodeError::NoSuchDevice { .. } => Status::invalid_argument(msg),
        NodeError::Lease(l) => match l {
            LeaseError::UnknownOrExpired { .. } => Status::not_found(msg),
            LeaseError::WrongInstance { .. } => Status::permission_denied(msg),
            LeaseError::RankOutOfRange { .. } => Status::invalid_argument(msg),
            _ => Status::failed_precondition(msg),
        },
        NodeError::UnknownInstance { .. } | NodeError::UnknownRank { .. } => Status::not_found(msg),
        NodeError::RankRegistered { .. } => Status::already_exists(msg),
        NodeError::InstanceMismatch { .. } => Status::failed_precondition(msg),
        NodeError::Cache(
            crate::tier::cache::CacheError::Full { .. }
            | crate::tier::cache::CacheError::OverQuota { .. }
            | crate::tier::cache::CacheError::NotAdmitted { .. },
        )
        | NodeError::Pool(crate::tier::pool::PoolError::Exhausted { .. }) => {
            Status::resource_exhausted(msg)
        }
        NodeError::Cache(_) => Status::invalid_argument(msg),
        NodeError::Device(DeviceError::Unsupported { .. }) => Status::failed_precondition(msg),
        // A link that failed may work again; a refusal or a missing data path will not.
        NodeError::Remote { source, .. } if !source.is_link_failure() => {
            Status::failed_precondition(msg)
        }
        NodeError::Unroutable { .. } => Status::failed_precondition(msg),
        NodeError::Remote { .. } | NodeError::Stopped { .. } => Status::unavailable(msg),
        NodeError::DeadlinePassed { .. } => Status::deadline_exceeded(msg),
        NodeError::Cancelled { .. } => Status::aborted(msg),
        _ => Status::internal(msg),
    }
}

/// A short stable name of the error's kind, for load completions.
pub(crate) fn error_kind(e: &NodeError) -> &'static str {
    match e {
        NodeError::Transfer { .. } => "transfer",
        NodeError::Remote { source, .. } => source.kind(),
        // As a peer's missing data path was reported before it was its own variant.
        NodeError::Unroutable { .. } => "no_data_path",
        NodeError::Stopped { .. } => "stopped",
        NodeError::DeadlinePassed { .. } => "deadline",
        NodeError::Cancelled { .. } => "cancelled",
        NodeError::Device(_) => "device",
        NodeError::Lease(_) => "lease",
        NodeError::Layout(_) => "layout",
        NodeError::Cache(_) | NodeError::Pool(_) => "pool",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvferry_gpu::KvLayout;

    #[test]
    fn packed_hashes_read_as_the_repeated_ones() {
        let repeated: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i, 7, i, 9]).collect();
        let packed: Vec<u8> = repeated.concat();
        let none: &[Vec<u8>] = &[];
        let a = query_hashes("Query", &repeated, &[], 0).unwrap();
        let b = query_hashes("Query", none, &packed, 4).unwrap();
        assert_eq!(a, b);
        assert_eq!(b.len(), 5);
        assert_eq!(b[3].as_bytes(), &[3, 7, 3, 9]);
        // Cut another way, other hashes.
        let c = query_hashes("Query", none, &packed, 2).unwrap();
        assert_eq!(c.len(), 10);
        for (packed, len) in [(&packed[..], 0), (&packed[..], 33), (&packed[..19], 4)] {
            let e = query_hashes("Query", none, packed, len).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{len}: {e:?}");
        }
        let e = query_hashes("Query", &repeated, &packed, 4).unwrap_err();
        assert!(e.message().contains("both"), "{e:?}");
        assert!(query_hashes("Query", none, &[], 4).is_err());
    }

    fn split(k: u64, v: u64) -> proto::LayerLayout {
        split_in(k, 0, v, 0)
    }

    fn split_in(k: u64, kr: u32, v: u64, vr: u32) -> proto::LayerLayout {
        proto::LayerLayout {
            layer: Some(proto::layer_layout::Layer::Split(proto::Split {
                k_base: k,
                v_base: v,
                k_region: kr,
                v_region: vr,
            })),
        }
    }

    fn one(base: u64, len: u64) -> Vec<Placed> {
        vec![Placed { base, len }]
    }

    #[test]
    fn layouts_must_lie_inside_the_memory_and_move_to_its_base() {
        let shape = KvShape::new(2, 1, 2, 64).unwrap();
        let l = proto::KvLayout {
            kind: proto::GroupKind::Attention as i32,
            layers: vec![split(0, 256), split(512, 768)],
            block_stride: 64,
            num_blocks: 4,
            view_offset: 0,
        };
        let (spec, regions) = layout("T", Some(&l)).unwrap();
        let placed = place("T", spec.clone(), &regions, &shape, &one(0x10000, 1024)).unwrap();
        assert_eq!(
            placed.layers[1],
            LayerLayout::Split {
                k_base: 0x10000 + 512,
                v_base: 0x10000 + 768
            }
        );
        let err = place("T", spec, &regions, &shape, &one(0x10000, 1000)).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("layer 1 V"), "{}", err.message());
        let overlap = proto::KvLayout {
            layers: vec![split(0, 256), split(128, 768)],
            ..l.clone()
        };
        let (spec, regions) = layout("T", Some(&overlap)).unwrap();
        let placed = place("T", spec, &regions, &shape, &one(0, 1 << 20)).unwrap();
        let err = KvLayout::new(placed, &shape).unwrap_err();
        assert!(err.to_string().contains("overlaps"), "{err}");
        let hole = proto::KvLayout {
            layers: vec![split(0, 256), proto::LayerLayout { layer: None }],
            ..l
        };
        assert!(layout("T", Some(&hole)).is_err());
    }

    #[test]
    fn each_plane_is_checked_against_its_own_region() {
        // Per-layer allocations: layer 0 in regions 0 (K) and 1 (V), layer 1 in region 2
        // (K and V). Offsets repeat across regions, which is fine; bounds are per region.
        let shape = KvShape::new(2, 1, 2, 64).unwrap();
        let l = proto::KvLayout {
            kind: proto::GroupKind::Attention as i32,
            layers: vec![split_in(0, 0, 0, 1), split_in(0, 2, 256, 2)],
            block_stride: 64,
            num_blocks: 4,
            view_offset: 0,
        };
        let regions = [
            Placed {
                base: 0x1_0000,
                len: 256,
            },
            Placed {
                base: 0x2_0000,
                len: 256,
            },
            Placed {
                base: 0x3_0000,
                len: 512,
            },
        ];
        let (spec, names) = layout("T", Some(&l)).unwrap();
        assert_eq!(names, vec![[0, 1], [2, 2]]);
        let placed = place("T", spec.clone(), &names, &shape, &regions).unwrap();
        assert_eq!(
            placed.layers,
            vec![
                LayerLayout::Split {
                    k_base: 0x1_0000,
                    v_base: 0x2_0000
                },
                LayerLayout::Split {
                    k_base: 0x3_0000,
                    v_base: 0x3_0100
                }
            ]
        );
        // Region 1 one byte short: layer 0 V named, with its region.
        let mut short = regions;
        short[1].len = 255;
        let err = place("T", spec.clone(), &names, &shape, &short).unwrap_err();
        assert!(
            err.message().contains("layer 0 V") && err.message().contains("region 1"),
            "{}",
            err.message()
        );
        // A region index past the list.
        let err = place("T", spec.clone(), &names, &shape, &regions[..2]).unwrap_err();
        assert!(
            err.message()
                .contains("layer 1 K plane names memory region 2"),
            "{}",
            err.message()
        );
        // Two regions that are one memory (the same base): the planes overlap there.
        let mut same = regions;
        same[1].base = same[0].base;
        let placed = place("T", spec, &names, &shape, &same).unwrap();
        let err = KvLayout::new(placed, &shape).unwrap_err();
        assert!(err.to_string().contains("overlaps"), "{err}");
        // A contiguous K/V pair split over two regions is refused.
        let c = proto::KvLayout {
            layers: vec![
                proto::LayerLayout {
                    layer: Some(proto::layer_layout::Layer::Contiguous(proto::Contiguous {
                        base: 0,
                        kv_stride: 256,
                        region: 0,
                    })),
                },
                split_in(0, 2, 256, 2),
            ],
            ..l
        };
        let (spec, names) = layout("T", Some(&c)).unwrap();
        let mut big = regions;
        big[0].len = 512;
        assert!(place("T", spec, &names, &shape, &big).is_ok());
    }

    #[test]
    fn counts_over_the_limits_are_resource_exhausted() {
        fn code<T>(r: Result<T, Status>) -> tonic::Code {
            r.map(|_| ()).unwrap_err().code()
        }
        assert_eq!(
            code(hashes::<Vec<u8>>("Q", &[])),
            tonic::Code::InvalidArgument
        );
        assert_eq!(code(hashes("Q", &[vec![]])), tonic::Code::InvalidArgument);
        assert_eq!(
            code(hashes("Q", &vec![vec![1u8]; MAX_ENGINE_HASHES + 1])),
            tonic::Code::ResourceExhausted
        );
        assert_eq!(hashes("Q", &[vec![1u8], vec![2u8; 32]]).unwrap().len(), 2);
        assert_eq!(
            code(blocks("L", "blocks", &vec![0; MAX_ENGINE_BLOCKS + 1])),
            tonic::Code::ResourceExhausted
        );
        assert_eq!(
            code(blocks("L", "blocks", &[])),
            tonic::Code::InvalidArgument
        );
        let s = |layers| proto::KvShape {
            layers,
            tp_size: 1,
            segments: 2,
            segment_bytes: 64,
        };
        assert!(shape("R", Some(&s(MAX_ENGINE_LAYERS))).is_ok());
        let e = shape("R", Some(&s(MAX_ENGINE_LAYERS + 1))).unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert!(e.message().contains("at most 512"), "{}", e.message());
        let l = proto::KvLayout {
            layers: vec![split(0, 64); MAX_ENGINE_LAYERS as usize + 1],
            ..Default::default()
        };
        assert_eq!(code(layout("R", Some(&l))), tonic::Code::ResourceExhausted);
        // The node's own refusal maps the same way.
        let e = status(
            "R",
            NodeError::Layout(LayoutError::TooManyLayers {
                layers: 513,
                max: 512,
            }),
        );
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
    }

    #[test]
    fn a_block_must_fit_a_slot() {
        let shape = KvShape::new(4, 2, 2, 1024).unwrap(); // 16 KiB per block
        assert!(fits_slot("R", &shape, 16 << 10).is_ok());
        let e = fits_slot("R", &shape, (16 << 10) - 64).unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        assert!(
            e.message().contains("16384 bytes") && e.message().contains("16320-byte pool slot"),
            "{}",
            e.message()
        );
    }
}
