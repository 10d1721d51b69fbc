//! A queue pair: the RC queue state machine plus a provider connection. This is the plain
//! object a NIC worker drives; it does no waiting of its own.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use thiserror::Error;

use crate::completion::{CompletionSink, WorkCompletion};
use crate::connection::{Connection, ConnectionError, Connector, WorkRequest};
use crate::descriptor::ReadRequest;
use crate::mr_table::{MrError, MrTable};
use crate::qp_key::QpKey;
use crate::rc_queue::{
    CompletionEffect, QpState, QueueFault, QueueLimits, RcQueue, RcQueueError, Submit,
};
use crate::scatter::Scatter;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum QpError {
    #[error("qp {qp}: {source}")]
    Queue {
        qp: QpKey,
        #[source]
        source: RcQueueError,
    },
    #[error("qp {qp}: destination of request {wr_id} refused")]
    LocalSegment {
        qp: QpKey,
        wr_id: u64,
        #[source]
        source: MrError,
    },
    #[error("qp {qp}: request {wr_id} reads {remote_len} bytes into segments of {local_len}")]
    LengthMismatch {
        qp: QpKey,
        wr_id: u64,
        remote_len: u64,
        local_len: u64,
    },
    #[error("qp {qp}: connecting failed")]
    Connect {
        qp: QpKey,
        #[source]
        source: ConnectionError,
    },
    #[error("qp {qp}: posting request {wr_id} failed")]
    Post {
        qp: QpKey,
        wr_id: u64,
        #[source]
        source: ConnectionError,
    },
    #[error("qp {qp} has no connection in state {state}")]
    NotConnected { qp: QpKey, state: QpState },
}

/// Process-wide (or per-NIC) QP counters; every one returns to zero once QPs are idle and
/// dropped.
#[derive(Debug, Default)]
pub struct QpGauges {
    qps: AtomicUsize,
    outstanding: AtomicUsize,
    in_flight: AtomicUsize,
    in_error: AtomicUsize,
}

/// A snapshot of [`QpGauges`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QpGaugeValues {
    /// QP objects alive.
    pub qps: usize,
    /// Requests accepted and not yet reported.
    pub outstanding: usize,
    /// Requests on the wire.
    pub in_flight: usize,
    /// QPs in the error state.
    pub in_error: usize,
}

impl QpGauges {
    pub fn snapshot(&self) -> QpGaugeValues {
        QpGaugeValues {
            qps: self.qps.load(Ordering::Relaxed),
            outstanding: self.outstanding.load(Ordering::Relaxed),
            in_flight: self.in_flight.load(Ordering::Relaxed),
            in_error: self.in_error.load(Ordering::Relaxed),
        }
    }
}

fn adjust(g: &AtomicUsize, old: usize, new: usize) {
    if new > old {
        g.fetch_add(new - old, Ordering::Relaxed);
    } else if old > new {
        g.fetch_sub(old - new, Ordering::Relaxed);
    }
}

/// One RC queue pair.
///
/// Driving it: `connect`, then `post` batches; feed every completion polled from the
/// completion queue with `handle_completion` (which also issues what the window now allows);
/// collect in-order results with `poll_completions`; call `poll_timeout` from a timer. After an
/// error keep feeding completions until `is_drained`, then `reset` and `connect` again.
pub struct Qp {
    key: QpKey,
    queue: RcQueue<WorkRequest>,
    conn: Option<Box<dyn Connection>>,
    local: MrTable,
    gauges: Arc<QpGauges>,
    shown: QpGaugeValues,
}

impl std::fmt::Debug for Qp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qp")
            .field("key", &self.key)
            .field("state", &self.queue.state())
            .field("outstanding", &self.queue.outstanding())
            .finish()
    }
}

impl Qp {
    /// A QP in reset whose destinations are checked against `local`.
    pub fn new(key: QpKey, limits: QueueLimits, local: MrTable, gauges: Arc<QpGauges>) -> Self {
        gauges.qps.fetch_add(1, Ordering::Relaxed);
        Qp {
            key,
            queue: RcQueue::new(limits),
            conn: None,
            local,
            gauges,
            shown: QpGaugeValues::default(),
        }
    }

