//! The Redis backend of the block directory, for nodes in different processes or hosts.
//!
//! Data model, under a key prefix (`kvf` by default):
//!
//! - `{prefix}:blk:{namespace}:{hex hash}` — the set of node ids holding that block;
//! - `{prefix}:node:{node}` — the set of block keys the node published, so that
//!   [`Directory::withdraw_node`] can remove a departed node without scanning, and a node
//!   can reconcile what the server lists for it with what it holds.
//!
//! [`RedisDirectory`] never lets Redis stall a node. It owns a thread with a small tokio
//! runtime and one `redis` [`ConnectionManager`] (pipelined, reconnecting):
//!
//! - `publish` / `withdraw` / `withdraw_node` record the change in a ledger of what each of
//!   this process's nodes holds and queue it; the thread writes everything queued in one
//!   MULTI/EXEC pipeline per round (the block sets and the node set stay consistent).
//! - a lookup is one pipeline of SMEMBERS run on that thread under `lookup_timeout`; the
//!   caller awaits the answer, never the network, and gets empty owner lists when the
//!   directory is down, slow or skipped.
//! - a [`Breaker`] opens after `breaker_failures` failed calls in a row or one call past its
//!   deadline; while it is open lookups are answered empty at once and queued writes are
//!   dropped (the ledger keeps the truth). Every `probe_interval` the thread asks the
//!   server for its `run_id`: that is the half-open probe while open, and a heartbeat that
//!   detects a restarted server while closed.
//! - when the breaker closes again, or the server's `run_id` changed (a restart, with or
//!   without its data), every node of this process re-announces all it holds; every
//!   `reconcile_interval` each node's set on the server is compared with its ledger and
//!   the differences written, so writes lost to a failure are repaired.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use thiserror::Error;
use tokio::sync::{watch, Notify};

use crate::model::{BlockHash, Namespace};
use crate::peer::breaker::{Breaker, BreakerState, Transition};
use crate::peer::directory::{Directory, DirectoryHealth, DirectoryStats, LatencyHistogram};
use crate::peer::link::BoxFut;

pub use crate::peer::redis_url::{redact_url, RedisUrl, RedisUrlError, DEFAULT_PORT};

/// Queued block updates past which the queue is dropped and a full re-announce owed
/// instead (a directory down for long must not grow memory without bound).
const MAX_PENDING: usize = 1 << 20;

/// Commands per write pipeline: each pipeline is one call under `write_timeout`.
const WRITE_CHUNK: usize = 4096;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RedisError {
    /// The address does not parse, or names what the client cannot reach (TLS, a socket).
    #[error(transparent)]
    Address(#[from] RedisUrlError),
    #[error("the redis key prefix must not be empty")]
    EmptyPrefix,
    /// The directory's own thread or runtime could not start.
    #[error("cannot start the redis directory's thread: {source}")]
    Thread {
        #[source]
        source: std::io::Error,
    },
    /// The redis client refused the address or configuration.
    #[error("redis client for {addr}: {source}")]
    Client {
        addr: String,
        #[source]
        source: redis::RedisError,
    },
    /// The server is unreachable or did not answer PING at start.
    #[error("cannot connect to redis at {addr}: {reason}")]
    Connect { addr: String, reason: String },
}

/// Deadlines and breaker of a [`RedisDirectory`] (the `[directory]` config section).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedisOptions {
    /// One connection attempt (and the PING at start).
    pub connect_timeout: Duration,
    /// The longest a query waits on the directory.
    pub lookup_timeout: Duration,
    /// One write pipeline, probe or reconcile step.
    pub write_timeout: Duration,
    /// Failed calls in a row that open the breaker (one call past its deadline opens it).
    pub breaker_failures: u32,
    /// The breaker's cool-down before a probe, and the heartbeat that detects a restarted
    /// server while it is closed.
    pub probe_interval: Duration,
    /// How often each node's entries on the server are compared with what it holds.
    pub reconcile_interval: Duration,
}

impl Default for RedisOptions {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(1),
            lookup_timeout: Duration::from_millis(100),
            write_timeout: Duration::from_secs(1),
            breaker_failures: 3,
            probe_interval: Duration::from_secs(1),
            reconcile_interval: Duration::from_secs(30),
        }
    }
}

/// The block directory kept in a Redis server, shared by every node pointed at it.
pub struct RedisDirectory {
    shared: Arc<Shared>,
}

