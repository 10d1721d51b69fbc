//! The RC QP state machine: creation limits, every transition's attribute mask and values
//! checked as a device checks them, posting (RTS only; error flushes) and going to error.

use std::collections::VecDeque;
use std::io;

use super::state::{Obj, State};
use super::{einval, errno, KNOWN_ACCESS, MASK_24};
use crate::verbs::gid::Gid;
use crate::verbs::ops::{Handle, QpCaps, Wc};
use crate::verbs::qp_attrs::{mask, Transition, VerbsQpState};
use crate::verbs::work::{wc, ReadWr};

pub(super) struct Qp {
    pub(super) ctx: usize,
    pub(super) pd: usize,
    pub(super) cq: usize,
    pub(super) qpn: u32,
    pub(super) caps: QpCaps,
    pub(super) state: VerbsQpState,
    pub(super) access: u32,
    pub(super) mtu: u32,
    pub(super) dest_qpn: u32,
    pub(super) dest_gid: Gid,
    pub(super) max_rd_atomic: u8,
    pub(super) max_dest_rd_atomic: u8,
    pub(super) sq: VecDeque<ReadWr>,
}

/// Required and optional attribute bits of each RC transition (IBA 11.2.4.2, as rdma-core's
/// `ibv_modify_qp` man page lists them).
fn transition_masks(from: VerbsQpState, to: VerbsQpState) -> Option<(u32, u32)> {
    use VerbsQpState::*;
    let s = mask::STATE;
    match (from, to) {
        (_, Reset) | (_, Error) => Some((s, 0)),
        (Reset, Init) => Some((s | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS, 0)),
        (Init, Init) => Some((s, mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS)),
        (Init, ReadyToReceive) => Some((
            s | mask::AV
                | mask::PATH_MTU
                | mask::DEST_QPN
                | mask::RQ_PSN
                | mask::MAX_DEST_RD_ATOMIC
                | mask::MIN_RNR_TIMER,
            mask::ACCESS_FLAGS | mask::PKEY_INDEX,
        )),
        (ReadyToReceive, ReadyToSend) => Some((
            s | mask::SQ_PSN
                | mask::TIMEOUT
                | mask::RETRY_CNT
                | mask::RNR_RETRY
                | mask::MAX_QP_RD_ATOMIC,
            mask::ACCESS_FLAGS | mask::MIN_RNR_TIMER,
        )),
        (ReadyToSend, ReadyToSend) => Some((s, mask::ACCESS_FLAGS | mask::MIN_RNR_TIMER)),
        _ => None,
    }
}

impl State {
    pub(super) fn create_qp(
        &mut self,
        pd: Handle,
        cq: Handle,
        caps: QpCaps,
    ) -> io::Result<(Handle, u32)> {
        let ctx = self.ctx_of_pd(pd)?;
        match self.objs.get(&cq.0) {
            Some(Obj::Cq(c)) if c.ctx == ctx => {}
            _ => return Err(einval("ibv_create_qp: CQ of another context")),
        }
        let attr = self.ctx(Handle(ctx))?.profile.attr;
        if caps.max_send_wr == 0 || caps.max_send_wr > attr.max_qp_wr {
            return Err(einval(&format!(
                "ibv_create_qp: max_send_wr {} exceeds the device's max_qp_wr {}",
                caps.max_send_wr, attr.max_qp_wr
            )));
        }
        if caps.max_send_sge == 0 || caps.max_send_sge > attr.max_sge {
            return Err(einval(&format!(
                "ibv_create_qp: max_send_sge {} exceeds the device's max_sge {}",
                caps.max_send_sge, attr.max_sge
            )));
        }
        let live = self
            .objs
            .values()
            .filter(|o| matches!(o, Obj::Qp(q) if q.ctx == ctx))
            .count();
        if live >= attr.max_qp as usize {
            return Err(errno(libc::ENOMEM, "ibv_create_qp: max_qp reached"));
        }
        self.next_qpn = (self.next_qpn % (MASK_24 - 0x100)) + 1;
        let qpn = 0x100 + self.next_qpn;
        let h = self.insert(Obj::Qp(Box::new(Qp {
            ctx,
            pd: pd.0,
            cq: cq.0,
            qpn,
            caps,
            state: VerbsQpState::Reset,
            access: 0,
            mtu: 0,
            dest_qpn: 0,
            dest_gid: Gid::default(),
            max_rd_atomic: 0,
            max_dest_rd_atomic: 0,
            sq: VecDeque::new(),
        })));
        Ok((h, qpn))
    }

