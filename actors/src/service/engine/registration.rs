//! RegisterInstance and UnregisterInstance: the memory a registration names (fd-socket
//! handles or CUDA IPC handles, by region), checked against the request before the node
//! sees it, and its completion board.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::api;
use crate::lease::registry::Memory;
use crate::model::InstanceId;
use crate::service::engine::memory_handles::Held;
use crate::service::engine::request::{self as check, status};
use crate::service::engine::service::EngineService;
use kvferry_proto::shm::board::Board;
use kvferry_proto::v1::*;
use kvferry_proto::MAX_ENGINE_REGIONS;

impl EngineService {
    pub(super) async fn handle_register_instance(
        &self,
        req: Request<RegisterInstanceRequest>,
    ) -> Result<Response<RegisterInstanceResponse>, Status> {
        const M: &str = "RegisterInstance";
        let r = req.into_inner();
        let instance = check::instance(M, &r.instance)?;
        let shape = check::shape(M, r.shape.as_ref())?;
        check::fits_slot(M, &shape, self.shared.node.config().pool.slot_bytes.0)?;
        let (spec, plane_regions) = check::layout(M, r.layout.as_ref())?;
        if r.rank >= shape.tp_size() {
            return Err(Status::invalid_argument(format!(
                "{M}: rank {} is out of range for tp {}",
                r.rank,
                shape.tp_size()
            )));
        }
        let (regions, memory, handles) = self.regions_of(M, &r, &instance)?;
        let board = self.board_of(M, &r, &instance)?;
        let layout = check::place(M, spec, &plane_regions, &shape, &regions)?;
        let key = (instance.clone(), r.rank);
        let namespace = self
            .shared
            .node
            .register_instance_with(
                api::RegisterInstance {
                    instance,
                    model: r.model,
                    dtype: r.dtype,
                    shape,
                    rank: r.rank,
                    device: r.device,
                    layout,
                },
                memory,
            )
            .await
            .map_err(|e| status(M, e))?;
        // The registration holds the memory now.
        let mut table = self.shared.handles();
        for h in handles {
            table.take(h);
        }
        if let Some(board) = board {
            table.take(r.completion_board);
            self.shared.boards().insert(key, (board, shape.layers()));
        }
        Ok(Response::new(RegisterInstanceResponse {
            namespace: namespace.to_string(),
        }))
    }

    pub(super) async fn handle_unregister_instance(
        &self,
        req: Request<UnregisterInstanceRequest>,
    ) -> Result<Response<UnregisterInstanceResponse>, Status> {
        const M: &str = "UnregisterInstance";
        let instance = check::instance(M, &req.into_inner().instance)?;
        let released = self
            .shared
            .node
            .unregister_instance(instance.clone())
            .await
            .map_err(|e| status(M, e))?;
        self.shared.boards().retain(|(i, _), _| *i != instance);
        Ok(Response::new(UnregisterInstanceResponse {
            leases_released: released as u32,
        }))
    }

    /// The memory a fd-socket handle names, checked against the request.
    fn memory_of(
        &self,
        m: &'static str,
        r: &RegisterInstanceRequest,
        instance: &InstanceId,
        handle: u64,
    ) -> Result<(u64, u64, crate::lease::registry::Memory), Status> {
        if handle == 0 {
            return Err(Status::invalid_argument(format!(
                "{m}: no memory handle; send the KV's fd on the fd socket first (or give a \
                 CUDA IPC handle)"
            )));
        }
        let h = self.handle(handle, || {
            format!("{m}: memory handle {handle} is unknown, expired or already registered")
        })?;
        if h.instance != *instance || h.rank != r.rank {
            return Err(Status::permission_denied(format!(
                "{m}: memory handle {handle} was sent for instance {} rank {}, not {instance} \
                 rank {}",
                h.instance, h.rank, r.rank
            )));
        }
        let Held::Kv(memory) = h.memory else {
            return Err(Status::invalid_argument(format!(
                "{m}: memory handle {handle} is a {}, not KV memory",
                h.kind.as_str()
            )));
        };
        if h.device != r.device {
            return Err(Status::invalid_argument(format!(
                "{m}: memory handle {handle} is memory of device {}, not {}",
                h.device, r.device
            )));
        }
        Ok((h.base, h.len, memory))
    }

