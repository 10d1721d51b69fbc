//! TLS counters of one node: failed handshakes by listener, reloads by result, and when its
//! own certificate expires. Kept as atomics beside the listeners and sampled at scrape time
//! ([`crate::metrics::Sampled`]); the expiry gauge is reckoned from the clock then, so it
//! counts down between reloads.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::SystemTime;

use metrics::{counter, gauge};

use crate::metrics::names::{TLS_CERT_EXPIRY, TLS_HANDSHAKE_FAILURES, TLS_RELOADS};

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

#[derive(Debug)]
pub struct TlsStats {
    failures: [AtomicU64; 6],
    reloads_ok: AtomicU64,
    reloads_failed: AtomicU64,
    /// The node's certificate's notAfter, unix seconds; `i64::MIN`: none loaded.
    cert_not_after: AtomicI64,
}

impl Default for TlsStats {
    fn default() -> Self {
        Self {
            failures: Default::default(),
            reloads_ok: AtomicU64::new(0),
            reloads_failed: AtomicU64::new(0),
            cert_not_after: AtomicI64::new(i64::MIN),
        }
    }
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

    pub(crate) fn set_cert_not_after(&self, unix: i64) {
        self.cert_not_after.store(unix, Ordering::Relaxed);
    }

    /// Seconds from `now` until the loaded certificate expires (negative once it has); none
    /// before one is loaded.
    pub fn cert_expires_in(&self, now: SystemTime) -> Option<i64> {
        let at = self.cert_not_after.load(Ordering::Relaxed);
        (at != i64::MIN).then(|| at.saturating_sub(crate::tls::material::unix_secs(now)))
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
    cert_expires_in: Option<i64>,
}

impl TlsStats {
    pub fn sample(&self) -> TlsSample {
        TlsSample {
            failures: TlsSide::ALL.map(|s| self.handshake_failures(s)),
            reloads: self.reloads(),
            cert_expires_in: self.cert_expires_in(SystemTime::now()),
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
        if let Some(s) = self.cert_expires_in {
            gauge!(TLS_CERT_EXPIRY).set(s as f64);
        }
    }
}
