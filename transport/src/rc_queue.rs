//! The RC queue contract every provider shares, as a plain state machine: no I/O, no clock of
//! its own (`now` is passed in), no knowledge of what a payload is.
//!
//! States: reset → init → ready-to-receive → ready-to-send, and error from anywhere. Requests
//! are accepted in batches (tracking preallocated per batch), issued in order while the send
//! window and the read depth allow, and reported in post order whatever order providers
//! complete them in. On an error every request not yet issued is flushed at once, issued ones
//! stay outstanding until their provider completes them (the drain), and only a fully drained
//! queue may be reset. Payloads (which pin destination memory) are handed back only when their
//! request is reported, so nothing is released before it has drained.

use std::collections::VecDeque;
use std::fmt;
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::completion::CompletionStatus;

/// Queue states, named as for an RC QP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QpState {
    Reset,
    Init,
    ReadyToReceive,
    ReadyToSend,
    Error,
}

impl fmt::Display for QpState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            QpState::Reset => "reset",
            QpState::Init => "init",
            QpState::ReadyToReceive => "ready-to-receive",
            QpState::ReadyToSend => "ready-to-send",
            QpState::Error => "error",
        })
    }
}

/// Bounds of one queue.
///
/// Every request on these queues is a read, so both `max_send_wr` and `max_rd_atomic` bound
/// every issued request and the effective window is the smaller. They stay separate because a
/// verbs QP is created with both and the NIC enforces them independently.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueLimits {
    pub max_send_wr: u32,
    pub max_rd_atomic: u32,
    pub max_sge: u32,
    pub completion_timeout: Duration,
}

impl Default for QueueLimits {
    fn default() -> Self {
        crate::config::NicConfig::default().queue_limits()
    }
}

impl QueueLimits {
    /// Requests that may be issued and not yet completed.
    pub fn window(&self) -> u32 {
        self.max_send_wr.min(self.max_rd_atomic).max(1)
    }
}

/// Why a queue went to error (the first cause only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum QueueFault {
    /// A request completed with an error status.
    Completion {
        wr_id: u64,
        status: CompletionStatus,
    },
    /// The provider refused to post a request.
    PostFailed { wr_id: u64 },
    /// A request stayed outstanding past the completion timeout.
    Timeout { wr_id: u64 },
    /// A post found the connection already gone; that request is flushed.
    ConnectionLost { wr_id: u64 },
    /// The driver moved the queue to error (lost connection noticed elsewhere, shutdown).
    Requested,
}

#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RcQueueError {
    #[error("transition {from} -> {to} is not allowed")]
    InvalidTransition { from: QpState, to: QpState },
    #[error("queue is {state}, requests are accepted only in ready-to-send")]
    NotReady { state: QpState },
    #[error("{outstanding} requests are still outstanding; drain before reset")]
    NotDrained { outstanding: usize },
    #[error("request {wr_id} has {sges} segments, limit is {max_sge}")]
    TooManySegments {
        wr_id: u64,
        sges: usize,
        max_sge: u32,
    },
    #[error("request {wr_id} has no segments or zero length")]
    EmptyRequest { wr_id: u64 },
    #[error("completion for request {wr_id}, which is not in flight")]
    UnknownCompletion { wr_id: u64 },
}

/// One request as submitted.
#[derive(Clone, Debug)]
pub struct Submit<P> {
    pub wr_id: u64,
    pub len: u64,
    pub sges: usize,
    pub payload: P,
}

/// One request reported in order, with its payload handed back for release.
#[derive(Debug)]
pub struct Reported<P> {
    pub wr_id: u64,
    pub status: CompletionStatus,
    pub bytes: u64,
    pub payload: P,
}

/// What feeding a completion did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompletionEffect {
    /// Accepted; the window may have room again.
    Accepted,
    /// Accepted, and it moved the queue to error: the driver must abort the connection so the
    /// requests still in flight complete.
    EnteredError,
}

#[derive(Debug)]
enum SlotState {
    Queued,
    Issued {
        at: Instant,
    },
    Done {
        status: CompletionStatus,
        bytes: u64,
    },
}

