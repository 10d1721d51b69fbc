//! Verbs endpoints as the Peer RPC carries them (`VerbsEndpoint` in peer.proto): per RDMA NIC
//! the port address (GID, LID, MTU), the responder depth, QP numbers with their PSNs, and the
//! owner's pool MRs with their rkeys. Everything is checked on receipt ([`VerbsPeerEndpoint::
//! from_proto`]) before anything is built from it: a requester brings its RC QPs to
//! ready-to-receive against exactly what passed these checks.
//!
//! [`VerbsResponder`] is the owner side of the exchange: it makes the owner's QPs for a
//! requester's endpoints and answers with them and the pool's MRs.

use std::collections::HashSet;

use kvferry_transport::verbs::gid::{Gid, Mtu};
use kvferry_transport::verbs::registration::{Chunk, KeyMap, NicKeys};
use kvferry_transport::verbs::QpEndpoint;
use thiserror::Error;

use kvferry_proto::v1 as proto;

/// Most NICs one message names.
pub const MAX_NICS: usize = 16;
/// Most QPs per NIC in one exchange (the largest `qps-per-peer`).
pub const MAX_QPS: usize = 64;
/// Most MRs advertised per NIC (a 4 TiB pool split at 4 GiB is 1024).
pub const MAX_REGIONS: usize = 4096;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum EndpointError {
    #[error("verbs endpoint: nic name {nic:?} is invalid (1 to 64 of [A-Za-z0-9_.-])")]
    Nic { nic: String },
    #[error("verbs endpoint {nic}: nic named twice")]
    DuplicateNic { nic: String },
    #[error("verbs endpoints: {count} nics, at most {MAX_NICS}")]
    TooManyNics { count: usize },
    #[error("verbs endpoint {nic}: gid is {len} bytes, not 16")]
    GidLength { nic: String, len: usize },
    #[error("verbs endpoint {nic}: no address (zero gid and zero lid)")]
    NoAddress { nic: String },
    #[error("verbs endpoint {nic}: lid {lid} does not fit 16 bits")]
    Lid { nic: String, lid: u32 },
    #[error("verbs endpoint {nic}: mtu {mtu} is not 256, 512, 1024, 2048 or 4096")]
    Mtu { nic: String, mtu: u32 },
    #[error("verbs endpoint {nic}: responder depth {depth} is not 1 to 255")]
    Depth { nic: String, depth: u32 },
    #[error("verbs endpoint {nic}: qp number {qpn} is zero or wider than 24 bits")]
    Qpn { nic: String, qpn: u32 },
    #[error("verbs endpoint {nic}: qp number {qpn} appears twice")]
    DuplicateQpn { nic: String, qpn: u32 },
    #[error("verbs endpoint {nic}: psn {psn} is wider than 24 bits")]
    Psn { nic: String, psn: u32 },
    #[error("verbs endpoint {nic}: qp slot {slot} is not below {MAX_QPS} or appears twice")]
    Slot { nic: String, slot: u32 },
    #[error("verbs endpoint {nic}: {field} {got} contradicts the nic's announced {announced}")]
    Contradicts {
        nic: String,
        field: &'static str,
        got: String,
        announced: String,
    },
    #[error("verbs endpoint {nic}: {count} qps, expected {expected}")]
    QpCount {
        nic: String,
        count: usize,
        expected: &'static str,
    },
    #[error("verbs endpoint {nic}: {count} regions, expected {expected}")]
    RegionCount {
        nic: String,
        count: usize,
        expected: &'static str,
    },
    #[error("verbs endpoint {nic}: region {addr:#x}+{len} {reason}")]
    Region {
        nic: String,
        addr: u64,
        len: u64,
        reason: &'static str,
    },
    #[error("verbs answer: nic {nic} was not asked for")]
    UnaskedNic { nic: String },
    #[error("verbs answer: nic {nic} has {got} qps for the {asked} asked")]
    AnswerQps {
        nic: String,
        asked: usize,
        got: usize,
    },
}

/// Where an endpoint appears, which decides what it must carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// In Hello: the port only (no QPs, no regions).
    Announce,
    /// In a Handshake request: the requester's QPs (at least one), no regions.
    Request,
    /// In a Handshake answer: the owner's QPs and its pool's MRs on the NIC.
    Answer,
}