    pub fn key(&self) -> QpKey {
        self.key
    }

    pub fn state(&self) -> QpState {
        self.queue.state()
    }

    /// The first cause of the current error state.
    pub fn fault(&self) -> Option<QueueFault> {
        self.queue.fault()
    }

    pub fn outstanding(&self) -> usize {
        self.queue.outstanding()
    }

    pub fn in_flight(&self) -> u32 {
        self.queue.in_flight()
    }

    pub fn max_in_flight_seen(&self) -> u32 {
        self.queue.max_in_flight_seen()
    }

    pub fn is_drained(&self) -> bool {
        self.queue.is_drained()
    }

    pub fn next_deadline(&self) -> Option<Instant> {
        self.queue.next_deadline()
    }

    fn sync_gauges(&mut self) {
        let now = QpGaugeValues {
            qps: 0,
            outstanding: self.queue.outstanding(),
            in_flight: self.queue.in_flight() as usize,
            in_error: usize::from(self.queue.state() == QpState::Error),
        };
        adjust(
            &self.gauges.outstanding,
            self.shown.outstanding,
            now.outstanding,
        );
        adjust(&self.gauges.in_flight, self.shown.in_flight, now.in_flight);
        adjust(&self.gauges.in_error, self.shown.in_error, now.in_error);
        self.shown = now;
    }

    fn queue_err(&self, source: RcQueueError) -> QpError {
        QpError::Queue {
            qp: self.key,
            source,
        }
    }

    /// reset → init → ready-to-receive (connection and handshake) → ready-to-send.
    pub fn connect(
        &mut self,
        connector: &dyn Connector,
        sink: Arc<dyn CompletionSink>,
    ) -> Result<(), QpError> {
        self.queue
            .modify(QpState::Init)
            .map_err(|e| self.queue_err(e))?;
        let conn = match connector.connect(self.key, sink) {
            Ok(c) => c,
            Err(source) => {
                // Nothing was posted, so going back to reset cannot fail.
                let _ = self.queue.modify(QpState::Reset);
                return Err(QpError::Connect {
                    qp: self.key,
                    source,
                });
            }
        };
        self.conn = Some(conn);
        self.queue
            .modify(QpState::ReadyToReceive)
            .and_then(|()| self.queue.modify(QpState::ReadyToSend))
            .map_err(|e| self.queue_err(e))
    }

    /// Checks and queues a batch (all or nothing), then issues what the window allows.
    pub fn post(&mut self, reads: &[ReadRequest], now: Instant) -> Result<usize, QpError> {
        if self.queue.state() != QpState::ReadyToSend {
            return Err(self.queue_err(RcQueueError::NotReady {
                state: self.queue.state(),
            }));
        }
        let max_sge = self.queue.limits().max_sge as usize;
        let mut batch = Vec::with_capacity(reads.len());
        for r in reads {
            if r.local.len() > max_sge {
                return Err(self.queue_err(RcQueueError::TooManySegments {
                    wr_id: r.wr_id,
                    sges: r.local.len(),
                    max_sge: max_sge as u32,
                }));
            }
            let scatter = Scatter::resolve(&self.local, &r.local).map_err(|source| {
                QpError::LocalSegment {
                    qp: self.key,
                    wr_id: r.wr_id,
                    source,
                }
            })?;
            if scatter.len() != r.remote.len {
                return Err(QpError::LengthMismatch {
                    qp: self.key,
                    wr_id: r.wr_id,
                    remote_len: r.remote.len,
                    local_len: scatter.len(),
                });
            }
            batch.push(Submit {
                wr_id: r.wr_id,
                len: r.remote.len,
                sges: r.local.len(),
                payload: WorkRequest {
                    qp: self.key,
                    wr_id: r.wr_id,
                    remote: r.remote,
                    scatter: Arc::new(scatter),
                },
            });
        }
        self.queue.submit(batch).map_err(|e| self.queue_err(e))?;
        let r = self.pump(now);
        self.sync_gauges();
        r
    }

