//! Who answers a read: the responder QP a requester QP is connected to, in this process or
//! in another one through the fabric, and where the bytes then come from.

use super::fabric;
use super::state::{Obj, State};
use crate::verbs::gid::Gid;
use crate::verbs::qp_attrs::VerbsQpState;

/// Where a read's bytes come from.
pub(super) enum Src {
    /// No responder answers (gone, unconnected, port down).
    None,
    Local {
        ctx: usize,
        pd: usize,
        access: u32,
    },
    Remote {
        pid: u32,
        pd: usize,
        access: u32,
        mrs: Vec<fabric::RemoteMr>,
    },
}

impl State {
    /// A responder in another process, through the fabric.
    pub(super) fn remote_responder(
        &self,
        gid: Gid,
        qpn: u32,
        from_gid: Gid,
        from_qpn: u32,
    ) -> (Src, usize) {
        let Some(p) = fabric::lookup(&gid) else {
            return (Src::None, 0);
        };
        if !p.up {
            return (Src::None, 0);
        }
        let Some(q) = p
            .qps
            .iter()
            .find(|q| q.qpn == qpn && q.ready && q.dest_qpn == from_qpn && q.dest_gid == from_gid)
        else {
            return (Src::None, 0);
        };
        let (pd, access, depth) = (q.pd, q.access, usize::from(q.depth));
        (
            Src::Remote {
                pid: p.pid,
                pd,
                access,
                mrs: p.mrs,
            },
            depth,
        )
    }

    /// The responder QP a requester QP is connected to: same GID, QPN, connected back.
    pub(super) fn responder(
        &self,
        gid: Gid,
        qpn: u32,
        from_gid: Gid,
        from_qpn: u32,
    ) -> Option<usize> {
        self.objs.iter().find_map(|(id, o)| match o {
            Obj::Qp(q) if q.qpn == qpn => {
                let Some(Obj::Ctx(c)) = self.objs.get(&q.ctx) else {
                    return None;
                };
                let (up, vanished) = self.device(&c.name);
                (c.gid == gid
                    && up
                    && !vanished
                    && q.dest_qpn == from_qpn
                    && q.dest_gid == from_gid
                    && matches!(
                        q.state,
                        VerbsQpState::ReadyToReceive | VerbsQpState::ReadyToSend
                    ))
                .then_some(*id)
            }
            _ => None,
        })
    }
}
