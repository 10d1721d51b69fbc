//! TLS counters of one node: failed handshakes by listener, reloads by result. Kept as
//! atomics beside the listeners and sampled at scrape time ([`crate::metrics::Sampled`]).

use std::sync::atomic::{AtomicU64, Ordering};

use metrics::counter;

use crate::metrics::names::{TLS_HANDSHAKE_FAILURES, TLS_RELOADS};

/// Where a handshake ran: a listener of this node, or this node calling a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsSide {
    Engine,
    Peer,
    Data,
    Metrics,
    /// This node's calls to its peers' Peer services.
    PeerClient,
    /// This node's data connections to its peers.
    DataClient,
}

impl TlsSide {
    pub const ALL: [TlsSide; 6] = [
        Self::Engine,
        Self::Peer,
        Self::Data,
        Self::Metrics,
        Self::PeerClient,
        Self::DataClient,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Engine => "engine",
            Self::Peer => "peer",
            Self::Data => "data",
            Self::Metrics => "metrics",
            Self::PeerClient => "peer-client",
            Self::DataClient => "data-client",
        }
    }
}

#[derive(Debug, Default)]
pub struct TlsStats {
    failures: [AtomicU64; 6],
    reloads_ok: AtomicU64,
    reloads_failed: AtomicU64,
}

impl TlsStats {
    pub fn handshake_failed(&self, side: TlsSide) {
        self.failures[side as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn handshake_failures(&self, side: TlsSide) -> u64 {
        self.failures[side as usize].load(Ordering::Relaxed)
    }

    pub(crate) fn reloaded(&self, ok: bool) {
        let c = if ok {
            &self.reloads_ok
        } else {
            &self.reloads_failed
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// (succeeded, failed) reloads.
    pub fn reloads(&self) -> (u64, u64) {
        (
            self.reloads_ok.load(Ordering::Relaxed),
            self.reloads_failed.load(Ordering::Relaxed),
        )
    }
}

/// A scrape's copy of the counters.
#[derive(Debug)]
pub struct TlsSample {
    failures: [u64; 6],
    reloads: (u64, u64),
}

impl TlsStats {
    pub fn sample(&self) -> TlsSample {
        TlsSample {
            failures: TlsSide::ALL.map(|s| self.handshake_failures(s)),
            reloads: self.reloads(),
        }
    }
}

impl crate::metrics::Sampled for TlsSample {
    fn record(&self) {
        for (side, n) in TlsSide::ALL.iter().zip(self.failures) {
            counter!(TLS_HANDSHAKE_FAILURES, "listener" => side.as_str()).absolute(n);
        }
        counter!(TLS_RELOADS, "result" => "ok").absolute(self.reloads.0);
        counter!(TLS_RELOADS, "result" => "failed").absolute(self.reloads.1);
    }
}