#[derive(Debug)]
struct Slot<P> {
    wr_id: u64,
    state: SlotState,
    timed_out: bool,
    /// Posted after the request that moved the queue to error: reported as flushed whatever
    /// the provider says, as an RC QP would (it stops executing at the failed request).
    flush: bool,
    payload: P,
}

/// The queue itself. `P` is whatever the driver needs per request (the provider-facing work
/// request); it is cloned once when issued and returned when reported.
#[derive(Debug)]
pub struct RcQueue<P> {
    limits: QueueLimits,
    state: QpState,
    fault: Option<QueueFault>,
    slots: VecDeque<Slot<P>>,
    /// Index of the first slot not yet issued; slots before it are issued or done.
    next_issue: usize,
    in_flight: u32,
    max_in_flight_seen: u32,
}

impl<P: Clone> RcQueue<P> {
    pub fn new(limits: QueueLimits) -> Self {
        RcQueue {
            limits,
            state: QpState::Reset,
            fault: None,
            slots: VecDeque::new(),
            next_issue: 0,
            in_flight: 0,
            max_in_flight_seen: 0,
        }
    }

    pub fn limits(&self) -> QueueLimits {
        self.limits
    }

    pub fn state(&self) -> QpState {
        self.state
    }

    pub fn fault(&self) -> Option<QueueFault> {
        self.fault
    }

    /// Requests accepted and not yet reported.
    pub fn outstanding(&self) -> usize {
        self.slots.len()
    }

    /// Requests issued to the provider and not yet completed.
    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// Highest `in_flight` ever observed (tests check it never passed the window).
    pub fn max_in_flight_seen(&self) -> u32 {
        self.max_in_flight_seen
    }

    /// True when nothing is outstanding: the queue may be reset and payloads were all released.
    pub fn is_drained(&self) -> bool {
        self.slots.is_empty()
    }

    /// Applies a state transition. `Error` is also reachable through completions and timeouts;
    /// `Reset` requires the queue to be drained.
    pub fn modify(&mut self, to: QpState) -> Result<(), RcQueueError> {
        use QpState::*;
        let from = self.state;
        match (from, to) {
            (Reset, Init) | (Init, ReadyToReceive) | (ReadyToReceive, ReadyToSend) => {
                self.state = to;
                Ok(())
            }
            (_, Error) => {
                self.enter_error(QueueFault::Requested);
                Ok(())
            }
            (_, Reset) => {
                if !self.slots.is_empty() {
                    return Err(RcQueueError::NotDrained {
                        outstanding: self.slots.len(),
                    });
                }
                self.state = Reset;
                self.fault = None;
                self.next_issue = 0;
                self.in_flight = 0;
                Ok(())
            }
            _ => Err(RcQueueError::InvalidTransition { from, to }),
        }
    }

    /// Accepts a batch atomically: either every request is queued or none is.
    pub fn submit(&mut self, batch: Vec<Submit<P>>) -> Result<(), RcQueueError> {
        if self.state != QpState::ReadyToSend {
            return Err(RcQueueError::NotReady { state: self.state });
        }
        for s in &batch {
            if s.sges == 0 || s.len == 0 {
                return Err(RcQueueError::EmptyRequest { wr_id: s.wr_id });
            }
            if s.sges > self.limits.max_sge as usize {
                return Err(RcQueueError::TooManySegments {
                    wr_id: s.wr_id,
                    sges: s.sges,
                    max_sge: self.limits.max_sge,
                });
            }
        }
        self.slots.reserve(batch.len());
        for s in batch {
            self.slots.push_back(Slot {
                wr_id: s.wr_id,
                state: SlotState::Queued,
                timed_out: false,
                flush: false,
                payload: s.payload,
            });
        }
        Ok(())
    }

