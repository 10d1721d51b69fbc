//! Checks engine requests field by field and turns them into the `Node`'s types, and turns
//! the node's errors into gRPC statuses. Pure functions: a request refused here never
//! reaches the node.

use kvferry_gpu::{DeviceError, GroupKind, KvLayout, KvLayoutSpec, KvShape, LayerLayout};
use tonic::Status;

use super::proto;
use super::MAX_ENGINE_HASHES;
use crate::error::NodeError;
use crate::lease::LeaseError;
use crate::model::{BlockHash, InstanceId, LeaseId};

fn bad(method: &str, what: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("{method}: {what}"))
}

pub(crate) fn instance(method: &str, s: &str) -> Result<InstanceId, Status> {
    InstanceId::new(s).map_err(|e| bad(method, e))
}

pub(crate) fn lease(method: &str, s: &str) -> Result<LeaseId, Status> {
    LeaseId::from_hex(s).map_err(|e| bad(method, e))
}

/// 1 to [`MAX_ENGINE_HASHES`] hashes of 1 to 32 bytes.
pub(crate) fn hashes(method: &str, hashes: &[Vec<u8>]) -> Result<Vec<BlockHash>, Status> {
    if hashes.is_empty() {
        return Err(bad(method, "no block hashes given"));
    }
    if hashes.len() > MAX_ENGINE_HASHES {
        return Err(bad(
            method,
            format!(
                "{} block hashes; at most {MAX_ENGINE_HASHES} per request",
                hashes.len()
            ),
        ));
    }
    BlockHash::parse_all(hashes).map_err(|e| bad(method, e))
}

/// 1 to [`MAX_ENGINE_HASHES`] block indices.
pub(crate) fn blocks(method: &str, field: &str, blocks: &[u32]) -> Result<(), Status> {
    if blocks.is_empty() {
        return Err(bad(method, format!("no {field} given")));
    }
    if blocks.len() > MAX_ENGINE_HASHES {
        return Err(bad(
            method,
            format!(
                "{} {field}; at most {MAX_ENGINE_HASHES} per request",
                blocks.len()
            ),
        ));
    }
    Ok(())
}

pub(crate) fn shape(method: &str, s: Option<&proto::KvShape>) -> Result<KvShape, Status> {
    let s = s.ok_or_else(|| bad(method, "no KV shape given"))?;
    KvShape::new(s.layers, s.tp_size, s.segments, s.segment_bytes).map_err(|e| bad(method, e))
}

