//! The connection state of each peer: opening its QPs the first time, re-linking it through
//! a new connector, and taking back the connect jobs.

use std::sync::Arc;
use std::time::Instant;

use kvferry_transport::{ConnectionError, Connector, NodeId, Qp, QpError, QpKey, QpNum};

use super::slot::Slot;
use super::{ConnectJob, Connected, Event, PeerQueues, WorkerError};

/// The connect requests of a peer whose QPs are being opened for the first time.
pub(super) struct Opening<C> {
    pub(super) replies: Vec<C>,
    pub(super) pending: usize,
    pub(super) failed: Option<Arc<QpError>>,
}

pub(super) struct Peer<C> {
    pub(super) connector: Arc<dyn Connector>,
    /// Bumped when the connector is replaced: a connect job of an older one is stale.
    pub(super) generation: u64,
    pub(super) qps: Vec<QpKey>,
    pub(super) opening: Option<Opening<C>>,
}

impl<B, C> PeerQueues<B, C> {
    /// Opens `qps` QPs (default: the NIC's qps-per-peer) to `peer` through `connector`;
    /// `reply` is answered once every one is connected, or with the first failure (then
    /// nothing of the peer is kept). A known peer's QPs are answered at once; a known peer
    /// with another connector (it restarted, at a new endpoint) has its QPs errored, drained
    /// and rebuilt through the new one.
    pub fn handle_connect(
        &mut self,
        peer: NodeId,
        connector: Arc<dyn Connector>,
        qps: Option<u32>,
        reply: C,
        now: Instant,
    ) {
        if let Some(p) = self.peers.get_mut(&peer) {
            if let Some(o) = p.opening.as_mut() {
                // Answered with the connect already under way.
                o.replies.push(reply);
                return;
            }
            let keys = p.qps.clone();
            let replaced = !Arc::ptr_eq(&p.connector, &connector);
            if replaced {
                p.connector = connector;
                p.generation += 1;
            }
            if replaced {
                // Another connector for a known peer: it restarted, at a new endpoint. Its
                // QPs' connections (even idle ones that look ready) lead to the dead process:
                // error them, let them drain, and reconnect through the new one.
                tracing::info!(nic = %self.config.name, %peer, "peer re-linked: rebuilding its QPs");
                for key in &keys {
                    if let Some(qp) = self.slots.get_mut(key).and_then(|s| s.qp.as_mut()) {
                        qp.set_error();
                    }
                    self.advance(*key, now);
                }
                self.settle(now);
            }
            self.events.push_back(Event::Connect {
                reply,
                result: Ok(keys),
            });
            return;
        }
        let n = qps.unwrap_or(self.config.qps_per_peer).max(1);
        let mut keys = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let key = QpKey::new(peer, self.nic, QpNum(self.next_qp));
            self.next_qp = self.next_qp.wrapping_add(1).max(1);
            let qp = Qp::new(
                key,
                self.config.queue_limits(),
                self.table.clone(),
                self.gauges.clone(),
            );
            self.jobs.push_back(ConnectJob {
                qp,
                connector: connector.clone(),
                sink: self.sink.clone(),
                generation: 0,
            });
            self.slots.insert(key, Slot::new());
            keys.push(key);
        }
        self.peers.insert(
            peer,
            Peer {
                connector,
                generation: 0,
                qps: keys,
                opening: Some(Opening {
                    replies: vec![reply],
                    pending: n as usize,
                    failed: None,
                }),
            },
        );
    }

    /// A connect job is back.
    pub fn handle_connected(&mut self, done: Connected, now: Instant) {
        let Connected {
            mut qp,
            result,
            generation,
        } = done;
        let key = qp.key();
        let Some(peer) = self.peers.get_mut(&key.peer) else {
            // The peer was given up meanwhile; the QP closes here.
            return;
        };
        if let Some(o) = peer.opening.as_mut() {
            o.pending = o.pending.saturating_sub(1);
            if let Err(e) = result {
                o.failed.get_or_insert_with(|| Arc::new(e));
            }
            let finished = o.pending == 0;
            if let Some(slot) = self.slots.get_mut(&key) {
                slot.qp = Some(qp);
            }
            if finished {
                self.finish_opening(key.peer, now);
            }
            return;
        }
        let stale = generation != peer.generation;
        let Some(slot) = self.slots.get_mut(&key) else {
            return;
        };
        match result {
            Ok(()) => {
                if stale {
                    // Connected through a connector replaced meanwhile: rebuild at once.
                    qp.set_error();
                }
                slot.qp = Some(qp);
            }
            Err(e) => {
                tracing::warn!(nic = %self.config.name, qp = %key, error = %e, "reconnecting a QP failed");
                slot.qp = Some(qp);
                let source = Arc::new(e);
                while let Some(w) = slot.waiting.pop_front() {
                    self.events.push_back(Event::Batch {
                        reply: w.reply,
                        result: Err(WorkerError::Reconnect {
                            qp: key,
                            source: Arc::clone(&source),
                        }),
                    });
                }
                if slot.stalled {
                    slot.stalled = false;
                    self.stalled.retain(|k| *k != key);
                }
                // Stays in reset; the next post tries again.
                return;
            }
        }
        self.advance(key, now);
        self.settle(now);
    }

    /// A connect job was lost (its thread panicked): the QP went with it. A new one in reset
    /// takes its place, and the connect counts as failed.
    pub fn handle_connect_lost(&mut self, key: QpKey, now: Instant) {
        let qp = Qp::new(
            key,
            self.config.queue_limits(),
            self.table.clone(),
            self.gauges.clone(),
        );
        let generation = self.peers.get(&key.peer).map_or(0, |p| p.generation);
        let result = Err(QpError::Connect {
            qp: key,
            source: ConnectionError::Setup {
                peer: key.peer,
                what: "connect job",
                source: std::io::Error::other("the connect job panicked"),
            },
        });
        self.handle_connected(
            Connected {
                qp,
                result,
                generation,
            },
            now,
        );
    }

    /// Every QP of a peer opened for the first time is back.
    pub(super) fn finish_opening(&mut self, peer: NodeId, now: Instant) {
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        let Some(opening) = p.opening.take() else {
            return;
        };
        let keys = p.qps.clone();
        if let Some(source) = opening.failed {
            tracing::warn!(nic = %self.config.name, %peer, error = %source, "connecting to a peer failed");
            self.peers.remove(&peer);
            let mut waiting = Vec::new();
            for key in &keys {
                if let Some(mut slot) = self.slots.remove(key) {
                    // The QPs that did connect close here.
                    drop(slot.qp.take());
                    waiting.extend(slot.waiting.drain(..).map(|w| w.reply));
                }
            }
            self.stalled.retain(|k| k.peer != peer);
            let err = |nic: &str| WorkerError::Connect {
                nic: nic.to_string(),
                peer,
                source: Arc::clone(&source),
            };
            for reply in waiting {
                self.events.push_back(Event::Batch {
                    reply,
                    result: Err(err(&self.config.name)),
                });
            }
            for reply in opening.replies {
                self.events.push_back(Event::Connect {
                    reply,
                    result: Err(err(&self.config.name)),
                });
            }
            return;
        }
        tracing::info!(nic = %self.config.name, %peer, qps = keys.len(), "peer connected");
        for reply in opening.replies {
            self.events.push_back(Event::Connect {
                reply,
                result: Ok(keys.clone()),
            });
        }
        for key in keys {
            self.advance(key, now);
        }
        self.settle(now);
    }
}
