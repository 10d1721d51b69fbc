//! The directory's thread: one round at a time, it probes or heartbeats, removes departed
//! nodes, re-announces or reconciles when owed, and writes everything queued.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use redis::aio::ConnectionManager;

use super::keys::{block_key, node_key};
use super::shared::{lock, Call, Shared};
use crate::model::{BlockHash, Namespace};

/// Commands per write pipeline: each pipeline is one call under `write_timeout`.
const WRITE_CHUNK: usize = 4096;

/// The directory's thread: writes queued updates, probes, re-announces and reconciles.
pub(super) struct Worker {
    shared: Arc<Shared>,
    conn: ConnectionManager,
    /// The server's `run_id` when last asked: another one means it restarted.
    run_id: Option<String>,
    next_beat: Instant,
    next_reconcile: Instant,
}

impl Worker {
    pub(super) fn new(shared: Arc<Shared>) -> Self {
        let now = Instant::now();
        Self {
            conn: shared.conn.clone(),
            next_reconcile: now + shared.options.reconcile_interval,
            shared,
            run_id: None,
            next_beat: now,
        }
    }

    pub(super) async fn run(mut self) {
        loop {
            let last = self.shared.stop.load(Ordering::Relaxed);
            let covered = lock(&self.shared.ledger).changes;
            self.round(last).await;
            self.shared.covered.send_replace(covered);
            if last {
                return;
            }
            let mut wake_at = self.next_beat.min(self.next_reconcile);
            if let Some(at) = lock(&self.shared.breaker).probe_at() {
                wake_at = wake_at.min(at);
            }
            tokio::select! {
                _ = self.shared.wake.notified() => {}
                _ = tokio::time::sleep_until(wake_at.into()) => {}
            }
        }
    }

    /// One round: the breaker first, then departed nodes, a re-announce or reconcile when
    /// due, and everything queued.
    async fn round(&mut self, last: bool) {
        let now = Instant::now();
        let probe = {
            let mut b = lock(&self.shared.breaker);
            !b.allows() && b.poll_probe(now)
        };
        if probe {
            self.next_beat = now + self.shared.options.probe_interval;
            let ok = self.beat(Call::Probe).await;
            let t = lock(&self.shared.breaker).on_probe(ok, Instant::now());
            self.shared.transition(t);
        } else if now >= self.next_beat && !last {
            self.next_beat = now + self.shared.options.probe_interval;
            self.beat(Call::Heartbeat).await;
        }
        if !lock(&self.shared.breaker).allows() {
            // Nothing is written while it is open; the ledger keeps the truth.
            lock(&self.shared.ledger).drop_pending();
            return;
        }
        if !self.purge_departed().await {
            return;
        }
        if !last {
            let (reannounce, reconcile) = {
                let l = lock(&self.shared.ledger);
                (l.reannounce, l.reconcile)
            };
            if reannounce || reconcile || now >= self.next_reconcile {
                self.next_reconcile = now + self.shared.options.reconcile_interval;
                if !self.reconcile(reannounce).await {
                    return;
                }
            }
        }
        self.write_pending().await;
    }

    /// Runs one pipeline under the write deadline.
    async fn call<T: redis::FromRedisValue>(
        &mut self,
        call: Call,
        p: &redis::Pipeline,
    ) -> Option<T> {
        let t = Instant::now();
        let r = tokio::time::timeout(
            self.shared.options.write_timeout,
            p.query_async::<T>(&mut self.conn),
        )
        .await;
        self.shared.outcome(call, t, r)
    }

    /// Asks the server for its `run_id`; a new one (a restart) owes a re-announce.
    async fn beat(&mut self, call: Call) -> bool {
        let mut p = redis::pipe();
        p.cmd("INFO").arg("server");
        let Some((info,)) = self.call::<(String,)>(call, &p).await else {
            return false;
        };
        let id = info
            .lines()
            .find_map(|l| l.strip_prefix("run_id:"))
            .map(|id| id.trim().to_owned());
        if let Some(id) = id {
            if self.run_id.as_ref().is_some_and(|old| *old != id) {
                tracing::warn!(
                    directory = %self.shared.addr,
                    "the directory restarted (its run_id changed); re-announcing what this process's nodes hold"
                );
                lock(&self.shared.ledger).reannounce = true;
            }
            self.run_id = Some(id);
        }
        true
    }

