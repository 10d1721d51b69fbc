//! What the NIC actors report for a scrape ([`NicMetrics`]), and how a scrape records it.

use ::metrics::{counter, gauge};

use crate::metrics::names::*;

/// What the NIC actors report for a scrape: memory registrations by NIC, kind and failure
/// reason; each NIC worker's QPs by state and completion errors by status.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NicMetrics {
    pub registry: crate::nic::RegistryCounts,
    /// (nic, its worker's gauges).
    pub workers: Vec<(String, crate::nic::WorkerGaugeValues)>,
}

/// The kinds of memory a NIC registers (`nic::mr_registry`'s `MrKind`).
const MR_KINDS: [&str; 2] = ["host", "device"];

impl crate::metrics::Sampled for NicMetrics {
    fn record(&self) {
        // Every NIC's registration series exist from its first scrape, at 0 until one is made,
        // so that `rate()` and alerts see the first registration.
        for (nic, _) in &self.registry.registered {
            for kind in MR_KINDS {
                counter!(MR_REGISTRATIONS, "nic" => nic.clone(), "kind" => kind).absolute(0);
            }
        }
        for (nic, kind, n) in &self.registry.made {
            counter!(MR_REGISTRATIONS, "nic" => nic.clone(), "kind" => *kind).absolute(*n);
        }
        for (nic, kind, reason, n) in &self.registry.failed {
            counter!(MR_REGISTRATION_FAILURES, "nic" => nic.clone(), "kind" => *kind, "reason" => *reason)
                .absolute(*n);
        }
        for (nic, n) in &self.registry.registered {
            gauge!(MRS_REGISTERED, "nic" => nic.clone()).set(*n as f64);
        }
        for (nic, g) in &self.workers {
            for (state, n) in g.states.labelled() {
                gauge!(QPS, "nic" => nic.clone(), "state" => state).set(n as f64);
            }
            for (status, n) in g.completion_errors.labelled() {
                counter!(COMPLETION_ERRORS, "nic" => nic.clone(), "status" => status).absolute(n);
            }
        }
    }
}