    pub(super) fn modify_qp(&mut self, qp: Handle, t: &Transition) -> io::Result<()> {
        let q = self.qp_mut(qp)?;
        let ctx = q.ctx;
        let from = q.state;
        let Some((required, optional)) = transition_masks(from, t.state) else {
            return Err(einval(&format!(
                "ibv_modify_qp: {from:?} -> {:?} is not a transition",
                t.state
            )));
        };
        if t.mask & required != required {
            return Err(einval(&format!(
                "ibv_modify_qp {from:?} -> {:?}: attribute mask {:#x} lacks required {:#x}",
                t.state,
                t.mask,
                required & !t.mask
            )));
        }
        if t.mask & !(required | optional) != 0 {
            return Err(einval(&format!(
                "ibv_modify_qp {from:?} -> {:?}: attribute mask bits {:#x} are not allowed",
                t.state,
                t.mask & !(required | optional)
            )));
        }
        let c = match self.objs.get(&ctx) {
            Some(Obj::Ctx(c)) => c,
            _ => return Err(einval("context closed")),
        };
        let profile = c.profile;
        let has = |b: u32| t.mask & b != 0;
        if has(mask::PORT) && t.port != 1 {
            return Err(einval("ibv_modify_qp: port_num must be 1"));
        }
        if has(mask::ACCESS_FLAGS) && t.access_flags & !KNOWN_ACCESS != 0 {
            return Err(einval("ibv_modify_qp: unknown access flags"));
        }
        if has(mask::PATH_MTU) && t.path_mtu > profile.mtu {
            return Err(einval(&format!(
                "ibv_modify_qp: path MTU {} exceeds the port's {}",
                t.path_mtu.bytes(),
                profile.mtu.bytes()
            )));
        }
        if has(mask::DEST_QPN) && (t.dest_qpn == 0 || t.dest_qpn > MASK_24) {
            return Err(einval(
                "ibv_modify_qp: dest_qp_num is zero or wider than 24 bits",
            ));
        }
        if (has(mask::RQ_PSN) && t.rq_psn > MASK_24) || (has(mask::SQ_PSN) && t.sq_psn > MASK_24) {
            return Err(einval("ibv_modify_qp: PSN wider than 24 bits"));
        }
        if has(mask::MAX_DEST_RD_ATOMIC)
            && u32::from(t.max_dest_rd_atomic) > profile.attr.max_qp_rd_atom
        {
            return Err(einval(&format!(
                "ibv_modify_qp: max_dest_rd_atomic {} exceeds the device's max_qp_rd_atom {}",
                t.max_dest_rd_atomic, profile.attr.max_qp_rd_atom
            )));
        }
        if has(mask::MAX_QP_RD_ATOMIC)
            && u32::from(t.max_rd_atomic) > profile.attr.max_qp_init_rd_atom
        {
            return Err(einval(&format!(
                "ibv_modify_qp: max_rd_atomic {} exceeds the device's max_qp_init_rd_atom {}",
                t.max_rd_atomic, profile.attr.max_qp_init_rd_atom
            )));
        }
        if (has(mask::RETRY_CNT) && t.retry_cnt > 7)
            || (has(mask::RNR_RETRY) && t.rnr_retry > 7)
            || (has(mask::TIMEOUT) && t.timeout > 31)
        {
            return Err(einval("ibv_modify_qp: retry or timeout out of range"));
        }
        if has(mask::AV) {
            if t.av.port != 1 {
                return Err(einval("ibv_modify_qp: address vector port must be 1"));
            }
            if !t.av.is_global || t.av.dgid.is_zero() || t.av.sgid_index != 0 {
                return Err(einval(
                    "ibv_modify_qp: a RoCE port needs a global route with a GID (index 0)",
                ));
            }
        }
        let gid = self.gid_of_ctx(ctx);
        if t.state == VerbsQpState::Error {
            self.fail_qp(qp.0);
            if let Some(g) = gid {
                self.publish(g);
            }
            return Ok(());
        }
        let q = self.qp_mut(qp)?;
        if has(mask::ACCESS_FLAGS) {
            q.access = t.access_flags;
        }
        if has(mask::PATH_MTU) {
            q.mtu = t.path_mtu.bytes();
        }
        if has(mask::DEST_QPN) {
            q.dest_qpn = t.dest_qpn;
        }
        if has(mask::AV) {
            q.dest_gid = t.av.dgid;
        }
        if has(mask::MAX_DEST_RD_ATOMIC) {
            q.max_dest_rd_atomic = t.max_dest_rd_atomic;
        }
        if has(mask::MAX_QP_RD_ATOMIC) {
            q.max_rd_atomic = t.max_rd_atomic;
        }
        if t.state == VerbsQpState::Reset {
            q.sq.clear();
            q.access = 0;
            q.dest_qpn = 0;
            q.dest_gid = Gid::default();
        }
        q.state = t.state;
        if let Some(g) = gid {
            self.publish(g);
        }
        Ok(())
    }