/// What the callers and the directory's thread share.
struct Shared {
    addr: String,
    prefix: String,
    options: RedisOptions,
    conn: ConnectionManager,
    runtime: tokio::runtime::Handle,
    breaker: Mutex<Breaker>,
    ledger: Mutex<Ledger>,
    wake: Notify,
    stop: AtomicBool,
    /// The ledger's `changes` that the thread's last finished round covered: a flush
    /// waits for the count at its call.
    covered: watch::Sender<u64>,
    publishes: AtomicU64,
    withdraws: AtomicU64,
    lookups: AtomicU64,
    skipped: AtomicU64,
    lookup_failures: AtomicU64,
    write_failures: AtomicU64,
    probe_failures: AtomicU64,
    reannounces: AtomicU64,
    latency: Mutex<(LatencyHistogram, LatencyHistogram)>,
    last_error: Mutex<Option<String>>,
}

/// What this process's nodes hold (the truth a re-announce writes), and the changes not
/// yet written.
#[derive(Default)]
struct Ledger {
    held: HashMap<String, HashSet<(Namespace, BlockHash)>>,
    pending: Vec<Update>,
    pending_hashes: usize,
    /// Nodes that left: their entries on the server are to be removed.
    departed: HashSet<String>,
    /// Every node re-announces all it holds at the next chance.
    reannounce: bool,
    /// The server's sets are compared with `held` at the next chance.
    reconcile: bool,
    /// Bumped by every change; a flush waits for a round that started after it.
    changes: u64,
}

struct Update {
    add: bool,
    node: String,
    ns: Namespace,
    hashes: Vec<BlockHash>,
}

impl Ledger {
    fn queue(&mut self, update: Update) {
        let held = self.held.entry(update.node.clone()).or_default();
        for h in &update.hashes {
            if update.add {
                held.insert((update.ns.clone(), *h));
            } else {
                held.remove(&(update.ns.clone(), *h));
            }
        }
        self.changes += 1;
        if self.pending_hashes + update.hashes.len() > MAX_PENDING {
            // The ledger has it all: a re-announce writes it in one go later.
            self.drop_pending();
            return;
        }
        self.pending_hashes += update.hashes.len();
        self.pending.push(update);
    }

    /// Queued updates are given up on; a full re-announce (with its reconcile, which also
    /// removes what was withdrawn meanwhile) replaces them.
    fn drop_pending(&mut self) {
        if !self.pending.is_empty() {
            self.reannounce = true;
        }
        self.pending.clear();
        self.pending_hashes = 0;
    }