/// The layout as sent: addresses are offsets inside the memory handle.
pub(crate) fn layout(method: &str, l: Option<&proto::KvLayout>) -> Result<KvLayoutSpec, Status> {
    let l = l.ok_or_else(|| bad(method, "no KV layout given"))?;
    let kind = match proto::GroupKind::try_from(l.kind) {
        Ok(proto::GroupKind::Attention) => GroupKind::Attention,
        Ok(proto::GroupKind::PageFirst) => GroupKind::PageFirst,
        Ok(proto::GroupKind::Recurrent) => GroupKind::Recurrent,
        Err(_) => return Err(bad(method, format!("unknown KV group kind {}", l.kind))),
    };
    let layers = l
        .layers
        .iter()
        .enumerate()
        .map(|(i, layer)| match &layer.layer {
            Some(proto::layer_layout::Layer::Contiguous(c)) => Ok(LayerLayout::Contiguous {
                base: c.base,
                kv_stride: c.kv_stride,
            }),
            Some(proto::layer_layout::Layer::Split(s)) => Ok(LayerLayout::Split {
                k_base: s.k_base,
                v_base: s.v_base,
            }),
            None => Err(bad(method, format!("layer {i} has no placement"))),
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(KvLayoutSpec {
        kind,
        layers,
        block_stride: l.block_stride,
        num_blocks: l.num_blocks,
        view_offset: l.view_offset,
    })
}

/// Checks that every plane of `spec` (offsets) lies inside `[0, len)` of the memory and
/// moves it to `base`, where the memory is mapped.
pub(crate) fn place(
    method: &str,
    spec: KvLayoutSpec,
    shape: &KvShape,
    base: u64,
    len: u64,
) -> Result<KvLayoutSpec, Status> {
    let checked = KvLayout::new(spec.clone(), shape).map_err(|e| bad(method, e))?;
    let planes = checked.planes().map_err(|e| bad(method, e))?;
    for p in planes {
        let end = p.start.checked_add(p.extent);
        if end.is_none_or(|end| end > len) {
            let seg = match (shape.segments(), p.segment) {
                (1, _) => "KV",
                (_, 0) => "K",
                _ => "V",
            };
            return Err(bad(
                method,
                format!(
                    "layer {} {seg} plane [{:#x}, +{:#x}) lies outside the memory handle ({len} bytes)",
                    p.layer, p.start, p.extent
                ),
            ));
        }
    }
    let shift = |v: u64| {
        v.checked_add(base)
            .ok_or_else(|| bad(method, "layout addresses overflow"))
    };
    let layers = spec
        .layers
        .iter()
        .map(|l| {
            Ok(match *l {
                LayerLayout::Contiguous { base, kv_stride } => LayerLayout::Contiguous {
                    base: shift(base)?,
                    kv_stride,
                },
                LayerLayout::Split { k_base, v_base } => LayerLayout::Split {
                    k_base: shift(k_base)?,
                    v_base: shift(v_base)?,
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
        NodeError::Cache(crate::cache::CacheError::Full { .. })
        | NodeError::Pool(crate::pool::PoolError::Exhausted { .. }) => {
            Status::resource_exhausted(msg)
        }
        NodeError::Cache(_) => Status::invalid_argument(msg),
        NodeError::Device(DeviceError::Unsupported { .. }) => Status::failed_precondition(msg),
        NodeError::Remote { .. } | NodeError::Stopped { .. } => Status::unavailable(msg),
        _ => Status::internal(msg),
    }
}

/// A short stable name of the error's kind, for load completions.
pub(crate) fn error_kind(e: &NodeError) -> &'static str {
    match e {
        NodeError::Transfer { .. } => "transfer",
        NodeError::Remote { .. } => "remote",
        NodeError::Stopped { .. } => "stopped",
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

    fn split(k: u64, v: u64) -> proto::LayerLayout {
        proto::LayerLayout {
            layer: Some(proto::layer_layout::Layer::Split(proto::Split {
                k_base: k,
                v_base: v,
            })),
        }
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
        let spec = layout("T", Some(&l)).unwrap();
        let placed = place("T", spec.clone(), &shape, 0x10000, 1024).unwrap();
        assert_eq!(
            placed.layers[1],
            LayerLayout::Split {
                k_base: 0x10000 + 512,
                v_base: 0x10000 + 768
            }
        );
        let err = place("T", spec, &shape, 0x10000, 1000).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("layer 1 V"), "{}", err.message());
        let overlap = proto::KvLayout {
            layers: vec![split(0, 256), split(128, 768)],
            ..l.clone()
        };
        let err = place(
            "T",
            layout("T", Some(&overlap)).unwrap(),
            &shape,
            0,
            1 << 20,
        )
        .unwrap_err();
        assert!(err.message().contains("overlaps"), "{}", err.message());
        let hole = proto::KvLayout {
            layers: vec![split(0, 256), proto::LayerLayout { layer: None }],
            ..l
        };
        assert!(layout("T", Some(&hole)).is_err());
    }

    #[test]
    fn hash_lists_are_bounded() {
        assert!(hashes("Q", &[]).is_err());
        assert!(hashes("Q", &[vec![]]).is_err());
        assert!(hashes("Q", &vec![vec![1u8]; MAX_ENGINE_HASHES + 1]).is_err());
        assert_eq!(hashes("Q", &[vec![1u8], vec![2u8; 32]]).unwrap().len(), 2);
    }
}