    /// Issues the next queued request if the state and window allow; the driver hands the
    /// returned payload to its provider.
    pub fn next_to_issue(&mut self, now: Instant) -> Option<(u64, P)> {
        if self.state != QpState::ReadyToSend || self.in_flight >= self.limits.window() {
            return None;
        }
        let slot = self.slots.get_mut(self.next_issue)?;
        slot.state = SlotState::Issued { at: now };
        self.next_issue += 1;
        self.in_flight += 1;
        self.max_in_flight_seen = self.max_in_flight_seen.max(self.in_flight);
        Some((slot.wr_id, slot.payload.clone()))
    }

    /// The provider refused the request just issued: it completes as `PostFailed` and the queue
    /// goes to error.
    pub fn handle_post_failure(&mut self, wr_id: u64) -> Result<(), RcQueueError> {
        let index = self.complete(wr_id, CompletionStatus::PostFailed, 0)?;
        self.enter_error(QueueFault::PostFailed { wr_id });
        self.flush_after(index);
        Ok(())
    }

    /// The provider refused the request just issued because its connection is gone: the
    /// request never ran, so it is flushed, and the queue goes to error.
    pub fn handle_connection_lost(&mut self, wr_id: u64) -> Result<(), RcQueueError> {
        let index = self.complete(wr_id, CompletionStatus::Flushed, 0)?;
        self.enter_error(QueueFault::ConnectionLost { wr_id });
        self.flush_after(index);
        Ok(())
    }

    /// Feeds one provider completion.
    pub fn handle_completion(
        &mut self,
        wr_id: u64,
        status: CompletionStatus,
        bytes: u64,
    ) -> Result<CompletionEffect, RcQueueError> {
        let index = self.complete(wr_id, status, bytes)?;
        if !status.is_success() && self.state != QpState::Error {
            self.enter_error(QueueFault::Completion { wr_id, status });
            self.flush_after(index);
            return Ok(CompletionEffect::EnteredError);
        }
        Ok(CompletionEffect::Accepted)
    }

    /// Marks an issued request done; returns its index.
    fn complete(
        &mut self,
        wr_id: u64,
        status: CompletionStatus,
        bytes: u64,
    ) -> Result<usize, RcQueueError> {
        // In flight is at most the window, so this scan is short.
        let index = self
            .slots
            .iter()
            .take(self.next_issue)
            .position(|s| s.wr_id == wr_id && matches!(s.state, SlotState::Issued { .. }))
            .ok_or(RcQueueError::UnknownCompletion { wr_id })?;
        let slot = &mut self.slots[index];
        let status = if slot.timed_out {
            CompletionStatus::TimedOut
        } else if slot.flush {
            CompletionStatus::Flushed
        } else {
            status
        };
        let bytes = if status.is_success() { bytes } else { 0 };
        slot.state = SlotState::Done { status, bytes };
        self.in_flight -= 1;
        Ok(index)
    }

    /// Everything after `index` reports as flushed.
    fn flush_after(&mut self, index: usize) {
        for s in self.slots.iter_mut().skip(index + 1) {
            s.flush = true;
            if let SlotState::Done { .. } = s.state {
                s.state = SlotState::Done {
                    status: CompletionStatus::Flushed,
                    bytes: 0,
                };
            }
        }
    }

    /// Moves the queue to error if the oldest issued request has been outstanding longer than
    /// the completion timeout. Returns the fault when it did (the driver aborts the connection).
    pub fn poll_timeout(&mut self, now: Instant) -> Option<QueueFault> {
        if self.state == QpState::Error {
            return None;
        }
        let timeout = self.limits.completion_timeout;
        let index = self.slots.iter().take(self.next_issue).position(|s| {
            matches!(s.state, SlotState::Issued { at } if now.saturating_duration_since(at) >= timeout)
        })?;
        let slot = &mut self.slots[index];
        slot.timed_out = true;
        let fault = QueueFault::Timeout { wr_id: slot.wr_id };
        self.enter_error(fault);
        self.flush_after(index);
        Some(fault)
    }

    /// When the oldest issued request will time out (for the driver's timer).
    pub fn next_deadline(&self) -> Option<Instant> {
        self.slots
            .iter()
            .take(self.next_issue)
            .find_map(|s| match s.state {
                SlotState::Issued { at } => Some(at + self.limits.completion_timeout),
                _ => None,
            })
    }

