//! A fault-injecting wrapper around any provider's connector: failed post, completion error at
//! the Nth request, delayed completion, connection drop, peer death.
//!
//! Requests are numbered from 1 over the connector's whole life (across reconnects), and each
//! fault fires once, so after recovery the next read runs clean.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::completion::{CompletionSink, CompletionStatus, WorkCompletion};
use crate::connection::{Connection, ConnectionError, Connector, WorkRequest};
use crate::qp_key::{NodeId, QpKey};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Critical sections only insert or remove whole entries.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What to do to the request the fault fires on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FaultKind {
    /// `issue` fails; the request never executes.
    FailPost,
    /// The request completes with this status without executing.
    CompletionError(CompletionStatus),
    /// The request executes but its completion is held back this long.
    Delay(Duration),
    /// The connection drops: the request fails with a transport error, later posts fail.
    DropConnection,
    /// Like a drop, and every reconnect fails until [`FaultyConnector::revive`].
    PeerDeath,
}

/// One fault: fires on request number `at` (1-based, counted across reconnects).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    pub at: u64,
    pub kind: FaultKind,
}

#[derive(Default)]
struct FaultState {
    faults: Mutex<Vec<Fault>>,
    issued: AtomicU64,
    fired: AtomicU64,
    peer_dead: AtomicBool,
}

/// Wraps a connector; clone-free, share it by reference or `Arc`.
pub struct FaultyConnector<C> {
    inner: C,
    peer: NodeId,
    state: Arc<FaultState>,
}

impl<C> std::fmt::Debug for FaultyConnector<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultyConnector")
            .field("peer", &self.peer)
            .field("issued", &self.state.issued.load(Ordering::Relaxed))
            .field("fired", &self.state.fired.load(Ordering::Relaxed))
            .finish()
    }
}

impl<C: Connector> FaultyConnector<C> {
    pub fn new(inner: C, peer: NodeId) -> Self {
        FaultyConnector {
            inner,
            peer,
            state: Arc::default(),
        }
    }

    pub fn inject(&self, fault: Fault) {
        lock(&self.state.faults).push(fault);
    }

    /// Requests seen so far (the next one is number `issued() + 1`).
    pub fn issued(&self) -> u64 {
        self.state.issued.load(Ordering::Relaxed)
    }

    pub fn fired(&self) -> u64 {
        self.state.fired.load(Ordering::Relaxed)
    }

    /// Lets connects succeed again after a peer death.
    pub fn revive(&self) {
        self.state.peer_dead.store(false, Ordering::Relaxed);
    }

    pub fn inner(&self) -> &C {
        &self.inner
    }
}

impl<C: Connector> Connector for FaultyConnector<C> {
    fn connect(
        &self,
        qp: QpKey,
        sink: Arc<dyn CompletionSink>,
    ) -> Result<Box<dyn Connection>, ConnectionError> {
        if self.state.peer_dead.load(Ordering::Relaxed) {
            return Err(ConnectionError::PeerUnreachable { peer: self.peer });
        }
        let fsink = Arc::new(FaultSink {
            inner: sink,
            delayed: Mutex::default(),
            delay_tx: Mutex::new(None),
        });
        let inner = self.inner.connect(qp, fsink.clone())?;
        Ok(Box::new(FaultyConnection {
            inner: Some(inner),
            qp,
            peer: self.peer,
            state: self.state.clone(),
            sink: fsink,
            delay_thread: None,
            dropped: false,
        }))
    }
}

type Delayed = (Instant, WorkCompletion);

/// Sits between the inner provider and the real sink to hold back delayed completions.
struct FaultSink {
    inner: Arc<dyn CompletionSink>,
    delayed: Mutex<HashMap<u64, Duration>>,
    delay_tx: Mutex<Option<mpsc::Sender<Delayed>>>,
}

