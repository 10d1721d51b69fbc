//! The TLS material, the reloadable context and the handshaking listener, over loopback
//! TCP with certificates made here (rcgen): refusals (another CA, expired, none, garbage,
//! silence), rotation under an open connection, and the checks `[tls]` runs at start.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::tls::*;

/// A CA that signs node certificates into a directory of its own.
pub(crate) struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
    pub dir: PathBuf,
}

impl TestCa {
    pub(crate) fn new(dir: &Path, name: &str) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name.push(DnType::CommonName, name);
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let issuer = CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap();
        std::fs::write(dir.join("ca.pem"), issuer.pem()).unwrap();
        Self {
            issuer,
            dir: dir.to_owned(),
        }
    }

    pub(crate) fn ca_path(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// Writes `<file>.pem` and `<file>.key` for node `name`; `expired`: valid only in 2001.
    pub(crate) fn node(&self, name: &str, file: &str, expired: bool) -> TlsFiles {
        self.node_with(name, file, |p| {
            if expired {
                p.not_before = rcgen::date_time_ymd(2001, 1, 1);
                p.not_after = rcgen::date_time_ymd(2001, 12, 31);
            }
        })
    }

    /// [`Self::node`] valid from a day ago until `secs` from now.
    pub(crate) fn node_expiring_in(&self, name: &str, file: &str, secs: u64) -> TlsFiles {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap();
        self.node_with(name, file, |p| {
            p.not_before = rcgen::date_time_ymd(1970, 1, 1) + (now - Duration::from_secs(86_400));
            p.not_after = rcgen::date_time_ymd(1970, 1, 1) + (now + Duration::from_secs(secs));
        })
    }

    fn node_with(
        &self,
        name: &str,
        file: &str,
        edit: impl FnOnce(&mut CertificateParams),
    ) -> TlsFiles {
        let mut p = CertificateParams::new(vec![name.to_owned(), "localhost".to_owned()]).unwrap();
        p.distinguished_name.push(DnType::CommonName, name);
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        edit(&mut p);
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &self.issuer).unwrap();
        let files = TlsFiles {
            cert: self.dir.join(format!("{file}.pem")),
            key: self.dir.join(format!("{file}.key")),
            ca: self.ca_path(),
        };
        std::fs::write(&files.cert, cert.pem()).unwrap();
        std::fs::write(&files.key, key.serialize_pem()).unwrap();
        files
    }
}

pub(crate) fn temp_dir(what: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "kvferry-tls-{what}-{}-{:x}",
        std::process::id(),
        rand_u64()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn rand_u64() -> u64 {
    let mut b = [0u8; 8];
    getrandom::fill(&mut b).unwrap();
    u64::from_le_bytes(b)
}

/// A TLS echo server on 127.0.0.1 over `tls_incoming`: each connection echoes what it reads.
async fn echo_server(
    ctx: &TlsContext,
    auth: ClientAuth,
    timeout: Duration,
) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let serving = TlsServing {
        config: ctx.server_config(auth, &[]).unwrap(),
        side: TlsSide::Peer,
        handshake_timeout: timeout,
        stats: Arc::clone(ctx.stats()),
    };
    let mut incoming = Box::pin(tls_incoming(listener, serving));
    tokio::spawn(async move {
        use futures::StreamExt;
        while let Some(Ok(mut s)) = incoming.next().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 256];
                loop {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            if s.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    addr
}

type ClientStream = tokio_rustls::client::TlsStream<TcpStream>;

/// Connects with `ctx`'s client config (or a config with no certificate) to `name`.
async fn dial(
    addr: std::net::SocketAddr,
    config: Arc<rustls::ClientConfig>,
    name: &str,
) -> std::io::Result<ClientStream> {
    let tcp = TcpStream::connect(addr).await?;
    tokio_rustls::TlsConnector::from(config)
        .connect(peer_server_name(name).unwrap(), tcp)
        .await
}

/// Writes and reads back one message: errors if the server closed the connection.
async fn echo(s: &mut ClientStream, msg: &[u8]) -> std::io::Result<Vec<u8>> {
    s.write_all(msg).await?;
    let mut back = vec![0u8; msg.len()];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut back))
        .await
        .map_err(|_| std::io::Error::other("no echo within 5 s"))??;
    Ok(back)
}

