//! The owner side of verbs connections on a node's open RDMA NICs: the ports it announces
//! and, for each requester QP, an owner QP brought up against it. Owner QPs are kept per
//! requester QP slot: a requester that rebuilds a QP asks for the same slot again, and the
//! new owner QP replaces the old one, so owner QPs never pile up and no live QP is destroyed
//! for room (at most 16 NICs × 64 slots per requester).
//!
//! This speaks NIC terms only (ports, QP endpoints, MRs); the Peer RPC's Handshake
//! translates its endpoints to and from them (`peer::verbs`).

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use kvferry_transport::verbs::registration::Chunk;
use kvferry_transport::verbs::{AcceptError, PortAddress, QpEndpoint, RdmaNic};

/// One RDMA NIC serving the pool: the device, the pool's MRs on it, the configured depth it
/// answers reads with (advertised clamped to what the device accepts).
pub struct ServingNic {
    pub nic: Arc<dyn RdmaNic>,
    pub regions: Vec<(Chunk, u32)>,
    pub responder_depth: u8,
}

/// What one serving NIC announces: its name, port and the read depth it answers with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServedPort {
    pub nic: String,
    pub address: PortAddress,
    pub responder_depth: u8,
}

/// One requester NIC's QPs asking for owner QPs: `(endpoint, slot)` each.
#[derive(Clone, Debug)]
pub struct QpRequest {
    pub nic: String,
    pub qps: Vec<(QpEndpoint, u32)>,
}

/// The owner QPs answering one [`QpRequest`], on the NIC that serves it.
#[derive(Clone, Debug)]
pub struct QpAnswer {
    pub port: ServedPort,
    /// The pool's MRs on the serving NIC: `(range, rkey)`.
    pub regions: Vec<(Chunk, u32)>,
    /// `(qpn, psn)` of each owner QP, in the request's order.
    pub qps: Vec<(u32, u32)>,
}

/// Which owner QP serves which requester QP: (requester node, requester NIC, its slot).
type SlotKey = (String, String, u32);

/// The owner side of verbs connections over a node's open RDMA NICs.
pub struct NicResponder {
    nics: Vec<ServingNic>,
    held: Mutex<HashMap<SlotKey, Box<dyn Any + Send + Sync>>>,
}

impl std::fmt::Debug for NicResponder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.nics.iter().map(|n| n.nic.name()).collect();
        f.debug_struct("NicResponder")
            .field("nics", &names)
            .finish()
    }
}

impl NicResponder {
    /// `None` without a NIC to serve on.
    pub fn new(nics: Vec<ServingNic>) -> Option<Self> {
        (!nics.is_empty()).then(|| NicResponder {
            nics,
            held: Mutex::new(HashMap::new()),
        })
    }

    /// The NIC answering a requester's NIC: the one of the same name, else by position.
    fn serving(&self, i: usize, requester_nic: &str) -> &ServingNic {
        self.nics
            .iter()
            .find(|n| n.nic.name() == requester_nic)
            .unwrap_or(&self.nics[i % self.nics.len()])
    }

    fn port(n: &ServingNic) -> ServedPort {
        // Advertise what the device accepts, not what was configured: a requester issuing
        // more reads than the responder holds gets remote invalid-request errors.
        let depth = n
            .nic
            .responder_depth()
            .map_or(n.responder_depth, |d| d.min(n.responder_depth));
        ServedPort {
            nic: n.nic.name().to_string(),
            address: n.nic.address(),
            responder_depth: depth.max(1),
        }
    }

    /// What every serving NIC announces.
    pub fn served_ports(&self) -> Vec<ServedPort> {
        self.nics.iter().map(Self::port).collect()
    }

    /// Owner QPs for every QP of `requests` (request `i` is served by the NIC of its name,
    /// else the `i`-th). All or nothing: on an error the QPs made so far are destroyed and
    /// none of the peer's held ones is replaced.
    pub fn accept_qps(
        &self,
        peer: &str,
        requests: &[QpRequest],
    ) -> Result<Vec<QpAnswer>, AcceptError> {
        let mut guards = Vec::new();
        let mut answers = Vec::with_capacity(requests.len());
        for (i, asked) in requests.iter().enumerate() {
            let serving = self.serving(i, &asked.nic);
            let mut qps = Vec::with_capacity(asked.qps.len());
            for (remote, slot) in &asked.qps {
                let (local, guard) = Arc::clone(&serving.nic).accept(*remote)?;
                qps.push((local.qpn, local.psn));
                guards.push(((peer.to_string(), asked.nic.clone(), *slot), guard));
            }
            answers.push(QpAnswer {
                port: Self::port(serving),
                regions: serving.regions.clone(),
                qps,
            });
        }
        // Replaced QPs are destroyed outside the lock (destroying waits for nothing, but
        // keeps the critical section a map update).
        let replaced: Vec<_> = {
            let mut held = self.held();
            guards
                .into_iter()
                .filter_map(|(k, g)| held.insert(k, g))
                .collect()
        };
        if !replaced.is_empty() {
            tracing::info!(
                peer,
                qps = replaced.len(),
                "verbs: owner QPs of rebuilt requester QPs replaced"
            );
        }
        drop(replaced);
        Ok(answers)
    }

