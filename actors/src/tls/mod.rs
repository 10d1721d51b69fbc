//! TLS for the node's TCP listeners and its calls to peers, over rustls (ring).
//!
//! [`TlsContext`] holds the node's certificate and the cluster CA from `[tls]`
//! ([`TlsFiles`], read by [`TlsMaterial`]) and hands out rustls server and client configs
//! whose certificate and verifiers it can swap ([`TlsContext::reload`], triggered by
//! [`reload::watch`]) without touching established sessions. [`tls_incoming`] turns a
//! listener into handshaken connections for tonic, each handshake on its own task within a
//! deadline; [`connect_tls`] dials a peer. [`TlsStats`] counts failed handshakes by listener
//! and reloads.

mod connector;
mod context;
mod error;
mod incoming;
mod material;
pub mod reload;
mod stats;

pub use connector::{connect_tls, TlsDial};
pub use context::{peer_server_name, ClientAuth, TlsContext, ALPN_H2, DEFAULT_EXPIRY_WARNING};
pub use error::TlsError;
pub(crate) use incoming::handshake_failed;
pub use incoming::{tls_incoming, ServerTlsStream, TlsAccept, TlsServing, MAX_PENDING_HANDSHAKES};
pub use material::{TlsFiles, TlsMaterial};
pub use stats::{TlsSample, TlsSide, TlsStats};

#[cfg(test)]
pub(crate) mod tests;
