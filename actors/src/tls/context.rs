//! [`TlsContext`]: the node's TLS material behind rustls configs that outlive a rotation.
//!
//! Every config handed out resolves the node's certificate and verifies peers through
//! the context, not through a copy: [`TlsContext::reload`] swaps in the new
//! `Arc<CertifiedKey>` and verifiers built from the new CA, and the next handshake uses
//! them. Sessions already established keep the keys they agreed and are not touched, so a
//! rotation drops nothing in flight. A reload that fails (a half-written file, a key that
//! is not the certificate's, a certificate already expired) keeps what was loaded and is
//! counted. The node's own certificate's notAfter is kept for the expiry gauge, and a
//! certificate that expires within the warning period is logged at load and at each reload.

use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{ResolvesClientCert, WebPkiServerVerifier};
use rustls::crypto::CryptoProvider;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{
    ClientConfig, DigitallySignedStruct, DistinguishedName, ServerConfig, SignatureScheme,
};
use rustls_pki_types::{CertificateDer, ServerName, UnixTime};
use serde::{Deserialize, Serialize};

use crate::tls::{TlsError, TlsFiles, TlsMaterial, TlsStats};

/// Whether a server asks its clients for a certificate.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum ClientAuth {
    /// No certificate is asked for.
    None,
    /// One is asked for and checked against the CA if sent; a client without one is served.
    #[default]
    Optional,
    /// A client without a certificate the CA signed is refused.
    Required,
}

/// How long before its certificate expires a node starts warning, unless told otherwise.
pub const DEFAULT_EXPIRY_WARNING: Duration = Duration::from_secs(14 * 86_400);

/// ALPN of the gRPC listeners (HTTP/2 only).
pub const ALPN_H2: &[u8] = b"h2";

/// What one load of the files became.
#[derive(Debug)]
struct Current {
    certified: Arc<CertifiedKey>,
    required: Arc<dyn ClientCertVerifier>,
    optional: Arc<dyn ClientCertVerifier>,
    server: Arc<WebPkiServerVerifier>,
    /// The leaf certificate's notAfter, unix seconds.
    not_after_unix: i64,
}

#[derive(Debug)]
struct Inner {
    files: TlsFiles,
    expiry_warning: Duration,
    provider: Arc<CryptoProvider>,
    current: RwLock<Arc<Current>>,
    stats: Arc<TlsStats>,
}

/// The node's certificate and CA, reloadable; cheap to clone.
#[derive(Clone, Debug)]
pub struct TlsContext {
    inner: Arc<Inner>,
}

fn build(files: &TlsFiles, provider: &Arc<CryptoProvider>) -> Result<Current, TlsError> {
    let m = TlsMaterial::load(files)?;
    let verifier_err = |source| TlsError::Verifier {
        path: files.ca.clone(),
        source,
    };
    let required =
        WebPkiClientVerifier::builder_with_provider(Arc::clone(&m.roots), Arc::clone(provider))
            .build()
            .map_err(verifier_err)?;
    let optional =
        WebPkiClientVerifier::builder_with_provider(Arc::clone(&m.roots), Arc::clone(provider))
            .allow_unauthenticated()
            .build()
            .map_err(verifier_err)?;
    let server = WebPkiServerVerifier::builder_with_provider(m.roots, Arc::clone(provider))
        .build()
        .map_err(verifier_err)?;
    Ok(Current {
        certified: m.certified,
        required,
        optional,
        server,
        not_after_unix: m.not_after_unix,
    })
}

impl TlsContext {
    /// Loads the files (ring as the crypto provider), warning of a certificate that
    /// expires within [`DEFAULT_EXPIRY_WARNING`].
    pub fn load(files: TlsFiles) -> Result<Self, TlsError> {
        Self::load_with(files, DEFAULT_EXPIRY_WARNING)
    }

