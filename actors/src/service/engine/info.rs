//! What a client asks about the node: its capabilities and limits, health, and stats.

use tonic::{Request, Response, Status};

use crate::lease::keeper::DIRECT_REFUSAL;
use crate::node::Node;
use crate::service::engine::request::status;
use crate::service::engine::service::EngineService;
use kvferry_proto::v1::*;
use kvferry_proto::{
    ENGINE_PROTOCOL, MAX_ENGINE_BLOCKS, MAX_ENGINE_HASHES, MAX_ENGINE_LAYERS, MAX_ENGINE_MAILBOXES,
    MAX_ENGINE_REGIONS, MAX_HASH_BYTES, MAX_LOOKUP_HASHES, MAX_POLL_WAIT_MS, MAX_TENANTS, VERSION,
};

impl EngineService {
    pub(super) async fn handle_capabilities(
        &self,
        _: Request<CapabilitiesRequest>,
    ) -> Result<Response<CapabilitiesResponse>, Status> {
        let node = &self.shared.node;
        let devices = node.devices();
        let kind = devices
            .first()
            .map(|d| d.kind())
            .unwrap_or(kvferry_gpu::DeviceKind::Host);
        let memory_kinds = match kind {
            kvferry_gpu::DeviceKind::Host => vec!["memfd".to_owned()],
            // A client memfd is registered as pinned host memory on a CUDA device.
            kvferry_gpu::DeviceKind::Cuda => vec!["dmabuf".to_owned(), "memfd".to_owned()],
        };
        let o = &self.shared.options;
        let refusal = direct_refusal(node);
        Ok(Response::new(CapabilitiesResponse {
            node_id: node.config().node_id.clone(),
            version: VERSION.to_owned(),
            protocol: ENGINE_PROTOCOL,
            device_kind: kind.as_str().to_owned(),
            device_count: devices.len() as u32,
            device_names: devices.iter().map(|d| d.name()).collect(),
            providers: node
                .config()
                .cluster
                .iter()
                .map(|c| c.provider.clone())
                .collect(),
            direct_possible: refusal.is_none(),
            direct_reason: refusal.unwrap_or_default(),
            fd_socket: self.shared.fd_path.clone().unwrap_or_default(),
            memory_kinds,
            max_message_bytes: o.max_message_bytes as u64,
            completion_retention: o.completion_retention as u32,
            handle_ttl_ms: u64::try_from(o.handle_ttl.as_millis()).unwrap_or(u64::MAX),
            max_hashes: MAX_ENGINE_HASHES as u32,
            max_layers: MAX_ENGINE_LAYERS,
            max_regions: MAX_ENGINE_REGIONS as u32,
            max_blocks: MAX_ENGINE_BLOCKS as u32,
            max_hash_bytes: MAX_HASH_BYTES as u32,
            slot_bytes: node.config().pool.slot_bytes.0,
            max_mailboxes: MAX_ENGINE_MAILBOXES as u32,
            monotonic_ns: crate::fence::monotonic_ns(),
            max_lookup_hashes: MAX_LOOKUP_HASHES as u32,
            max_poll_wait_ms: MAX_POLL_WAIT_MS,
            max_tenants: MAX_TENANTS as u32,
        }))
    }

    pub(super) async fn handle_health(
        &self,
        _: Request<HealthRequest>,
    ) -> Result<Response<HealthResponse>, Status> {
        self.shared
            .node
            .stats()
            .await
            .map_err(|e| status("Health", e))?;
        Ok(Response::new(HealthResponse {
            serving: true,
            node_id: self.shared.node.config().node_id.clone(),
        }))
    }

    pub(super) async fn handle_stats(
        &self,
        _: Request<StatsRequest>,
    ) -> Result<Response<StatsResponse>, Status> {
        let s = self
            .shared
            .node
            .stats()
            .await
            .map_err(|e| status("Stats", e))?;
        let e = crate::metrics::EngineProbe::engine_gauges(self.shared.as_ref());
        Ok(Response::new(StatsResponse {
            leases_live: s.leases_live as u64,
            leases_expired: s.leases_expired,
            blocks: s.blocks as u64,
            sealed_blocks: s.sealed_blocks as u64,
            pinned_blocks: s.pinned_blocks as u64,
            pins: s.pins,
            pool_slots: s.pool_slots as u64,
            evictions: s.evictions,
            instances: s.instances as u64,
            transfers_in_flight: s.transfers_in_flight as u64,
            loads_ok: s.loads_ok,
            loads_failed: s.loads_failed,
            bytes_loaded: s.bytes_loaded,
            sessions: e.sessions,
            memory_handles: e.memory_handles,
            loads_pending: e.loads_pending,
            completions_retained: e.completions_retained,
            completions_dropped: e.completions_dropped,
        }))
    }
}

/// Why this node refuses `direct_gpu`, if it does: the keeper's rule, asked before a query.
/// A verbs gate that cannot serve refuses first; a node without peers has no remote suffix.
fn direct_refusal(node: &Node) -> Option<String> {
    if let Some(reason) = node.nics().and_then(|n| n.direct_refusal.clone()) {
        return Some(reason);
    }
    (!node.has_peers()).then(|| DIRECT_REFUSAL.to_owned())
}

impl EngineService {
    /// Lookup: the directory's longest prefix per node; bounded by [`MAX_LOOKUP_HASHES`]
    /// (advertised in Capabilities), checked before anything is parsed: past it,
    /// RESOURCE_EXHAUSTED as every limit of a request.
    pub(super) async fn handle_lookup(
        &self,
        req: Request<LookupRequest>,
    ) -> Result<Response<LookupResponse>, Status> {
        let r = req.into_inner();
        if r.hashes.len() > MAX_LOOKUP_HASHES {
            return Err(Status::resource_exhausted(format!(
                "Lookup: {} hashes, at most {MAX_LOOKUP_HASHES} (Capabilities.max_lookup_hashes) \
                 per call",
                r.hashes.len()
            )));
        }
        let ns = crate::model::Namespace::parse(&r.namespace)
            .map_err(|e| Status::invalid_argument(format!("Lookup: {e}")))?;
        let hashes = crate::model::BlockHash::parse_all(&r.hashes)
            .map_err(|e| Status::invalid_argument(format!("Lookup: {e}")))?;
        let nodes = self
            .shared
            .node
            .lookup(&ns, &hashes)
            .await
            .map_err(|e| status("Lookup", e))?;
        Ok(Response::new(LookupResponse {
            nodes: nodes
                .into_iter()
                .map(|(node_id, blocks)| NodePrefix {
                    node_id,
                    blocks: u32::try_from(blocks).unwrap_or(u32::MAX),
                })
                .collect(),
            max_hashes: MAX_LOOKUP_HASHES as u32,
        }))
    }
}
