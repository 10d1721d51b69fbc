//! What can go wrong loading TLS material or setting TLS up.

use std::path::PathBuf;

use thiserror::Error;

/// Loading the node's certificate, key or CA. Each variant names the file; [`TlsError::key`]
/// names the config key, so a refused start says which line to fix.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TlsError {
    #[error("reading {what} {}", path.display())]
    Read {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} {}: not PEM", path.display())]
    Pem {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: rustls_pki_types::pem::Error,
    },
    #[error("{what} {}: holds no {expected}", path.display())]
    Empty {
        what: &'static str,
        path: PathBuf,
        expected: &'static str,
    },
    /// The leaf certificate is not an X.509 certificate its validity can be read from.
    #[error("certificate {}: not a readable X.509 certificate: {reason}", path.display())]
    Certificate { path: PathBuf, reason: String },
    /// The node's own certificate is past its notAfter: every peer would refuse it.
    #[error("certificate {}: expired {ago_secs} s ago (notAfter {not_after_unix}, unix time)", path.display())]
    Expired {
        path: PathBuf,
        not_after_unix: i64,
        ago_secs: u64,
    },
    /// The key parsed but is of a kind rustls cannot sign with.
    #[error("key {}: unsupported private key", path.display())]
    UnsupportedKey {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
    /// `key` is not the private key of `cert`'s first certificate.
    #[error("key {} is not the key of certificate {}", key.display(), cert.display())]
    KeyMismatch {
        key: PathBuf,
        cert: PathBuf,
        #[source]
        source: rustls::Error,
    },
    /// A certificate of the CA file is not one webpki accepts as a trust anchor.
    #[error("ca {}: not a usable CA certificate", path.display())]
    BadCa {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("ca {}: building the certificate verifier", path.display())]
    Verifier {
        path: PathBuf,
        #[source]
        source: rustls::server::VerifierBuilderError,
    },
    /// rustls refused the protocol versions or the provider (not expected with ring).
    #[error("setting up TLS")]
    Setup {
        #[source]
        source: rustls::Error,
    },
    /// A peer's node id is not a name a certificate can carry.
    #[error("peer {peer:?}: not a DNS name a certificate can name")]
    ServerName { peer: String },
}

impl TlsError {
    /// The `[tls]` key whose file is at fault.
    pub fn key(&self) -> &'static str {
        match self {
            Self::Read { what, .. } | Self::Pem { what, .. } | Self::Empty { what, .. } => {
                match *what {
                    "certificate" => "tls.cert",
                    "key" => "tls.key",
                    _ => "tls.ca",
                }
            }
            Self::Certificate { .. } | Self::Expired { .. } => "tls.cert",
            Self::UnsupportedKey { .. } | Self::KeyMismatch { .. } => "tls.key",
            Self::BadCa { .. } | Self::Verifier { .. } => "tls.ca",
            Self::Setup { .. } => "tls",
            Self::ServerName { .. } => "cluster.peers",
        }
    }
}
