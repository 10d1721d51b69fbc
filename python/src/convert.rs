//! Python arguments into the Rust client's requests, and its answers into dicts (the
//! Python API's return values). Every refusal here names what was wrong before anything
//! is sent.

use kvferry_client::proto::api::DirectGrant;
use kvferry_client::proto::v1::{
    CapabilitiesResponse, LoadCompletion, LoadStatus, StatsResponse, StoreResponse,
};
use kvferry_client::proto::{BlockHash, InstanceId, LeaseId};
use kvferry_client::{MemoryRegion, PlanePlacement, QueryAnswer, RegionLayer};
use kvferry_gpu::GroupKind;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::errors;

pub fn instance(py: Python<'_>, method: &str, id: &str) -> PyResult<InstanceId> {
    InstanceId::new(id).map_err(|e| errors::invalid(py, method, format!("instance {id:?}: {e}")))
}

pub fn instances(py: Python<'_>, method: &str, ids: &[String]) -> PyResult<Vec<InstanceId>> {
    ids.iter().map(|i| instance(py, method, i)).collect()
}

pub fn hashes(py: Python<'_>, method: &str, hashes: &[Vec<u8>]) -> PyResult<Vec<BlockHash>> {
    BlockHash::parse_all(hashes).map_err(|e| errors::invalid(py, method, e.to_string()))
}

pub fn lease(py: Python<'_>, method: &str, lease: &str) -> PyResult<LeaseId> {
    LeaseId::from_hex(lease).map_err(|e| errors::invalid(py, method, format!("lease: {e}")))
}

pub fn kind(py: Python<'_>, kind: &str) -> PyResult<GroupKind> {
    match kind {
        "attention" => Ok(GroupKind::Attention),
        "cross-layer" | "cross_layer" => Ok(GroupKind::CrossLayer),
        // Sent as such: the node refuses it, naming the group.
        "recurrent" => Ok(GroupKind::Recurrent),
        other => Err(errors::invalid(
            py,
            "register",
            format!("kind {other:?}: expected \"attention\", \"cross_layer\" or \"recurrent\""),
        )),
    }
}

/// `regions`: `("handle", int)` (from `send_memfd`) or `("cuda_ipc", bytes)`.
pub fn regions(
    py: Python<'_>,
    items: &[(String, Bound<'_, PyAny>)],
) -> PyResult<Vec<MemoryRegion>> {
    items
        .iter()
        .enumerate()
        .map(|(i, (kind, value))| {
            let bad = |what: String| errors::invalid(py, "register", format!("region {i}: {what}"));
            match kind.as_str() {
                "handle" => value
                    .extract::<u64>()
                    .map(MemoryRegion::Handle)
                    .map_err(|_| bad("a handle is an int from send_memfd".into())),
                "cuda_ipc" => value
                    .cast::<PyBytes>()
                    .map(|b| MemoryRegion::CudaIpc(b.as_bytes().to_vec()))
                    .map_err(|_| bad("a CUDA IPC handle is bytes".into())),
                other => Err(bad(format!(
                    "kind {other:?}: expected \"handle\" or \"cuda_ipc\""
                ))),
            }
        })
        .collect()
}

/// `planes`: per layer `(k_region, k_offset, v_region, v_offset)` with two segments,
/// `(region, offset)` with one.
pub fn planes(
    py: Python<'_>,
    segments: u32,
    regions: usize,
    items: &[Bound<'_, PyAny>],
) -> PyResult<Vec<RegionLayer>> {
    let want = if segments == 1 {
        "(region, offset)"
    } else {
        "(k_region, k_offset, v_region, v_offset)"
    };
    items
        .iter()
        .enumerate()
        .map(|(layer, item)| {
            let bad = |what: String| {
                errors::invalid(py, "register", format!("layer {layer} planes: {what}"))
            };
            let nums: Vec<u64> = item
                .extract()
                .map_err(|_| bad(format!("expected a tuple of ints {want}")))?;
            let place = |region: u64, offset: u64| -> PyResult<PlanePlacement> {
                match u32::try_from(region) {
                    Ok(r) if (r as usize) < regions => Ok(PlanePlacement { region: r, offset }),
                    _ => Err(bad(format!(
                        "region {region} is not one of the {regions} regions"
                    ))),
                }
            };
            match (segments, nums.as_slice()) {
                (1, &[r, o]) => Ok(RegionLayer {
                    k: place(r, o)?,
                    v: None,
                }),
                (2, &[kr, ko, vr, vo]) => Ok(RegionLayer {
                    k: place(kr, ko)?,
                    v: Some(place(vr, vo)?),
                }),
                _ => Err(bad(format!(
                    "expected {want} for {segments} segment(s), got {} numbers",
                    nums.len()
                ))),
            }
        })
        .collect()
}

pub fn capabilities<'py>(py: Python<'py>, c: CapabilitiesResponse) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("node_id", c.node_id)?;
    d.set_item("version", c.version)?;
    d.set_item("protocol", c.protocol)?;
    d.set_item("device_kind", c.device_kind)?;
    d.set_item("device_count", c.device_count)?;
    d.set_item("device_names", c.device_names)?;
    d.set_item("providers", c.providers)?;
    d.set_item("direct_possible", c.direct_possible)?;
    d.set_item("direct_reason", c.direct_reason)?;
    d.set_item("fd_socket", c.fd_socket)?;
    d.set_item("memory_kinds", c.memory_kinds)?;
    d.set_item("max_message_bytes", c.max_message_bytes)?;
    d.set_item("completion_retention", c.completion_retention)?;
    d.set_item("handle_ttl_ms", c.handle_ttl_ms)?;
    d.set_item("max_hashes", c.max_hashes)?;
    d.set_item("max_layers", c.max_layers)?;
    d.set_item("max_regions", c.max_regions)?;
    d.set_item("max_blocks", c.max_blocks)?;
    d.set_item("max_hash_bytes", c.max_hash_bytes)?;
    d.set_item("slot_bytes", c.slot_bytes)?;
    d.set_item("max_mailboxes", c.max_mailboxes)?;
    d.set_item("max_lookup_hashes", c.max_lookup_hashes)?;
    Ok(d)
}

pub fn stats<'py>(py: Python<'py>, s: StatsResponse) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("leases_live", s.leases_live)?;
    d.set_item("leases_expired", s.leases_expired)?;
    d.set_item("blocks", s.blocks)?;
    d.set_item("sealed_blocks", s.sealed_blocks)?;
    d.set_item("pinned_blocks", s.pinned_blocks)?;
    d.set_item("pins", s.pins)?;
    d.set_item("pool_slots", s.pool_slots)?;
    d.set_item("evictions", s.evictions)?;
    d.set_item("instances", s.instances)?;
    d.set_item("transfers_in_flight", s.transfers_in_flight)?;
    d.set_item("loads_ok", s.loads_ok)?;
    d.set_item("loads_failed", s.loads_failed)?;
    d.set_item("bytes_loaded", s.bytes_loaded)?;
    d.set_item("sessions", s.sessions)?;
    d.set_item("memory_handles", s.memory_handles)?;
    d.set_item("loads_pending", s.loads_pending)?;
    d.set_item("completions_retained", s.completions_retained)?;
    d.set_item("completions_dropped", s.completions_dropped)?;
    Ok(d)
}