    fn entries(&self) -> usize {
        self.held.values().map(HashSet::len).sum()
    }
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Call {
    Lookup,
    Write,
    /// The heartbeat while closed: it feeds the breaker as any call does.
    Heartbeat,
    /// The half-open probe: only it decides whether the breaker closes.
    Probe,
}

impl Shared {
    /// Counts a call's outcome, feeds the breaker and keeps the latest error.
    fn outcome<T>(
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

    fn transition(&self, t: Option<Transition>) {
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

fn block_key(prefix: &str, ns: &Namespace, h: &BlockHash) -> String {
    let mut k = format!("{prefix}:blk:{}:", ns.as_str());
    for b in h.as_bytes() {
        k.push_str(&format!("{b:02x}"));
    }
    k
}

fn node_key(prefix: &str, node: &str) -> String {
    format!("{prefix}:node:{node}")
}

/// The directory's thread: writes queued updates, probes, re-announces and reconciles.
struct Worker {
    shared: Arc<Shared>,
    conn: ConnectionManager,
    /// The server's `run_id` when last asked: another one means it restarted.
    run_id: Option<String>,
    next_beat: Instant,
    next_reconcile: Instant,
}

impl Worker {
    fn new(shared: Arc<Shared>) -> Self {
        let now = Instant::now();
        Self {
            conn: shared.conn.clone(),
            next_reconcile: now + shared.options.reconcile_interval,
            shared,
            run_id: None,
            next_beat: now,
        }
    }

    async fn run(mut self) {
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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::net::TcpListener;
    use std::path::PathBuf;
    use std::process::{Child, Command, Stdio};
    use std::thread;

    use super::*;
    use crate::peer::directory::{EmbeddedDirectory, Segment};

    /// A real `redis-server` on a loopback port, killed on drop (and continued first, if a
    /// test stopped it).
    struct RedisServer {
        child: Child,
        port: u16,
        /// Where it saves and loads its data; None: in memory only.
        dir: Option<PathBuf>,
    }

    impl RedisServer {
        fn start() -> Self {
            Self::start_with(None)
        }

        fn start_with(dir: Option<PathBuf>) -> Self {
            for _ in 0..5 {
                if let Some(s) = Self::start_on(free_port(), dir.clone()) {
                    return s;
                }
            }
            panic!("redis-server did not come up on any of 5 free ports");
        }

        /// None when the server exits early (its port was taken meanwhile).
        fn start_on(port: u16, dir: Option<PathBuf>) -> Option<Self> {
            let mut cmd = Command::new("redis-server");
            cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--appendonly", "no", "--save", ""]);
            if let Some(d) = &dir {
                cmd.arg("--dir").arg(d).args(["--dbfilename", "dir.rdb"]);
            }
            let child = cmd
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn();
            let child = match child {
                Ok(c) => c,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                    "redis-server is not installed (needed by the Redis directory tests): \
                     run ./scripts/test, which installs it, or apt-get install redis-server"
                ),
                Err(e) => panic!("cannot start redis-server: {e}"),
            };
            let mut s = Self { child, port, dir };
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if matches!(s.child.try_wait(), Ok(Some(_))) {
                    return None;
                }
                if s.pong() {
                    return Some(s);
                }
                thread::sleep(Duration::from_millis(20));
            }
            panic!("redis-server on port {port} did not answer PING within 10 s");
        }

        fn addr(&self) -> String {
            format!("127.0.0.1:{}", self.port)
        }

        fn pong(&self) -> bool {
            redis::Client::open(format!("redis://{}/", self.addr()))
                .and_then(|c| c.get_connection_with_timeout(Duration::from_millis(500)))
                .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
                .is_ok()
        }

        /// A plain blocking connection of the test's own, to look at the server.
        fn conn(&self) -> redis::Connection {
            let c = redis::Client::open(format!("redis://{}/", self.addr())).unwrap();
            let conn = c
                .get_connection_with_timeout(Duration::from_secs(2))
                .unwrap();
            conn.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            conn
        }

        /// Block keys under `prefix`, counted with SCAN.
        fn entries(&self, prefix: &str) -> usize {
            let mut c = self.conn();
            let it = redis::cmd("SCAN")
                .cursor_arg(0)
                .arg("MATCH")
                .arg(format!("{prefix}:blk:*"))
                .clone()
                .iter::<String>(&mut c)
                .unwrap();
            it.filter_map(Result::ok).collect::<HashSet<String>>().len()
        }

        /// Signals the server while it runs (never a pid that was reaped and may be reused).
        fn signal(&mut self, sig: libc::c_int) {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            // SAFETY: kill(2) on our own child, not yet reaped; no memory is involved.
            let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, sig) };
            assert_eq!(rc, 0, "kill({}, {sig})", self.child.id());
        }

        /// Hangs the server: its socket still accepts, nothing answers.
        fn stop(&mut self) {
            self.signal(libc::SIGSTOP);
        }

        fn cont(&mut self) {
            self.signal(libc::SIGCONT);
        }

        /// Kills it and starts another on the same port (with the same data directory).
        fn restart(mut self) -> Self {
            self.kill();
            let dir = self.dir.take();
            let port = self.port;
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                if let Some(s) = Self::start_on(port, dir.clone()) {
                    return s;
                }
                assert!(Instant::now() < deadline, "no restart on port {port}");
                thread::sleep(Duration::from_millis(50));
            }
        }

        fn kill(&mut self) {
            self.cont();
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    impl Drop for RedisServer {
        fn drop(&mut self) {
            self.kill();
        }
    }

    fn free_port() -> u16 {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        l.local_addr().expect("local addr").port()
    }

    /// Short deadlines; no periodic reconcile within a test, so that what a test sees
    /// found again was re-announced (the periodic one has a test of its own).
    fn quick() -> RedisOptions {
        RedisOptions {
            connect_timeout: Duration::from_millis(500),
            lookup_timeout: Duration::from_millis(200),
            write_timeout: Duration::from_millis(500),
            breaker_failures: 3,
            probe_interval: Duration::from_millis(100),
            reconcile_interval: Duration::from_secs(600),
        }
    }

    /// Within how long a directory back from an outage has re-announced everything: a
    /// probe, then one round.
    fn recovery(o: &RedisOptions) -> Duration {
        o.probe_interval * 2 + o.write_timeout * 2 + Duration::from_millis(500)
    }

    fn ns(fp: &str) -> Namespace {
        Namespace::new("m", "bf16", fp).unwrap()
    }

    fn hashes(n: u64) -> Vec<BlockHash> {
        (0..n).map(BlockHash::from_u64).collect()
    }

    fn seg(start: usize, len: usize, owners: &[&str]) -> Segment {
        Segment {
            start,
            len,
            owners: owners.iter().map(|o| o.to_string()).collect(),
        }
    }

    fn block_on<F: Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f)
    }

