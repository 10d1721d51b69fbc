//! The transport benchmarks `kvferry bench transport` runs. Each returns plain medians over a
//! few short repetitions (one warm-up run is discarded), measured in one process against a
//! baseline taken in the same run, so ratios stay meaningful on a noisy machine.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::stats::median;

use kvferry_transport::loopback::LoopbackConnector;
use kvferry_transport::shm::{ShmConnector, ShmOwner};
use kvferry_transport::tcp::{TcpConnector, TcpOwner};
use kvferry_transport::{
    Access, CompletionQueue, CompletionStatus, Connector, HostRegion, LocalSegment, MrError,
    MrHandle, MrTable, NicId, NodeId, Qp, QpError, QpGauges, QpKey, QpNum, QueueLimits,
    ReadRequest, RegionError, RemoteDescriptor, WorkCompletion,
};

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum BenchError {
    #[error("setting up {what} failed")]
    Setup {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("allocating benchmark memory failed")]
    Region(#[from] RegionError),
    #[error("registering benchmark memory failed")]
    Mr(#[from] MrError),
    #[error("queue pair failed")]
    Qp(#[from] QpError),
    #[error("read {wr_id} completed with {status}")]
    ReadFailed {
        wr_id: u64,
        status: CompletionStatus,
    },
    #[error("reads did not complete within {seconds} s")]
    Stalled { seconds: u64 },
}

/// Sizes of one benchmark run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BenchConfig {
    /// Bytes moved per repetition by the throughput benchmarks.
    pub bytes: usize,
    /// Size of each read in the throughput benchmarks.
    pub read_size: usize,
    /// Measured repetitions (after one warm-up).
    pub repetitions: usize,
    /// Reads per repetition of the request-rate benchmark.
    pub small_reads: usize,
    /// Size of each read in the request-rate benchmark.
    pub small_read_size: usize,
    /// Send window of the benchmark QPs.
    pub window: u32,
}

impl Default for BenchConfig {
    fn default() -> Self {
        BenchConfig {
            bytes: 64 << 20,
            read_size: 1 << 20,
            repetitions: 5,
            small_reads: 20_000,
            small_read_size: 4096,
            window: 16,
        }
    }
}

/// A provider against its baseline: medians in GiB/s and their ratio.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ThroughputResult {
    pub bytes: u64,
    pub repetitions: usize,
    pub provider_gib_s: f64,
    pub baseline_gib_s: f64,
    /// provider / baseline.
    pub ratio: f64,
}

/// Request rate of small reads.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RateResult {
    pub read_size: usize,
    pub reads: usize,
    pub repetitions: usize,
    pub reads_per_sec: f64,
}

/// Everything `kvferry bench transport` reports.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TransportBench {
    /// `tcp_vs_socket`: tcp provider vs a plain socket copy of the same bytes on loopback.
    pub tcp_vs_socket: ThroughputResult,
    /// `shm_vs_memcpy`: shm provider vs memcpy of the same bytes.
    pub shm_vs_memcpy: ThroughputResult,
    /// Loopback provider, small reads per second.
    pub loopback_rate: RateResult,
}

/// Runs all three.
pub fn run_all(cfg: &BenchConfig) -> Result<TransportBench, BenchError> {
    Ok(TransportBench {
        tcp_vs_socket: tcp_vs_socket(cfg)?,
        shm_vs_memcpy: shm_vs_memcpy(cfg)?,
        loopback_rate: loopback_rate(cfg)?,
    })
}

fn gib_s(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / (1u64 << 30) as f64 / d.as_secs_f64().max(1e-9)
}

const OWNER: NodeId = NodeId(2);
const ME: NodeId = NodeId(1);

struct Side {
    table: MrTable,
    region: Arc<HostRegion>,
    mr: MrHandle,
}

fn owner_pool(len: usize) -> Result<Side, BenchError> {
    let table = MrTable::new();
    let region = Arc::new(HostRegion::memfd("kvferry-bench-pool", len)?);
    let pattern: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    region.write_at(0, &pattern)?;
    let mr = table.register_host(region.clone(), Access::REMOTE_READ)?;
    Ok(Side { table, region, mr })
}

fn destination(len: usize) -> Result<Side, BenchError> {
    let table = MrTable::new();
    let region = Arc::new(HostRegion::anonymous(len)?);
    // Touch every page so page faults are not measured.
    region.fill(0)?;
    let mr = table.register_host(region.clone(), Access::LOCAL_WRITE)?;
    Ok(Side { table, region, mr })
}