    /// Removes the entries of nodes that left; false when the server failed.
    async fn purge_departed(&mut self) -> bool {
        let departed: Vec<String> = lock(&self.shared.ledger).departed.iter().cloned().collect();
        for node in departed {
            let key = node_key(&self.shared.prefix, &node);
            let mut p = redis::pipe();
            p.cmd("SMEMBERS").arg(&key);
            let Some((listed,)) = self.call::<(Vec<String>,)>(Call::Write, &p).await else {
                return false;
            };
            if !self.write_sets(&node, &[], &listed).await {
                return false;
            }
            // A node that rejoined meanwhile publishes afresh (queued after this).
            lock(&self.shared.ledger).departed.remove(&node);
        }
        true
    }

    /// Makes the server's sets of each node of this process what the ledger holds: all of
    /// it re-added when `full` (the server lost it or may have), else only the differences.
    async fn reconcile(&mut self, full: bool) -> bool {
        let snapshot: Vec<(String, Vec<(Namespace, BlockHash)>)> = {
            let mut l = lock(&self.shared.ledger);
            // What is queued is in `held` already: the comparison writes it.
            l.pending.clear();
            l.pending_hashes = 0;
            l.reconcile = false;
            if full {
                l.reannounce = false;
            }
            l.held
                .iter()
                .map(|(n, b)| (n.clone(), b.iter().cloned().collect()))
                .collect()
        };
        let prefix = self.shared.prefix.clone();
        for (node, blocks) in snapshot {
            let want: HashSet<String> = blocks
                .iter()
                .map(|(ns, h)| block_key(&prefix, ns, h))
                .collect();
            let mut p = redis::pipe();
            p.cmd("SMEMBERS").arg(node_key(&prefix, &node));
            let Some((listed,)) = self.call::<(Vec<String>,)>(Call::Write, &p).await else {
                return self.owe(full);
            };
            let listed: HashSet<String> = listed.into_iter().collect();
            let add: Vec<String> = if full {
                want.iter().cloned().collect()
            } else {
                want.difference(&listed).cloned().collect()
            };
            let del: Vec<String> = listed.difference(&want).cloned().collect();
            if !self.write_sets(&node, &add, &del).await {
                return self.owe(full);
            }
        }
        if full {
            self.shared.reannounces.fetch_add(1, Ordering::Relaxed);
            tracing::info!(
                directory = %self.shared.addr,
                "re-announced every block this process's nodes hold"
            );
        }
        true
    }

    /// A reconcile that failed is owed again.
    fn owe(&self, full: bool) -> bool {
        let mut l = lock(&self.shared.ledger);
        l.reconcile = true;
        l.reannounce |= full;
        false
    }

    /// Writes what was queued, in order, in pipelines of [`WRITE_CHUNK`] commands.
    async fn write_pending(&mut self) {
        let updates = {
            let mut l = lock(&self.shared.ledger);
            l.pending_hashes = 0;
            std::mem::take(&mut l.pending)
        };
        let prefix = self.shared.prefix.clone();
        for u in updates {
            let keys: Vec<String> = u
                .hashes
                .iter()
                .map(|h| block_key(&prefix, &u.ns, h))
                .collect();
            let ok = if u.add {
                self.write_sets(&u.node, &keys, &[]).await
            } else {
                self.write_sets(&u.node, &[], &keys).await
            };
            if !ok {
                // What landed is unknown, the rest was not sent: compare at the next chance.
                let mut l = lock(&self.shared.ledger);
                l.drop_pending();
                l.reconcile = true;
                return;
            }
        }
    }

    /// Adds `node` to the sets of `add` and removes it from those of `del`, mirrored in the
    /// node's own set, each chunk in one MULTI/EXEC.
    async fn write_sets(&mut self, node: &str, add: &[String], del: &[String]) -> bool {
        let nkey = node_key(&self.shared.prefix, node);
        for (op, keys) in [("SADD", add), ("SREM", del)] {
            for chunk in keys.chunks(WRITE_CHUNK) {
                let mut p = redis::pipe();
                p.atomic();
                for k in chunk {
                    p.cmd(op).arg(k).arg(node).ignore();
                }
                p.cmd(op).arg(&nkey).arg(chunk).ignore();
                if self.call::<()>(Call::Write, &p).await.is_none() {
                    return false;
                }
            }
        }
        true
    }
}