    /// Writes what is queued, then looks up.
    fn lookup(d: &RedisDirectory, space: &Namespace, h: &[BlockHash], me: &str) -> Vec<Segment> {
        block_on(async {
            d.flush().await;
            d.lookup(space, h, me).await
        })
    }

    fn owners(
        d: &RedisDirectory,
        space: &Namespace,
        h: &[BlockHash],
        me: &str,
    ) -> Vec<Vec<String>> {
        block_on(async {
            d.flush().await;
            d.owners(space, h, me).await
        })
    }

    /// Polls `f` until it holds, for at most `within`; the time it took.
    fn eventually(within: Duration, what: &str, mut f: impl FnMut() -> bool) -> Duration {
        let t = Instant::now();
        while !f() {
            assert!(t.elapsed() < within, "{what}: not within {within:?}");
            thread::sleep(Duration::from_millis(20));
        }
        t.elapsed()
    }

    #[test]
    fn segments_across_three_nodes() {
        let server = RedisServer::start();
        let d = RedisDirectory::connect_with(&server.addr(), "kvf", quick()).unwrap();
        let h = hashes(12);
        d.publish("b", &ns("x"), &h[0..4]);
        d.publish("a", &ns("x"), &h[4..8]);
        d.publish("c", &ns("x"), &h[8..12]);
        assert_eq!(
            lookup(&d, &ns("x"), &h[4..], "b"),
            vec![seg(0, 4, &["a"]), seg(4, 4, &["c"])]
        );
        // Shared blocks list every holder, sorted, and keep the run with the common owner.
        d.publish("c", &ns("x"), &h[6..8]);
        d.publish("a", &ns("x"), &h[6..8]); // twice is once
        assert_eq!(
            owners(&d, &ns("x"), &h[5..9], "b"),
            vec![vec!["a"], vec!["a", "c"], vec!["a", "c"], vec!["c"]]
        );
        assert_eq!(
            lookup(&d, &ns("x"), &h[4..], "b"),
            vec![seg(0, 4, &["a"]), seg(4, 4, &["c"])]
        );
        // A node never lists itself.
        assert!(lookup(&d, &ns("x"), &h[0..4], "b").is_empty());
        assert_eq!(lookup(&d, &ns("x"), &h[0..4], "a"), vec![seg(0, 4, &["b"])]);
        assert_eq!(owners(&d, &ns("x"), &h[6..7], "a"), vec![vec!["c"]]);
        let s = d.stats();
        assert_eq!((s.publishes, s.entries), (16, 14));
        assert_eq!(server.entries("kvf"), 12);
        assert_eq!(d.errors(), 0, "{:?}", d.last_error());
        assert_eq!(d.breaker(), BreakerState::Closed);
    }

    #[test]
    fn withdraw_and_withdraw_node() {
        let server = RedisServer::start();
        let d = RedisDirectory::connect_with(&server.addr(), "kvf", quick()).unwrap();
        let h = hashes(12);
        d.publish("b", &ns("x"), &h[0..4]);
        d.publish("a", &ns("x"), &h[4..8]);
        d.publish("c", &ns("x"), &h[8..12]);
        d.publish("c", &ns("x"), &h[6..8]);
        // A hole ends the lookup.
        d.withdraw("a", &ns("x"), &h[5..6]);
        assert_eq!(lookup(&d, &ns("x"), &h[4..], "b"), vec![seg(0, 1, &["a"])]);
        assert_eq!(server.entries("kvf"), 11);
        // Withdrawing what a node does not hold changes nothing.
        d.withdraw("b", &ns("x"), &h[8..12]);
        assert_eq!(owners(&d, &ns("x"), &h[8..9], ""), vec![vec!["c"]]);

        d.withdraw_node("c");
        block_on(d.flush());
        assert_eq!(server.entries("kvf"), 7, "as the embedded directory");
        assert_eq!(
            owners(&d, &ns("x"), &h[6..10], "b"),
            vec![vec!["a"], vec!["a"], vec![], vec![]]
        );
        // The node's own index is gone too, and a second withdraw_node is a no-op.
        let exists: i64 = redis::cmd("EXISTS")
            .arg("kvf:node:c")
            .query(&mut server.conn())
            .unwrap();
        assert_eq!(exists, 0);
        d.withdraw_node("c");
        d.withdraw_node("never-seen");
        // A node that rejoins publishes afresh.
        d.publish("c", &ns("x"), &h[8..9]);
        assert_eq!(owners(&d, &ns("x"), &h[8..9], "b"), vec![vec!["c"]]);
        assert_eq!(d.errors(), 0, "{:?}", d.last_error());
    }

