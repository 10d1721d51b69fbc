//! The device's objects (contexts, PDs, CQs, QPs, MRs) in one table under the device lock,
//! the per-name device state faults act on, and the GID each device name has.

use std::collections::{HashMap, VecDeque};
use std::io;

use super::cq::Cq;
use super::einval;
use super::fabric;
use super::mr::Mr;
use super::profile::SoftProfile;
use super::qp::Qp;
use crate::verbs::gid::Gid;
use crate::verbs::ops::{AsyncEvent, Handle};

pub(super) struct Ctx {
    pub(super) name: String,
    pub(super) profile: SoftProfile,
    pub(super) gid: Gid,
    pub(super) events: VecDeque<AsyncEvent>,
}

pub(super) enum Obj {
    Ctx(Ctx),
    Pd { ctx: usize },
    Cq(Cq),
    Qp(Box<Qp>),
    Mr(Mr),
}

#[derive(Default)]
pub(super) struct Device {
    pub(super) port_up: bool,
    pub(super) vanished: bool,
    pub(super) stalled: bool,
    /// (countdown, status) of injected completion errors.
    pub(super) errors: Vec<(u64, u32)>,
}

#[derive(Default)]
pub(super) struct State {
    pub(super) objs: HashMap<usize, Obj>,
    pub(super) next: usize,
    pub(super) next_qpn: u32,
    pub(super) next_key: u32,
    pub(super) devices: HashMap<String, Device>,
    /// Reads executed, by device name (tests read it through [`SoftOps::reads`]).
    pub(super) reads: HashMap<String, u64>,
    /// Other processes' memory mapped here.
    pub(super) maps: fabric::Maps,
}

/// The GID a device name has on this host: fixed per (process, name), never link-local.
pub(super) fn gid_of(name: &str) -> Gid {
    let mut g = [0u8; 16];
    g[0] = 0xfd;
    g[1] = 0x6b;
    g[2..6].copy_from_slice(&std::process::id().to_be_bytes());
    // FNV-1a of the name: distinct devices get distinct GIDs.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    g[6..14].copy_from_slice(&h.to_be_bytes());
    g[15] = 1;
    Gid(g)
}

impl State {
    pub(super) fn gid_of_ctx(&self, ctx: usize) -> Option<Gid> {
        match self.objs.get(&ctx) {
            Some(Obj::Ctx(c)) => Some(c.gid),
            _ => None,
        }
    }

    pub(super) fn insert(&mut self, o: Obj) -> Handle {
        self.next += 1;
        self.objs.insert(self.next, o);
        Handle(self.next)
    }

    pub(super) fn ctx(&self, h: Handle) -> io::Result<&Ctx> {
        match self.objs.get(&h.0) {
            Some(Obj::Ctx(c)) => Ok(c),
            _ => Err(einval("not a device context")),
        }
    }

    pub(super) fn ctx_mut(&mut self, id: usize) -> Option<&mut Ctx> {
        match self.objs.get_mut(&id) {
            Some(Obj::Ctx(c)) => Some(c),
            _ => None,
        }
    }

    pub(super) fn ctx_of_pd(&self, pd: Handle) -> io::Result<usize> {
        match self.objs.get(&pd.0) {
            Some(Obj::Pd { ctx }) => Ok(*ctx),
            _ => Err(einval("not a protection domain")),
        }
    }

    pub(super) fn qp_mut(&mut self, h: Handle) -> io::Result<&mut Qp> {
        match self.objs.get_mut(&h.0) {
            Some(Obj::Qp(q)) => Ok(q),
            _ => Err(einval("not a queue pair")),
        }
    }

    pub(super) fn device(&self, name: &str) -> (bool, bool) {
        self.devices
            .get(name)
            .map_or((true, false), |d| (d.port_up, d.vanished))
    }

    pub(super) fn port_event(&mut self, name: &str, up: bool) {
        let ctxs: Vec<usize> = self
            .objs
            .iter()
            .filter_map(|(id, o)| match o {
                Obj::Ctx(c) if c.name == name => Some(*id),
                _ => None,
            })
            .collect();
        for id in &ctxs {
            if let Some(c) = self.ctx_mut(*id) {
                c.events.push_back(if up {
                    AsyncEvent::PortActive { port: 1 }
                } else {
                    AsyncEvent::PortError { port: 1 }
                });
            }
        }
        if !up {
            // A port that goes down takes its connected QPs to error (their sends flush).
            let qps: Vec<usize> = self
                .objs
                .iter()
                .filter_map(|(id, o)| match o {
                    Obj::Qp(q) if ctxs.contains(&q.ctx) => Some(*id),
                    _ => None,
                })
                .collect();
            for q in qps {
                self.fail_qp(q);
            }
        }
    }
}
