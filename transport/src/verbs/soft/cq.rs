//! Completion queues: their depth (a completion that finds one full overruns it, and it
//! fails from then on) and polling, which is when the device makes progress.

use std::collections::VecDeque;
use std::io;

use super::einval;
use super::errno;
use super::state::{Obj, State};
use crate::verbs::ops::{AsyncEvent, Handle, Wc};
use crate::verbs::qp_attrs::VerbsQpState;

pub(super) struct Cq {
    pub(super) ctx: usize,
    pub(super) cap: usize,
    pub(super) entries: VecDeque<Wc>,
    pub(super) overrun: bool,
}

impl State {
    pub(super) fn create_cq(&mut self, ctx: Handle, cqe: u32) -> io::Result<Handle> {
        let max = self.ctx(ctx)?.profile.attr.max_cqe;
        if cqe == 0 || cqe > max {
            return Err(einval(&format!(
                "ibv_create_cq: {cqe} entries, the device takes 1..={max}"
            )));
        }
        Ok(self.insert(Obj::Cq(Cq {
            ctx: ctx.0,
            cap: cqe as usize,
            entries: VecDeque::new(),
            overrun: false,
        })))
    }

    pub(super) fn destroy_cq(&mut self, cq: Handle) -> io::Result<()> {
        if !matches!(self.objs.get(&cq.0), Some(Obj::Cq(_))) {
            return Err(einval("not a completion queue"));
        }
        if self
            .objs
            .values()
            .any(|o| matches!(o, Obj::Qp(q) if q.cq == cq.0))
        {
            return Err(errno(libc::EBUSY, "ibv_destroy_cq: QPs still use it"));
        }
        self.objs.remove(&cq.0);
        Ok(())
    }

    pub(super) fn poll_cq(&mut self, cq: Handle, out: &mut [Wc]) -> io::Result<usize> {
        match self.objs.get(&cq.0) {
            Some(Obj::Cq(c)) if c.overrun => {
                return Err(io::Error::other("ibv_poll_cq: the CQ overran"));
            }
            Some(Obj::Cq(_)) => {}
            _ => return Err(einval("not a completion queue")),
        }
        self.progress(cq.0);
        let Some(Obj::Cq(c)) = self.objs.get_mut(&cq.0) else {
            return Err(einval("not a completion queue"));
        };
        if c.overrun {
            return Err(io::Error::other("ibv_poll_cq: the CQ overran"));
        }
        let mut n = 0;
        while n < out.len() {
            let Some(e) = c.entries.pop_front() else {
                break;
            };
            out[n] = e;
            n += 1;
        }
        Ok(n)
    }

    /// Delivers a completion; a full CQ overruns: it fails from now on, its QPs go to error
    /// (without completions: there is nowhere to put them) and the context hears `CqError`.
    pub(super) fn push_cqe(&mut self, cq: usize, e: Wc) {
        let Some(Obj::Cq(c)) = self.objs.get_mut(&cq) else {
            return;
        };
        if c.overrun {
            return;
        }
        if c.entries.len() < c.cap {
            c.entries.push_back(e);
            return;
        }
        c.overrun = true;
        let ctx = c.ctx;
        tracing::warn!(cq, cap = c.cap, "soft verbs: completion queue overrun");
        if let Some(x) = self.ctx_mut(ctx) {
            x.events.push_back(AsyncEvent::CqError);
        }
        for o in self.objs.values_mut() {
            if let Obj::Qp(q) = o {
                if q.cq == cq {
                    q.state = VerbsQpState::Error;
                    q.sq.clear();
                }
            }
        }
    }
}