    /// Owner QPs alive (one per requester QP slot served).
    pub fn qps(&self) -> usize {
        self.held().len()
    }

    /// Drops every owner QP of `peer` (it left or restarted).
    pub fn forget(&self, peer: &str) {
        let gone: Vec<_> = {
            let mut held = self.held();
            let keys: Vec<SlotKey> = held.keys().filter(|k| k.0 == peer).cloned().collect();
            keys.into_iter().filter_map(|k| held.remove(&k)).collect()
        };
        drop(gone);
    }

    /// A poisoned map is still a map of QP guards: dropping or keeping them stays correct.
    fn held(&self) -> MutexGuard<'_, HashMap<SlotKey, Box<dyn Any + Send + Sync>>> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

    use kvferry_transport::verbs::gid::{Gid, Mtu};
    use kvferry_transport::verbs::{ChunkMr, RegistrarError};
    use kvferry_transport::HostRegion;

    use super::*;

    /// A NIC named `name` that counts its owner QPs and refuses to make more than `room`.
    struct Fake {
        name: &'static str,
        next: AtomicU32,
        alive: Arc<AtomicUsize>,
        room: usize,
    }

    struct FakeQp(Arc<AtomicUsize>);

    impl Drop for FakeQp {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }

    impl RdmaNic for Fake {
        fn name(&self) -> &str {
            self.name
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
            None
        }

        fn register_chunk(
            &self,
            _region: &Arc<HostRegion>,
            chunk: Chunk,
        ) -> Result<ChunkMr, RegistrarError> {
            Err(RegistrarError::OutsideRegion {
                nic: self.name.into(),
                addr: chunk.addr,
                len: chunk.len,
            })
        }

        fn accept(
            self: Arc<Self>,
            remote: QpEndpoint,
        ) -> Result<(QpEndpoint, Box<dyn Any + Send + Sync>), AcceptError> {
            if self.alive.load(Ordering::SeqCst) >= self.room {
                return Err(AcceptError::Setup {
                    nic: self.name.into(),
                    what: "creating a QP",
                    reason: "no room".into(),
                });
            }
            self.alive.fetch_add(1, Ordering::SeqCst);
            let qpn = self.next.fetch_add(1, Ordering::SeqCst);
            Ok((
                QpEndpoint { qpn, ..remote },
                Box::new(FakeQp(Arc::clone(&self.alive))),
            ))
        }
    }

    fn serving(name: &'static str, rkey: u32, room: usize) -> (ServingNic, Arc<AtomicUsize>) {
        let alive = Arc::new(AtomicUsize::new(0));
        let nic = Arc::new(Fake {
            name,
            next: AtomicU32::new(0x500),
            alive: Arc::clone(&alive),
            room,
        });
        let regions = vec![(
            Chunk {
                addr: 0x10_0000,
                len: 0x1_0000,
            },
            rkey,
        )];
        let s = ServingNic {
            nic,
            regions,
            responder_depth: 0,
        };
        (s, alive)
    }

    fn qp(qpn: u32) -> QpEndpoint {
        QpEndpoint {
            qpn,
            psn: 1,
            lid: 0,
            gid: Gid([3; 16]),
            mtu: Mtu::M4096,
            responder_depth: 16,
        }
    }

    fn ask(nic: &str, qps: &[(u32, u32)]) -> QpRequest {
        QpRequest {
            nic: nic.into(),
            qps: qps.iter().map(|(n, slot)| (qp(*n), *slot)).collect(),
        }
    }

    /// A request goes to the NIC of its name, else by position; the answer carries that
    /// NIC's port and MRs, and a configured depth of 0 is still announced as 1.
    #[test]
    fn requests_are_served_by_name_then_position() {
        let (a, _) = serving("mlx5_0", 0xa, 8);
        let (b, _) = serving("mlx5_1", 0xb, 8);
        let r = NicResponder::new(vec![a, b]).unwrap();
        assert!(r.served_ports().iter().all(|p| p.responder_depth == 1));
        let answers = r
            .accept_qps(
                "p",
                &[ask("mlx5_1", &[(0x11, 0)]), ask("other", &[(0x12, 1)])],
            )
            .unwrap();
        assert_eq!(answers[0].port.nic, "mlx5_1");
        assert_eq!(answers[0].regions[0].1, 0xb);
        assert_eq!(answers[1].port.nic, "mlx5_1", "position 1 is mlx5_1");
        assert_eq!(answers[0].qps, vec![(0x500, 1)]);
        assert_eq!(r.qps(), 2);
        assert!(NicResponder::new(Vec::new()).is_none());
    }

    /// A refused QP fails the whole request: what was made for it is destroyed, and the
    /// peer's QPs already held stay.
    #[test]
    fn a_refused_qp_leaves_the_held_ones_in_place() {
        let (a, alive) = serving("mlx5_0", 0xa, 2);
        let r = NicResponder::new(vec![a]).unwrap();
        r.accept_qps("p", &[ask("mlx5_0", &[(0x20, 0)])]).unwrap();
        let e = r
            .accept_qps("p", &[ask("mlx5_0", &[(0x21, 0), (0x22, 1)])])
            .unwrap_err();
        assert!(e.to_string().contains("no room"), "{e}");
        assert_eq!((r.qps(), alive.load(Ordering::SeqCst)), (1, 1));
    }
}
