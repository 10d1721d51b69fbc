//! The callers' side of the Redis directory: every method records or queues and returns;
//! what waits on Redis runs on the directory's own thread.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::sync::{watch, Notify};

use super::error::RedisError;
use super::keys::block_key;
use super::ledger::{Ledger, Update};
use super::options::RedisOptions;
use super::shared::{lock, Call, Shared};
use super::worker::Worker;
use crate::model::{BlockHash, Namespace};
use crate::peer::breaker::{Breaker, BreakerState};
use crate::peer::directory::{Directory, DirectoryHealth, DirectoryStats};
use crate::peer::link::BoxFut;
use crate::peer::redis_url::RedisUrl;

/// The block directory kept in a Redis server, shared by every node pointed at it.
pub struct RedisDirectory {
    shared: Arc<Shared>,
}

impl fmt::Debug for RedisDirectory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisDirectory")
            .field("addr", &self.shared.addr)
            .field("prefix", &self.shared.prefix)
            .field("breaker", &self.breaker())
            .finish()
    }
}

impl RedisDirectory {
    /// Connects to `addr` (any form [`RedisUrl::parse`] takes) and checks the server answers
    /// PING (after AUTH and SELECT, where the address asks for them); fails with [`RedisError::Connect`] when it is unreachable.
    pub fn connect(addr: &str, prefix: &str) -> Result<Self, RedisError> {
        Self::connect_with(addr, prefix, RedisOptions::default())
    }

    /// As [`RedisDirectory::connect`], with these deadlines and breaker. Call it outside
    /// an async context or from one that may block for `connect_timeout`.
    pub fn connect_with(
        addr: &str,
        prefix: &str,
        options: RedisOptions,
    ) -> Result<Self, RedisError> {
        let dir = Self::start(addr, prefix, options)?;
        let (tx, rx) = std::sync::mpsc::channel();
        let shared = Arc::clone(&dir.shared);
        let deadline = shared.options.connect_timeout;
        dir.shared.runtime.spawn(async move {
            let mut conn = shared.conn.clone();
            let ping = redis::cmd("PING");
            let r = tokio::time::timeout(deadline, ping.query_async::<String>(&mut conn)).await;
            let _ = tx.send(match r {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!("no answer to PING within {deadline:?}")),
            });
        });
        let answer = rx
            .recv_timeout(deadline + Duration::from_secs(1))
            .unwrap_or_else(|_| Err("the directory's thread did not answer".into()));
        answer.map_err(|reason| RedisError::Connect {
            addr: dir.shared.addr.clone(),
            reason,
        })?;
        Ok(dir)
    }

    /// Starts the directory's thread without checking the server (it connects lazily,
    /// and the breaker keeps a node going while it is down).
    pub fn start(addr: &str, prefix: &str, options: RedisOptions) -> Result<Self, RedisError> {
        if prefix.is_empty() {
            return Err(RedisError::EmptyPrefix);
        }
        let url = RedisUrl::parse(addr)?;
        // What errors and logs name: the address without its password.
        let host_port = url.to_string();
        let client_err = |source| RedisError::Client {
            addr: host_port.clone(),
            source,
        };
        let client = redis::Client::open(url.connection_info()).map_err(client_err)?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|source| RedisError::Thread { source })?;
        let longest = options.write_timeout.max(options.lookup_timeout);
        // Retries are the breaker's: one connection attempt per call, bounded.
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(options.connect_timeout))
            .set_response_timeout(Some(longest))
            .set_number_of_retries(0);
        let conn = {
            let _in_runtime = runtime.enter();
            ConnectionManager::new_lazy_with_config(client, config).map_err(client_err)?
        };
        let shared = Arc::new(Shared {
            addr: host_port,
            prefix: prefix.to_owned(),
            breaker: Mutex::new(Breaker::new(
                options.breaker_failures,
                options.probe_interval,
            )),
            options,
            conn,
            runtime: runtime.handle().clone(),
            ledger: Mutex::new(Ledger::default()),
            wake: Notify::new(),
            stop: AtomicBool::new(false),
            covered: watch::Sender::new(0),
            publishes: AtomicU64::new(0),
            withdraws: AtomicU64::new(0),
            lookups: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
            lookup_failures: AtomicU64::new(0),
            write_failures: AtomicU64::new(0),
            probe_failures: AtomicU64::new(0),
            reannounces: AtomicU64::new(0),
            latency: Mutex::new(Default::default()),
            last_error: Mutex::new(None),
        });
        let worker = Worker::new(Arc::clone(&shared));
        std::thread::Builder::new()
            .name("kvferry-directory".into())
            .spawn(move || runtime.block_on(worker.run()))
            .map_err(|source| RedisError::Thread { source })?;
        Ok(Self { shared })
    }

    /// Failed directory calls since start (lookups, writes and probes).
    pub fn errors(&self) -> u64 {
        let s = &self.shared;
        s.lookup_failures.load(Ordering::Relaxed)
            + s.write_failures.load(Ordering::Relaxed)
            + s.probe_failures.load(Ordering::Relaxed)
    }

    /// The most recent failure, for operators.
    pub fn last_error(&self) -> Option<String> {
        lock(&self.shared.last_error).clone()
    }

    pub fn breaker(&self) -> BreakerState {
        lock(&self.shared.breaker).state()
    }

    pub fn addr(&self) -> &str {
        &self.shared.addr
    }

    pub fn options(&self) -> &RedisOptions {
        &self.shared.options
    }

    fn queue(&self, update: Update) {
        if update.hashes.is_empty() {
            return;
        }
        lock(&self.shared.ledger).queue(update);
        self.shared.wake.notify_one();
    }
}

