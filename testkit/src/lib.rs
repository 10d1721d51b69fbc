//! Fixtures and benchmark helpers for kvferry's tests and the `kvferry` binary's `demo` and
//! `bench`, without the runtime: they speak the wire (`kvferry-proto`), the engine client
//! (`kvferry-client`), devices (`kvferry-gpu`) and transports; what needs a `Node` is
//! `kvferry-harness`'s. The library crates never depend on this one.
//!
//! Fixtures: the byte pattern of every (block, rank, layer, segment, offset) and its
//! [`CANARY`] ([`rank_part`]); [`DeviceKv`] (device KV in each [`KvKind`] engines allocate,
//! canaries everywhere, [`DeviceKv::verify`]); [`MemfdKv`] and [`MemfdRegionsKv`] (host KV in
//! memfds, as an engine without a GPU passes it); [`Attached`], an engine process attached to
//! a running node, and [`put_pattern_over`] a client; [`LabCa`], a lab CA writing node
//! certificates ([`CertFiles`]) for TLS. Benchmarks: [`transport_bench`] and the raw-driver
//! baselines [`bench_raw_h2d`] and [`bench_raw_duplex`].

mod attached;
mod cuda_bench;
mod cuda_duplex;
mod device_kv;
mod lab_tls;
mod memfd_kv;
mod pattern;
mod stats;

pub mod transport_bench;

pub use attached::{put_pattern_over, AttachError, Attached};
pub use cuda_bench::bench_raw_h2d;
pub use cuda_duplex::{bench_raw_duplex, DuplexRanges};
pub use device_kv::{DeviceKv, KvKind};
pub use lab_tls::{CertFiles, LabCa, LabTlsError};
pub use memfd_kv::{MemfdKv, MemfdRegionsKv};
pub use pattern::{fill_segment, rank_part, CANARY};
pub use stats::median;
