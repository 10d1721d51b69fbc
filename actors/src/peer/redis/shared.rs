//! What the callers and the directory's thread share, and how each call's outcome feeds
//! the counters, the latency histograms and the breaker.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use redis::aio::ConnectionManager;
use tokio::sync::{watch, Notify};

use super::ledger::Ledger;
use super::options::RedisOptions;
use crate::peer::breaker::{Breaker, Transition};
use crate::peer::directory::LatencyHistogram;

/// What the callers and the directory's thread share.
pub(super) struct Shared {
    pub(super) addr: String,
    pub(super) prefix: String,
    pub(super) options: RedisOptions,
    pub(super) conn: ConnectionManager,
    pub(super) runtime: tokio::runtime::Handle,
    pub(super) breaker: Mutex<Breaker>,
    pub(super) ledger: Mutex<Ledger>,
    pub(super) wake: Notify,
    pub(super) stop: AtomicBool,
    /// The ledger's `changes` that the thread's last finished round covered: a flush
    /// waits for the count at its call.
    pub(super) covered: watch::Sender<u64>,
    pub(super) publishes: AtomicU64,
    pub(super) withdraws: AtomicU64,
    pub(super) lookups: AtomicU64,
    pub(super) skipped: AtomicU64,
    pub(super) lookup_failures: AtomicU64,
    pub(super) write_failures: AtomicU64,
    pub(super) probe_failures: AtomicU64,
    pub(super) reannounces: AtomicU64,
    pub(super) latency: Mutex<(LatencyHistogram, LatencyHistogram)>,
    pub(super) last_error: Mutex<Option<String>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Call {
    Lookup,
    Write,
    /// The heartbeat while closed: it feeds the breaker as any call does.
    Heartbeat,
    /// The half-open probe: only it decides whether the breaker closes.
    Probe,
}

impl Shared {
    /// Counts a call's outcome, feeds the breaker and keeps the latest error.
    pub(super) fn outcome<T>(
        &self,
        call: Call,
        started: Instant,
        r: Result<redis::RedisResult<T>, tokio::time::error::Elapsed>,
    ) -> Option<T> {
        let now = Instant::now();
        let took = now.duration_since(started);
        {
            let mut lat = lock(&self.latency);
            match call {
                Call::Lookup => {
                    lat.0.observe(took.as_secs_f64());
                    crate::metrics::directory_call("lookup", took.as_secs_f64());
                }
                Call::Write => {
                    lat.1.observe(took.as_secs_f64());
                    crate::metrics::directory_call("write", took.as_secs_f64());
                }
                Call::Heartbeat | Call::Probe => {}
            }
        }
        // The breaker's transition is applied once the error is kept, so that its log line
        // can say why it opened.
        let (failed, transition) = match r {
            Ok(Ok(v)) => {
                if call != Call::Probe {
                    lock(&self.breaker).on_success();
                }
                return Some(v);
            }
            Ok(Err(e)) => {
                let msg = format!("redis at {}: {call:?} failed: {e}", self.addr);
                let t = (call != Call::Probe)
                    .then(|| lock(&self.breaker).on_failure(now))
                    .flatten();
                (msg, t)
            }
            Err(_) => {
                let deadline = match call {
                    Call::Lookup => self.options.lookup_timeout,
                    _ => self.options.write_timeout,
                };
                let t = (call != Call::Probe)
                    .then(|| lock(&self.breaker).on_slow(now))
                    .flatten();
                let msg = format!(
                    "redis at {}: {call:?} missed its deadline of {deadline:?}",
                    self.addr
                );
                (msg, t)
            }
        };
        match call {
            Call::Lookup => &self.lookup_failures,
            Call::Write => &self.write_failures,
            Call::Heartbeat | Call::Probe => &self.probe_failures,
        }
        .fetch_add(1, Ordering::Relaxed);
        // Every failure at debug; an operator's line comes with the breaker opening.
        tracing::debug!(directory = %self.addr, error = %failed, "directory call failed");
        *lock(&self.last_error) = Some(failed);
        self.transition(transition);
        None
    }

    pub(super) fn transition(&self, t: Option<Transition>) {
        match t {
            Some(Transition::Opened) => tracing::warn!(
                directory = %self.addr,
                error = lock(&self.last_error).as_deref().unwrap_or(""),
                probe_every = ?self.options.probe_interval,
                "directory breaker opened: queries plan from local blocks and known peers until a probe answers"
            ),
            Some(Transition::Closed) => tracing::info!(
                directory = %self.addr,
                "directory breaker closed: the directory answers again; re-announcing what this process's nodes hold"
            ),
            None => {}
        }
        match t {
            // Writes in flight may or may not have landed: the next chance compares.
            Some(Transition::Opened) => lock(&self.ledger).reconcile = true,
            // Everything written while it was open was dropped.
            Some(Transition::Closed) => lock(&self.ledger).reannounce = true,
            None => {}
        }
    }
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}