/// One NIC's side of a verbs connection, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerbsPeerEndpoint {
    pub nic: String,
    pub gid: Gid,
    pub lid: u16,
    pub mtu: Mtu,
    pub responder_depth: u8,
    /// `(qpn, psn)` of each QP, in exchange order.
    pub qps: Vec<(u32, u32)>,
    /// The requester's slot of each QP (same order as `qps`; what the owner keys its QPs
    /// by, so a rebuilt QP replaces its predecessor); zeros in answers and announcements.
    pub slots: Vec<u32>,
    /// The pool's MRs on this NIC: `(range, rkey)`.
    pub regions: Vec<(Chunk, u32)>,
}

fn valid_nic_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

const MASK_24: u32 = 0x00ff_ffff;

impl VerbsPeerEndpoint {
    /// Checks every field of a received endpoint for `role`.
    pub fn from_proto(p: &proto::VerbsEndpoint, role: Role) -> Result<Self, EndpointError> {
        let nic = p.nic.clone();
        if !valid_nic_name(&nic) {
            return Err(EndpointError::Nic { nic });
        }
        let gid: [u8; 16] = p
            .gid
            .as_slice()
            .try_into()
            .map_err(|_| EndpointError::GidLength {
                nic: nic.clone(),
                len: p.gid.len(),
            })?;
        let gid = Gid(gid);
        let lid = u16::try_from(p.lid).map_err(|_| EndpointError::Lid {
            nic: nic.clone(),
            lid: p.lid,
        })?;
        if gid.is_zero() && lid == 0 {
            return Err(EndpointError::NoAddress { nic });
        }
        let mtu = Mtu::from_bytes(p.mtu).ok_or_else(|| EndpointError::Mtu {
            nic: nic.clone(),
            mtu: p.mtu,
        })?;
        let responder_depth = u8::try_from(p.responder_depth)
            .ok()
            .filter(|d| *d >= 1)
            .ok_or_else(|| EndpointError::Depth {
                nic: nic.clone(),
                depth: p.responder_depth,
            })?;
        let (qp_ok, qp_expected) = match role {
            Role::Announce => (p.qps.is_empty(), "none in Hello"),
            Role::Request | Role::Answer => (
                (1..=MAX_QPS).contains(&p.qps.len()),
                "1 to 64 in a handshake",
            ),
        };
        if !qp_ok {
            return Err(EndpointError::QpCount {
                nic,
                count: p.qps.len(),
                expected: qp_expected,
            });
        }
        let mut seen = HashSet::with_capacity(p.qps.len());
        let mut slots_seen = HashSet::with_capacity(p.qps.len());
        let mut qps = Vec::with_capacity(p.qps.len());
        let mut slots = Vec::with_capacity(p.qps.len());
        for q in &p.qps {
            if q.qpn == 0 || q.qpn > MASK_24 {
                return Err(EndpointError::Qpn { nic, qpn: q.qpn });
            }
            if !seen.insert(q.qpn) {
                return Err(EndpointError::DuplicateQpn { nic, qpn: q.qpn });
            }
            if q.psn > MASK_24 {
                return Err(EndpointError::Psn { nic, psn: q.psn });
            }
            if q.slot >= MAX_QPS as u32 || (role == Role::Request && !slots_seen.insert(q.slot)) {
                return Err(EndpointError::Slot { nic, slot: q.slot });
            }
            slots.push(q.slot);
            qps.push((q.qpn, q.psn));
        }
        let (regions_ok, regions_expected) = match role {
            Role::Announce | Role::Request => (p.regions.is_empty(), "none outside an answer"),
            Role::Answer => (
                (1..=MAX_REGIONS).contains(&p.regions.len()),
                "1 to 4096 in an answer",
            ),
        };
        if !regions_ok {
            return Err(EndpointError::RegionCount {
                nic,
                count: p.regions.len(),
                expected: regions_expected,
            });
        }
        let mut keys = KeyMap::new();
        let mut regions = Vec::with_capacity(p.regions.len());
        for r in &p.regions {
            let bad = |reason| EndpointError::Region {
                nic: nic.clone(),
                addr: r.addr,
                len: r.len,
                reason,
            };
            if r.nic != nic {
                return Err(bad("names another nic"));
            }
            if r.len == 0 || r.addr.checked_add(r.len).is_none() {
                return Err(bad("is empty or wraps"));
            }
            let chunk = Chunk {
                addr: r.addr,
                len: r.len,
            };
            // A NIC's rkeys are 32 bits; the field is wider for tcp's keys.
            let rkey = u32::try_from(r.rkey).map_err(|_| bad("has an rkey over 32 bits"))?;
            keys.insert(chunk, NicKeys { lkey: 0, rkey })
                .map_err(|_| bad("overlaps another region"))?;
            regions.push((chunk, rkey));
        }
        Ok(VerbsPeerEndpoint {
            nic,
            gid,
            lid,
            mtu,
            responder_depth,
            qps,
            slots,
            regions,
        })
    }