    fn enter_error(&mut self, fault: QueueFault) {
        self.state = QpState::Error;
        if self.fault.is_none() {
            self.fault = Some(fault);
        }
        // Never issued, so nothing can still land for them: flush at once.
        for s in self.slots.iter_mut().skip(self.next_issue) {
            s.state = SlotState::Done {
                status: CompletionStatus::Flushed,
                bytes: 0,
            };
        }
        self.next_issue = self.slots.len();
    }

    /// Pops the oldest request if it is done (in post order).
    pub fn poll_reported(&mut self) -> Option<Reported<P>> {
        let head = self.slots.front()?;
        let SlotState::Done { status, bytes } = head.state else {
            return None;
        };
        let slot = self.slots.pop_front()?;
        self.next_issue -= 1;
        Some(Reported {
            wr_id: slot.wr_id,
            status,
            bytes,
            payload: slot.payload,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(send: u32, rd: u32) -> QueueLimits {
        QueueLimits {
            max_send_wr: send,
            max_rd_atomic: rd,
            max_sge: 4,
            completion_timeout: Duration::from_millis(100),
        }
    }

    fn ready(l: QueueLimits) -> RcQueue<u64> {
        let mut q = RcQueue::new(l);
        q.modify(QpState::Init).unwrap();
        q.modify(QpState::ReadyToReceive).unwrap();
        q.modify(QpState::ReadyToSend).unwrap();
        q
    }

    fn batch(ids: std::ops::Range<u64>) -> Vec<Submit<u64>> {
        ids.map(|i| Submit {
            wr_id: i,
            len: 10,
            sges: 1,
            payload: i,
        })
        .collect()
    }

    #[test]
    fn transitions() {
        let mut q: RcQueue<u64> = RcQueue::new(limits(4, 4));
        assert!(matches!(
            q.modify(QpState::ReadyToSend),
            Err(RcQueueError::InvalidTransition { .. })
        ));
        assert!(matches!(
            q.submit(batch(0..1)),
            Err(RcQueueError::NotReady { .. })
        ));
        let mut q = ready(limits(4, 4));
        q.modify(QpState::Error).unwrap();
        assert_eq!(q.fault(), Some(QueueFault::Requested));
        q.modify(QpState::Reset).unwrap();
        assert_eq!(q.fault(), None);
    }

    #[test]
    fn window_and_in_order_reporting() {
        let t0 = Instant::now();
        let mut q = ready(limits(8, 3));
        q.submit(batch(0..10)).unwrap();
        let issued: Vec<u64> = std::iter::from_fn(|| q.next_to_issue(t0).map(|x| x.0)).collect();
        assert_eq!(issued, vec![0, 1, 2]);
        // Out-of-order completion: 2 then 0; only 0 is reportable, then 1 blocks.
        q.handle_completion(2, CompletionStatus::Success, 10)
            .unwrap();
        assert!(q.poll_reported().is_none());
        q.handle_completion(0, CompletionStatus::Success, 10)
            .unwrap();
        assert_eq!(q.poll_reported().unwrap().wr_id, 0);
        assert!(q.poll_reported().is_none());
        // Two slots free now.
        assert_eq!(q.next_to_issue(t0).unwrap().0, 3);
        assert_eq!(q.next_to_issue(t0).unwrap().0, 4);
        assert!(q.next_to_issue(t0).is_none());
        let mut order = Vec::new();
        for id in [1, 4, 3] {
            q.handle_completion(id, CompletionStatus::Success, 10)
                .unwrap();
        }
        while let Some(r) = q.poll_reported() {
            order.push(r.wr_id);
        }
        assert_eq!(order, vec![1, 2, 3, 4]);
        let mut done = 5;
        while done < 10 {
            while let Some((id, _)) = q.next_to_issue(t0) {
                q.handle_completion(id, CompletionStatus::Success, 10)
                    .unwrap();
            }
            while let Some(r) = q.poll_reported() {
                assert_eq!(r.wr_id, done);
                done += 1;
            }
        }
        assert!(q.is_drained());
        assert_eq!(q.max_in_flight_seen(), 3);
    }

    #[test]
    fn error_flushes_queued_and_waits_for_issued() {
        let t0 = Instant::now();
        let mut q = ready(limits(4, 4));
        q.submit(batch(0..8)).unwrap();
        while q.next_to_issue(t0).is_some() {}
        q.handle_completion(2, CompletionStatus::Success, 10)
            .unwrap();
        q.handle_completion(2, CompletionStatus::Success, 10)
            .unwrap_err();
        assert_eq!(
            q.handle_completion(1, CompletionStatus::RemoteAccessError, 0)
                .unwrap(),
            CompletionEffect::EnteredError
        );
        assert_eq!(q.state(), QpState::Error);
        assert!(q.next_to_issue(t0).is_none());
        assert!(matches!(
            q.modify(QpState::Reset),
            Err(RcQueueError::NotDrained { outstanding: 8 })
        ));
        // Nothing reported until the head completes: payloads stay held.
        assert!(q.poll_reported().is_none());
        q.handle_completion(0, CompletionStatus::Success, 10)
            .unwrap();
        // Executed by the provider, but after the failed request: reported flushed (as 2 was).
        q.handle_completion(3, CompletionStatus::Success, 10)
            .unwrap();
        let got: Vec<_> =
            std::iter::from_fn(|| q.poll_reported().map(|r| (r.wr_id, r.status))).collect();
        use CompletionStatus::*;
        assert_eq!(
            got,
            vec![
                (0, Success),
                (1, RemoteAccessError),
                (2, Flushed),
                (3, Flushed),
                (4, Flushed),
                (5, Flushed),
                (6, Flushed),
                (7, Flushed)
            ]
        );
        q.modify(QpState::Reset).unwrap();
        assert!(matches!(
            q.handle_completion(9, Success, 1),
            Err(RcQueueError::UnknownCompletion { wr_id: 9 })
        ));
    }

    #[test]
    fn timeout_on_simulated_clock() {
        let t0 = Instant::now();
        let mut q = ready(limits(2, 2));
        q.submit(batch(0..3)).unwrap();
        q.next_to_issue(t0).unwrap();
        q.next_to_issue(t0 + Duration::from_millis(50)).unwrap();
        assert_eq!(q.next_deadline(), Some(t0 + Duration::from_millis(100)));
        assert_eq!(q.poll_timeout(t0 + Duration::from_millis(99)), None);
        assert_eq!(
            q.poll_timeout(t0 + Duration::from_millis(100)),
            Some(QueueFault::Timeout { wr_id: 0 })
        );
        // The late completion still has to arrive; it is reported as timed out.
        q.handle_completion(0, CompletionStatus::Success, 10)
            .unwrap();
        q.handle_completion(1, CompletionStatus::Flushed, 0)
            .unwrap();
        let got: Vec<_> = std::iter::from_fn(|| q.poll_reported().map(|r| r.status)).collect();
        use CompletionStatus::*;
        assert_eq!(got, vec![TimedOut, Flushed, Flushed]);
    }

    #[test]
    fn post_failure_and_batch_checks() {
        let t0 = Instant::now();
        let mut q = ready(limits(4, 4));
        let mut b = batch(0..2);
        b[1].sges = 5;
        assert!(matches!(
            q.submit(b),
            Err(RcQueueError::TooManySegments { wr_id: 1, .. })
        ));
        assert_eq!(q.outstanding(), 0);
        q.submit(batch(0..2)).unwrap();
        let (id, _) = q.next_to_issue(t0).unwrap();
        q.handle_post_failure(id).unwrap();
        assert_eq!(q.fault(), Some(QueueFault::PostFailed { wr_id: 0 }));
        let got: Vec<_> = std::iter::from_fn(|| q.poll_reported().map(|r| r.status)).collect();
        assert_eq!(
            got,
            vec![CompletionStatus::PostFailed, CompletionStatus::Flushed]
        );
    }
}