impl Drop for RedisDirectory {
    /// The thread writes what is queued (within its deadlines) and ends on its own; a
    /// drop never waits on the network.
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.shared.wake.notify_one();
    }
}

impl Directory for RedisDirectory {
    fn publish(&self, node: &str, ns: &Namespace, hashes: &[BlockHash]) {
        self.shared
            .publishes
            .fetch_add(hashes.len() as u64, Ordering::Relaxed);
        self.queue(Update {
            add: true,
            node: node.to_owned(),
            ns: ns.clone(),
            hashes: hashes.to_vec(),
        });
    }

    fn withdraw(&self, node: &str, ns: &Namespace, hashes: &[BlockHash]) {
        self.shared
            .withdraws
            .fetch_add(hashes.len() as u64, Ordering::Relaxed);
        self.queue(Update {
            add: false,
            node: node.to_owned(),
            ns: ns.clone(),
            hashes: hashes.to_vec(),
        });
    }

    fn owners(
        &self,
        ns: &Namespace,
        hashes: &[BlockHash],
        exclude: &str,
    ) -> BoxFut<Vec<Vec<String>>> {
        let s = &self.shared;
        s.lookups.fetch_add(1, Ordering::Relaxed);
        let n = hashes.len();
        let misses = move || vec![Vec::new(); n];
        if n == 0 {
            return Box::pin(std::future::ready(Vec::new()));
        }
        if !lock(&s.breaker).allows() {
            s.skipped.fetch_add(1, Ordering::Relaxed);
            return Box::pin(std::future::ready(misses()));
        }
        let mut pipe = redis::pipe();
        for h in hashes {
            pipe.cmd("SMEMBERS").arg(block_key(&s.prefix, ns, h));
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let shared = Arc::clone(s);
        let exclude = exclude.to_owned();
        // The call runs on the directory's thread, whose timer enforces the deadline: the
        // caller only awaits the answer, whatever executor it is on.
        s.runtime.spawn(async move {
            let mut conn = shared.conn.clone();
            let t = Instant::now();
            let r = tokio::time::timeout(
                shared.options.lookup_timeout,
                pipe.query_async::<Vec<Vec<String>>>(&mut conn),
            )
            .await;
            let owners = shared.outcome(Call::Lookup, t, r).map(|mut all| {
                for owners in &mut all {
                    owners.retain(|o| *o != exclude);
                    // Sets are unordered; sorted owners keep lookups stable across calls.
                    owners.sort_unstable();
                }
                all
            });
            let _ = tx.send(owners);
        });
        Box::pin(async move {
            match rx.await {
                Ok(Some(owners)) if owners.len() == n => owners,
                _ => misses(),
            }
        })
    }

    fn withdraw_node(&self, node: &str) {
        let mut l = lock(&self.shared.ledger);
        l.held.remove(node);
        let before = l.pending.len();
        l.pending.retain(|u| u.node != node);
        if l.pending.len() != before {
            l.pending_hashes = l.pending.iter().map(|u| u.hashes.len()).sum();
        }
        l.departed.insert(node.to_owned());
        l.changes += 1;
        drop(l);
        self.shared.wake.notify_one();
    }

    fn stats(&self) -> DirectoryStats {
        let s = &self.shared;
        let (entries, pending) = {
            let l = lock(&s.ledger);
            (l.entries(), l.pending_hashes)
        };
        let (breaker, trips) = {
            let b = lock(&s.breaker);
            (b.state(), b.trips())
        };
        let (lookup_seconds, write_seconds) = lock(&s.latency).clone();
        DirectoryStats {
            publishes: s.publishes.load(Ordering::Relaxed),
            withdraws: s.withdraws.load(Ordering::Relaxed),
            lookups: s.lookups.load(Ordering::Relaxed),
            entries,
            health: Some(DirectoryHealth {
                breaker,
                trips,
                lookups_skipped: s.skipped.load(Ordering::Relaxed),
                lookup_failures: s.lookup_failures.load(Ordering::Relaxed),
                write_failures: s.write_failures.load(Ordering::Relaxed),
                probe_failures: s.probe_failures.load(Ordering::Relaxed),
                reannounces: s.reannounces.load(Ordering::Relaxed),
                pending,
                lookup_seconds,
                write_seconds,
                last_error: lock(&s.last_error).clone(),
            }),
        }
    }

    fn flush(&self) -> BoxFut<()> {
        let s = &self.shared;
        let target = lock(&s.ledger).changes;
        let mut covered = s.covered.subscribe();
        s.wake.notify_one();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let bound = s.options.write_timeout * 4 + s.options.lookup_timeout;
        s.runtime.spawn(async move {
            let _ = tokio::time::timeout(bound, covered.wait_for(|c| *c >= target)).await;
            let _ = tx.send(());
        });
        Box::pin(async move {
            let _ = rx.await;
        })
    }
}
