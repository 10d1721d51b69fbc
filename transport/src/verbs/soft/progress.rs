//! The progress engine: when a CQ is polled, each of its QPs in RTS executes up to
//! `max_rd_atomic` queued reads, under the checks a responder and a requester make, moving
//! bytes between registered memory.

use super::responder::Src;
use super::state::{Obj, State};
use crate::verbs::ops::Wc;
use crate::verbs::qp_attrs::VerbsQpState;
use crate::verbs::registration::{ACCESS_LOCAL_WRITE, ACCESS_REMOTE_READ};
use crate::verbs::work::{wc, ReadWr};

impl State {
    /// One round of the progress engine for every QP reporting to `cq`.
    pub(super) fn progress(&mut self, cq: usize) {
        let qps: Vec<usize> = self
            .objs
            .iter()
            .filter_map(|(id, o)| match o {
                Obj::Qp(q)
                    if q.cq == cq && q.state == VerbsQpState::ReadyToSend && !q.sq.is_empty() =>
                {
                    Some(*id)
                }
                _ => None,
            })
            .collect();
        for id in qps {
            self.progress_qp(id);
        }
    }

    fn progress_qp(&mut self, id: usize) {
        let Some(Obj::Qp(q)) = self.objs.get(&id) else {
            return;
        };
        let (ctx, pd, cq, qpn) = (q.ctx, q.pd, q.cq, q.qpn);
        let (dest_gid, dest_qpn) = (q.dest_gid, q.dest_qpn);
        let batch = usize::from(q.max_rd_atomic).min(q.sq.len());
        let Some(Obj::Ctx(c)) = self.objs.get(&ctx) else {
            return;
        };
        let (name, gid, max_msg) = (c.name.clone(), c.gid, c.profile.max_msg_sz);
        if self.devices.get(&name).is_some_and(|d| d.stalled) {
            return;
        }
        let (port_up, _) = self.device(&name);
        let local = if port_up {
            self.responder(dest_gid, dest_qpn, gid, qpn)
        } else {
            None
        };
        // The responder sees the whole batch in flight at once.
        let (src, depth) = match local.and_then(|r| self.objs.get(&r)) {
            Some(Obj::Qp(r)) => (
                Src::Local {
                    ctx: r.ctx,
                    pd: r.pd,
                    access: r.access,
                },
                usize::from(r.max_dest_rd_atomic),
            ),
            _ if port_up => self.remote_responder(dest_gid, dest_qpn, gid, qpn),
            _ => (Src::None, 0),
        };
        for i in 0..batch {
            let Some(Obj::Qp(q)) = self.objs.get_mut(&id) else {
                return;
            };
            let Some(wr) = q.sq.pop_front() else {
                return;
            };
            *self.reads.entry(name.clone()).or_default() += 1;
            let status = self.execute(&name, (ctx, pd), &src, i >= depth, max_msg, &wr);
            let len: u64 = wr.sges.iter().map(|s| u64::from(s.len)).sum();
            self.push_cqe(
                cq,
                Wc {
                    wr_id: wr.wr_id,
                    status,
                    qp_num: qpn,
                    byte_len: if status == wc::SUCCESS { len as u32 } else { 0 },
                },
            );
            if status != wc::SUCCESS {
                self.fail_qp(id);
                return;
            }
        }
    }

    /// Executes one read; the completion status.
    fn execute(
        &mut self,
        name: &str,
        (ctx, pd): (usize, usize),
        src: &Src,
        over_depth: bool,
        max_msg: u64,
        wr: &ReadWr,
    ) -> u32 {
        if let Some(d) = self.devices.get_mut(name) {
            let mut hit = None;
            for (i, (left, status)) in d.errors.iter_mut().enumerate() {
                if *left == 0 {
                    hit = Some((i, *status));
                    break;
                }
                *left -= 1;
            }
            if let Some((i, status)) = hit {
                d.errors.remove(i);
                return status;
            }
        }
        let r_access = match src {
            Src::None => return wc::RETRY_EXC_ERR,
            Src::Local { access, .. } | Src::Remote { access, .. } => *access,
        };
        if over_depth {
            return wc::REM_INV_REQ_ERR;
        }
        let len: u64 = wr.sges.iter().map(|s| u64::from(s.len)).sum();
        if len > max_msg {
            return wc::LOC_LEN_ERR;
        }
        if r_access & ACCESS_REMOTE_READ == 0 {
            return wc::REM_ACCESS_ERR;
        }
        let (addr, rkey) = (wr.remote_addr, wr.rkey);
        let found = match src {
            Src::None => None,
            Src::Local { ctx, pd, .. } => self
                .mr_covering(*ctx, *pd, rkey, addr, len)
                .filter(|m| m.access & ACCESS_REMOTE_READ != 0)
                .map(|m| m.host + (addr - m.addr)),
            Src::Remote { pid, pd, mrs, .. } => mrs
                .iter()
                .find(|m| {
                    m.key == rkey
                        && m.pd == *pd
                        && m.access & ACCESS_REMOTE_READ != 0
                        && addr >= m.addr
                        && addr
                            .checked_add(len)
                            .is_some_and(|e| e <= m.addr.saturating_add(m.len))
                })
                .and_then(|m| {
                    let e = m.export;
                    self.maps
                        .get(*pid, &e)
                        .and_then(|map| map.at(e.offset + (addr - m.addr), len))
                }),
        };
        let Some(src) = found else {
            return wc::REM_ACCESS_ERR;
        };
        let mut dsts = Vec::with_capacity(wr.sges.len());
        for s in &wr.sges {
            match self
                .mr_covering(ctx, pd, s.lkey, s.addr, u64::from(s.len))
                .filter(|m| m.access & ACCESS_LOCAL_WRITE != 0)
            {
                Some(m) => dsts.push((m.host + (s.addr - m.addr), s.len as usize)),
                None => return wc::LOC_PROT_ERR,
            }
        }
        let mut at = src;
        for (dst, n) in dsts {
            // SAFETY: both ranges lie inside live MRs (checked above, under the fabric lock),
            // whose memory the registrants keep mapped until they deregister; source and
            // destination may alias only if a test reads a region into itself, which
            // `copy` (memmove) allows.
            unsafe { std::ptr::copy(at as *const u8, dst as *mut u8, n) };
            at += n as u64;
        }
        wc::SUCCESS
    }
}
