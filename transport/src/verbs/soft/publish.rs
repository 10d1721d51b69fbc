//! What other processes see of this one: per GID, its ready QPs and exported MRs, written
//! to the fabric whenever they change.

use super::fabric;
use super::profile::SoftProfile;
use super::state::{gid_of, Ctx, Obj, State};
use crate::verbs::gid::Gid;
use crate::verbs::qp_attrs::VerbsQpState;

impl State {
    /// Republishes every GID of the device `name` (after a port or presence change).
    pub(super) fn publish_name(&self, name: &str) {
        let gids: Vec<Gid> = self
            .objs
            .values()
            .filter_map(|o| match o {
                Obj::Ctx(c) if c.name == name => Some(c.gid),
                _ => None,
            })
            .collect();
        for g in gids {
            self.publish(g);
        }
        if let Some(p) = SoftProfile::for_name(name).map(|_| gid_of(name)) {
            self.publish(p);
        }
    }

    /// Republishes what other processes must check about `gid`: its ready QPs and its
    /// exported MRs (nothing, once no context of it is open).
    pub(super) fn publish(&self, gid: Gid) {
        let ctxs: Vec<(usize, &Ctx)> = self
            .objs
            .iter()
            .filter_map(|(id, o)| match o {
                Obj::Ctx(c) if c.gid == gid => Some((*id, c)),
                _ => None,
            })
            .collect();
        let Some((_, first)) = ctxs.first() else {
            fabric::publish(&gid, None);
            return;
        };
        let (up, vanished) = self.device(&first.name);
        let mine = |ctx: usize| ctxs.iter().any(|(id, _)| *id == ctx);
        let mut p = fabric::Published {
            pid: std::process::id(),
            up: up && !vanished,
            ..fabric::Published::default()
        };
        for o in self.objs.values() {
            match o {
                Obj::Qp(q) if mine(q.ctx) => p.qps.push(fabric::RemoteQp {
                    qpn: q.qpn,
                    ready: matches!(
                        q.state,
                        VerbsQpState::ReadyToReceive | VerbsQpState::ReadyToSend
                    ),
                    access: q.access,
                    dest_qpn: q.dest_qpn,
                    dest_gid: q.dest_gid,
                    depth: q.max_dest_rd_atomic,
                    pd: q.pd,
                }),
                Obj::Mr(m) if mine(m.ctx) => {
                    if let Some(export) = m.export {
                        p.mrs.push(fabric::RemoteMr {
                            key: m.key,
                            pd: m.pd,
                            addr: m.addr,
                            len: m.len,
                            access: m.access,
                            export,
                        });
                    }
                }
                _ => {}
            }
        }
        fabric::publish(&gid, Some(&p));
    }
}