    pub fn to_proto(&self) -> proto::VerbsEndpoint {
        proto::VerbsEndpoint {
            nic: self.nic.clone(),
            gid: self.gid.0.to_vec(),
            lid: u32::from(self.lid),
            mtu: self.mtu.bytes(),
            responder_depth: u32::from(self.responder_depth),
            qps: self
                .qps
                .iter()
                .enumerate()
                .map(|(i, (qpn, psn))| proto::QueuePair {
                    qpn: *qpn,
                    psn: *psn,
                    slot: self.slots.get(i).copied().unwrap_or(0),
                })
                .collect(),
            regions: self
                .regions
                .iter()
                .map(|(c, rkey)| proto::PoolRegion {
                    nic: self.nic.clone(),
                    addr: c.addr,
                    len: c.len,
                    rkey: u64::from(*rkey),
                })
                .collect(),
        }
    }

    /// The `i`th QP as the transport connects to it.
    pub fn qp_endpoint(&self, i: usize) -> Option<QpEndpoint> {
        let (qpn, psn) = *self.qps.get(i)?;
        Some(QpEndpoint {
            qpn,
            psn,
            lid: self.lid,
            gid: self.gid,
            mtu: self.mtu,
            responder_depth: self.responder_depth,
        })
    }

    /// The advertised MRs as the key map reads are built against.
    pub fn key_map(&self) -> KeyMap {
        let mut m = KeyMap::new();
        for (c, rkey) in &self.regions {
            // Overlaps were refused on receipt.
            let _ = m.insert(
                *c,
                NicKeys {
                    lkey: 0,
                    rkey: *rkey,
                },
            );
        }
        m
    }
}

/// Checks a received list: each endpoint for `role`, NIC names distinct, at most
/// [`MAX_NICS`].
pub fn endpoints_from_proto(
    list: &[proto::VerbsEndpoint],
    role: Role,
) -> Result<Vec<VerbsPeerEndpoint>, EndpointError> {
    if list.len() > MAX_NICS {
        return Err(EndpointError::TooManyNics { count: list.len() });
    }
    let mut out: Vec<VerbsPeerEndpoint> = Vec::with_capacity(list.len());
    for p in list {
        let e = VerbsPeerEndpoint::from_proto(p, role)?;
        if out.iter().any(|o| o.nic == e.nic) {
            return Err(EndpointError::DuplicateNic { nic: e.nic });
        }
        out.push(e);
    }
    Ok(out)
}

/// Checks that an owner's answer matches the request: only NICs that were asked for, each
/// with as many QPs as were offered.
pub fn check_answer(
    asked: &[VerbsPeerEndpoint],
    answer: &[VerbsPeerEndpoint],
) -> Result<(), EndpointError> {
    for a in answer {
        let Some(q) = asked.iter().find(|q| q.nic == a.nic) else {
            return Err(EndpointError::UnaskedNic { nic: a.nic.clone() });
        };
        if q.qps.len() != a.qps.len() {
            return Err(EndpointError::AnswerQps {
                nic: a.nic.clone(),
                asked: q.qps.len(),
                got: a.qps.len(),
            });
        }
    }
    Ok(())
}

