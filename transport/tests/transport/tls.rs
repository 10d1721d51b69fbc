//! The tcp data plane over TLS, with certificates made here (rcgen): reads are byte-exact and
//! a guessed key still reads nothing; a client with a certificate from another CA, with
//! none, or without TLS at all is refused, counted, and reads nothing.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvferry_transport::tcp::{ClientTls, TcpConnector, TcpOwner, TcpOwnerOptions};
use kvferry_transport::{DataAuth, LinkGrant, QpError, Reject};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};

use super::*;

const SEED: u8 = 0x5e;
const OWNER_NAME: &str = "owner-100";

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

struct Ca(CertifiedIssuer<'static, KeyPair>);

impl Ca {
    fn new(name: &str) -> Ca {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name.push(DnType::CommonName, name);
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        Ca(CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap())
    }

    fn roots(&self) -> Arc<rustls::RootCertStore> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.0.der().clone()).unwrap();
        Arc::new(roots)
    }

    fn leaf(&self, name: &str) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
        let mut p = CertificateParams::new(vec![name.to_owned()]).unwrap();
        p.distinguished_name.push(DnType::CommonName, name);
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &self.0).unwrap();
        let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        (vec![cert.der().clone()], der)
    }

    /// The owner's config: its certificate, and clients must present one this CA signed.
    fn server(&self, name: &str) -> Arc<rustls::ServerConfig> {
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(self.roots(), provider())
                .build()
                .unwrap();
        let (chain, key) = self.leaf(name);
        Arc::new(
            rustls::ServerConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_client_cert_verifier(verifier)
                .with_single_cert(chain, key)
                .unwrap(),
        )
    }

    /// A client trusting `self` that presents a certificate `signer` made, or none.
    fn client(&self, signer: Option<&Ca>) -> ClientTls {
        let b = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(self.roots());
        let config = match signer {
            Some(s) => {
                let (chain, key) = s.leaf("requester-1");
                b.with_client_auth_cert(chain, key).unwrap()
            }
            None => b.with_no_client_auth(),
        };
        ClientTls {
            config: Arc::new(config),
            server_name: ServerName::try_from(OWNER_NAME).unwrap(),
        }
    }
}

/// Every refusal the owner reported, in order.
type Seen = Arc<Mutex<Vec<(Option<SocketAddr>, Reject)>>>;

struct Owner {
    pool: Pool,
    auth: DataAuth,
    tcp: TcpOwner,
    seen: Seen,
}

impl Owner {
    fn start(ca: &Ca) -> Owner {
        let pool = pool(SEED, 4 << 20);
        let auth = DataAuth::new();
        let mut opts = TcpOwnerOptions::new(auth.clone());
        opts.tls = Some(ca.server(OWNER_NAME));
        opts.hello_deadline = Duration::from_secs(1);
        let seen: Seen = Arc::default();
        let s = seen.clone();
        opts.on_reject = Some(Arc::new(move |from, why| {
            s.lock().unwrap().push((from, why))
        }));
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let tcp = TcpOwner::spawn_with(l, OWNER, pool.table.clone(), opts).unwrap();
        Owner {
            pool,
            auth,
            tcp,
            seen,
        }
    }

    fn connector(&self, grant: LinkGrant, tls: Option<ClientTls>) -> TcpConnector {
        let c = TcpConnector::new(ME, OWNER, self.tcp.local_addr(), grant)
            .with_connect_timeout(Duration::from_secs(2));
        match tls {
            Some(t) => c.with_tls(t),
            None => c,
        }
    }

