//! The files of `[tls]` read into what rustls uses: the node's [`CertifiedKey`] (the key
//! checked to be the certificate's) and the CA's [`RootCertStore`], and the leaf
//! certificate's notAfter (x509-parser), which the node reports and checks at start.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use rustls::sign::CertifiedKey;
use rustls::RootCertStore;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::tls::TlsError;

/// Where the node's TLS material is read from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// Certificate chain, PEM, leaf first.
    pub cert: PathBuf,
    /// Private key of the leaf, PEM.
    pub key: PathBuf,
    /// CA certificates peers' certificates must chain to, PEM.
    pub ca: PathBuf,
}

impl TlsFiles {
    /// The files' modification times, to notice a rotation by polling.
    pub fn stamps(&self) -> [Option<SystemTime>; 3] {
        let m = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        [m(&self.cert), m(&self.key), m(&self.ca)]
    }
}

/// The files, parsed and checked.
#[derive(Clone, Debug)]
pub struct TlsMaterial {
    pub certified: Arc<CertifiedKey>,
    pub roots: Arc<RootCertStore>,
    /// The leaf certificate's notAfter, unix seconds.
    pub not_after_unix: i64,
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_owned(),
        source,
    })
}

fn certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(what, path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::Pem {
            what,
            path: path.to_owned(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsError::Empty {
            what,
            path: path.to_owned(),
            expected: "CERTIFICATE block",
        });
    }
    Ok(certs)
}

impl TlsMaterial {
    /// Reads and checks the three files: each parses, the CA's certificates are trust
    /// anchors, and the key is the leaf certificate's.
    pub fn load(files: &TlsFiles) -> Result<Self, TlsError> {
        let chain = certs("certificate", &files.cert)?;
        let key_pem = read("key", &files.key)?;
        let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|source| match source {
            rustls_pki_types::pem::Error::NoItemsFound => TlsError::Empty {
                what: "key",
                path: files.key.clone(),
                expected: "PRIVATE KEY block",
            },
            source => TlsError::Pem {
                what: "key",
                path: files.key.clone(),
                source,
            },
        })?;
        let signer = rustls::crypto::ring::sign::any_supported_type(&key).map_err(|source| {
            TlsError::UnsupportedKey {
                path: files.key.clone(),
                source,
            }
        })?;
        let not_after_unix = not_after(&chain[0], &files.cert)?;
        let certified = CertifiedKey::new(chain, signer);
        certified
            .keys_match()
            .map_err(|source| TlsError::KeyMismatch {
                key: files.key.clone(),
                cert: files.cert.clone(),
                source,
            })?;
        let mut roots = RootCertStore::empty();
        for ca in certs("ca", &files.ca)? {
            roots.add(ca).map_err(|source| TlsError::BadCa {
                path: files.ca.clone(),
                source,
            })?;
        }
        Ok(Self {
            certified: Arc::new(certified),
            roots: Arc::new(roots),
            not_after_unix,
        })
    }

    /// Seconds from `now` until the certificate expires; negative once it has.
    pub fn expires_in(&self, now: SystemTime) -> i64 {
        self.not_after_unix.saturating_sub(unix_secs(now))
    }

    /// Refuses a certificate already past its notAfter at `now` (naming `tls.cert`).
    pub fn check_unexpired(&self, cert: &Path, now: SystemTime) -> Result<(), TlsError> {
        let left = self.expires_in(now);
        if left < 0 {
            return Err(TlsError::Expired {
                path: cert.to_owned(),
                not_after_unix: self.not_after_unix,
                ago_secs: left.unsigned_abs(),
            });
        }
        Ok(())
    }
}

/// `t` in unix seconds (before 1970: negative).
pub(crate) fn unix_secs(t: SystemTime) -> i64 {
    match t.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        Err(e) => i64::try_from(e.duration().as_secs()).map_or(i64::MIN, |s| -s),
    }
}

/// The notAfter of a DER certificate, unix seconds.
fn not_after(cert: &CertificateDer<'_>, path: &Path) -> Result<i64, TlsError> {
    let (_, parsed) =
        x509_parser::parse_x509_certificate(cert.as_ref()).map_err(|e| TlsError::Certificate {
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
    Ok(parsed.validity().not_after.timestamp())
}
