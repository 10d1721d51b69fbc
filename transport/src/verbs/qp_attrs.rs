//! The attributes an RC QP is modified with on its way reset → init → RTR → RTS (and to error
//! for the drain), as plain data. The FFI layer copies each [`Transition`] into `ibv_qp_attr`
//! and passes its mask, so the choices are tested here without a NIC.

use super::config::VerbsConfig;
use super::gid::{path_mtu, Gid, Mtu, PortAddress};

/// `ibv_qp_state` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VerbsQpState {
    Reset = 0,
    Init = 1,
    ReadyToReceive = 2,
    ReadyToSend = 3,
    Error = 6,
}

/// `ibv_qp_attr_mask` bits.
pub mod mask {
    pub const STATE: u32 = 1 << 0;
    pub const ACCESS_FLAGS: u32 = 1 << 3;
    pub const PKEY_INDEX: u32 = 1 << 4;
    pub const PORT: u32 = 1 << 5;
    pub const AV: u32 = 1 << 7;
    pub const PATH_MTU: u32 = 1 << 8;
    pub const TIMEOUT: u32 = 1 << 9;
    pub const RETRY_CNT: u32 = 1 << 10;
    pub const RNR_RETRY: u32 = 1 << 11;
    pub const RQ_PSN: u32 = 1 << 12;
    pub const MAX_QP_RD_ATOMIC: u32 = 1 << 13;
    pub const MIN_RNR_TIMER: u32 = 1 << 15;
    pub const SQ_PSN: u32 = 1 << 16;
    pub const MAX_DEST_RD_ATOMIC: u32 = 1 << 17;
    pub const DEST_QPN: u32 = 1 << 20;
}

/// What each side tells the other to connect one QP (exchanged over the peer RPC).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpEndpoint {
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
    pub gid: Gid,
    pub mtu: Mtu,
    /// Reads this side accepts in flight as responder (its `max_dest_rd_atomic`).
    pub responder_depth: u8,
}

/// Address vector for RTR.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct AddressVector {
    pub dlid: u16,
    pub sl: u8,
    pub port: u8,
    pub is_global: bool,
    pub dgid: Gid,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// One `ibv_modify_qp` call: only the fields named in `mask` are meaningful.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transition {
    pub state: VerbsQpState,
    pub mask: u32,
    pub access_flags: u32,
    pub pkey_index: u16,
    pub port: u8,
    pub path_mtu: Mtu,
    pub dest_qpn: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub max_dest_rd_atomic: u8,
    pub max_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub av: AddressVector,
}

impl Transition {
    fn to(state: VerbsQpState) -> Transition {
        Transition {
            state,
            mask: mask::STATE,
            access_flags: 0,
            pkey_index: 0,
            port: 0,
            path_mtu: Mtu::M1024,
            dest_qpn: 0,
            rq_psn: 0,
            sq_psn: 0,
            max_dest_rd_atomic: 0,
            max_rd_atomic: 0,
            min_rnr_timer: 0,
            timeout: 0,
            retry_cnt: 0,
            rnr_retry: 0,
            av: AddressVector::default(),
        }
    }

    /// Move to error: outstanding requests complete flushed (the drain).
    pub fn error() -> Transition {
        Transition::to(VerbsQpState::Error)
    }

    /// Back to reset, once drained.
    pub fn reset() -> Transition {
        Transition::to(VerbsQpState::Reset)
    }
}

/// Device limits on read depth (`max_qp_init_rd_atom` as initiator, `max_qp_rd_atom` as
/// responder).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadDepthLimits {
    pub initiator: u32,
    pub responder: u32,
}

/// Reads this side accepts as responder: the configured depth within the device's limit.
pub fn responder_depth(max_rd_atomic: u32, dev: ReadDepthLimits) -> u8 {
    max_rd_atomic.min(dev.responder).clamp(1, 255) as u8
}