    #[test]
    fn namespaces_and_prefixes_do_not_mix() {
        let server = RedisServer::start();
        let d = RedisDirectory::connect_with(&server.addr(), "kvf", quick()).unwrap();
        let other = RedisDirectory::connect_with(&server.addr(), "kvf2", quick()).unwrap();
        let h = hashes(4);
        d.publish("a", &ns("x"), &h);
        d.publish("b", &ns("y"), &h[..2]);
        assert_eq!(lookup(&d, &ns("x"), &h, "z"), vec![seg(0, 4, &["a"])]);
        assert_eq!(lookup(&d, &ns("y"), &h, "z"), vec![seg(0, 2, &["b"])]);
        assert!(lookup(&d, &ns("w"), &h, "z").is_empty());
        assert!(lookup(&other, &ns("x"), &h, "z").is_empty());
        assert_eq!(server.entries("kvf2"), 0);
        d.withdraw_node("a");
        assert!(lookup(&d, &ns("x"), &h, "z").is_empty());
        assert_eq!(lookup(&d, &ns("y"), &h, "z"), vec![seg(0, 2, &["b"])]);
        // Hashes of different lengths are different blocks.
        let short = BlockHash::new(&[0, 0, 0, 0, 0, 0, 0]).unwrap();
        assert_eq!(
            owners(&d, &ns("y"), &[short], "z"),
            vec![Vec::<String>::new()]
        );
    }

