//! kvferry's cross-crate and multi-process integration tests, one test binary (one link on
//! two cores instead of seven): each module is one area, named as its tests are filtered
//! (`cargo test -p kvferry-tests --test integration engine_rpc::`).

mod data_plane;
mod engine_rpc;
mod events;
mod node;
mod peer_rpc;
mod remote;
mod spans;
mod ssd;
mod tenants;
mod tls;
mod transport_actors;
mod verbs_soft;
