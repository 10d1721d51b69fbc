//! The integration tests' harness over the runtime (`tests/tests/integration`, the `kvferry`
//! binary's tests, its `demo` and `bench`); the runtime-free fixtures it builds on are
//! `kvferry-testkit`'s.
//!
//! A node over a host-emulated device ([`node`], [`start`]), in-process clusters of them
//! ([`Cluster`]), their Peer service ([`PeerServer`], [`grpc_peers`]) and engine service with
//! its fd socket ([`EngineServer`]); the testkit's KV on a node ([`RegisterKv`],
//! [`put_pattern`]), and the requests every test makes ([`query`], [`load`],
//! [`load_and_verify`], [`expected`]); gauge checks ([`settled`], [`Cluster::settled`]); an
//! owner node in its own process ([`run_owner_process`]); lab certificates as [`TlsFiles`]
//! ([`tls_files`]); and real processes the tests start (`redis-server`, `promtool`, this test
//! binary as a child).
//!
//! [`TlsFiles`]: kvferry_actors::tls::TlsFiles

mod cluster;
mod engine_server;
mod fixtures;
mod hooked;
mod node_kv;
mod owner;
mod peer_server;
mod process;
pub mod raw;
mod tls;

pub use cluster::Cluster;
pub use engine_server::EngineServer;
pub use fixtures::*;
pub use hooked::{HookedDevice, SubmitHook};
pub use node_kv::{put_pattern, RegisterKv};
pub use owner::{run_owner_process, OwnerSpec};
pub use peer_server::{grpc_peers, PeerServer};
pub use process::{
    free_port, promtool_check, stdin_closed, wait_listening, ChildTest, RedisServer,
};
pub use tls::tls_files;

/// The testkit's client-side pattern put, beside this crate's in-process one.
pub use kvferry_testkit::put_pattern_over;
/// Host KV of a client without a GPU, as the tests play that client (a memfd with the
/// fixture's pattern and canaries).
pub use kvferry_testkit::MemfdKv;