impl CompletionSink for FaultSink {
    fn push(&self, wc: WorkCompletion) {
        let delay = lock(&self.delayed).remove(&wc.wr_id);
        if let Some(d) = delay {
            if let Some(tx) = lock(&self.delay_tx).as_ref() {
                if tx.send((Instant::now() + d, wc)).is_ok() {
                    return;
                }
            }
        }
        self.inner.push(wc);
    }
}

struct FaultyConnection {
    inner: Option<Box<dyn Connection>>,
    qp: QpKey,
    peer: NodeId,
    state: Arc<FaultState>,
    sink: Arc<FaultSink>,
    delay_thread: Option<JoinHandle<()>>,
    dropped: bool,
}

impl FaultyConnection {
    fn take_fault(&self, n: u64) -> Option<FaultKind> {
        let mut faults = lock(&self.state.faults);
        let pos = faults.iter().position(|f| f.at == n)?;
        self.state.fired.fetch_add(1, Ordering::Relaxed);
        Some(faults.swap_remove(pos).kind)
    }

    fn fail_now(&self, wr: WorkRequest, status: CompletionStatus) {
        let wr_id = wr.wr_id;
        drop(wr);
        self.sink.inner.push(WorkCompletion {
            qp: self.qp,
            wr_id,
            status,
            bytes: 0,
        });
    }

    fn start_delay_thread(&mut self) {
        if self.delay_thread.is_some() {
            return;
        }
        let (tx, rx) = mpsc::channel::<Delayed>();
        let out = self.sink.inner.clone();
        let spawned = std::thread::Builder::new()
            .name("kvferry-fault-delay".into())
            .spawn(move || {
                // Runs until the connection drops its sender; everything queued is delivered.
                for (due, wc) in rx {
                    let now = Instant::now();
                    if due > now {
                        std::thread::sleep(due - now);
                    }
                    out.push(wc);
                }
            });
        if let Ok(t) = spawned {
            *lock(&self.sink.delay_tx) = Some(tx);
            self.delay_thread = Some(t);
        }
    }
}

impl Connection for FaultyConnection {
    fn peer(&self) -> NodeId {
        self.peer
    }

    fn issue(&mut self, wr: WorkRequest) -> Result<(), ConnectionError> {
        let n = self.state.issued.fetch_add(1, Ordering::Relaxed) + 1;
        let peer = self.peer;
        if self.dropped {
            return Err(ConnectionError::ConnectionLost { peer });
        }
        let fault = self.take_fault(n);
        if let Some(FaultKind::Delay(_)) = fault {
            self.start_delay_thread();
        }
        let Some(inner) = self.inner.as_mut() else {
            return Err(ConnectionError::ConnectionLost { peer });
        };
        match fault {
            None => inner.issue(wr),
            Some(FaultKind::FailPost) => Err(ConnectionError::Post {
                peer,
                wr_id: wr.wr_id,
                reason: format!("injected post failure at request {n}"),
            }),
            Some(FaultKind::CompletionError(status)) => {
                self.fail_now(wr, status);
                Ok(())
            }
            Some(FaultKind::Delay(d)) => {
                lock(&self.sink.delayed).insert(wr.wr_id, d);
                inner.issue(wr)
            }
            Some(kind @ (FaultKind::DropConnection | FaultKind::PeerDeath)) => {
                if kind == FaultKind::PeerDeath {
                    self.state.peer_dead.store(true, Ordering::Relaxed);
                }
                inner.abort();
                self.dropped = true;
                self.fail_now(wr, CompletionStatus::TransportError);
                Ok(())
            }
        }
    }

    fn abort(&mut self) {
        if let Some(c) = self.inner.as_mut() {
            c.abort();
        }
    }
}

impl Drop for FaultyConnection {
    fn drop(&mut self) {
        if let Some(c) = self.inner.as_mut() {
            c.abort();
        }
        // Stop the inner provider first (it may still push into the delay queue), then close
        // the queue and wait for the delayed completions to go out.
        drop(self.inner.take());
        drop(lock(&self.sink.delay_tx).take());
        if let Some(t) = self.delay_thread.take() {
            let _ = t.join();
        }
    }
}