/// `count` reads of `size` bytes, source and destination both laid out back to back
/// (wrapping inside the pool and destination).
fn reads(owner: &Side, dst: &Side, count: usize, size: usize) -> Vec<ReadRequest> {
    let slots = (owner.region.len() / size).max(1);
    let dslots = (dst.region.len() / size).max(1);
    (0..count)
        .map(|i| ReadRequest {
            wr_id: i as u64,
            remote: RemoteDescriptor {
                addr: owner.region.addr() + ((i % slots) * size) as u64,
                len: size as u64,
                rkey: owner.mr.key(),
            },
            local: vec![LocalSegment {
                lkey: dst.mr.key(),
                addr: dst.region.addr() + ((i % dslots) * size) as u64,
                len: size as u64,
            }],
        })
        .collect()
}

/// Posts a batch and drives the QP to completion, as a NIC worker would; returns the time.
fn run_batch(
    qp: &mut Qp,
    cq: &CompletionQueue,
    batch: &[ReadRequest],
) -> Result<Duration, BenchError> {
    let start = Instant::now();
    qp.post(batch, start)?;
    let mut raw: Vec<WorkCompletion> = Vec::with_capacity(256);
    let mut done: Vec<WorkCompletion> = Vec::with_capacity(256);
    let deadline = start + Duration::from_secs(30);
    while qp.outstanding() > 0 {
        if Instant::now() > deadline {
            return Err(BenchError::Stalled { seconds: 30 });
        }
        raw.clear();
        cq.wait(&mut raw, 256, Duration::from_millis(100));
        let now = Instant::now();
        for wc in &raw {
            qp.handle_completion(wc, now)?;
        }
        done.clear();
        qp.poll_completions(&mut done);
        if let Some(bad) = done.iter().find(|c| !c.status.is_success()) {
            return Err(BenchError::ReadFailed {
                wr_id: bad.wr_id,
                status: bad.status,
            });
        }
    }
    Ok(start.elapsed())
}

fn connected_qp(
    cfg: &BenchConfig,
    dst: &Side,
    connector: &dyn Connector,
    cq: &Arc<CompletionQueue>,
) -> Result<Qp, BenchError> {
    let limits = QueueLimits {
        max_send_wr: cfg.window,
        max_rd_atomic: cfg.window,
        max_sge: 1,
        completion_timeout: Duration::from_secs(10),
    };
    let mut qp = Qp::new(
        QpKey::new(OWNER, NicId(0), QpNum(1)),
        limits,
        dst.table.clone(),
        Arc::new(QpGauges::default()),
    );
    qp.connect(connector, cq.clone())?;
    Ok(qp)
}

fn provider_medians(
    cfg: &BenchConfig,
    owner: &Side,
    dst: &Side,
    connector: &dyn Connector,
) -> Result<f64, BenchError> {
    let cq = Arc::new(CompletionQueue::new(cfg.window as usize));
    let mut qp = connected_qp(cfg, dst, connector, &cq)?;
    let count = (cfg.bytes / cfg.read_size).max(1);
    let batch = reads(owner, dst, count, cfg.read_size);
    let moved = count * cfg.read_size;
    run_batch(&mut qp, &cq, &batch)?;
    let mut v = Vec::with_capacity(cfg.repetitions);
    for _ in 0..cfg.repetitions {
        v.push(gib_s(moved, run_batch(&mut qp, &cq, &batch)?));
    }
    Ok(median(&mut v))
}

