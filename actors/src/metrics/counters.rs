//! What a node records as it happens: loads, transfers, queries, abandoned requests.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use ::metrics::{counter, histogram};

use crate::api::TransferReport;
use crate::metrics::namespaces::TenantUsage;
use crate::metrics::namespaces::{NamespaceLabels, NamespaceUsage};
use crate::metrics::registry::Registry;
use crate::metrics::STAGE_SECONDS;
use crate::metrics::{ABANDONED, BYTES, LOADS, NAMESPACE_QUERY_BLOCKS, QUERIES, QUERY_BLOCKS};
use crate::model::Namespace;

/// How often one kind of failed transfer is logged per path.
pub const FAILURE_LOG_PERIOD: std::time::Duration = std::time::Duration::from_secs(10);
static FAILURES: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new(FAILURE_LOG_PERIOD);
static ABANDONS: crate::log_limit::LogLimit = crate::log_limit::LogLimit::new(FAILURE_LOG_PERIOD);

/// What a node counts as it happens: the plain counters `Node::stats` reads, and the
/// families of its own recorder.
#[derive(Debug)]
pub struct Counters {
    pub transfers_in_flight: AtomicUsize,
    pub loads_ok: AtomicU64,
    pub loads_failed: AtomicU64,
    pub bytes_loaded: AtomicU64,
    pub(super) registry: Registry,
    /// Which namespaces the per-namespace families name.
    namespaces: NamespaceLabels,
}

impl Default for Counters {
    fn default() -> Self {
        Self {
            transfers_in_flight: AtomicUsize::new(0),
            loads_ok: AtomicU64::new(0),
            loads_failed: AtomicU64::new(0),
            bytes_loaded: AtomicU64::new(0),
            registry: Registry::new(),
            namespaces: NamespaceLabels::new(32),
        }
    }
}

impl Counters {
    pub fn load(&self, ok: bool, bytes: u64) {
        if ok {
            self.loads_ok.fetch_add(1, Ordering::Relaxed);
            self.bytes_loaded.fetch_add(bytes, Ordering::Relaxed);
        } else {
            self.loads_failed.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Records one finished transfer: by path and status, its bytes and its stages.
    pub fn transfer(&self, path: &'static str, out: Result<&TransferReport, ()>) {
        let stages = self.registry.record(|| record_transfer(path, out));
        self.registry.sampled(stages as u64);
    }

    /// Logs a failed transfer with its kind (the error's variant): at most one line per
    /// path and kind every [`FAILURE_LOG_PERIOD`], saying how many it stands for, since a
    /// fault (a peer gone, a full pool) fails every load until it clears.
    pub fn log_failure<E>(&self, path: &'static str, e: &E)
    where
        E: std::fmt::Debug + std::fmt::Display,
    {
        let debug = format!("{e:?}");
        let kind = debug
            .split(|c: char| !c.is_alphanumeric() && c != '_')
            .next()
            .unwrap_or("");
        if let Some(held_back) = FAILURES.allow(&format!("{path}/{kind}")) {
            tracing::warn!(path, kind, error = %e, held_back, "transfer failed");
        }
    }

    /// Records a query by result: `local`, `remote` (some blocks from peers) or `miss`.
    pub fn query(&self, result: &'static str) {
        self.registry.record(|| record_query(result));
    }

    /// Counts a request discarded because its client's fence passed (`op`: save,
    /// put_blocks, query) and logs it, at most one line per op every
    /// [`FAILURE_LOG_PERIOD`].
    pub fn abandoned(&self, op: &'static str, blocks: usize, late: std::time::Duration) {
        self.registry
            .record(|| counter!(ABANDONED, "op" => op).increment(1));
        if let Some(held_back) = ABANDONS.allow(op) {
            tracing::warn!(
                op,
                blocks,
                late_ms = late.as_millis() as u64,
                held_back,
                "the client gave up before the request took effect; discarded"
            );
        }
    }

    /// How many namespaces the per-namespace families name (the rest are "other").
    pub fn set_namespace_labels(&self, cap: usize) {
        self.namespaces.set_cap(cap);
    }

    /// Records a query's hit and missed blocks under its namespace's label.
    pub fn namespace_query(&self, ns: &Namespace, hit: usize, miss: usize) {
        let label = self.namespaces.label(ns);
        self.registry.record(|| {
            for (result, n) in [("hit", hit), ("miss", miss)] {
                counter!(NAMESPACE_QUERY_BLOCKS, "namespace" => label.clone(), "result" => result)
                    .increment(n as u64);
            }
        });
    }

    /// The namespaces' RAM use under their labels, for a scrape.
    pub fn namespace_usage(&self, usage: &[TenantUsage]) -> NamespaceUsage {
        NamespaceUsage::of(&self.namespaces, usage)
    }

    /// The namespaces' SSD use under the same labels, for a scrape.
    pub fn namespace_ssd_usage(
        &self,
        usage: &[TenantUsage],
    ) -> crate::metrics::namespaces::SsdNamespaceUsage {
        crate::metrics::namespaces::SsdNamespaceUsage(NamespaceUsage::of(&self.namespaces, usage))
    }

    /// Records where a query's blocks were found: this node's RAM or SSD, a peer, nowhere.
    pub fn query_blocks(&self, ram: usize, ssd: usize, remote: usize, miss: usize) {
        self.registry
            .record(|| record_query_blocks(ram, ssd, remote, miss));
    }
}

/// Returns the stage samples recorded.
pub(super) fn record_transfer(path: &'static str, out: Result<&TransferReport, ()>) -> usize {
    match out {
        Ok(r) => {
            counter!(LOADS, "path" => path, "status" => "ok").increment(1);
            counter!(BYTES, "path" => path).increment(r.bytes);
            for s in &r.stages {
                histogram!(STAGE_SECONDS, "path" => path, "stage" => s.name.as_str())
                    .record(s.seconds);
            }
            r.stages.len()
        }
        Err(()) => {
            counter!(LOADS, "path" => path, "status" => "error").increment(1);
            0
        }
    }
}

pub(super) fn record_query(result: &'static str) {
    counter!(QUERIES, "result" => result).increment(1);
}

pub(super) fn record_query_blocks(ram: usize, ssd: usize, remote: usize, miss: usize) {
    for (tier, n) in [
        ("ram", ram),
        ("ssd", ssd),
        ("remote", remote),
        ("miss", miss),
    ] {
        counter!(QUERY_BLOCKS, "tier" => tier).increment(n as u64);
    }
}

/// Counts one transfer in flight for as long as it lives.
#[derive(Debug)]
pub struct InFlight(pub(crate) Arc<Counters>);

impl InFlight {
    pub fn new(c: Arc<Counters>) -> Self {
        c.transfers_in_flight.fetch_add(1, Ordering::Relaxed);
        Self(c)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.transfers_in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}