    /// The completion board a registration names (0: none), checked against the request.
    fn board_of(
        &self,
        m: &'static str,
        r: &RegisterInstanceRequest,
        instance: &InstanceId,
    ) -> Result<Option<Arc<Board>>, Status> {
        if r.completion_board == 0 {
            return Ok(None);
        }
        let id = r.completion_board;
        let h = self.handle(id, || {
            format!("{m}: completion board {id} is unknown, expired or already registered")
        })?;
        if h.instance != *instance || h.rank != r.rank {
            return Err(Status::permission_denied(format!(
                "{m}: completion board {id} was sent for instance {} rank {}, not {instance} \
                 rank {}",
                h.instance, h.rank, r.rank
            )));
        }
        let Held::Board(board) = h.memory else {
            return Err(Status::invalid_argument(format!(
                "{m}: handle {id} is {} memory, not a completion board",
                h.kind.as_str()
            )));
        };
        Ok(Some(board))
    }

    /// The allocation a CUDA IPC handle names, mapped on the requested device.
    fn ipc_memory(
        &self,
        m: &'static str,
        r: &RegisterInstanceRequest,
        ipc: &[u8],
    ) -> Result<(u64, u64, crate::lease::registry::Memory), Status> {
        if ipc.len() > 1024 {
            return Err(Status::invalid_argument(format!(
                "{m}: a CUDA IPC handle of {} bytes (64, or PyTorch's framed form)",
                ipc.len()
            )));
        }
        let device = self.shared.node.device(r.device).ok_or_else(|| {
            Status::not_found(format!("{m}: device {} is not on this node", r.device))
        })?;
        let buf = device.import_ipc(ipc).map_err(|e| {
            Status::failed_precondition(format!(
                "{m}: device {} cannot map the CUDA IPC handle: {e}",
                r.device
            ))
        })?;
        Ok((buf.ptr(), buf.len(), Memory::Mapped(Arc::new(buf))))
    }

    /// The memory regions of a registration, in the request's order, and the fd-socket
    /// handles they take once it succeeds. Protocol 1's single memory is region 0.
    #[allow(clippy::type_complexity)]
    fn regions_of(
        &self,
        m: &'static str,
        r: &RegisterInstanceRequest,
        instance: &InstanceId,
    ) -> Result<
        (
            Vec<check::Placed>,
            Vec<crate::lease::registry::Memory>,
            Vec<u64>,
        ),
        Status,
    > {
        use memory_region::Memory as Region;
        // Counted before any region is looked at (each may map memory).
        if r.regions.len() > MAX_ENGINE_REGIONS {
            return Err(Status::resource_exhausted(format!(
                "{m}: {} memory regions; at most {MAX_ENGINE_REGIONS} per registration",
                r.regions.len()
            )));
        }
        let single = r.memory_handle != 0 || !r.cuda_ipc_handle.is_empty();
        let regions: Vec<Region> = match (single, r.regions.is_empty()) {
            (true, false) => {
                return Err(Status::invalid_argument(format!(
                    "{m}: give memory regions, or (protocol 1) one memory handle or CUDA IPC \
                     handle, not both"
                )));
            }
            (true, true) if r.memory_handle != 0 && !r.cuda_ipc_handle.is_empty() => {
                return Err(Status::invalid_argument(format!(
                    "{m}: give a memory handle or a CUDA IPC handle, not both"
                )));
            }
            (true, true) if r.memory_handle != 0 => vec![Region::MemoryHandle(r.memory_handle)],
            (true, true) => vec![Region::CudaIpcHandle(r.cuda_ipc_handle.clone())],
            (false, true) => vec![Region::MemoryHandle(0)],
            (false, false) => r
                .regions
                .iter()
                .enumerate()
                .map(|(i, g)| {
                    g.memory.clone().ok_or_else(|| {
                        Status::invalid_argument(format!("{m}: memory region {i} names no memory"))
                    })
                })
                .collect::<Result<_, _>>()?,
        };
        let mut placed = Vec::with_capacity(regions.len());
        let mut memory = Vec::with_capacity(regions.len());
        let mut handles = Vec::new();
        for (i, region) in regions.iter().enumerate() {
            let (base, len, mem) = match region {
                Region::MemoryHandle(h) => {
                    if handles.contains(h) {
                        return Err(Status::invalid_argument(format!(
                            "{m}: memory handle {h} is named by two regions (region {i})"
                        )));
                    }
                    let got = self.memory_of(m, r, instance, *h)?;
                    handles.push(*h);
                    got
                }
                Region::CudaIpcHandle(ipc) => self.ipc_memory(m, r, ipc)?,
            };
            placed.push(check::Placed { base, len });
            memory.push(mem);
        }
        Ok((placed, memory, handles))
    }
}