    #[test]
    fn matches_the_embedded_directory() {
        let server = RedisServer::start();
        let d = RedisDirectory::connect_with(&server.addr(), "kvf", quick()).unwrap();
        let e = EmbeddedDirectory::new();
        let nodes = ["a", "b", "c", "d"];
        let h = hashes(16);
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..200 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let node = nodes[(x % 4) as usize];
            let lo = ((x >> 8) % 16) as usize;
            let hi = lo + ((x >> 16) % (17 - lo as u64)) as usize;
            let space = ns(if (x >> 24).is_multiple_of(3) {
                "y"
            } else {
                "x"
            });
            match (x >> 32) % 10 {
                0..=5 => {
                    d.publish(node, &space, &h[lo..hi]);
                    e.publish(node, &space, &h[lo..hi]);
                }
                6..=8 => {
                    d.withdraw(node, &space, &h[lo..hi]);
                    e.withdraw(node, &space, &h[lo..hi]);
                }
                _ => {
                    d.withdraw_node(node);
                    e.withdraw_node(node);
                }
            }
            let me = nodes[((x >> 40) % 4) as usize];
            let mut want = block_on(e.owners(&space, &h, me));
            want.iter_mut().for_each(|o| o.sort());
            assert_eq!(owners(&d, &space, &h, me), want);
        }
        assert_eq!(server.entries("kvf"), e.stats().entries);
        assert_eq!(d.errors(), 0, "{:?}", d.last_error());
    }

    #[test]
    fn connect_fails_clearly_when_unreachable() {
        let port = free_port();
        let err = RedisDirectory::connect(&format!("redis://127.0.0.1:{port}"), "kvf").unwrap_err();
        assert!(matches!(err, RedisError::Connect { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("cannot connect to redis at 127.0.0.1:{port}")),
            "{msg}"
        );
        assert!(matches!(
            RedisDirectory::connect("127.0.0.1:1", ""),
            Err(RedisError::EmptyPrefix)
        ));
    }

    /// `requirepass`, an ACL user and a database index, against a real server: each URL form
    /// connects, AUTHs, SELECTs its database and finds what it published there; a missing or
    /// wrong password fails at connect; no error and no address shown carries a password.
    #[test]
    fn a_password_an_acl_user_and_a_database_index_really_connect() {
        let server = RedisServer::start();
        let mut admin = server.conn();
        redis::cmd("ACL")
            .arg(&[
                "SETUSER",
                "kvuser",
                "on",
                ">user-secret",
                "~*",
                "&*",
                "+@all",
            ])
            .query::<()>(&mut admin)
            .unwrap();
        // The admin connection stays authenticated as the default user.
        redis::cmd("CONFIG")
            .arg(&["SET", "requirepass", "default-secret"])
            .query::<()>(&mut admin)
            .unwrap();
        let addr = server.addr();
        for (url, db) in [
            (format!("redis://:default-secret@{addr}/3"), 3),
            (format!("redis://kvuser:user-secret@{addr}/5"), 5),
            (format!("redis://default:default-secret@{addr}"), 0),
        ] {
            let d = RedisDirectory::connect_with(&url, "kvf", quick())
                .unwrap_or_else(|e| panic!("{}: {e}", redact_url(&url)));
            assert!(!d.addr().contains("secret"), "{}", d.addr());
            assert!(!format!("{d:?}").contains("secret"));
            let h = hashes(4);
            d.publish("a", &ns("x"), &h);
            assert_eq!(lookup(&d, &ns("x"), &h, "b"), vec![seg(0, 4, &["a"])]);
            assert_eq!(d.errors(), 0, "{:?}", d.last_error());
            // In its own database, and there only.
            redis::cmd("SELECT")
                .arg(db)
                .query::<()>(&mut admin)
                .unwrap();
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg("kvf:blk:*")
                .query(&mut admin)
                .unwrap();
            assert_eq!(keys.len(), 4, "db {db}: {keys:?}");
            redis::cmd("FLUSHDB").query::<()>(&mut admin).unwrap();
        }
        for url in [
            addr.clone(),
            format!("redis://:wrong-secret@{addr}"),
            format!("redis://kvuser:wrong-secret@{addr}/5"),
        ] {
            let e = RedisDirectory::connect_with(&url, "kvf", quick()).unwrap_err();
            assert!(matches!(e, RedisError::Connect { .. }), "{e:?}");
            let (shown, debug) = (e.to_string(), format!("{e:?}"));
            assert!(shown.contains(&addr), "{shown}");
            assert!(
                !shown.contains("secret") && !debug.contains("secret"),
                "{debug}"
            );
        }
    }

    /// The config check and the node take the same URLs: every form either passes both or
    /// fails both, with the same reason. (A bare `host[:port]`, which the library takes, is
    /// refused by the check: a directory in a config is `static` or a URL.)
    #[test]
    fn the_config_check_and_the_node_agree_on_every_address() {
        for addr in ["h", "h:1", "[::1]:7000", "etcd"] {
            let text = format!("[cluster]\ndirectory = \"{addr}\"\n");
            let cfg: crate::NodeConfig = toml::from_str(&text).unwrap();
            let e = cfg.validate().unwrap_err().to_string();
            assert!(e.contains("is not static or redis://"), "{e}");
        }
        for addr in [
            "redis://h",
            "redis://[::1]:7000",
            "redis://h:1/0",
            "redis://h/3",
            "redis://:pw@h",
            "redis://u:pw@h:1/2",
            "redis://u@h",
            "rediss://u:pw@h",
            "unix:///tmp/r.sock",
            "redis://",
            "redis://h:1/x",
            "redis://h:1/-2",
            "redis://0.0.0.0:1",
        ] {
            let text = format!("[cluster]\ndirectory = \"{addr}\"\n");
            let cfg: crate::NodeConfig = toml::from_str(&text).unwrap();
            let check = cfg.validate().map_err(|e| e.to_string());
            let node = RedisDirectory::start(addr, "kvf", quick()).map_err(|e| e.to_string());
            match (&check, &node) {
                (Ok(()), Ok(_)) => {}
                (Err(c), Err(n)) => assert!(c.contains(n.as_str()), "{addr}: {c} / {n}"),
                _ => panic!(
                    "{addr}: the check says {check:?}, the node {:?}",
                    node.map(|_| ())
                ),
            }
            if let Err(e) = &check {
                assert!(!e.contains("pw@"), "{e}");
            }
        }
    }

    /// A hung server (SIGSTOP): lookups answer empty within the bound, then at once (the
    /// breaker opened); publishes never wait; once it answers again, the breaker closes
    /// and what was sealed meanwhile is found.
    #[test]
    fn a_hung_server_costs_a_lookup_at_most_the_bound() {
        let mut server = RedisServer::start();
        let o = quick();
        let d = RedisDirectory::connect_with(&server.addr(), "kvf", o.clone()).unwrap();
        let h = hashes(8);
        d.publish("a", &ns("x"), &h[..4]);
        assert_eq!(lookup(&d, &ns("x"), &h, "b"), vec![seg(0, 4, &["a"])]);

        server.stop();
        let slack = Duration::from_millis(150);
        let mut slowest = Duration::ZERO;
        for _ in 0..20 {
            let t = Instant::now();
            let owners = block_on(d.owners(&ns("x"), &h, "b"));
            slowest = slowest.max(t.elapsed());
            assert_eq!(owners, vec![Vec::<String>::new(); 8]);
            // Sealing and evicting never waits on the directory.
            let t = Instant::now();
            d.publish("a", &ns("x"), &h[4..8]);
            d.withdraw("a", &ns("x"), &h[..1]);
            d.publish("a", &ns("x"), &h[..1]);
            assert!(t.elapsed() < Duration::from_millis(20), "{:?}", t.elapsed());
        }
        assert!(
            slowest <= o.lookup_timeout + slack,
            "a lookup took {slowest:?}"
        );
        assert_eq!(d.breaker(), BreakerState::Open);
        let health = d.stats().health.unwrap();
        assert!(health.lookups_skipped >= 15, "{health:?}");
        assert!(
            health.trips >= 1
                && health.lookup_failures + health.write_failures + health.probe_failures >= 1
        );
        assert!(d.last_error().unwrap().contains(&server.addr()));
        // The flush of a hung directory is bounded too.
        let t = Instant::now();
        block_on(d.flush());
        assert!(t.elapsed() < o.write_timeout * 4 + o.lookup_timeout + slack);

        server.cont();
        let took = eventually(Duration::from_secs(5), "the breaker closes", || {
            d.breaker() == BreakerState::Closed
        });
        assert!(
            took <= o.probe_interval + o.write_timeout * 2 + slack * 4,
            "{took:?}"
        );
        // The blocks sealed during the hang are re-announced.
        eventually(recovery(&o), "blocks sealed while hung are found", || {
            block_on(d.lookup(&ns("x"), &h, "b")) == vec![seg(0, 8, &["a"])]
        });
        assert!(d.stats().health.unwrap().reannounces >= 1);
    }

    /// A server killed and restarted empty: every block is found again within the
    /// reconcile interval, with what was sealed and evicted while it was down.
    #[test]
    fn a_server_restarted_empty_is_told_everything_again() {
        let mut server = RedisServer::start();
        let o = quick();
        let d = RedisDirectory::connect_with(&server.addr(), "kvf", o.clone()).unwrap();
        let h = hashes(12);
        d.publish("a", &ns("x"), &h[..4]);
        d.publish("c", &ns("x"), &h[4..8]);
        assert_eq!(
            lookup(&d, &ns("x"), &h, "b"),
            vec![seg(0, 4, &["a"]), seg(4, 4, &["c"])]
        );
        server.kill();
        // Down: lookups answer empty at once or within the bound, writes are queued.
        for _ in 0..5 {
            let t = Instant::now();
            assert!(block_on(d.lookup(&ns("x"), &h, "b")).is_empty());
            assert!(t.elapsed() <= o.lookup_timeout + Duration::from_millis(150));
        }
        d.publish("c", &ns("x"), &h[8..12]); // sealed during the outage
        d.withdraw("a", &ns("x"), &h[3..4]); // evicted during the outage
        eventually(Duration::from_secs(5), "the breaker opens", || {
            d.breaker() == BreakerState::Open
        });
        let server = server.restart();
        let took = eventually(recovery(&o), "all found again", || {
            block_on(d.lookup(&ns("x"), &h, "b")) == vec![seg(0, 3, &["a"])]
                && block_on(d.owners(&ns("x"), &h[3..12], "b"))
                    == [
                        vec![],
                        vec!["c".to_string()],
                        vec!["c".into()],
                        vec!["c".into()],
                        vec!["c".into()],
                        vec!["c".into()],
                        vec!["c".into()],
                        vec!["c".into()],
                        vec!["c".into()],
                    ]
        });
        assert_eq!(server.entries("kvf"), 11, "found again after {took:?}");
        assert_eq!(d.breaker(), BreakerState::Closed);
    }

    /// A restart between two heartbeats fails no call and opens no breaker; the new
    /// `run_id` alone triggers the re-announce.
    #[test]
    fn a_quick_restart_is_noticed_by_its_run_id() {
        let o = quick();
        let server = RedisServer::start();
        let d = RedisDirectory::connect_with(&server.addr(), "kvf", o.clone()).unwrap();
        let h = hashes(4);
        d.publish("a", &ns("x"), &h);
        assert_eq!(lookup(&d, &ns("x"), &h, "b"), vec![seg(0, 4, &["a"])]);
        let server = server.restart();
        eventually(recovery(&o), "re-announced after a restart", || {
            block_on(d.lookup(&ns("x"), &h, "b")) == vec![seg(0, 4, &["a"])]
        });
        assert_eq!(server.entries("kvf"), 4);
        assert!(d.stats().health.unwrap().reannounces >= 1);
    }

    /// A server restarted with an older snapshot of its data: what was withdrawn since is
    /// removed, what was published since is added.
    #[test]
    fn a_server_restarted_with_old_data_is_reconciled() {
        let dir = std::env::temp_dir().join(format!(
            "kvferry-redis-{}-{}",
            std::process::id(),
            free_port()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let server = RedisServer::start_with(Some(dir.clone()));
        let o = quick();
        let d = RedisDirectory::connect_with(&server.addr(), "kvf", o.clone()).unwrap();
        let h = hashes(8);
        d.publish("a", &ns("x"), &h[..4]);
        block_on(d.flush());
        let _: String = redis::cmd("SAVE").query(&mut server.conn()).unwrap();
        d.withdraw("a", &ns("x"), &h[2..4]);
        d.publish("a", &ns("x"), &h[4..6]);
        assert_eq!(
            owners(&d, &ns("x"), &h[..6], "b")
                .iter()
                .filter(|o| !o.is_empty())
                .count(),
            4
        );
        let server = server.restart();
        eventually(recovery(&o), "reconciled after a restart with data", || {
            let got = block_on(d.owners(&ns("x"), &h, "b"));
            let holds: Vec<bool> = got.iter().map(|o| !o.is_empty()).collect();
            holds == [true, true, false, false, true, true, false, false]
        });
        assert_eq!(server.entries("kvf"), 4);
        let members: Vec<String> = redis::cmd("SMEMBERS")
            .arg("kvf:node:a")
            .query(&mut server.conn())
            .unwrap();
        assert_eq!(members.len(), 4, "{members:?}");
        drop(server);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Entries that a lost write left behind (here: written behind the directory's back)
    /// are repaired by the periodic reconcile.
    #[test]
    fn the_periodic_reconcile_repairs_lost_writes() {
        let server = RedisServer::start();
        let o = RedisOptions {
            reconcile_interval: Duration::from_millis(500),
            ..quick()
        };
        let d = RedisDirectory::connect_with(&server.addr(), "kvf", o.clone()).unwrap();
        let h = hashes(4);
        d.publish("a", &ns("x"), &h[..2]);
        block_on(d.flush());
        let mut c = server.conn();
        // A lost publish and a lost withdraw.
        let k1 = block_key("kvf", &ns("x"), &h[1]);
        let k3 = block_key("kvf", &ns("x"), &h[3]);
        let _: () = redis::pipe()
            .cmd("SREM")
            .arg(&k1)
            .arg("a")
            .ignore()
            .cmd("SREM")
            .arg("kvf:node:a")
            .arg(&k1)
            .ignore()
            .cmd("SADD")
            .arg(&k3)
            .arg("a")
            .ignore()
            .cmd("SADD")
            .arg("kvf:node:a")
            .arg(&k3)
            .ignore()
            .query(&mut c)
            .unwrap();
        let took = eventually(o.reconcile_interval * 4, "reconciled", || {
            let holds: Vec<bool> = block_on(d.owners(&ns("x"), &h, "b"))
                .iter()
                .map(|o| !o.is_empty())
                .collect();
            holds == [true, true, false, false]
        });
        assert!(took <= o.reconcile_interval * 2, "{took:?}");
        assert_eq!(
            d.stats().health.unwrap().reannounces,
            0,
            "a diff, not a re-announce"
        );
    }

    #[test]
    fn a_directory_started_while_the_server_is_down_catches_up() {
        let port = free_port();
        let o = quick();
        let d = RedisDirectory::start(&format!("127.0.0.1:{port}"), "kvf", o.clone()).unwrap();
        let h = hashes(4);
        d.publish("a", &ns("x"), &h);
        eventually(Duration::from_secs(5), "the breaker opens", || {
            d.breaker() == BreakerState::Open
        });
        assert!(block_on(d.lookup(&ns("x"), &h, "b")).is_empty());
        let _server = RedisServer::start_on(port, None).expect("a server on the port");
        eventually(
            recovery(&o) + o.connect_timeout,
            "found once the server is up",
            || block_on(d.lookup(&ns("x"), &h, "b")) == vec![seg(0, 4, &["a"])],
        );
    }
}