    fn wait_for(&self, why: Reject, n: u64) {
        let until = Instant::now() + Duration::from_secs(10);
        while self.tcp.rejections().get(why) < n {
            assert!(
                Instant::now() < until,
                "{why:?}: {:?}",
                self.tcp.rejections().labelled()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Every destination byte of `p` is still canary.
fn untouched(dest: &HostRegion, p: &Plan) {
    let bytes = dest.to_vec();
    for piece in p.pieces.iter().flatten() {
        let at = piece.dst as usize..(piece.dst + piece.len) as usize;
        assert!(
            bytes[at].iter().all(|b| *b == CANARY),
            "{piece:?} was written"
        );
    }
}

#[test]
fn tls_reads_are_byte_exact_and_a_guessed_key_reads_nothing() {
    let ca = Ca::new("cluster");
    let o = Owner::start(&ca);
    let c = o.connector(o.auth.issue(ME).unwrap(), Some(ca.client(Some(&ca))));
    let r = requester(8 << 20);
    let mut qp = r.qp(OWNER, 1, limits(8, 4));
    qp.connect(&c, r.cq.clone()).unwrap();
    // Many reads, fragmented, larger than a TLS record and than rustls' buffers.
    let p = plan(&r, (&o.pool, SEED), 24, 200_000, 3, 0);
    let (done, errs) = post_and_drive(&mut qp, &r.cq, &p.reads);
    assert!(errs.is_empty(), "{errs:?}");
    assert!(all_ok(&done), "{done:?}");
    verify(&r.dest, &p, &done);
    assert_in_order(&done, &p.reads);

    let mut g = plan(&r, (&o.pool, SEED), 2, 4_000, 1, 6 << 20);
    g.reads[0].remote.rkey = MrKey(g.reads[0].remote.rkey.0 ^ 1);
    let (done, _) = post_and_drive(&mut qp, &r.cq, &g.reads);
    assert_eq!(done[0].status, CompletionStatus::RemoteAccessError);
    o.wait_for(Reject::BadRead, 1);
    let refused = Plan {
        reads: g.reads[..1].to_vec(),
        pieces: g.pieces[..1].to_vec(),
        seed: SEED,
    };
    untouched(&r.dest, &refused);
    assert_eq!(o.tcp.rejections().get(Reject::Tls), 0);
}

#[test]
fn clients_from_another_ca_without_a_certificate_or_in_clear_are_refused() {
    let ca = Ca::new("cluster");
    let other = Ca::new("other");
    let o = Owner::start(&ca);
    let refused = |tls: Option<ClientTls>| {
        let c = o.connector(o.auth.issue(ME).unwrap(), tls);
        let r = requester(1 << 20);
        let mut qp = r.qp(OWNER, 1, limits(2, 2));
        let e = match qp.connect(&c, r.cq.clone()) {
            Err(e) => e,
            Ok(()) => {
                // TLS 1.3 reports a refused client certificate after the client's Finished:
                // the first read fails and lands nothing.
                let p = plan(&r, (&o.pool, SEED), 2, 10_000, 1, 0);
                let (done, _) = post_and_drive(&mut qp, &r.cq, &p.reads);
                assert!(done.iter().all(|d| !d.status.is_success()), "{done:?}");
                untouched(&r.dest, &p);
                return;
            }
        };
        assert!(matches!(e, QpError::Connect { .. }), "{e:?}");
        let p = plan(&r, (&o.pool, SEED), 1, 10_000, 1, 0);
        untouched(&r.dest, &p);
    };
    refused(Some(ca.client(Some(&other))));
    o.wait_for(Reject::Tls, 1);
    refused(Some(ca.client(None)));
    o.wait_for(Reject::Tls, 2);
    // A client trusting another CA refuses the owner's certificate itself.
    refused(Some(other.client(Some(&ca))));
    o.wait_for(Reject::Tls, 3);
    // Plaintext against a TLS owner: each side waits for the other's first flight until the
    // hello deadline.
    refused(None);
    o.wait_for(Reject::TlsTimeout, 1);
    let seen: Vec<Reject> = o.seen.lock().unwrap().iter().map(|(_, w)| *w).collect();
    assert_eq!(
        seen,
        [Reject::Tls, Reject::Tls, Reject::Tls, Reject::TlsTimeout]
    );

    // The cluster's own requester still reads.
    let c = o.connector(o.auth.issue(ME).unwrap(), Some(ca.client(Some(&ca))));
    let r = requester(2 << 20);
    let mut qp = r.qp(OWNER, 1, limits(4, 4));
    qp.connect(&c, r.cq.clone()).unwrap();
    let p = plan(&r, (&o.pool, SEED), 6, 10_000, 2, 0);
    let (done, errs) = post_and_drive(&mut qp, &r.cq, &p.reads);
    assert!(errs.is_empty() && all_ok(&done));
    verify(&r.dest, &p, &done);
}
