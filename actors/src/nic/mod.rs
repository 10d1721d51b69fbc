//! NIC-side actors: [`MrRegistry`] (every region on every NIC, refcounted, coalesced),
//! [`NicWorker`] (one per NIC on its own `Arbiter`, a thin driver of [`PeerQueues`], the
//! plain per-QP bookkeeping: windows, completion-queue admission, ordered batches, drains,
//! reconnects), [`CompletionPoller`] (one OS thread per completion queue), [`NicSection`] and
//! [`VerbsSection`] (the `[[nic]]` and `[verbs]` config), [`NicRuntime`], which runs them on
//! Arbiters of the node's actix `System`, and two plain decisions for the load path:
//! [`verbs_refusal`] (the `direct_gpu` gate) and [`stripe_plan`] / [`NicRouting`] (which NIC
//! carries each read).

pub mod config;
pub mod gate;
pub mod metrics;
pub mod mr_registry;
pub mod peer_queues;
pub mod poller;
pub mod responder;
pub mod runtime;
pub mod stripe;
pub mod worker;

pub use config::{parse_nics, NicSection, NicSectionError, VerbsSection};
pub use gate::verbs_refusal;
pub use metrics::NicMetrics;
pub use mr_registry::{
    GetRegistryCounts, MrRegistry, RdmaSlot, RegionHandles, RegionId, RegionSpec, RegisterRegion,
    Registry, RegistryCounts, RegistryError, RegistryFailures, RegistryGaugeValues, RegistryGauges,
};
pub use peer_queues::{ConnectJob, ConnectResult, Connected, Event, FailureKind, PeerQueues};
pub use poller::{CompletionPoller, CompletionStream};
pub use responder::{NicResponder, ServingNic};
pub use runtime::{
    run_on_system, NicRuntime, NodeNics, PreparedNics, PreparedRuntime, RuntimeError, VerbsNicSide,
    VerbsSide,
};
pub use stripe::{stripe_plan, NicRouting, ReadRoute, RoutingError, StripePlan};
pub use worker::{
    BatchResult, CompletionErrorCounts, Connect, Gauges, NicWorker, PostReads, QpStateCounts,
    WorkerError, WorkerGaugeValues,
};