    /// [`Self::load`], warning (at load and at each reload) of a certificate that expires
    /// within `expiry_warning` (zero: never). An expired certificate is loaded (a config's
    /// `validate()` refuses it; tests present one), but a reload does not swap one in.
    pub fn load_with(files: TlsFiles, expiry_warning: Duration) -> Result<Self, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let current = build(&files, &provider)?;
        let stats = Arc::new(TlsStats::default());
        stats.set_cert_not_after(current.not_after_unix);
        let ctx = Self {
            inner: Arc::new(Inner {
                files,
                expiry_warning,
                provider,
                current: RwLock::new(Arc::new(current)),
                stats,
            }),
        };
        ctx.warn_if_expiring(SystemTime::now());
        Ok(ctx)
    }

    /// Seconds from `now` until the certificate handshakes present expires (negative once
    /// it has).
    pub fn cert_expires_in(&self, now: SystemTime) -> i64 {
        self.current()
            .not_after_unix
            .saturating_sub(crate::tls::material::unix_secs(now))
    }

    /// Logs a warning if the certificate expires within the warning period; whether it did.
    fn warn_if_expiring(&self, now: SystemTime) -> bool {
        let left = self.cert_expires_in(now);
        let warn = i64::try_from(self.inner.expiry_warning.as_secs()).unwrap_or(i64::MAX);
        if warn == 0 || left >= warn {
            return false;
        }
        tracing::warn!(
            cert = %self.inner.files.cert.display(),
            expires_in_days = left as f64 / 86_400.0,
            warn_days = warn / 86_400,
            "this node's TLS certificate expires soon: peers will refuse it then; rotate it \
             (new files, then SIGHUP)"
        );
        true
    }

    pub fn files(&self) -> &TlsFiles {
        &self.inner.files
    }

    pub fn stats(&self) -> &Arc<TlsStats> {
        &self.inner.stats
    }

    fn current(&self) -> Arc<Current> {
        Arc::clone(
            &self
                .inner
                .current
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// The certificate handshakes present now.
    pub fn certified_key(&self) -> Arc<CertifiedKey> {
        Arc::clone(&self.current().certified)
    }

    /// Rereads the files; on success later handshakes use them, on failure nothing changes.
    /// Either way the result is counted and logged.
    pub fn reload(&self) -> Result<(), TlsError> {
        let now = SystemTime::now();
        let built = build(&self.inner.files, &self.inner.provider).and_then(|c| {
            let left = c
                .not_after_unix
                .saturating_sub(crate::tls::material::unix_secs(now));
            match left < 0 {
                true => Err(TlsError::Expired {
                    path: self.inner.files.cert.clone(),
                    not_after_unix: c.not_after_unix,
                    ago_secs: left.unsigned_abs(),
                }),
                false => Ok(c),
            }
        });
        match built {
            Ok(c) => {
                self.inner.stats.set_cert_not_after(c.not_after_unix);
                *self
                    .inner
                    .current
                    .write()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(c);
                self.inner.stats.reloaded(true);
                tracing::info!(
                    cert = %self.inner.files.cert.display(),
                    "TLS certificate, key and CA reloaded; new handshakes use them"
                );
                self.warn_if_expiring(now);
                Ok(())
            }
            Err(e) => {
                self.inner.stats.reloaded(false);
                tracing::warn!(
                    key = e.key(),
                    error = %e,
                    "TLS reload failed; keeping the certificate and CA loaded before"
                );
                Err(e)
            }
        }
    }

    /// A server config over this context: the node's certificate, clients verified as
    /// `auth` says, ALPN `alpn` (empty: none).
    pub fn server_config(
        &self,
        auth: ClientAuth,
        alpn: &[&[u8]],
    ) -> Result<Arc<ServerConfig>, TlsError> {
        let mut c = ServerConfig::builder_with_provider(Arc::clone(&self.inner.provider))
            .with_safe_default_protocol_versions()
            .map_err(|source| TlsError::Setup { source })?
            .with_client_cert_verifier(Arc::new(ClientVerifier {
                ctx: self.clone(),
                auth,
            }))
            .with_cert_resolver(Arc::new(Resolver(self.clone())));
        c.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        // No resumption: a resumed session skips the certificate checks, so a client
        // refused by a reloaded CA (or one whose certificate expired) could come back on
        // an old session. Connections are long-lived; a full handshake each costs little.
        c.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        c.send_tls13_tickets = 0;
        Ok(Arc::new(c))
    }

    /// A client config over this context: presents the node's certificate, verifies the
    /// server's against the CA (and the name the caller connects with).
    pub fn client_config(&self, alpn: &[&[u8]]) -> Result<Arc<ClientConfig>, TlsError> {
        let mut c = ClientConfig::builder_with_provider(Arc::clone(&self.inner.provider))
            .with_safe_default_protocol_versions()
            .map_err(|source| TlsError::Setup { source })?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(ServerVerifier(self.clone())))
            .with_client_cert_resolver(Arc::new(Resolver(self.clone())));
        c.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(Arc::new(c))
    }

    /// What the data plane takes: a server config that requires a peer certificate the CA
    /// signed, and a client config that presents this node's; neither sets ALPN.
    pub fn data_plane_configs(&self) -> Result<(Arc<ServerConfig>, Arc<ClientConfig>), TlsError> {
        Ok((
            self.server_config(ClientAuth::Required, &[])?,
            self.client_config(&[])?,
        ))
    }
}

/// The name a peer's certificate must carry: its node id.
pub fn peer_server_name(node_id: &str) -> Result<ServerName<'static>, TlsError> {
    ServerName::try_from(node_id.to_owned()).map_err(|_| TlsError::ServerName {
        peer: node_id.to_owned(),
    })
}

/// The node's current certificate, as server and as client.
#[derive(Debug)]
struct Resolver(TlsContext);

impl ResolvesServerCert for Resolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.certified_key())
    }
}

impl ResolvesClientCert for Resolver {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(self.0.certified_key())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// Clients checked against the CA loaded now.
#[derive(Debug)]
struct ClientVerifier {
    ctx: TlsContext,
    auth: ClientAuth,
}

impl ClientVerifier {
    fn inner(&self) -> Arc<dyn ClientCertVerifier> {
        let c = self.ctx.current();
        match self.auth {
            ClientAuth::Required => Arc::clone(&c.required),
            _ => Arc::clone(&c.optional),
        }
    }
}

impl ClientCertVerifier for ClientVerifier {
    fn offer_client_auth(&self) -> bool {
        self.auth != ClientAuth::None
    }

    fn client_auth_mandatory(&self) -> bool {
        self.auth == ClientAuth::Required
    }

    // No hints: a node has one certificate and presents it whatever the server asks.
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.inner()
            .verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner().supported_verify_schemes()
    }
}

/// Servers checked against the CA loaded now.
#[derive(Debug)]
struct ServerVerifier(TlsContext);

impl ServerCertVerifier for ServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.0.current().server.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0
            .current()
            .server
            .verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0
            .current()
            .server
            .verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.current().server.supported_verify_schemes()
    }
}