pub fn store<'py>(py: Python<'py>, s: StoreResponse) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("written", s.written)?;
    d.set_item("present", s.present)?;
    d.set_item("sealed", s.sealed)?;
    d.set_item("bytes", s.bytes)?;
    d.set_item("seconds", s.seconds)?;
    d.set_item("not_stored", s.not_stored)?;
    Ok(d)
}

pub fn query<'py>(py: Python<'py>, q: QueryAnswer) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("lease", q.lease.map(|l| l.to_hex()))?;
    d.set_item("namespace", q.namespace)?;
    d.set_item("local_blocks", q.local_blocks)?;
    d.set_item("ssd_blocks", q.ssd_blocks)?;
    d.set_item("remote_blocks", q.remote_blocks)?;
    let (direct, reason) = match q.direct {
        DirectGrant::NotRequested => ("not_requested", None),
        DirectGrant::Granted => ("granted", None),
        DirectGrant::Refused { reason } => ("refused", Some(reason)),
    };
    d.set_item("direct", direct)?;
    d.set_item("direct_reason", reason)?;
    Ok(d)
}

pub fn completion<'py>(py: Python<'py>, c: LoadCompletion) -> PyResult<Bound<'py, PyDict>> {
    let ok = c.status() == LoadStatus::LoadOk;
    let d = PyDict::new(py);
    d.set_item("load_id", c.load_id)?;
    d.set_item("instance", c.instance)?;
    d.set_item("rank", c.rank)?;
    d.set_item("ok", ok)?;
    let nonempty = |s: String| (!s.is_empty()).then_some(s);
    d.set_item("error_kind", nonempty(c.error_kind))?;
    d.set_item("error", nonempty(c.error))?;
    d.set_item("bytes", c.bytes)?;
    d.set_item("blocks", c.blocks)?;
    d.set_item("path", c.path)?;
    d.set_item("seconds", c.seconds)?;
    let stages = PyDict::new(py);
    for s in c.stages {
        stages.set_item(s.name, s.seconds)?;
    }
    d.set_item("stages", stages)?;
    d.set_item("failed_blocks", c.failed_blocks)?;
    Ok(d)
}