/// A client config that trusts `ca` but presents no certificate.
fn anonymous_client(ca: &Path) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    let pem = std::fs::read(ca).unwrap();
    use rustls_pki_types::pem::PemObject;
    for c in rustls_pki_types::CertificateDer::pem_slice_iter(&pem) {
        roots.add(c.unwrap()).unwrap();
    }
    Arc::new(
        rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth(),
    )
}

/// The error a refused client sees: the server's alert, on the handshake or (TLS 1.3 sends
/// the server's verdict on a client certificate after the client's Finished) on the first
/// read.
async fn refused(addr: std::net::SocketAddr, config: Arc<rustls::ClientConfig>) -> String {
    match dial(addr, config, "owner").await {
        Err(e) => e.to_string(),
        Ok(mut s) => match echo(&mut s, b"hello").await {
            Err(e) => e.to_string(),
            Ok(v) => panic!("a refused client was served: {v:?}"),
        },
    }
}

async fn failures_reach(ctx: &TlsContext, side: TlsSide, n: u64) {
    for _ in 0..500 {
        if ctx.stats().handshake_failures(side) >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "{} failures counted on {}, expected {n}",
        ctx.stats().handshake_failures(side),
        side.as_str()
    );
}

#[tokio::test]
async fn mutual_tls_serves_the_cluster_and_refuses_other_cas_expired_and_anonymous_peers() {
    let dir = temp_dir("mtls");
    let ca = TestCa::new(&dir.join("ca"), "cluster CA");
    let owner = TlsContext::load(ca.node("owner", "owner", false)).unwrap();
    let addr = echo_server(&owner, ClientAuth::Required, Duration::from_secs(5)).await;

    // A member of the cluster is served, both ways verified.
    let member = TlsContext::load(ca.node("member", "member", false)).unwrap();
    let mut s = dial(addr, member.client_config(&[]).unwrap(), "owner")
        .await
        .unwrap();
    assert_eq!(echo(&mut s, b"kv").await.unwrap(), b"kv");

    // Another CA's certificate, an expired one, none at all: refused by the owner.
    let other = TestCa::new(&dir.join("other"), "another CA");
    let mut stranger_files = other.node("member", "stranger", false);
    stranger_files.ca = ca.ca_path(); // trusts the owner, but the owner does not trust it
    let stranger = TlsContext::load(stranger_files).unwrap();
    let e = refused(addr, stranger.client_config(&[]).unwrap()).await;
    assert!(e.contains("received fatal alert: UnknownCA"), "{e}");
    let expired = TlsContext::load(ca.node("member", "expired", true)).unwrap();
    let e = refused(addr, expired.client_config(&[]).unwrap()).await;
    assert!(
        e.contains("received fatal alert: CertificateExpired"),
        "{e}"
    );
    let e = refused(addr, anonymous_client(&ca.ca_path())).await;
    assert!(
        e.contains("received fatal alert: CertificateRequired"),
        "{e}"
    );
    failures_reach(&owner, TlsSide::Peer, 3).await;

    // The client side refuses an owner it does not trust: a member that trusts another CA.
    let mut wary_files = ca.node("member", "wary", false);
    wary_files.ca = other.ca_path();
    let wary = TlsContext::load(wary_files).unwrap();
    let e = dial(addr, wary.client_config(&[]).unwrap(), "owner")
        .await
        .unwrap_err();
    assert!(e.to_string().contains("UnknownIssuer"), "{e}");
    // ... and one whose certificate names another node.
    let e = dial(addr, member.client_config(&[]).unwrap(), "someone-else")
        .await
        .unwrap_err();
    assert!(e.to_string().contains("not valid for name"), "{e}");

    // The member's connection was never disturbed, and a new one works.
    assert_eq!(echo(&mut s, b"still").await.unwrap(), b"still");
    let mut again = dial(addr, member.client_config(&[]).unwrap(), "owner")
        .await
        .unwrap();
    assert_eq!(echo(&mut again, b"again").await.unwrap(), b"again");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn rotation_serves_new_handshakes_the_new_certificate_and_keeps_open_connections() {
    let dir = temp_dir("rotate");
    let ca = TestCa::new(&dir.join("ca"), "cluster CA");
    let files = ca.node("owner", "owner", false);
    let owner = TlsContext::load(files.clone()).unwrap();
    let addr = echo_server(&owner, ClientAuth::Required, Duration::from_secs(5)).await;
    let member = TlsContext::load(ca.node("member", "member", false)).unwrap();
    let client = member.client_config(&[]).unwrap();

    let mut old = dial(addr, Arc::clone(&client), "owner").await.unwrap();
    let old_cert = old.get_ref().1.peer_certificates().unwrap()[0].clone();
    assert_eq!(echo(&mut old, b"before").await.unwrap(), b"before");

    // Rotate: a new key and certificate written over the files, then a reload.
    let rotated = ca.node("owner", "owner", false);
    assert_eq!(rotated, files);
    owner.reload().unwrap();
    assert_eq!(owner.stats().reloads(), (1, 0));

    let mut new = dial(addr, Arc::clone(&client), "owner").await.unwrap();
    let new_cert = new.get_ref().1.peer_certificates().unwrap()[0].clone();
    assert_ne!(
        old_cert, new_cert,
        "a new handshake still got the old certificate"
    );
    assert_eq!(
        new_cert,
        owner.certified_key().cert[0],
        "the new handshake got the reloaded certificate"
    );
    // The connection made before the rotation carries on.
    assert_eq!(echo(&mut old, b"after").await.unwrap(), b"after");
    assert_eq!(echo(&mut new, b"new").await.unwrap(), b"new");

    // A broken file is not taken: the reload fails, counted, and the old material serves.
    std::fs::write(&files.key, b"-----BEGIN PRIVATE KEY-----\ngarbage\n").unwrap();
    let e = owner.reload().unwrap_err();
    assert_eq!(e.key(), "tls.key", "{e}");
    assert_eq!(owner.stats().reloads(), (1, 1));
    let mut third = dial(addr, Arc::clone(&client), "owner").await.unwrap();
    assert_eq!(
        third.get_ref().1.peer_certificates().unwrap()[0],
        new_cert,
        "a failed reload changed the certificate"
    );
    assert_eq!(echo(&mut third, b"ok").await.unwrap(), b"ok");

    // The CA is reloaded too: once the files trust only another CA, the member is refused.
    let other = TestCa::new(&dir.join("other"), "another CA");
    std::fs::copy(other.ca_path(), ca.ca_path()).unwrap();
    ca.node("owner", "owner", false); // a valid key again (signed by the old CA: fine)
    owner.reload().unwrap();
    let before = owner.stats().handshake_failures(TlsSide::Peer);
    let _ = refused(addr, Arc::clone(&client)).await;
    failures_reach(&owner, TlsSide::Peer, before + 1).await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn the_reload_watch_picks_up_changed_files() {
    let dir = temp_dir("watch");
    let ca = TestCa::new(&dir.join("ca"), "cluster CA");
    let files = ca.node("owner", "owner", false);
    let owner = TlsContext::load(files).unwrap();
    let first = owner.certified_key().cert[0].clone();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(reload::watch(
        owner.clone(),
        false,
        Duration::from_millis(20),
        async move {
            let _ = stopped.await;
        },
    ));
    // Modification times have a coarse grain on some filesystems: differ by a second.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    ca.node("owner", "owner", false);
    for _ in 0..200 {
        if owner.certified_key().cert[0] != first {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_ne!(
        owner.certified_key().cert[0],
        first,
        "the changed files were not reloaded"
    );
    assert_eq!(owner.stats().reloads().1, 0);
    let _ = stop.send(());
    task.await.unwrap().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Clients that never finish a handshake (silent, trickling, garbage, truncated records)
/// are closed by the deadline or at once, counted, and never hold up a good client.
#[tokio::test]
async fn slow_silent_and_garbage_clients_are_closed_and_others_are_served() {
    let dir = temp_dir("slow");
    let ca = TestCa::new(&dir.join("ca"), "cluster CA");
    let owner = TlsContext::load(ca.node("owner", "owner", false)).unwrap();
    // Long enough that a member queued behind the slow clients would show it.
    let deadline = Duration::from_millis(1000);
    let addr = echo_server(&owner, ClientAuth::Required, deadline).await;
    let member = TlsContext::load(ca.node("member", "member", false)).unwrap();

    // 64 silent connections and 8 that trickle a handshake record one byte at a time.
    let mut silent = Vec::new();
    for _ in 0..64 {
        silent.push(TcpStream::connect(addr).await.unwrap());
    }
    let mut trickle = Vec::new();
    for _ in 0..8 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(&[0x16]).await.unwrap();
        trickle.push(s);
    }
    // Garbage, and a handshake record header that promises more than ever comes.
    let mut garbage = TcpStream::connect(addr).await.unwrap();
    garbage.write_all(&[0xff; 64]).await.unwrap();
    let mut truncated = TcpStream::connect(addr).await.unwrap();
    truncated
        .write_all(&[0x16, 0x03, 0x01, 0x40, 0x00, 0x01, 0x00])
        .await
        .unwrap();

    // Meanwhile a member is served at once.
    let started = std::time::Instant::now();
    let mut s = dial(addr, member.client_config(&[]).unwrap(), "owner")
        .await
        .unwrap();
    assert_eq!(echo(&mut s, b"served").await.unwrap(), b"served");
    assert!(
        started.elapsed() < deadline,
        "a member waited {:?} behind slow clients",
        started.elapsed()
    );

    // Garbage is refused at once; the rest are closed by the deadline, not later.
    let mut buf = [0u8; 64];
    let closed = |r: std::io::Result<usize>| matches!(r, Ok(0) | Err(_));
    for s in [&mut garbage, &mut truncated] {
        let r = tokio::time::timeout(deadline * 4, async {
            loop {
                match s.read(&mut buf).await {
                    Ok(0) => return Ok(0),
                    Ok(_) => continue, // an alert, then the close
                    Err(e) => return Err(e),
                }
            }
        })
        .await
        .expect("a bad client was not closed");
        assert!(closed(r));
    }
    for s in silent.iter_mut().chain(trickle.iter_mut()) {
        let r = tokio::time::timeout(deadline * 4, s.read(&mut buf))
            .await
            .expect("a slow client outlived the handshake deadline");
        assert!(closed(r));
    }
    failures_reach(&owner, TlsSide::Peer, 64 + 8 + 2).await;
    // The member's connection is still fine.
    assert_eq!(echo(&mut s, b"still").await.unwrap(), b"still");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn loading_names_the_file_at_fault() {
    let dir = temp_dir("load");
    let ca = TestCa::new(&dir.join("ca"), "cluster CA");
    let good = ca.node("a", "a", false);
    TlsMaterial::load(&good).unwrap();
    let other = ca.node("b", "b", false);

    let key_of = |f: &TlsFiles| TlsMaterial::load(f).unwrap_err().key();
    let missing = TlsFiles {
        cert: dir.join("nope.pem"),
        ..good.clone()
    };
    assert_eq!(key_of(&missing), "tls.cert");
    let junk = dir.join("junk.pem");
    std::fs::write(&junk, b"not a certificate at all").unwrap();
    assert_eq!(
        key_of(&TlsFiles {
            cert: junk.clone(),
            ..good.clone()
        }),
        "tls.cert"
    );
    assert_eq!(
        key_of(&TlsFiles {
            key: junk.clone(),
            ..good.clone()
        }),
        "tls.key"
    );
    assert_eq!(
        key_of(&TlsFiles {
            ca: junk.clone(),
            ..good.clone()
        }),
        "tls.ca"
    );
    // b's key with a's certificate.
    let mismatch = TlsFiles {
        key: other.key.clone(),
        ..good.clone()
    };
    let e = TlsMaterial::load(&mismatch).unwrap_err();
    assert!(matches!(e, TlsError::KeyMismatch { .. }), "{e:?}");
    assert_eq!(e.key(), "tls.key");
    // A truncated certificate.
    let pem = std::fs::read_to_string(&good.cert).unwrap();
    let cut = dir.join("cut.pem");
    std::fs::write(&cut, &pem[..pem.len() / 2]).unwrap();
    assert_eq!(
        key_of(&TlsFiles {
            cert: cut,
            ..good.clone()
        }),
        "tls.cert"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Log lines written while a subscriber of it is the default.
#[derive(Clone, Default)]
struct Capture(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Capture {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Capture {
    fn subscriber(&self) -> impl tracing::Subscriber + Send + Sync {
        let w = self.clone();
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || w.clone())
            .finish()
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// The node's own certificate's expiry: read at load and reported, counting down, through
/// the stats; a warning within the warning period (not outside it); an expired certificate
/// refused by a reload, which keeps the one loaded before.
#[test]
fn own_certificate_expiry_is_reported_warned_of_and_an_expired_one_not_swapped_in() {
    let dir = temp_dir("expiry");
    let ca = TestCa::new(&dir.join("ca"), "cluster CA");
    let days = |n: u64| n * 86_400;
    let files = ca.node_expiring_in("owner", "owner", days(5));
    let logged = |warn: Duration| {
        let buf = Capture::default();
        let ctx = tracing::subscriber::with_default(buf.subscriber(), || {
            TlsContext::load_with(files.clone(), warn).unwrap()
        });
        (ctx, buf.text())
    };
    let (ctx, text) = logged(DEFAULT_EXPIRY_WARNING);
    assert!(text.contains("expires soon"), "{text}");
    assert!(text.contains("WARN"), "{text}");
    let now = std::time::SystemTime::now();
    let left = ctx.cert_expires_in(now);
    assert!(
        (days(5) as i64 - 60..=days(5) as i64).contains(&left),
        "{left}"
    );
    assert_eq!(ctx.stats().cert_expires_in(now), Some(left));
    // Ten seconds on, the gauge says ten seconds less: it is reckoned at the scrape.
    let later = now + Duration::from_secs(10);
    assert_eq!(ctx.stats().cert_expires_in(later), Some(left - 10));
    // A warning period shorter than what is left, or none: no warning.
    for warn in [Duration::from_secs(days(1)), Duration::ZERO] {
        let (_, text) = logged(warn);
        assert!(!text.contains("expires soon"), "{warn:?}: {text}");
    }

    // Rotated to a certificate valid for a year: the gauge follows the reload.
    ca.node_expiring_in("owner", "owner", days(365));
    ctx.reload().unwrap();
    let left = ctx
        .stats()
        .cert_expires_in(std::time::SystemTime::now())
        .unwrap();
    assert!(left > days(364) as i64, "{left}");
    let served = ctx.certified_key().cert[0].clone();

    // One already expired is refused naming tls.cert; the year-long one stays.
    ca.node("owner", "owner", true);
    let e = ctx.reload().unwrap_err();
    assert!(matches!(e, TlsError::Expired { .. }), "{e:?}");
    assert_eq!(e.key(), "tls.cert");
    assert_eq!(ctx.stats().reloads(), (1, 1));
    assert_eq!(ctx.certified_key().cert[0], served);
    assert!(
        ctx.stats()
            .cert_expires_in(std::time::SystemTime::now())
            .unwrap()
            > days(364) as i64
    );
    // The material itself says so too (what validate() checks).
    let m = TlsMaterial::load(&files).unwrap();
    assert!(m.expires_in(std::time::SystemTime::now()) < 0);
    assert!(m
        .check_unexpired(&files.cert, std::time::SystemTime::now())
        .is_err());
    let _ = std::fs::remove_dir_all(&dir);
}
