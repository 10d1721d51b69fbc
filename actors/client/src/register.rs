//! Registrations on the wire: a rank's KV as memory regions, planes placed in them.

use kvferry_proto::api;
use kvferry_proto::model::InstanceId;
use kvferry_proto::v1::*;

/// The wire form of a registration (addresses as given: offsets inside the memory).
pub fn register_request(
    req: &api::RegisterInstance,
    memory_handle: u64,
) -> RegisterInstanceRequest {
    let s = &req.shape;
    let l = &req.layout;
    RegisterInstanceRequest {
        instance: req.instance.as_str().to_owned(),
        model: req.model.clone(),
        dtype: req.dtype.clone(),
        shape: Some(KvShape {
            layers: s.layers(),
            tp_size: s.tp_size(),
            segments: s.segments(),
            segment_bytes: s.segment_bytes(),
        }),
        rank: req.rank,
        device: req.device,
        layout: Some(KvLayout {
            kind: match l.kind {
                kvferry_gpu::GroupKind::Attention => GroupKind::Attention,
                kvferry_gpu::GroupKind::CrossLayer => GroupKind::CrossLayer,
                kvferry_gpu::GroupKind::Recurrent => GroupKind::Recurrent,
            } as i32,
            layers: l
                .layers
                .iter()
                .map(|layer| LayerLayout {
                    layer: Some(match *layer {
                        kvferry_gpu::LayerLayout::Contiguous { base, kv_stride } => {
                            layer_layout::Layer::Contiguous(Contiguous {
                                base,
                                kv_stride,
                                region: 0,
                            })
                        }
                        kvferry_gpu::LayerLayout::Split { k_base, v_base } => {
                            layer_layout::Layer::Split(Split {
                                k_base,
                                v_base,
                                k_region: 0,
                                v_region: 0,
                            })
                        }
                    }),
                })
                .collect(),
            block_stride: l.block_stride,
            num_blocks: l.num_blocks,
            view_offset: l.view_offset,
        }),
        memory_handle,
        cuda_ipc_handle: Vec::new(),
        regions: Vec::new(),
        completion_board: 0,
    }
}

/// One piece of memory a rank's KV lies in, as a registration names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemoryRegion {
    /// A memory handle from the node's fd socket (a memfd or DMA-BUF sent for this rank).
    Handle(u64),
    /// A CUDA allocation of this process, by its IPC handle (64 bytes, or PyTorch's framed
    /// form); offsets are from the allocation's base.
    CudaIpc(Vec<u8>),
}

/// Where one plane (K, V, or MLA's single segment) of a layer starts: a byte offset of its
/// block 0 inside a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanePlacement {
    /// Index into [`RegisterRegions::regions`].
    pub region: u32,
    pub offset: u64,
}

/// One layer's planes: K and V, or (one segment) K alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionLayer {
    pub k: PlanePlacement,
    pub v: Option<PlanePlacement>,
}

/// A rank's KV spread over several memory regions (an engine's one tensor per layer): every
/// plane names its region and its offset inside it; planes share the block stride.
#[derive(Clone, Debug)]
pub struct RegisterRegions {
    pub instance: InstanceId,
    pub model: String,
    pub dtype: String,
    pub shape: kvferry_gpu::KvShape,
    pub rank: u32,
    pub device: u32,
    pub kind: kvferry_gpu::GroupKind,
    pub block_stride: u64,
    pub num_blocks: u32,
    pub regions: Vec<MemoryRegion>,
    pub layers: Vec<RegionLayer>,
}

