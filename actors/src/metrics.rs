//! Counters and gauges shared by the actors; `Stats` reads them. (The Prometheus exporter
//! reads the same values.)

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

#[derive(Debug, Default)]
pub struct Counters {
    pub transfers_in_flight: AtomicUsize,
    pub loads_ok: AtomicU64,
    pub loads_failed: AtomicU64,
    pub bytes_loaded: AtomicU64,
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
}

/// Counts one transfer in flight for as long as it lives.
#[derive(Debug)]
pub struct InFlight(pub(crate) std::sync::Arc<Counters>);

impl InFlight {
    pub fn new(c: std::sync::Arc<Counters>) -> Self {
        c.transfers_in_flight.fetch_add(1, Ordering::Relaxed);
        Self(c)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.transfers_in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}