    pub(super) fn destroy_qp(&mut self, qp: Handle) -> io::Result<()> {
        let ctx = self.qp_mut(qp)?.ctx;
        self.objs.remove(&qp.0);
        if let Some(g) = self.gid_of_ctx(ctx) {
            self.publish(g);
        }
        Ok(())
    }

    pub(super) fn post_read(&mut self, qp: Handle, wr: &ReadWr) -> io::Result<()> {
        let q = self.qp_mut(qp)?;
        if wr.sges.len() > q.caps.max_send_sge as usize {
            return Err(einval(&format!(
                "ibv_post_send: {} SGEs, the QP takes {}",
                wr.sges.len(),
                q.caps.max_send_sge
            )));
        }
        match q.state {
            VerbsQpState::ReadyToSend => {}
            VerbsQpState::Error => {
                let (cq, qpn) = (q.cq, q.qpn);
                self.push_cqe(
                    cq,
                    Wc {
                        wr_id: wr.wr_id,
                        status: wc::WR_FLUSH_ERR,
                        qp_num: qpn,
                        byte_len: 0,
                    },
                );
                return Ok(());
            }
            s => {
                return Err(einval(&format!(
                    "ibv_post_send: the QP is in {s:?}, sends need RTS"
                )))
            }
        }
        if q.sq.len() >= q.caps.max_send_wr as usize {
            return Err(errno(libc::ENOMEM, "ibv_post_send: send queue full"));
        }
        q.sq.push_back(wr.clone());
        Ok(())
    }

    /// Moves a QP to error and flushes its send queue.
    pub(super) fn fail_qp(&mut self, qp: usize) {
        let Some(Obj::Qp(q)) = self.objs.get_mut(&qp) else {
            return;
        };
        q.state = VerbsQpState::Error;
        let (cq, qpn) = (q.cq, q.qpn);
        let flushed: Vec<u64> = q.sq.drain(..).map(|w| w.wr_id).collect();
        for wr_id in flushed {
            self.push_cqe(
                cq,
                Wc {
                    wr_id,
                    status: wc::WR_FLUSH_ERR,
                    qp_num: qpn,
                    byte_len: 0,
                },
            );
        }
    }
}
