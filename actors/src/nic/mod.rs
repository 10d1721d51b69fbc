//! NIC-side actors: [`MrRegistry`] (every region on every NIC, refcounted, coalesced),
//! [`NicWorker`] (one per NIC on its own `Arbiter`: QPs, handshakes, ordered batches),
//! [`CompletionPoller`] (one OS thread per completion queue), [`NicSection`] (the `[[nic]]`
//! config) and [`NicRuntime`], which runs them on an actix `System` of its own.

pub mod config;
pub mod mr_registry;
pub mod poller;
pub mod runtime;
pub mod worker;

pub use config::{parse_nics, NicSection, NicSectionError};
pub use mr_registry::{
    MrRegistry, RegionHandles, RegionId, RegionSpec, RegisterRegion, Registry, RegistryError,
    RegistryFailures, RegistryGaugeValues, RegistryGauges,
};
pub use poller::{CompletionPoller, CompletionStream};
pub use runtime::{NicRuntime, RuntimeError};
pub use worker::{
    BatchResult, Connect, Gauges, NicWorker, PostReads, WorkerError, WorkerGaugeValues,
};