/// tcp provider reading `cfg.bytes` vs a plain socket copy of the same bytes on loopback.
pub fn tcp_vs_socket(cfg: &BenchConfig) -> Result<ThroughputResult, BenchError> {
    let setup = |what| move |source| BenchError::Setup { what, source };
    let pool_len = cfg.bytes.max(cfg.read_size);
    let owner = owner_pool(pool_len)?;
    let dst = destination(pool_len)?;
    let listener = TcpListener::bind("127.0.0.1:0").map_err(setup("tcp listener"))?;
    // The data plane as a node serves it: every connection proves a link grant.
    let auth = kvferry_transport::DataAuth::new();
    let grant = auth.issue(ME).map_err(|e| BenchError::Setup {
        what: "link grant",
        source: std::io::Error::other(e),
    })?;
    let server =
        TcpOwner::spawn(listener, OWNER, owner.table.clone(), auth).map_err(setup("tcp owner"))?;
    let connector = TcpConnector::new(ME, OWNER, server.local_addr(), grant);
    let provider = provider_medians(cfg, &owner, &dst, &connector)?;
    server.shutdown();

    // Baseline: one socket, the sender writes the same bytes from memory on each "go", the
    // receiver reads them into a pre-touched buffer.
    let moved = (cfg.bytes / cfg.read_size).max(1) * cfg.read_size;
    let listener = TcpListener::bind("127.0.0.1:0").map_err(setup("baseline listener"))?;
    let addr = listener.local_addr().map_err(setup("baseline listener"))?;
    let reps = cfg.repetitions + 1;
    let chunk = cfg.read_size;
    let sender = std::thread::spawn(move || -> io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let src: Vec<u8> = (0..moved).map(|i| (i % 251) as u8).collect();
        let mut go = [0u8; 1];
        for _ in 0..reps {
            s.read_exact(&mut go)?;
            for c in src.chunks(chunk) {
                s.write_all(c)?;
            }
        }
        Ok(())
    });
    let mut s = TcpStream::connect(addr).map_err(setup("baseline connect"))?;
    s.set_nodelay(true).map_err(setup("baseline socket"))?;
    let mut buf = vec![0u8; moved];
    let mut v = Vec::with_capacity(cfg.repetitions);
    for rep in 0..reps {
        let start = Instant::now();
        s.write_all(&[1]).map_err(setup("baseline go"))?;
        s.read_exact(&mut buf).map_err(setup("baseline read"))?;
        if rep > 0 {
            v.push(gib_s(moved, start.elapsed()));
        }
    }
    let _ = sender.join();
    let baseline = median(&mut v);
    Ok(ThroughputResult {
        bytes: moved as u64,
        repetitions: cfg.repetitions,
        provider_gib_s: provider,
        baseline_gib_s: baseline,
        ratio: provider / baseline.max(1e-12),
    })
}

/// The tcp provider over mutual TLS (a self-signed CA made here, rcgen; ring's AES-GCM)
/// against the same provider in clear, in one run: `provider_gib_s` is TLS, `baseline_gib_s`
/// plain.
pub fn tcp_tls_vs_plain(cfg: &BenchConfig) -> Result<ThroughputResult, BenchError> {
    let pool_len = cfg.bytes.max(cfg.read_size);
    let owner = owner_pool(pool_len)?;
    let dst = destination(pool_len)?;
    let plain = tcp_provider(cfg, &owner, &dst, None)?;
    let tls = tcp_provider(cfg, &owner, &dst, Some(bench_tls()?))?;
    let moved = (cfg.bytes / cfg.read_size).max(1) * cfg.read_size;
    Ok(ThroughputResult {
        bytes: moved as u64,
        repetitions: cfg.repetitions,
        provider_gib_s: tls,
        baseline_gib_s: plain,
        ratio: tls / plain.max(1e-12),
    })
}

type BenchTls = (Arc<rustls::ServerConfig>, kvferry_transport::tcp::ClientTls);

fn tcp_provider(
    cfg: &BenchConfig,
    owner: &Side,
    dst: &Side,
    tls: Option<BenchTls>,
) -> Result<f64, BenchError> {
    let setup = |what| move |source| BenchError::Setup { what, source };
    let listener = TcpListener::bind("127.0.0.1:0").map_err(setup("tcp listener"))?;
    let auth = kvferry_transport::DataAuth::new();
    let grant = auth.issue(ME).map_err(|e| BenchError::Setup {
        what: "link grant",
        source: std::io::Error::other(e),
    })?;
    let mut opts = kvferry_transport::tcp::TcpOwnerOptions::new(auth);
    opts.tls = tls.as_ref().map(|(s, _)| Arc::clone(s));
    let server = TcpOwner::spawn_with(listener, OWNER, owner.table.clone(), opts)
        .map_err(setup("tcp owner"))?;
    let mut connector = TcpConnector::new(ME, OWNER, server.local_addr(), grant);
    if let Some((_, c)) = tls {
        connector = connector.with_tls(c);
    }
    let r = provider_medians(cfg, owner, dst, &connector);
    server.shutdown();
    r
}

