//! The verbs data path between nodes, over the endpoint exchange of the Peer RPC.
//!
//! Owner side: the node's [`NicResponder`] answers verbs Handshakes with new QPs on its RDMA
//! NICs (brought to ready-to-send against the requester's) and the pool's MRs with their
//! rkeys; this translates the Handshake's endpoints for it.
//! Requester side: [`GrpcExchange`] trades one QP's endpoint per Handshake for the
//! transport's `VerbsConnector`, and [`VerbsLink`] reads through one RC link per NIC,
//! striping direct loads across them as the planner routed them.
//!
//! Without a usable RDMA NIC (every machine this was built on) none of this is reached: the
//! node has no responder (verbs Handshakes are refused), and the capability gate refuses
//! `direct_gpu`. The code compiles in every build; the rdma-core calls behind it are the
//! transport's, under its `verbs` feature.

use std::sync::Arc;

use kvferry_gpu::{CopyList, CopyOp, HostSpan};
use kvferry_transport::verbs::registration::KeyMap;
use kvferry_transport::verbs::{EndpointExchange, QpEndpoint};
use kvferry_transport::{ConnectionError, MrKey, NodeId, QpKey};

use super::VerbsResponder;
use crate::model::{BlockHash, Namespace};
use crate::nic::responder::{NicResponder, QpRequest, ServedPort};
use crate::nic::runtime::VerbsSide;
use crate::nic::ReadRoute;
use crate::peer::client::{PeerClient, PeerInfo};
use crate::peer::endpoint::{check_announced, VerbsPeerEndpoint};
use crate::peer::error::LinkError;
use crate::peer::link::{BoxFut, DeviceDest, PeerLink, PinnedRemote, ReadStats};
use crate::peer::rc_link::RcLink;

/// An announced port as the Peer RPC carries it (no QPs, slots or regions).
fn announced(p: ServedPort) -> VerbsPeerEndpoint {
    VerbsPeerEndpoint {
        nic: p.nic,
        gid: p.address.gid,
        lid: p.address.lid,
        mtu: p.address.mtu,
        responder_depth: p.responder_depth,
        qps: Vec::new(),
        slots: Vec::new(),
        regions: Vec::new(),
    }
}

/// The Handshake's side of the node's responder: its endpoints in, its answers out, each
/// answer naming the requester's NIC it answers and carrying the serving NIC's regions.
impl VerbsResponder for NicResponder {
    fn ports(&self) -> Vec<VerbsPeerEndpoint> {
        self.served_ports().into_iter().map(announced).collect()
    }

