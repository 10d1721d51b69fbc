//! NIC-side actors: [`MrRegistry`] (every region on every NIC, refcounted, coalesced),
//! [`NicWorker`] (one per NIC on its own `Arbiter`: QPs, handshakes, ordered batches),
//! [`CompletionPoller`] (one OS thread per completion queue), [`NicSection`] and
//! [`VerbsSection`] (the `[[nic]]` and `[verbs]` config), [`NicRuntime`], which runs them on
//! an actix `System` of its own, and two plain decisions for the load path: [`verbs_refusal`]
//! (the `direct_gpu` gate) and [`stripe_plan`] / [`NicRouting`] (which NIC carries each read).

pub mod config;
pub mod gate;
pub mod mr_registry;
pub mod poller;
pub mod runtime;
pub mod stripe;
pub mod worker;

pub use config::{parse_nics, NicSection, NicSectionError, VerbsSection};
pub use gate::verbs_refusal;
pub use mr_registry::{
    GetRegistryCounts, MrRegistry, RdmaSlot, RegionHandles, RegionId, RegionSpec, RegisterRegion,
    Registry, RegistryCounts, RegistryError, RegistryFailures, RegistryGaugeValues, RegistryGauges,
};
pub use poller::{CompletionPoller, CompletionStream};
pub use runtime::{NicRuntime, NodeNics, RuntimeError};
pub use stripe::{stripe_plan, NicRouting, ReadRoute, RoutingError, StripePlan};
pub use worker::{
    BatchResult, CompletionErrorCounts, Connect, Gauges, NicWorker, PostReads, QpStateCounts,
    WorkerError, WorkerGaugeValues,
};
