//! The completion poller: one thread per NIC that polls its CQs, hands each completion to
//! the QP it belongs to, and reads the device's asynchronous events (a CQ overrun fails that
//! CQ's requests and gives new QPs a fresh CQ).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::send_queue::ConnShared;
use super::{lock, NicInner};
use crate::completion::CompletionStatus;
use crate::verbs::ops::{AsyncEvent, Handle, Wc};
use crate::verbs::work::completion_status;

const POLL_BATCH: usize = 32;
const IDLE_SLEEP: Duration = Duration::from_micros(50);

pub(super) fn poll_loop(inner: &NicInner) {
    let mut wcs = vec![Wc::default(); POLL_BATCH];
    while !inner.stop.load(Ordering::Relaxed) {
        let mut got = 0;
        for cq in inner.device.cqs() {
            match inner.device.poll(cq, &mut wcs) {
                Ok(n) => {
                    got += n;
                    for wc in &wcs[..n] {
                        let conn = lock(&inner.conns).get(&wc.qp_num).cloned();
                        if let Some(c) = conn {
                            c.part_done(wc.wr_id, completion_status(wc.status), true);
                            c.pump();
                        }
                    }
                }
                Err(e) => cq_failed(inner, cq, &e.to_string()),
            }
        }
        while let Ok(Some(ev)) = inner.device.async_event() {
            inner.async_events.fetch_add(1, Ordering::Relaxed);
            got += 1;
            match ev {
                AsyncEvent::CqError => {
                    tracing::warn!(nic = %inner.device.name(), "verbs: CQ error event");
                    for cq in inner.device.cqs() {
                        // The failed CQ answers its next poll with an error; find it.
                        if inner.device.poll(cq, &mut []).is_err() {
                            cq_failed(inner, cq, "CQ error event");
                        }
                    }
                }
                AsyncEvent::PortError { port } => {
                    tracing::warn!(nic = %inner.device.name(), port, "verbs: port down")
                }
                AsyncEvent::PortActive { port } => {
                    tracing::info!(nic = %inner.device.name(), port, "verbs: port active")
                }
                other => {
                    tracing::warn!(nic = %inner.device.name(), event = other.as_str(), "verbs: async event")
                }
            }
        }
        if got == 0 {
            std::thread::sleep(IDLE_SLEEP);
        }
    }
}

/// A CQ overran: every request of its QPs fails (transport error, the worker rebuilds the
/// QPs) and new QPs get a fresh CQ.
fn cq_failed(inner: &NicInner, cq: Handle, why: &str) {
    let victims: Vec<Arc<ConnShared>> = lock(&inner.conns)
        .values()
        .filter(|c| c.cq == cq && !lock(&c.sq).broken)
        .cloned()
        .collect();
    if victims.is_empty() && !inner.device.cqs().last().is_some_and(|c| *c == cq) {
        return;
    }
    if inner.device.cq() == cq {
        inner.cq_overruns.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            nic = %inner.device.name(),
            qps = victims.len(),
            reason = why,
            "verbs: completion queue failed; its QPs are rebuilt on a fresh CQ"
        );
        if let Err(e) = inner.device.replace_cq(cq) {
            tracing::warn!(nic = %inner.device.name(), error = %e, "verbs: replacing the CQ failed");
        }
    }
    for c in victims {
        c.fail_all(CompletionStatus::TransportError);
    }
}