/// The three transitions that bring a reset QP to ready-to-send against `remote`.
///
/// The initiator depth is the configured `max_rd_atomic` (16 by default) clamped to what this
/// device can issue and what the peer accepts, so the NIC never sends more reads than the
/// responder has resources for (which would stall on RNR-like retries).
pub fn connect_transitions(
    cfg: &VerbsConfig,
    max_rd_atomic: u32,
    dev: ReadDepthLimits,
    local: &PortAddress,
    remote: &QpEndpoint,
    local_psn: u32,
    access_flags: u32,
) -> [Transition; 3] {
    let mut init = Transition::to(VerbsQpState::Init);
    init.mask |= mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS;
    init.port = local.port;
    init.access_flags = access_flags;

    let mut rtr = Transition::to(VerbsQpState::ReadyToReceive);
    rtr.mask |= mask::AV
        | mask::PATH_MTU
        | mask::DEST_QPN
        | mask::RQ_PSN
        | mask::MAX_DEST_RD_ATOMIC
        | mask::MIN_RNR_TIMER;
    rtr.path_mtu = path_mtu(local.mtu, remote.mtu);
    rtr.dest_qpn = remote.qpn;
    rtr.rq_psn = remote.psn & 0x00ff_ffff;
    rtr.max_dest_rd_atomic = responder_depth(max_rd_atomic, dev);
    rtr.min_rnr_timer = cfg.min_rnr_timer;
    rtr.av = AddressVector {
        dlid: remote.lid,
        sl: cfg.service_level,
        port: local.port,
        is_global: local.global,
        dgid: if local.global {
            remote.gid
        } else {
            Gid::default()
        },
        sgid_index: local.gid_index,
        hop_limit: if local.global { cfg.hop_limit } else { 0 },
        traffic_class: cfg.traffic_class,
    };

    let mut rts = Transition::to(VerbsQpState::ReadyToSend);
    rts.mask |=
        mask::TIMEOUT | mask::RETRY_CNT | mask::RNR_RETRY | mask::SQ_PSN | mask::MAX_QP_RD_ATOMIC;
    rts.timeout = cfg.timeout;
    rts.retry_cnt = cfg.retry_count;
    rts.rnr_retry = cfg.rnr_retry;
    rts.sq_psn = local_psn & 0x00ff_ffff;
    rts.max_rd_atomic = max_rd_atomic
        .min(dev.initiator)
        .min(remote.responder_depth.into())
        .clamp(1, 255) as u8;
    [init, rtr, rts]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(global: bool) -> PortAddress {
        PortAddress {
            port: 1,
            gid_index: 3,
            gid: Gid([1; 16]),
            lid: if global { 0 } else { 4 },
            global,
            mtu: Mtu::M4096,
        }
    }

    fn remote() -> QpEndpoint {
        QpEndpoint {
            qpn: 0x123,
            psn: 0x1ab_cdef,
            lid: 9,
            gid: Gid([2; 16]),
            mtu: Mtu::M2048,
            responder_depth: 16,
        }
    }

    const DEV: ReadDepthLimits = ReadDepthLimits {
        initiator: 16,
        responder: 16,
    };

    #[test]
    fn reset_to_rts_roce() {
        let cfg = VerbsConfig::default();
        let [init, rtr, rts] = connect_transitions(&cfg, 16, DEV, &addr(true), &remote(), 7, 4);
        assert_eq!(init.state, VerbsQpState::Init);
        assert_eq!(
            init.mask,
            mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS
        );
        assert_eq!((init.port, init.access_flags), (1, 4));
        assert_eq!(rtr.state, VerbsQpState::ReadyToReceive);
        assert_eq!(rtr.path_mtu, Mtu::M2048);
        assert_eq!(rtr.dest_qpn, 0x123);
        assert_eq!(rtr.rq_psn, 0xab_cdef);
        assert_eq!(rtr.max_dest_rd_atomic, 16);
        assert!(rtr.av.is_global);
        assert_eq!(rtr.av.dgid, Gid([2; 16]));
        assert_eq!((rtr.av.sgid_index, rtr.av.hop_limit), (3, 64));
        assert_eq!(rtr.mask & mask::SQ_PSN, 0);
        assert_eq!(rts.state, VerbsQpState::ReadyToSend);
        assert_eq!((rts.timeout, rts.retry_cnt, rts.rnr_retry), (14, 7, 7));
        assert_eq!((rts.sq_psn, rts.max_rd_atomic), (7, 16));
        assert_ne!(rts.mask & mask::MAX_QP_RD_ATOMIC, 0);
    }

    #[test]
    fn infiniband_and_depth_clamps() {
        let cfg = VerbsConfig {
            timeout: 18,
            retry_count: 3,
            rnr_retry: 5,
            ..VerbsConfig::default()
        };
        let mut r = remote();
        r.responder_depth = 8;
        let dev = ReadDepthLimits {
            initiator: 32,
            responder: 4,
        };
        let [_, rtr, rts] = connect_transitions(&cfg, 16, dev, &addr(false), &r, 1, 4);
        assert!(!rtr.av.is_global);
        assert_eq!(rtr.av.dlid, 9);
        assert_eq!(rtr.av.dgid, Gid::default());
        assert_eq!(rtr.max_dest_rd_atomic, 4);
        assert_eq!(rts.max_rd_atomic, 8);
        assert_eq!((rts.timeout, rts.retry_cnt, rts.rnr_retry), (18, 3, 5));
        assert_eq!(Transition::error().mask, mask::STATE);
        assert_eq!(Transition::reset().state, VerbsQpState::Reset);
    }
}