/// Checks an owner's answer against the ports it announced in Hello: it must come from an
/// announced port (its GID and LID), with that port's MTU, accepting no more reads than the
/// port announced. A contradiction is refused naming the field, before any QP is connected.
pub fn check_announced(
    answer: &VerbsPeerEndpoint,
    ports: &[VerbsPeerEndpoint],
) -> Result<(), EndpointError> {
    let contradicts = |field, got: String, announced: String| EndpointError::Contradicts {
        nic: answer.nic.clone(),
        field,
        got,
        announced,
    };
    let port = ports
        .iter()
        .find(|p| p.gid == answer.gid && p.lid == answer.lid)
        .ok_or_else(|| {
            contradicts(
                "gid",
                answer.gid.to_string(),
                ports
                    .iter()
                    .map(|p| p.gid.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
            )
        })?;
    if answer.mtu != port.mtu {
        return Err(contradicts(
            "mtu",
            answer.mtu.bytes().to_string(),
            port.mtu.bytes().to_string(),
        ));
    }
    if answer.responder_depth > port.responder_depth {
        return Err(contradicts(
            "responder depth",
            answer.responder_depth.to_string(),
            port.responder_depth.to_string(),
        ));
    }
    Ok(())
}

/// The owner side of the verbs exchange: the ports a node announces in Hello, and, per
/// Handshake, new owner QPs connected to the requester's (ready-to-receive against them)
/// with the pool's MRs on each NIC.
pub trait VerbsResponder: Send + Sync + std::fmt::Debug {
    fn ports(&self) -> Vec<VerbsPeerEndpoint>;
    /// `request` passed [`endpoints_from_proto`] with [`Role::Request`]; the answer must
    /// pass it with [`Role::Answer`] and [`check_answer`].
    fn accept(
        &self,
        peer: &str,
        request: &[VerbsPeerEndpoint],
    ) -> Result<Vec<VerbsPeerEndpoint>, String>;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good(role: Role) -> proto::VerbsEndpoint {
        proto::VerbsEndpoint {
            nic: "mlx5_0".into(),
            gid: vec![0xfe, 0x80, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 1],
            lid: 0,
            mtu: 4096,
            responder_depth: 16,
            qps: match role {
                Role::Announce => vec![],
                _ => vec![
                    proto::QueuePair {
                        qpn: 0x11,
                        psn: 7,
                        slot: 0,
                    },
                    proto::QueuePair {
                        qpn: 0x12,
                        psn: 0xff_ffff,
                        slot: 1,
                    },
                ],
            },
            regions: match role {
                Role::Answer => vec![
                    proto::PoolRegion {
                        nic: "mlx5_0".into(),
                        addr: 0x10_0000,
                        len: 0x1000,
                        rkey: 5,
                    },
                    proto::PoolRegion {
                        nic: "mlx5_0".into(),
                        addr: 0x10_1000,
                        len: 0x1000,
                        rkey: 6,
                    },
                ],
                _ => vec![],
            },
        }
    }

    #[test]
    fn well_formed_endpoints_round_trip() {
        for role in [Role::Announce, Role::Request, Role::Answer] {
            let p = good(role);
            let e = VerbsPeerEndpoint::from_proto(&p, role).unwrap();
            assert_eq!(e.to_proto(), p);
        }
        let e = VerbsPeerEndpoint::from_proto(&good(Role::Answer), Role::Answer).unwrap();
        assert_eq!(e.key_map().remote_key(0x10_1800, 16), Ok(6));
        let q = e.qp_endpoint(1).unwrap();
        assert_eq!((q.qpn, q.psn, q.mtu), (0x12, 0xff_ffff, Mtu::M4096));
        assert!(e.qp_endpoint(2).is_none());
        // InfiniBand: zero GID with a LID is an address.
        let mut ib = good(Role::Request);
        ib.gid = vec![0; 16];
        ib.lid = 7;
        assert!(VerbsPeerEndpoint::from_proto(&ib, Role::Request).is_ok());
    }

    #[test]
    fn malformed_endpoints_are_refused_field_by_field() {
        type Edit = fn(&mut proto::VerbsEndpoint);
        let cases: Vec<(Role, Edit, &str)> = vec![
            (Role::Request, |p| p.nic = String::new(), "nic name"),
            (Role::Request, |p| p.nic = "mlx 5".into(), "nic name"),
            (Role::Request, |p| p.nic = "n".repeat(65), "nic name"),
            (Role::Request, |p| p.gid = vec![1; 15], "gid is 15 bytes"),
            (Role::Request, |p| p.gid = vec![1; 17], "gid is 17 bytes"),
            (Role::Request, |p| p.gid = vec![0; 16], "no address"),
            (Role::Request, |p| p.lid = 0x1_0000, "lid 65536"),
            (Role::Request, |p| p.mtu = 1500, "mtu 1500"),
            (Role::Request, |p| p.mtu = 0, "mtu 0"),
            (Role::Request, |p| p.responder_depth = 0, "depth 0"),
            (Role::Request, |p| p.responder_depth = 256, "depth 256"),
            (Role::Request, |p| p.qps.clear(), "0 qps"),
            (
                Role::Request,
                |p| {
                    p.qps = (1..=65)
                        .map(|q| proto::QueuePair {
                            qpn: q,
                            psn: 0,
                            slot: 0,
                        })
                        .collect()
                },
                "65 qps",
            ),
            (Role::Request, |p| p.qps[0].qpn = 0, "qp number 0"),
            (
                Role::Request,
                |p| p.qps[0].qpn = 0x100_0000,
                "qp number 16777216",
            ),
            (Role::Request, |p| p.qps[1].qpn = 0x11, "appears twice"),
            (Role::Request, |p| p.qps[0].psn = 0x100_0000, "psn 16777216"),
            (
                Role::Announce,
                |p| {
                    p.qps.push(proto::QueuePair {
                        qpn: 1,
                        psn: 0,
                        slot: 0,
                    })
                },
                "none in Hello",
            ),
            (
                Role::Request,
                |p| {
                    p.regions.push(proto::PoolRegion {
                        nic: "mlx5_0".into(),
                        addr: 0x1000,
                        len: 1,
                        rkey: 1,
                    })
                },
                "none outside an answer",
            ),
            (Role::Answer, |p| p.regions.clear(), "0 regions"),
            (
                Role::Answer,
                |p| p.regions[1].nic = "mlx5_1".into(),
                "names another nic",
            ),
            (Role::Answer, |p| p.regions[0].len = 0, "empty or wraps"),
            (
                Role::Answer,
                |p| {
                    p.regions[0].addr = u64::MAX - 1;
                    p.regions[0].len = 4
                },
                "empty or wraps",
            ),
            (
                Role::Answer,
                |p| p.regions[1].addr = 0x10_0800,
                "overlaps another region",
            ),
        ];
        for (role, edit, want) in cases {
            let mut p = good(role);
            edit(&mut p);
            let e = VerbsPeerEndpoint::from_proto(&p, role).unwrap_err();
            assert!(e.to_string().contains(want), "{want:?}: {e}");
        }
    }

    #[test]
    fn answers_must_agree_with_the_announced_port() {
        let port = VerbsPeerEndpoint::from_proto(&good(Role::Announce), Role::Announce).unwrap();
        let ok = VerbsPeerEndpoint::from_proto(&good(Role::Answer), Role::Answer).unwrap();
        check_announced(&ok, std::slice::from_ref(&port)).unwrap();
        let mut deeper = ok.clone();
        deeper.responder_depth = 17;
        let mut mtu = ok.clone();
        mtu.mtu = Mtu::M1024;
        let mut gid = ok.clone();
        gid.gid = Gid([7; 16]);
        for (bad, field) in [
            (deeper, "responder depth 17"),
            (mtu, "mtu 1024"),
            (gid, "gid"),
        ] {
            let e = check_announced(&bad, std::slice::from_ref(&port)).unwrap_err();
            assert!(e.to_string().contains(field), "{field}: {e}");
            assert!(matches!(e, EndpointError::Contradicts { .. }), "{e}");
        }
    }

    #[test]
    fn request_slots_are_below_64_and_distinct() {
        let mut p = good(Role::Request);
        p.qps[1].slot = 0;
        let e = VerbsPeerEndpoint::from_proto(&p, Role::Request).unwrap_err();
        assert!(matches!(e, EndpointError::Slot { slot: 0, .. }), "{e}");
        p.qps[1].slot = 64;
        let e = VerbsPeerEndpoint::from_proto(&p, Role::Request).unwrap_err();
        assert!(matches!(e, EndpointError::Slot { slot: 64, .. }), "{e}");
        p.qps[1].slot = 5;
        let e = VerbsPeerEndpoint::from_proto(&p, Role::Request).unwrap();
        assert_eq!(e.slots, vec![0, 5]);
    }

    #[test]
    fn lists_and_answers_are_checked_as_a_whole() {
        let one = good(Role::Request);
        let e = endpoints_from_proto(&[one.clone(), one.clone()], Role::Request).unwrap_err();
        assert!(matches!(e, EndpointError::DuplicateNic { .. }), "{e}");
        let many: Vec<_> = (0..17)
            .map(|i| {
                let mut p = one.clone();
                p.nic = format!("mlx5_{i}");
                p
            })
            .collect();
        assert!(matches!(
            endpoints_from_proto(&many, Role::Request),
            Err(EndpointError::TooManyNics { count: 17 })
        ));
        let asked = endpoints_from_proto(&[one], Role::Request).unwrap();
        let mut ans = good(Role::Answer);
        let ok = endpoints_from_proto(std::slice::from_ref(&ans), Role::Answer).unwrap();
        check_answer(&asked, &ok).unwrap();
        ans.qps.pop();
        let short = endpoints_from_proto(std::slice::from_ref(&ans), Role::Answer).unwrap();
        assert!(matches!(
            check_answer(&asked, &short),
            Err(EndpointError::AnswerQps {
                asked: 2,
                got: 1,
                ..
            })
        ));
        ans.nic = "mlx5_9".into();
        for r in &mut ans.regions {
            r.nic = "mlx5_9".into();
        }
        let other = endpoints_from_proto(&[ans], Role::Answer).unwrap();
        assert!(matches!(
            check_answer(&asked, &other),
            Err(EndpointError::UnaskedNic { .. })
        ));
    }
}
