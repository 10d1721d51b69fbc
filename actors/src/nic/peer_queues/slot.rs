//! One QP's queue: the batches posted on it (answered in post order) and the posts held back.

use std::collections::VecDeque;

use kvferry_transport::{Qp, QpKey, QueueFault, ReadRequest, WorkCompletion};

use super::{CompletionErrorCounts, Event, WorkerError};

pub(super) struct Batch<B> {
    /// The QP-local id of the first read; the batch's reads carry `first..first + ids.len()`.
    pub(super) first: u64,
    /// The callers' ids, restored on the completions.
    pub(super) ids: Vec<u64>,
    pub(super) done: Vec<WorkCompletion>,
    pub(super) reply: B,
}

pub(super) struct Waiting<B> {
    pub(super) reads: Vec<ReadRequest>,
    pub(super) reply: B,
}

pub(super) struct Slot<B> {
    /// `None` while a connect job holds it.
    pub(super) qp: Option<Qp>,
    /// Batches posted on this QP, in post order (reports come back in the same order).
    pub(super) batches: VecDeque<Batch<B>>,
    /// Posts held back: QP not ready, or no room in the completion queue.
    pub(super) waiting: VecDeque<Waiting<B>>,
    /// The cause of the current error state (callers' ids), for the drained batches' replies.
    pub(super) fault: Option<QueueFault>,
    /// The next QP-local `wr_id`; never reused, so no two pending reads share one.
    pub(super) next_wr: u64,
    /// What this QP counts against the completion queue now.
    pub(super) charge: usize,
    /// In the stalled list (its head batch waits for room in the completion queue).
    pub(super) stalled: bool,
}

impl<B> Slot<B> {
    pub(super) fn new() -> Self {
        Slot {
            qp: None,
            batches: VecDeque::new(),
            waiting: VecDeque::new(),
            fault: None,
            next_wr: 1,
            charge: 0,
            stalled: false,
        }
    }
}

/// Hands in-order reports to the batches they belong to (restoring the callers' ids);
/// answers finished batches.
pub(super) fn deliver<B, C>(
    qp: QpKey,
    batches: &mut VecDeque<Batch<B>>,
    fault: Option<QueueFault>,
    reports: &[WorkCompletion],
    errors: &mut CompletionErrorCounts,
    stray: &mut u64,
    events: &mut VecDeque<Event<B, C>>,
) {
    for wc in reports {
        errors.count(wc.status);
        let Some(front) = batches.front_mut() else {
            *stray += 1;
            continue;
        };
        let mut wc = *wc;
        wc.wr_id = front.ids.get(front.done.len()).copied().unwrap_or(wc.wr_id);
        front.done.push(wc);
        if front.done.len() < front.ids.len() {
            continue;
        }
        let Some(b) = batches.pop_front() else {
            continue;
        };
        let result = match b.done.iter().find(|c| !c.status.is_success()) {
            None => Ok(b.done),
            Some(first) => Err(WorkerError::ReadFailed {
                qp,
                wr_id: first.wr_id,
                status: first.status,
                fault,
                completions: b.done.clone(),
            }),
        };
        events.push_back(Event::Batch {
            reply: b.reply,
            result,
        });
    }
}