fn bench_tls() -> Result<BenchTls, BenchError> {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
    let bad = |e: String| BenchError::Setup {
        what: "bench certificates",
        source: std::io::Error::other(e),
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut p = CertificateParams::new(Vec::<String>::new()).map_err(|e| bad(e.to_string()))?;
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let key = KeyPair::generate().map_err(|e| bad(e.to_string()))?;
    let ca = CertifiedIssuer::self_signed(p, key).map_err(|e| bad(e.to_string()))?;
    let leaf = || -> Result<_, BenchError> {
        let p = CertificateParams::new(vec!["owner".to_owned()]).map_err(|e| bad(e.to_string()))?;
        let key = KeyPair::generate().map_err(|e| bad(e.to_string()))?;
        let cert = p.signed_by(&key, &ca).map_err(|e| bad(e.to_string()))?;
        let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        Ok((vec![cert.der().clone()], der))
    };
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(ca.der().clone())
        .map_err(|e| bad(e.to_string()))?;
    let roots = Arc::new(roots);
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        roots.clone(),
        provider.clone(),
    )
    .build()
    .map_err(|e| bad(e.to_string()))?;
    let (chain, key) = leaf()?;
    let server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| bad(e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|e| bad(e.to_string()))?;
    let (chain, key) = leaf()?;
    let client = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| bad(e.to_string()))?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .map_err(|e| bad(e.to_string()))?;
    let name = ServerName::try_from("owner").map_err(|e| bad(e.to_string()))?;
    Ok((
        Arc::new(server),
        kvferry_transport::tcp::ClientTls {
            config: Arc::new(client),
            server_name: name,
        },
    ))
}

/// shm provider reading `cfg.bytes` vs memcpy of the same bytes.
pub fn shm_vs_memcpy(cfg: &BenchConfig) -> Result<ThroughputResult, BenchError> {
    let setup = |what| move |source| BenchError::Setup { what, source };
    let pool_len = cfg.bytes.max(cfg.read_size);
    let owner = owner_pool(pool_len)?;
    let dst = destination(pool_len)?;
    let path = std::env::temp_dir().join(format!(
        "kvferry-bench-{}-{}.sock",
        std::process::id(),
        Instant::now().elapsed().subsec_nanos()
    ));
    let listener = UnixListener::bind(&path).map_err(setup("unix listener"))?;
    let server = ShmOwner::spawn(listener, OWNER, owner.table.clone());
    let result = server.map_err(setup("shm owner")).and_then(|server| {
        let connector = ShmConnector::new(ME, OWNER, &path);
        let r = provider_medians(cfg, &owner, &dst, &connector);
        server.shutdown();
        r
    });
    let _ = std::fs::remove_file(&path);
    let provider = result?;

    let count = (cfg.bytes / cfg.read_size).max(1);
    let moved = count * cfg.read_size;
    let mut buf = vec![0u8; pool_len];
    let slots = (pool_len / cfg.read_size).max(1);
    let mut v = Vec::with_capacity(cfg.repetitions);
    for rep in 0..=cfg.repetitions {
        let start = Instant::now();
        for i in 0..count {
            let off = (i % slots) * cfg.read_size;
            owner
                .region
                .read_at(off, &mut buf[off..off + cfg.read_size])?;
            // Keep the copies from being optimised away as dead stores.
            std::hint::black_box(&mut buf);
        }
        if rep > 0 {
            v.push(gib_s(moved, start.elapsed()));
        }
    }
    let baseline = median(&mut v);
    Ok(ThroughputResult {
        bytes: moved as u64,
        repetitions: cfg.repetitions,
        provider_gib_s: provider,
        baseline_gib_s: baseline,
        ratio: provider / baseline.max(1e-12),
    })
}

/// Loopback provider: small reads per second through the whole QP path.
pub fn loopback_rate(cfg: &BenchConfig) -> Result<RateResult, BenchError> {
    let size = cfg.small_read_size.max(1);
    let owner = owner_pool((size * 1024).max(1 << 20))?;
    let dst = destination((size * 1024).max(1 << 20))?;
    let connector = LoopbackConnector::new(OWNER, owner.table.clone());
    let cq = Arc::new(CompletionQueue::new(cfg.window as usize));
    let mut qp = connected_qp(cfg, &dst, &connector, &cq)?;
    let batch = reads(&owner, &dst, cfg.small_reads.max(1), size);
    run_batch(&mut qp, &cq, &batch)?;
    let mut v = Vec::with_capacity(cfg.repetitions);
    for _ in 0..cfg.repetitions {
        let d = run_batch(&mut qp, &cq, &batch)?;
        v.push(batch.len() as f64 / d.as_secs_f64().max(1e-9));
    }
    Ok(RateResult {
        read_size: size,
        reads: batch.len(),
        repetitions: cfg.repetitions,
        reads_per_sec: median(&mut v),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smoke() {
        let cfg = BenchConfig {
            bytes: 4 << 20,
            read_size: 256 << 10,
            repetitions: 2,
            small_reads: 500,
            small_read_size: 4096,
            window: 8,
        };
        let r = run_all(&cfg).unwrap();
        assert!(r.tcp_vs_socket.provider_gib_s > 0.0 && r.tcp_vs_socket.baseline_gib_s > 0.0);
        assert!(r.shm_vs_memcpy.ratio > 0.0);
        assert!(r.loopback_rate.reads_per_sec > 0.0);
    }
}