/// The wire form of a registration over several regions (protocol 2).
pub fn register_regions_request(r: &RegisterRegions) -> RegisterInstanceRequest {
    let spec = kvferry_gpu::KvLayoutSpec {
        kind: r.kind,
        layers: Vec::new(),
        block_stride: r.block_stride,
        num_blocks: r.num_blocks,
        view_offset: 0,
    };
    let mut msg = register_request(
        &api::RegisterInstance {
            instance: r.instance.clone(),
            model: r.model.clone(),
            dtype: r.dtype.clone(),
            shape: r.shape,
            rank: r.rank,
            device: r.device,
            layout: spec,
        },
        0,
    );
    if let Some(layout) = msg.layout.as_mut() {
        layout.layers = r
            .layers
            .iter()
            .map(|l| {
                let v = l.v.unwrap_or(l.k);
                LayerLayout {
                    layer: Some(layer_layout::Layer::Split(Split {
                        k_base: l.k.offset,
                        v_base: v.offset,
                        k_region: l.k.region,
                        v_region: v.region,
                    })),
                }
            })
            .collect();
        // Split planes need two segments; with one, the layer is its K plane alone.
        if r.shape.segments() == 1 {
            for (wire, l) in layout.layers.iter_mut().zip(&r.layers) {
                wire.layer = Some(layer_layout::Layer::Contiguous(Contiguous {
                    base: l.k.offset,
                    kv_stride: 0,
                    region: l.k.region,
                }));
            }
        }
    }
    msg.regions = r
        .regions
        .iter()
        .map(|g| kvferry_proto::v1::MemoryRegion {
            memory: Some(match g {
                MemoryRegion::Handle(h) => memory_region::Memory::MemoryHandle(*h),
                MemoryRegion::CudaIpc(ipc) => memory_region::Memory::CudaIpcHandle(ipc.clone()),
            }),
        })
        .collect();
    msg
}

/// What one rank registers, for [`crate::EngineClient::register`]: where its KV lies and,
/// optionally, the completion board its loads report to.
#[derive(Clone, Copy, Debug)]
pub struct Registration<'a> {
    kv: RegisteredKv<'a>,
    pub(crate) board: u64,
}

#[derive(Clone, Copy, Debug)]
enum RegisteredKv<'a> {
    Handle(&'a api::RegisterInstance, u64),
    CudaIpc(&'a api::RegisterInstance, &'a [u8]),
    Regions(&'a RegisterRegions),
}

impl<'a> Registration<'a> {
    /// KV in the memory of one fd-socket handle (a memfd, DMA-BUF or VMM fd sent with
    /// `send_*`); the layout's addresses are offsets inside that memory.
    pub fn in_handle(req: &'a api::RegisterInstance, memory_handle: u64) -> Self {
        Self::of(RegisteredKv::Handle(req, memory_handle))
    }

    /// KV in a CUDA allocation of another process (an engine worker's), named by its 64-byte
    /// IPC handle; the layout's addresses are offsets from the allocation's base.
    pub fn cuda_ipc(req: &'a api::RegisterInstance, ipc_handle: &'a [u8]) -> Self {
        Self::of(RegisteredKv::CudaIpc(req, ipc_handle))
    }

    /// KV spread over several memory regions (protocol 2): fd-socket handles and CUDA IPC
    /// handles, each plane naming its region.
    pub fn regions(req: &'a RegisterRegions) -> Self {
        Self::of(RegisteredKv::Regions(req))
    }

    /// Loads that name a slot report to this completion board (a handle from `send_board`;
    /// protocol 3). 0: none, as without.
    pub fn with_board(mut self, board: u64) -> Self {
        self.board = board;
        self
    }

    fn of(kv: RegisteredKv<'a>) -> Self {
        Self { kv, board: 0 }
    }

    pub(crate) fn request(&self) -> RegisterInstanceRequest {
        match self.kv {
            RegisteredKv::Handle(req, handle) => register_request(req, handle),
            RegisteredKv::CudaIpc(req, ipc) => {
                let mut msg = register_request(req, 0);
                msg.cuda_ipc_handle = ipc.to_vec();
                msg
            }
            RegisteredKv::Regions(req) => register_regions_request(req),
        }
    }
}

/// How one load is started, for [`crate::EngineClient::load`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadOptions {
    pub(crate) board: Option<(u32, u32)>,
}

impl LoadOptions {
    /// The load reports to `slot` of the rank's completion board, its words tagged `tag`.
    pub fn on_board(slot: u32, tag: u32) -> Self {
        Self {
            board: Some((slot, tag)),
        }
    }

    /// As [`Self::on_board`] where `board` is `Some((slot, tag))`; as without otherwise.
    pub fn board(board: Option<(u32, u32)>) -> Self {
        Self { board }
    }
}