    fn accept(
        &self,
        peer: &str,
        request: &[VerbsPeerEndpoint],
    ) -> Result<Vec<VerbsPeerEndpoint>, String> {
        let asked = request
            .iter()
            .map(|e| {
                let qps = (0..e.qps.len())
                    .map(|q| {
                        let remote = e
                            .qp_endpoint(q)
                            .ok_or_else(|| "requester QP vanished".to_string())?;
                        Ok((remote, e.slots.get(q).copied().unwrap_or(0)))
                    })
                    .collect::<Result<_, String>>()?;
                Ok(QpRequest {
                    nic: e.nic.clone(),
                    qps,
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        let answers = self.accept_qps(peer, &asked).map_err(|e| e.to_string())?;
        Ok(request
            .iter()
            .zip(answers)
            .map(|(asked, a)| VerbsPeerEndpoint {
                nic: asked.nic.clone(),
                regions: a.regions,
                slots: vec![0; a.qps.len()],
                qps: a.qps,
                ..announced(a.port)
            })
            .collect())
    }
}

/// Trades one QP's endpoint with the owner per call, through a verbs Handshake on the Peer
/// RPC. Called from a NIC worker while it connects (a blocking step, like a tcp connect);
/// the call runs on the gRPC client's runtime from a scoped thread.
pub struct GrpcExchange {
    pub client: PeerClient,
    pub runtime: tokio::runtime::Handle,
    /// This node's id, as the owner knows it.
    pub node_id: String,
    /// This side's NIC (the name the owner answers).
    pub nic: String,
    pub peer: NodeId,
}

impl EndpointExchange for GrpcExchange {
    fn exchange(
        &self,
        qp: QpKey,
        local: QpEndpoint,
    ) -> Result<(QpEndpoint, KeyMap), ConnectionError> {
        let fail = |reason: String| ConnectionError::Handshake {
            peer: self.peer,
            reason,
        };
        let mine = VerbsPeerEndpoint {
            nic: self.nic.clone(),
            gid: local.gid,
            lid: local.lid,
            mtu: local.mtu,
            responder_depth: local.responder_depth,
            qps: vec![(local.qpn, local.psn)],
            // The owner keys its QP by this slot: a rebuilt QP replaces its predecessor.
            slots: vec![qp.qp.0 % crate::peer::endpoint::MAX_QPS as u32],
            regions: Vec::new(),
        };
        let me = PeerInfo::local(
            &self.node_id,
            &[super::Provider::Verbs],
            std::slice::from_ref(&self.nic),
        );
        let (hello, answer) = std::thread::scope(|s| {
            s.spawn(|| {
                self.runtime.block_on(async {
                    // What the owner announces for its NICs, to hold the answer to.
                    let hello = self.client.hello(me).await?;
                    let answer = self
                        .client
                        .handshake_verbs(&self.node_id, std::slice::from_ref(&mine))
                        .await?;
                    Ok::<_, crate::peer::client::PeerClientError>((hello, answer))
                })
            })
            .join()
        })
        .map_err(|_| fail("the handshake thread panicked".into()))?
        .map_err(|e| fail(e.to_string()))?;
        let theirs = answer
            .verbs
            .first()
            .ok_or_else(|| fail("the owner answered no nic".into()))?;
        // The answer must agree with the port the owner announced (MTU, address, no deeper
        // than announced): anything else is refused here, before any QP leaves reset.
        check_announced(theirs, &hello.verbs).map_err(|e| fail(e.to_string()))?;
        let remote = theirs
            .qp_endpoint(0)
            .ok_or_else(|| fail("the owner answered no QP".into()))?;
        Ok((remote, theirs.key_map()))
    }
}

/// A link to one owner over verbs: one RC link per local RDMA NIC (index = position in
/// `nics`), pins through the owner's Peer service (shared by every per-NIC link).
pub struct VerbsLink {
    node_id: String,
    nics: Vec<String>,
    links: Vec<RcLink>,
}

impl std::fmt::Debug for VerbsLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsLink")
            .field("node", &self.node_id)
            .field("nics", &self.nics)
            .finish()
    }
}

impl VerbsLink {
    /// `links[i]` reads through NIC `nics[i]`; at least one.
    pub fn new(node_id: String, nics: Vec<String>, links: Vec<RcLink>) -> Result<Self, LinkError> {
        if links.is_empty() || links.len() != nics.len() {
            return Err(LinkError::remote(
                node_id,
                super::RemoteError::no_path("a verbs link needs one RC link per nic"),
            ));
        }
        Ok(VerbsLink {
            node_id,
            nics,
            links,
        })
    }
}

/// A link to `to` over every NIC of `side`, each with its own RC QPs whose endpoints are
/// traded through `client` (the owner's Peer service).
pub fn connect_link(
    side: &VerbsSide,
    from: &str,
    to: &str,
    control: crate::peer::link::Control,
    client: &PeerClient,
) -> Result<VerbsLink, LinkError> {
    let (local, peer) = (
        crate::peer::cluster::transport_id(from),
        crate::peer::cluster::transport_id(to),
    );
    let mut names = Vec::with_capacity(side.nics.len());
    let mut links = Vec::with_capacity(side.nics.len());
    for n in &side.nics {
        let exchange = Arc::new(GrpcExchange {
            client: client.clone(),
            runtime: tokio::runtime::Handle::current(),
            node_id: from.to_string(),
            nic: n.name.clone(),
            peer,
        });
        let connector = Arc::clone(&n.nic)
            .connector(peer, exchange)
            .ok_or_else(|| {
                LinkError::remote(
                    to.to_string(),
                    super::RemoteError::no_path(format!(
                        "nic {} has no verbs provider behind it",
                        n.name
                    )),
                )
            })?;
        links.push(RcLink::new(
            to.to_string(),
            crate::peer::rc_link::RcEndpoints {
                control: control.clone(),
                // Verbs reads name the owner's MRs by address (the rkeys came with the
                // handshake); the provider-neutral key is not used on the wire.
                rkey: MrKey(0),
                local,
                peer,
                addr: std::net::SocketAddr::from(([0, 0, 0, 0], 0)),
                worker: n.worker.clone(),
                table: n.table.clone(),
                pool_lkey: n.pool_lkey,
                max_sge: n.max_sge,
                qps: n.qps,
                faults: Vec::new(),
                connector: Some(connector),
                rdma: Some(Arc::clone(&n.nic)),
                grant: None,
            },
        ));
        names.push(n.name.clone());
    }
    VerbsLink::new(to.to_string(), names, links)
}

/// Splits a direct load's copy list into one list per link as `route` assigns its reads
/// (each op goes with the read its source lies in). `None` when an op's read or NIC is
/// unknown (then everything goes through the first NIC).
pub fn split_by_route(
    list: &CopyList,
    route: &ReadRoute,
    link_nics: &[String],
) -> Option<Vec<(usize, CopyList)>> {
    let mut out: Vec<(usize, CopyList)> = Vec::new();
    for op in list.ops() {
        let name = route.nic_of(op.src)?;
        let link = link_nics.iter().position(|n| n == name)?;
        let at = match out.iter().position(|(l, _)| *l == link) {
            Some(i) => i,
            None => {
                out.push((link, CopyList::with_capacity(list.len())));
                out.len() - 1
            }
        };
        out[at].1.push(op.src, op.dst, op.len);
    }
    Some(out)
}

impl PeerLink for VerbsLink {
    fn node_id(&self) -> &str {
        &self.node_id
    }

    fn provider(&self) -> &'static str {
        "verbs"
    }

    fn lanes(&self) -> usize {
        self.links[0].lanes()
    }

    fn pin(
        &self,
        ns: Namespace,
        hashes: Vec<BlockHash>,
    ) -> BoxFut<Result<PinnedRemote, LinkError>> {
        self.links[0].pin(ns, hashes)
    }

    fn unpin(&self, pin_id: u64) {
        self.links[0].unpin(pin_id);
    }

    fn read_host(&self, ops: Vec<CopyOp>, into: HostSpan) -> BoxFut<Result<ReadStats, LinkError>> {
        self.links[0].read_host(ops, into)
    }

    fn read_device(
        &self,
        dest: Arc<dyn DeviceDest>,
        list: CopyList,
        regions: Vec<(u64, u64)>,
    ) -> BoxFut<Result<ReadStats, LinkError>> {
        self.links[0].read_device(dest, list, regions)
    }

    fn read_device_routed(
        &self,
        dest: Arc<dyn DeviceDest>,
        list: CopyList,
        regions: Vec<(u64, u64)>,
        route: Option<ReadRoute>,
    ) -> BoxFut<Result<ReadStats, LinkError>> {
        let parts = route
            .as_ref()
            .and_then(|r| split_by_route(&list, r, &self.nics));
        let Some(mut parts) = parts else {
            return self.read_device(dest, list, regions);
        };
        if parts.len() == 1 {
            // One NIC carries it all: the one the route chose, not the first link.
            let (link, part) = parts.remove(0);
            return self.links[link].read_device(dest, part, regions);
        }
        // Every part holds the destination until it has landed or drained.
        let reads: Vec<_> = parts
            .into_iter()
            .map(|(link, part)| {
                self.links[link].read_device(Arc::clone(&dest), part, regions.clone())
            })
            .collect();
        Box::pin(async move {
            let mut total = ReadStats::default();
            let mut first_err = None;
            // Wait for every part, failed or not, before reporting: nothing is released
            // while a read may still land.
            for r in reads {
                match r.await {
                    Ok(s) => {
                        total.bytes += s.bytes;
                        total.register += s.register;
                        total.post = total.post.max(s.post);
                        total.wire = total.wire.max(s.wire);
                    }
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
            drop(dest);
            match first_err {
                Some(e) => Err(e),
                None => Ok(total),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::any::Any;

    use kvferry_transport::verbs::registration::Chunk;
    use kvferry_transport::verbs::RdmaNic;

    use super::*;
    use crate::nic::responder::ServingNic;

    #[test]
    fn routes_split_the_list_read_by_read() {
        // 4 reads (blocks) of 32 bytes, each scattered into 2 non-adjacent pieces.
        let mut list = CopyList::with_capacity(8);
        for i in 0..8u64 {
            list.push(0x1000 + i * 16, 0x9000 + i * 32, 16);
        }
        // Reads 0 and 2 on mlx5_3, 1 and 3 on mlx5_2.
        let route = ReadRoute {
            nics: vec!["mlx5_3".into(), "mlx5_2".into()],
            reads: (0..4u64)
                .map(|i| (0x1000 + i * 32, 32, (i % 2) as usize))
                .collect(),
        };
        let links = vec!["mlx5_2".to_string(), "mlx5_3".to_string()];
        let parts = split_by_route(&list, &route, &links).unwrap();
        assert_eq!(parts.len(), 2);
        let (l0, p0) = &parts[0];
        assert_eq!(*l0, 1);
        let srcs: Vec<u64> = p0.ops().iter().map(|o| o.src).collect();
        assert_eq!(srcs, vec![0x1000, 0x1010, 0x1040, 0x1050]);
        let (l1, p1) = &parts[1];
        assert_eq!(*l1, 0);
        assert_eq!(p1.ops()[0].dst, 0x9040);
        assert_eq!(p1.bytes(), 64);
        // A source outside every read, or a NIC without a link: not split.
        let mut stray = CopyList::with_capacity(1);
        stray.push(0x8000, 0x9000, 16);
        assert!(split_by_route(&stray, &route, &links).is_none());
        let unknown = ReadRoute {
            nics: vec!["mlx5_9".into()],
            reads: vec![(0x1000, 128, 0)],
        };
        assert!(split_by_route(&list, &unknown, &links).is_none());
    }

    use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

    use kvferry_transport::verbs::gid::{Gid, Mtu};
    use kvferry_transport::verbs::{AcceptError, ChunkMr, PortAddress, RegistrarError};
    use kvferry_transport::HostRegion;

    use crate::peer::endpoint::VerbsResponder;

    /// A NIC whose device accepts 8 reads as responder and counts its owner QPs.
    struct Fake {
        next: AtomicU32,
        alive: Arc<AtomicUsize>,
    }

    struct FakeQp(Arc<AtomicUsize>);

    impl Drop for FakeQp {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }

    impl RdmaNic for Fake {
        fn name(&self) -> &str {
            "soft_mlx5_0"
        }

        fn address(&self) -> PortAddress {
            PortAddress {
                port: 1,
                gid_index: 0,
                gid: Gid([9; 16]),
                lid: 0,
                global: true,
                mtu: Mtu::M4096,
            }
        }

        fn responder_depth(&self) -> Option<u8> {
            Some(8)
        }

        fn register_chunk(
            &self,
            _region: &Arc<HostRegion>,
            chunk: Chunk,
        ) -> Result<ChunkMr, RegistrarError> {
            Err(RegistrarError::OutsideRegion {
                nic: "soft_mlx5_0".into(),
                addr: chunk.addr,
                len: chunk.len,
            })
        }

        fn accept(
            self: Arc<Self>,
            remote: QpEndpoint,
        ) -> Result<(QpEndpoint, Box<dyn Any + Send + Sync>), AcceptError> {
            self.alive.fetch_add(1, Ordering::SeqCst);
            let qpn = self.next.fetch_add(1, Ordering::SeqCst);
            Ok((
                QpEndpoint { qpn, ..remote },
                Box::new(FakeQp(Arc::clone(&self.alive))),
            ))
        }
    }

    fn responder(configured_depth: u8) -> (NicResponder, Arc<AtomicUsize>) {
        let alive = Arc::new(AtomicUsize::new(0));
        let nic = Arc::new(Fake {
            next: AtomicU32::new(0x500),
            alive: Arc::clone(&alive),
        });
        let serving = ServingNic {
            nic,
            regions: vec![(
                Chunk {
                    addr: 0x10_0000,
                    len: 0x1_0000,
                },
                0x77,
            )],
            responder_depth: configured_depth,
        };
        (NicResponder::new(vec![serving]).unwrap(), alive)
    }

    fn request(qpn: u32, slot: u32) -> VerbsPeerEndpoint {
        VerbsPeerEndpoint {
            nic: "soft_mlx5_1".into(),
            gid: Gid([3; 16]),
            lid: 0,
            mtu: Mtu::M4096,
            responder_depth: 16,
            qps: vec![(qpn, 1)],
            slots: vec![slot],
            regions: Vec::new(),
        }
    }

    /// Defect 4: the depth announced (Hello) and answered (Handshake) is the device's
    /// clamp of the configured one, not the configured one.
    #[test]
    fn the_owner_advertises_the_depth_its_device_accepts() {
        let (r, _) = responder(32);
        assert_eq!(r.ports()[0].responder_depth, 8);
        let a = r.accept("b", &[request(0x11, 0)]).unwrap();
        assert_eq!(a[0].responder_depth, 8);
        let (r, _) = responder(4);
        assert_eq!(r.ports()[0].responder_depth, 4);
    }

    /// Defect 6: owner QPs are kept per requester QP slot; a rebuilt QP (same slot)
    /// replaces its predecessor instead of piling up, and a live QP of another slot is never
    /// destroyed to make room.
    #[test]
    fn owner_qps_are_replaced_per_requester_slot() {
        let (r, alive) = responder(16);
        for qpn in 0x20..0x60 {
            r.accept("b", &[request(qpn, 0)]).unwrap();
        }
        assert_eq!(alive.load(Ordering::SeqCst), 1);
        r.accept("b", &[request(0x70, 1)]).unwrap();
        r.accept("c", &[request(0x71, 0)]).unwrap();
        assert_eq!((r.qps(), alive.load(Ordering::SeqCst)), (3, 3));
        r.forget("b");
        assert_eq!((r.qps(), alive.load(Ordering::SeqCst)), (1, 1));
        drop(r);
        assert_eq!(alive.load(Ordering::SeqCst), 0);
    }
}