    /// Issues queued requests while the window allows. On a post failure the QP goes to
    /// error and the connection is aborted.
    pub fn pump(&mut self, now: Instant) -> Result<usize, QpError> {
        let mut issued = 0;
        let result = loop {
            let Some((wr_id, wr)) = self.queue.next_to_issue(now) else {
                break Ok(issued);
            };
            let Some(conn) = self.conn.as_mut() else {
                let _ = self.queue.handle_post_failure(wr_id);
                break Err(QpError::NotConnected {
                    qp: self.key,
                    state: self.queue.state(),
                });
            };
            match conn.issue(wr) {
                Ok(()) => issued += 1,
                Err(source) => {
                    // The request was just issued, so the queue knows it.
                    let _ = match source {
                        ConnectionError::ConnectionLost { .. } => {
                            self.queue.handle_connection_lost(wr_id)
                        }
                        _ => self.queue.handle_post_failure(wr_id),
                    };
                    conn.abort();
                    break Err(QpError::Post {
                        qp: self.key,
                        wr_id,
                        source,
                    });
                }
            }
        };
        self.sync_gauges();
        result
    }

    /// Feeds one completion from the completion queue (the caller routed it by `wc.qp`).
    pub fn handle_completion(&mut self, wc: &WorkCompletion, now: Instant) -> Result<(), QpError> {
        let effect = self
            .queue
            .handle_completion(wc.wr_id, wc.status, wc.bytes)
            .map_err(|e| self.queue_err(e));
        let result = match effect {
            Ok(CompletionEffect::EnteredError) => {
                if let Some(c) = self.conn.as_mut() {
                    c.abort();
                }
                Ok(())
            }
            Ok(CompletionEffect::Accepted) => self.pump(now).map(|_| ()),
            Err(e) => Err(e),
        };
        self.sync_gauges();
        result
    }

    /// Moves reported requests into `out` in post order and releases their destinations.
    pub fn poll_completions(&mut self, out: &mut Vec<WorkCompletion>) -> usize {
        let mut n = 0;
        while let Some(r) = self.queue.poll_reported() {
            out.push(WorkCompletion {
                qp: self.key,
                wr_id: r.wr_id,
                status: r.status,
                bytes: r.bytes,
            });
            drop(r.payload);
            n += 1;
        }
        self.sync_gauges();
        n
    }

    /// Checks the completion timeout against `now`; on expiry the QP goes to error and the
    /// connection is aborted so the drain can finish.
    pub fn poll_timeout(&mut self, now: Instant) -> Option<QueueFault> {
        let fault = self.queue.poll_timeout(now);
        if fault.is_some() {
            if let Some(c) = self.conn.as_mut() {
                c.abort();
            }
        }
        self.sync_gauges();
        fault
    }

    /// Moves the QP to error (lost connection noticed elsewhere, shutdown) and aborts the
    /// connection; outstanding requests drain through completions as usual.
    pub fn set_error(&mut self) {
        // A transition to error is always allowed.
        let _ = self.queue.modify(QpState::Error);
        if let Some(c) = self.conn.as_mut() {
            c.abort();
        }
        self.sync_gauges();
    }

    /// Back to reset once drained; drops the connection. Connect again to reuse the QP.
    pub fn reset(&mut self) -> Result<(), QpError> {
        self.queue
            .modify(QpState::Reset)
            .map_err(|e| self.queue_err(e))?;
        self.conn = None;
        self.sync_gauges();
        Ok(())
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // Dropping the connection aborts it and joins its threads, so nothing writes into a
        // destination afterwards; outstanding payloads are released with the queue.
        self.conn = None;
        let zero = QpGaugeValues::default();
        adjust(
            &self.gauges.outstanding,
            self.shown.outstanding,
            zero.outstanding,
        );
        adjust(&self.gauges.in_flight, self.shown.in_flight, zero.in_flight);
        adjust(&self.gauges.in_error, self.shown.in_error, zero.in_error);
        self.gauges.qps.fetch_sub(1, Ordering::Relaxed);
    }
}
