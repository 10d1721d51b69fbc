//! Integration tests of the transport crate: providers end to end (byte-for-byte, with
//! canaries), owner and requester in separate processes, the fault matrix, and the edge cases
//! of the RC contract.
//!
//! Multi-process tests re-execute this binary (`current_exe`) with `KVF_CHILD` set; the child
//! runs `child_entry`, prints one `READY ...` line and serves until its stdin closes, so it
//! never outlives the parent.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvferry_transport::fault::{Fault, FaultKind, FaultyConnector};
use kvferry_transport::loopback::LoopbackConnector;
use kvferry_transport::shm::{ShmConnector, ShmOwner};
use kvferry_transport::tcp::{TcpConnector, TcpOwner};
use kvferry_transport::{
    Access, CompletionQueue, CompletionStatus, Connector, DataAuth, DeviceSink, HostRegion,
    LinkGrant, LinkSecret, LocalSegment, MrHandle, MrKey, MrTable, NicId, NodeId, Qp, QpError,
    QpGaugeValues, QpGauges, QpKey, QpNum, QpState, QueueFault, QueueLimits, ReadRequest,
    RemoteDescriptor, SinkError, WorkCompletion,
};

#[path = "transport/data_plane.rs"]
mod data_plane;
#[path = "transport/tls.rs"]
mod tls;

const CANARY: u8 = 0xA5;
const OWNER: NodeId = NodeId(100);
const ME: NodeId = NodeId(1);

fn pat(seed: u8, off: u64) -> u8 {
    ((off.wrapping_mul(2_654_435_761) >> 11) as u8) ^ (off as u8) ^ seed
}

fn limits(window: u32, max_sge: u32) -> QueueLimits {
    QueueLimits {
        max_send_wr: window * 2,
        max_rd_atomic: window,
        max_sge,
        completion_timeout: Duration::from_secs(5),
    }
}

// ---------------------------------------------------------------------------------------------
// Owner side

struct Pool {
    table: MrTable,
    region: Arc<HostRegion>,
    mr: MrHandle,
}

fn pool(seed: u8, len: usize) -> Pool {
    let table = MrTable::new();
    let region = Arc::new(HostRegion::memfd("kvf-test-pool", len).unwrap());
    let bytes: Vec<u8> = (0..len as u64).map(|o| pat(seed, o)).collect();
    region.write_at(0, &bytes).unwrap();
    let mr = table
        .register_host(region.clone(), Access::REMOTE_READ)
        .unwrap();
    Pool { table, region, mr }
}

static SOCK_SEQ: AtomicU32 = AtomicU32::new(0);

fn sock_path() -> PathBuf {
    std::env::temp_dir().join(format!(
        "kvf-t-{}-{}.sock",
        std::process::id(),
        SOCK_SEQ.fetch_add(1, Ordering::Relaxed)
    ))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Prov {
    Loopback,
    Tcp,
    Shm,
}

/// An in-process owner serving a pool over one provider.
struct Served {
    pool: Pool,
    /// The grants a tcp owner checks (unused by the other providers).
    auth: DataAuth,
    tcp: Option<TcpOwner>,
    shm: Option<(ShmOwner, PathBuf)>,
    connector: Arc<dyn Connector>,
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some((o, p)) = self.shm.take() {
            o.shutdown();
            let _ = std::fs::remove_file(p);
        }
    }
}

fn serve(prov: Prov, node: NodeId, seed: u8, len: usize) -> Served {
    let pool = pool(seed, len);
    let auth = DataAuth::new();
    match prov {
        Prov::Loopback => Served {
            auth,
            connector: Arc::new(LoopbackConnector::new(node, pool.table.clone())),
            pool,
            tcp: None,
            shm: None,
        },
        Prov::Tcp => {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let o = TcpOwner::spawn(l, node, pool.table.clone(), auth.clone()).unwrap();
            let grant = auth.issue(ME).unwrap();
            Served {
                auth,
                connector: Arc::new(
                    TcpConnector::new(ME, node, o.local_addr(), grant)
                        .with_io_timeout(Duration::from_secs(3)),
                ),
                pool,
                tcp: Some(o),
                shm: None,
            }
        }
        Prov::Shm => {
            let path = sock_path();
            let l = UnixListener::bind(&path).unwrap();
            let o = ShmOwner::spawn(l, node, pool.table.clone()).unwrap();
            Served {
                auth,
                connector: Arc::new(ShmConnector::new(ME, node, &path)),
                pool,
                tcp: None,
                shm: Some((o, path)),
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Requester side

struct Requester {
    table: MrTable,
    dest: Arc<HostRegion>,
    mr: Option<MrHandle>,
    gauges: Arc<QpGauges>,
    cq: Arc<CompletionQueue>,
}

fn requester(len: usize) -> Requester {
    let table = MrTable::new();
    let dest = Arc::new(HostRegion::anonymous(len).unwrap());
    dest.fill(CANARY).unwrap();
    let mr = table
        .register_host(dest.clone(), Access::LOCAL_WRITE)
        .unwrap();
    Requester {
        table,
        dest,
        mr: Some(mr),
        gauges: Arc::new(QpGauges::default()),
        cq: Arc::new(CompletionQueue::new(64)),
    }
}

impl Requester {
    fn qp(&self, peer: NodeId, num: u32, l: QueueLimits) -> Qp {
        Qp::new(
            QpKey::new(peer, NicId(0), QpNum(num)),
            l,
            self.table.clone(),
            self.gauges.clone(),
        )
    }

    fn lkey(&self) -> MrKey {
        self.mr.as_ref().map(|m| m.key()).unwrap()
    }
}

/// One piece of an expected destination: dest offset, source offset, length.
#[derive(Clone, Copy, Debug)]
struct Piece {
    dst: u64,
    src: u64,
    len: u64,
}

struct Plan {
    reads: Vec<ReadRequest>,
    pieces: Vec<Vec<Piece>>,
    seed: u8,
}

/// `n` reads of `len` bytes from scattered source offsets, each split into `frags` uneven
/// pieces with canary gaps between them in the destination. `dst_base` is where the
/// destination layout starts.
fn plan(r: &Requester, src: (&Pool, u8), n: usize, len: u64, frags: usize, dst_base: u64) -> Plan {
    let (pool, seed) = src;
    let pool_len = pool.region.len() as u64;
    let mut cursor = dst_base;
    let mut reads = Vec::new();
    let mut pieces = Vec::new();
    for i in 0..n {
        let src_off = (i as u64 * 104_729 + 13) % (pool_len - len);
        let mut cuts: Vec<u64> = (1..frags as u64)
            .map(|j| len * j / frags as u64 + j * 3)
            .collect();
        cuts.retain(|&c| c > 0 && c < len);
        cuts.dedup();
        let mut bounds = vec![0];
        bounds.extend(cuts);
        bounds.push(len);
        let mut local = Vec::new();
        let mut ps = Vec::new();
        for w in bounds.windows(2) {
            cursor += 8; // canary gap
            let plen = w[1] - w[0];
            local.push(LocalSegment {
                lkey: r.lkey(),
                addr: r.dest.addr() + cursor,
                len: plen,
            });
            ps.push(Piece {
                dst: cursor,
                src: src_off + w[0],
                len: plen,
            });
            cursor += plen;
        }
        assert!(
            cursor + 8 <= r.dest.len() as u64,
            "destination too small for plan"
        );
        reads.push(ReadRequest {
            wr_id: 1000 + i as u64,
            remote: RemoteDescriptor {
                addr: pool.region.addr() + src_off,
                len,
                rkey: pool.mr.key(),
            },
            local,
        });
        pieces.push(ps);
    }
    Plan {
        reads,
        pieces,
        seed,
    }
}

/// Checks the whole destination: successful reads exact, failed reads' pieces either canary
/// or correct, everything else canary.
fn verify(dest: &HostRegion, p: &Plan, done: &[WorkCompletion]) {
    let status: HashMap<u64, CompletionStatus> = done.iter().map(|c| (c.wr_id, c.status)).collect();
    let got = dest.to_vec();
    let mut covered = vec![false; got.len()];
    for (read, ps) in p.reads.iter().zip(&p.pieces) {
        let ok = status
            .get(&read.wr_id)
            .map(|s| s.is_success())
            .unwrap_or(false);
        for pc in ps {
            for k in 0..pc.len {
                let at = (pc.dst + k) as usize;
                covered[at] = true;
                let want = pat(p.seed, pc.src + k);
                if ok {
                    assert_eq!(
                        got[at], want,
                        "wr {} byte {} of piece {:?}",
                        read.wr_id, k, pc
                    );
                } else {
                    assert!(
                        got[at] == want || got[at] == CANARY,
                        "failed wr {} wrote garbage",
                        read.wr_id
                    );
                }
            }
        }
    }
    for (i, b) in got.iter().enumerate() {
        if !covered[i] {
            assert_eq!(*b, CANARY, "byte {i} outside every destination was written");
        }
    }
}

/// Drives one QP until nothing is outstanding (bounded), the way a NIC worker would.
fn drive(
    qp: &mut Qp,
    cq: &CompletionQueue,
    limit: Duration,
) -> (Vec<WorkCompletion>, Vec<QpError>) {
    let end = Instant::now() + limit;
    let (mut raw, mut out, mut errs) = (Vec::new(), Vec::new(), Vec::new());
    while qp.outstanding() > 0 {
        assert!(Instant::now() < end, "drain did not finish: {qp:?}");
        raw.clear();
        cq.wait(&mut raw, 64, Duration::from_millis(10));
        let now = Instant::now();
        for wc in &raw {
            assert_eq!(wc.qp, qp.key());
            if let Err(e) = qp.handle_completion(wc, now) {
                errs.push(e);
            }
        }
        qp.poll_timeout(now);
        qp.poll_completions(&mut out);
    }
    (out, errs)
}

fn post_and_drive(
    qp: &mut Qp,
    cq: &CompletionQueue,
    reads: &[ReadRequest],
) -> (Vec<WorkCompletion>, Vec<QpError>) {
    let mut errs = Vec::new();
    if let Err(e) = qp.post(reads, Instant::now()) {
        errs.push(e);
    }
    let (out, more) = drive(qp, cq, Duration::from_secs(10));
    errs.extend(more);
    (out, errs)
}

fn assert_in_order(done: &[WorkCompletion], reads: &[ReadRequest]) {
    let ids: Vec<u64> = done.iter().map(|c| c.wr_id).collect();
    let want: Vec<u64> = reads.iter().map(|r| r.wr_id).collect();
    assert_eq!(ids, want, "completions not reported in post order");
}

fn all_ok(done: &[WorkCompletion]) -> bool {
    done.iter().all(|c| c.status.is_success())
}

// ---------------------------------------------------------------------------------------------
// Child processes

#[test]
fn child_entry() {
    let Ok(role) = std::env::var("KVF_CHILD") else {
        return;
    };
    let seed: u8 = std::env::var("KVF_SEED").unwrap().parse().unwrap();
    let len: usize = std::env::var("KVF_LEN").unwrap().parse().unwrap();
    let p = pool(seed, len);
    let auth = DataAuth::new();
    let grant = auth.issue(ME).unwrap();
    let secret: String = grant
        .secret
        .as_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let ready = |where_: &str| {
        println!(
            "READY {where_} {} {} {} {} {secret}",
            p.mr.key().0,
            p.region.addr(),
            len,
            grant.link,
        );
        let _ = std::io::Write::flush(&mut std::io::stdout());
    };
    let wait_parent = || {
        let mut b = [0u8; 16];
        while matches!(std::io::stdin().read(&mut b), Ok(n) if n > 0) {}
    };
    match role.as_str() {
        "tcp" => {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let o = TcpOwner::spawn(l, OWNER, p.table.clone(), auth.clone()).unwrap();
            ready(&o.local_addr().to_string());
            wait_parent();
            o.shutdown();
        }
        "shm" => {
            let path = std::env::var("KVF_PATH").unwrap();
            let l = UnixListener::bind(&path).unwrap();
            let o = ShmOwner::spawn(l, OWNER, p.table.clone()).unwrap();
            ready(&path);
            wait_parent();
            o.shutdown();
        }
        "shm-writer" => {
            // Maps the owner's pool like a requester and tries to write through the mapping.
            let path = std::env::var("KVF_PATH").unwrap();
            let m = ShmConnector::new(ME, OWNER, &path).map_exports().unwrap();
            let r = m.regions()[0];
            println!("WRITING");
            let _ = std::io::Write::flush(&mut std::io::stdout());
            // SAFETY: deliberately invalid: the page is mapped PROT_READ, so this store must
            // kill the process with SIGSEGV (which the parent asserts).
            unsafe { std::ptr::write_volatile(r.local_addr as *mut u8, 1) };
            println!("WROTE");
        }
        other => panic!("unknown child role {other}"),
    }
    std::process::exit(0);
}

struct ChildOwner {
    child: Child,
    path: Option<PathBuf>,
    stdin: Option<ChildStdin>,
    addr: String,
    rkey: MrKey,
    base: u64,
    len: u64,
    /// The grant the child's tcp owner issued to `ME`.
    grant: LinkGrant,
}

fn spawn_child(role: &str, seed: u8, len: usize, path: Option<&PathBuf>) -> ChildOwner {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["child_entry", "--exact", "--nocapture", "--test-threads=1"])
        .env("KVF_CHILD", role)
        .env("KVF_SEED", seed.to_string())
        .env("KVF_LEN", len.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(p) = path {
        cmd.env("KVF_PATH", p);
    }
    let mut child = cmd.spawn().unwrap();
    let stdin = child.stdin.take();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            // libtest prints "test child_entry ... " without a newline before the test runs.
            if let Some(at) = line.find("READY ") {
                let _ = tx.send(line[at..].to_string());
            }
        }
    });
    let mut owner = ChildOwner {
        child,
        path: path.cloned(),
        stdin,
        addr: String::new(),
        rkey: MrKey(0),
        base: 0,
        len: 0,
        grant: DataAuth::new().issue(ME).unwrap(),
    };
    let line = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("child owner did not start");
    let f: Vec<&str> = line.split_whitespace().collect();
    owner.addr = f[1].to_string();
    owner.rkey = MrKey(f[2].parse().unwrap());
    owner.base = f[3].parse().unwrap();
    owner.len = f[4].parse().unwrap();
    let secret: Vec<u8> = (0..f[6].len() / 2)
        .map(|i| u8::from_str_radix(&f[6][2 * i..2 * i + 2], 16).unwrap())
        .collect();
    owner.grant = LinkGrant {
        link: f[5].parse().unwrap(),
        secret: LinkSecret::from_bytes(&secret).unwrap(),
    };
    owner
}

impl ChildOwner {
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ChildOwner {
    fn drop(&mut self) {
        if let Some(p) = self.path.take() {
            let _ = std::fs::remove_file(p);
        }
        drop(self.stdin.take());
        let end = Instant::now() + Duration::from_secs(5);
        while Instant::now() < end {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.kill();
    }
}

/// A pool description for a child-owned pool (its bytes are `pat(seed, ..)`).
fn remote_pool_view(c: &ChildOwner) -> Pool {
    // Plans only need the owner's base, length and key; mirror them in a stand-in.
    let table = MrTable::new();
    let region = Arc::new(HostRegion::anonymous(c.len as usize).unwrap());
    let mr = table
        .register_host(region.clone(), Access::REMOTE_READ)
        .unwrap();
    Pool { table, region, mr }
}

/// Rewrites a plan built against a stand-in pool to name the child's real pool.
fn retarget(p: &mut Plan, stand_in: &Pool, c: &ChildOwner) {
    for r in &mut p.reads {
        r.remote.addr = r.remote.addr - stand_in.region.addr() + c.base;
        r.remote.rkey = c.rkey;
    }
}

fn cross_process(prov: Prov) {
    const SEED: u8 = 0x3C;
    const POOL: usize = 4 << 20;
    let path = sock_path();
    let child = spawn_child(
        if prov == Prov::Tcp { "tcp" } else { "shm" },
        SEED,
        POOL,
        Some(&path),
    );
    let connector: Box<dyn Connector> = match prov {
        Prov::Tcp => Box::new(TcpConnector::new(
            ME,
            OWNER,
            child.addr.parse().unwrap(),
            child.grant.clone(),
        )),
        _ => Box::new(ShmConnector::new(ME, OWNER, &child.addr)),
    };
    let r = requester(8 << 20);
    let stand_in = remote_pool_view(&child);
    let mut qp = r.qp(OWNER, 1, limits(4, 8));
    qp.connect(&connector, r.cq.clone()).unwrap();

    // Contiguous, a batch 6x the window.
    let mut p1 = plan(&r, (&stand_in, SEED), 24, 65_536 + 17, 1, 0);
    retarget(&mut p1, &stand_in, &child);
    let (done, errs) = post_and_drive(&mut qp, &r.cq, &p1.reads);
    assert!(errs.is_empty(), "{errs:?}");
    assert!(all_ok(&done), "{done:?}");
    assert_in_order(&done, &p1.reads);
    assert!(qp.max_in_flight_seen() <= 4);
    // Fragmented: 8 uneven pieces each, after the first layout.
    let mut p2 = plan(&r, (&stand_in, SEED), 20, 40_000 + 3, 8, 3 << 20);
    retarget(&mut p2, &stand_in, &child);
    let (done2, errs) = post_and_drive(&mut qp, &r.cq, &p2.reads);
    assert!(errs.is_empty() && all_ok(&done2), "{errs:?} {done2:?}");
    assert_in_order(&done2, &p2.reads);
    let mut both = Plan {
        reads: p1.reads.clone(),
        pieces: p1.pieces.clone(),
        seed: SEED,
    };
    both.reads.extend(p2.reads.clone());
    both.pieces.extend(p2.pieces.clone());
    let mut all = done.clone();
    all.extend(done2);
    verify(&r.dest, &both, &all);

    // Wrong key and out-of-bounds are refused by the owner; the QP drains and recovers.
    for bad in 0..2 {
        let mut p3 = plan(&r, (&stand_in, SEED), 3, 1000, 2, 6 << 20);
        retarget(&mut p3, &stand_in, &child);
        if bad == 0 {
            p3.reads[1].remote.rkey = MrKey(child.rkey.0 ^ 0x55);
        } else {
            p3.reads[1].remote.addr = child.base + child.len - 10;
        }
        let (done3, _) = post_and_drive(&mut qp, &r.cq, &p3.reads);
        assert_in_order(&done3, &p3.reads);
        assert_eq!(
            done3[1].status,
            CompletionStatus::RemoteAccessError,
            "{done3:?}"
        );
        assert_eq!(done3[2].status, CompletionStatus::Flushed);
        // The owner closes a connection after refusing a read, so the queue may see the
        // closed connection (issuing the next read) before the refusal's completion.
        assert!(
            matches!(
                qp.fault(),
                Some(QueueFault::Completion {
                    status: CompletionStatus::RemoteAccessError,
                    ..
                }) | Some(QueueFault::ConnectionLost { .. })
            ),
            "{:?}",
            qp.fault()
        );
        assert_eq!(qp.state(), QpState::Error);
        assert_eq!(r.table.gauges().uses, 0);
        qp.reset().unwrap();
        qp.connect(&connector, r.cq.clone()).unwrap();
        let mut p4 = plan(&r, (&stand_in, SEED), 3, 1000, 2, 6 << 20);
        retarget(&mut p4, &stand_in, &child);
        let (done4, errs) = post_and_drive(&mut qp, &r.cq, &p4.reads);
        assert!(errs.is_empty() && all_ok(&done4));
        verify_region_pieces(&r.dest, &p4);
    }
    drop(qp);
    assert_eq!(r.gauges.snapshot(), QpGaugeValues::default());
    assert_eq!(r.table.gauges().uses, 0);
    drop(child);
}

/// Checks only the pieces of a plan (when other plans overlapped its surroundings).
fn verify_region_pieces(dest: &HostRegion, p: &Plan) {
    let got = dest.to_vec();
    for ps in &p.pieces {
        for pc in ps {
            for k in 0..pc.len {
                assert_eq!(got[(pc.dst + k) as usize], pat(p.seed, pc.src + k));
            }
        }
    }
}

#[test]
fn tcp_cross_process() {
    cross_process(Prov::Tcp);
}

#[test]
fn shm_cross_process() {
    cross_process(Prov::Shm);
}

#[test]
fn tcp_owner_process_death_drains_and_recovers() {
    const SEED: u8 = 0x51;
    const POOL: usize = 8 << 20;
    let mut child = spawn_child("tcp", SEED, POOL, None);
    let connector = TcpConnector::new(ME, OWNER, child.addr.parse().unwrap(), child.grant.clone())
        .with_connect_timeout(Duration::from_millis(500));
    let r = requester(8 << 20);
    let stand_in = remote_pool_view(&child);
    let mut qp = r.qp(OWNER, 1, limits(8, 4));
    qp.connect(&connector, r.cq.clone()).unwrap();
    let mut p = plan(&r, (&stand_in, SEED), 60, 100_000, 3, 0);
    retarget(&mut p, &stand_in, &child);
    qp.post(&p.reads, Instant::now()).unwrap();
    // Let some complete, then kill the owner with reads in flight.
    let mut raw = Vec::new();
    let mut done = Vec::new();
    while done.len() < 5 {
        raw.clear();
        r.cq.wait(&mut raw, 64, Duration::from_millis(50));
        for wc in &raw {
            let _ = qp.handle_completion(wc, Instant::now());
        }
        qp.poll_completions(&mut done);
    }
    child.kill();
    let (rest, _) = drive(&mut qp, &r.cq, Duration::from_secs(10));
    done.extend(rest);
    assert_in_order(&done, &p.reads);
    // Under load every issued read may land before the kill; then the loss is seen with
    // nothing issued and the rest is flushed. Either way the queue records the fault.
    assert!(
        done.iter()
            .any(|c| c.status == CompletionStatus::TransportError)
            || qp.fault().is_some(),
        "{done:?}"
    );
    assert!(!all_ok(&done));
    verify(&r.dest, &p, &done);
    assert_eq!(qp.state(), QpState::Error);
    assert_eq!(r.table.gauges().uses, 0);
    qp.reset().unwrap();
    // The peer is gone: reconnecting is a typed connect error.
    assert!(matches!(
        qp.connect(&connector, r.cq.clone()),
        Err(QpError::Connect { .. })
    ));
    assert_eq!(qp.state(), QpState::Reset);
    // A new owner process: the next read works.
    let child2 = spawn_child("tcp", SEED, POOL, None);
    let connector2 = TcpConnector::new(
        ME,
        OWNER,
        child2.addr.parse().unwrap(),
        child2.grant.clone(),
    );
    qp.connect(&connector2, r.cq.clone()).unwrap();
    let stand_in2 = remote_pool_view(&child2);
    let mut p2 = plan(&r, (&stand_in2, SEED), 4, 5000, 2, 7 << 20);
    retarget(&mut p2, &stand_in2, &child2);
    let (d2, errs) = post_and_drive(&mut qp, &r.cq, &p2.reads);
    assert!(errs.is_empty() && all_ok(&d2));
    verify_region_pieces(&r.dest, &p2);
    drop(qp);
    assert_eq!(r.gauges.snapshot(), QpGaugeValues::default());
}

#[test]
fn shm_mapping_is_read_only() {
    use std::os::unix::process::ExitStatusExt;
    let served = serve(Prov::Shm, OWNER, 7, 1 << 20);
    let path = served.shm.as_ref().unwrap().1.clone();
    let m = ShmConnector::new(ME, OWNER, &path).map_exports().unwrap();
    let regions = m.regions();
    assert_eq!(regions.len(), 1);
    let reg = regions[0];
    assert_eq!(reg.rkey, served.pool.mr.key());
    // 1. The kernel's view: the mapping is r--s.
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let line = maps
        .lines()
        .find(|l| {
            let start = l.split('-').next().unwrap();
            u64::from_str_radix(start, 16).unwrap() == reg.local_addr
        })
        .expect("mapping not in /proc/self/maps");
    let perms = line.split_whitespace().nth(1).unwrap();
    assert_eq!(perms, "r--s", "{line}");
    // 2. It cannot be upgraded: the descriptor was opened read-only.
    // SAFETY: mprotect on a mapping we own; it is expected to fail and change nothing.
    let rc = unsafe {
        libc::mprotect(
            reg.local_addr as *mut libc::c_void,
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
        )
    };
    assert_eq!(rc, -1);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::EACCES)
    );
    // 3. A requester process writing through it dies with SIGSEGV, and the pool is unchanged.
    let before = served.pool.region.to_vec();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    let out = cmd
        .args(["child_entry", "--exact", "--nocapture", "--test-threads=1"])
        .env("KVF_CHILD", "shm-writer")
        .env("KVF_SEED", "0")
        .env("KVF_LEN", "4096")
        .env("KVF_PATH", &path)
        .stderr(Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("WRITING") && !stdout.contains("WROTE"),
        "{stdout}"
    );
    assert_eq!(out.status.signal(), Some(libc::SIGSEGV), "{:?}", out.status);
    assert_eq!(served.pool.region.to_vec(), before);
}

// ---------------------------------------------------------------------------------------------
// Fault matrix

fn fault_case(prov: Prov, kind: FaultKind) {
    const SEED: u8 = 0x77;
    let served = serve(prov, OWNER, SEED, 2 << 20);
    let faulty = FaultyConnector::new(served.connector.clone(), OWNER);
    let r = requester(4 << 20);
    let mut l = limits(4, 4);
    if let FaultKind::Delay(_) = kind {
        l.completion_timeout = Duration::from_millis(60);
    }
    let mut qp = r.qp(OWNER, 9, l);
    qp.connect(&faulty, r.cq.clone()).unwrap();
    faulty.inject(Fault { at: 3, kind });
    let p = plan(&r, (&served.pool, SEED), 12, 20_000, 3, 0);
    let (done, errs) = post_and_drive(&mut qp, &r.cq, &p.reads);
    let ctx = format!("{prov:?} {kind:?}: {done:?} {errs:?} {:?}", qp.fault());
    assert_eq!(faulty.fired(), 1, "{ctx}");
    // A typed error.
    assert_eq!(qp.state(), QpState::Error, "{ctx}");
    let fault = qp.fault().unwrap();
    match kind {
        FaultKind::FailPost => {
            assert!(matches!(fault, QueueFault::PostFailed { .. }), "{ctx}");
            assert!(
                errs.iter().any(|e| matches!(e, QpError::Post { .. })),
                "{ctx}"
            );
        }
        FaultKind::CompletionError(s) => {
            assert_eq!(
                fault,
                QueueFault::Completion {
                    wr_id: 1002,
                    status: s
                },
                "{ctx}"
            )
        }
        FaultKind::Delay(_) => assert!(matches!(fault, QueueFault::Timeout { .. }), "{ctx}"),
        // Either the dropped request's completion or the next post notices first.
        _ => assert!(
            matches!(
                fault,
                QueueFault::Completion {
                    wr_id: 1002,
                    status: CompletionStatus::TransportError
                } | QueueFault::ConnectionLost { wr_id: 1003 }
            ),
            "{ctx}"
        ),
    }
    assert_in_order(&done, &p.reads);
    // Earlier requests finished or were flushed by the abort; the faulty one carries the
    // fault's status; every later one is flushed.
    use CompletionStatus::*;
    assert!(
        done[..2]
            .iter()
            .all(|c| matches!(c.status, Success | Flushed)),
        "{ctx}"
    );
    let want = match kind {
        FaultKind::FailPost => PostFailed,
        FaultKind::CompletionError(s) => s,
        FaultKind::Delay(_) => TimedOut,
        _ => TransportError,
    };
    assert_eq!(done[2].status, want, "{ctx}");
    assert!(done[3..].iter().all(|c| c.status == Flushed), "{ctx}");
    // No byte outside the destinations, the successful ones exact.
    verify(&r.dest, &p, &done);
    // Nothing outstanding, every gauge at zero (the QP object itself aside).
    assert_eq!(qp.outstanding(), 0);
    qp.reset().unwrap();
    assert_eq!(
        r.gauges.snapshot(),
        QpGaugeValues {
            qps: 1,
            ..QpGaugeValues::default()
        },
        "{ctx}"
    );
    assert_eq!(r.table.gauges().uses, 0, "{ctx}");
    assert_eq!(served.pool.table.gauges().uses, 0, "{ctx}");
    // Recovery: peer death keeps reconnects failing until the peer is back.
    if kind == FaultKind::PeerDeath {
        assert!(matches!(
            qp.connect(&faulty, r.cq.clone()),
            Err(QpError::Connect { .. })
        ));
        faulty.revive();
    }
    qp.connect(&faulty, r.cq.clone()).unwrap();
    r.dest.fill(CANARY).unwrap();
    let p2 = plan(&r, (&served.pool, SEED), 6, 20_000, 3, 0);
    let (d2, errs) = post_and_drive(&mut qp, &r.cq, &p2.reads);
    assert!(errs.is_empty() && all_ok(&d2), "{ctx} then {d2:?} {errs:?}");
    verify(&r.dest, &p2, &d2);
    drop(qp);
    assert_eq!(r.gauges.snapshot(), QpGaugeValues::default());
    if let Some(o) = &served.tcp {
        let end = Instant::now() + Duration::from_secs(5);
        while o.connections() > 0 && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(o.connections(), 0);
    }
}

fn fault_matrix(prov: Prov) {
    for kind in [
        FaultKind::FailPost,
        FaultKind::CompletionError(CompletionStatus::RemoteAccessError),
        FaultKind::CompletionError(CompletionStatus::TransportError),
        FaultKind::Delay(Duration::from_millis(200)),
        FaultKind::DropConnection,
        FaultKind::PeerDeath,
    ] {
        fault_case(prov, kind);
    }
}

#[test]
fn fault_matrix_loopback() {
    fault_matrix(Prov::Loopback);
}

#[test]
fn fault_matrix_tcp() {
    fault_matrix(Prov::Tcp);
}

#[test]
fn fault_matrix_shm() {
    fault_matrix(Prov::Shm);
}

#[test]
fn tcp_owner_drops_connection_mid_batch() {
    const SEED: u8 = 0x12;
    let served = serve(Prov::Tcp, OWNER, SEED, 4 << 20);
    let r = requester(8 << 20);
    let mut qp = r.qp(OWNER, 1, limits(8, 2));
    qp.connect(&served.connector, r.cq.clone()).unwrap();
    let p = plan(&r, (&served.pool, SEED), 40, 150_000, 2, 0);
    qp.post(&p.reads, Instant::now()).unwrap();
    served.tcp.as_ref().unwrap().drop_connections();
    let (done, _) = drive(&mut qp, &r.cq, Duration::from_secs(10));
    assert_in_order(&done, &p.reads);
    verify(&r.dest, &p, &done);
    assert_eq!(qp.state(), QpState::Error);
    qp.reset().unwrap();
    assert_eq!(r.table.gauges().uses, 0);
    assert_eq!(served.pool.table.gauges().uses, 0);
    qp.connect(&served.connector, r.cq.clone()).unwrap();
    r.dest.fill(CANARY).unwrap();
    let p2 = plan(&r, (&served.pool, SEED), 3, 1000, 1, 0);
    let (d2, _) = post_and_drive(&mut qp, &r.cq, &p2.reads);
    assert!(all_ok(&d2));
    verify(&r.dest, &p2, &d2);
}

// ---------------------------------------------------------------------------------------------
// Contract edge cases

#[test]
fn loopback_contiguous_fragmented_and_windowed() {
    const SEED: u8 = 0x21;
    let served = serve(Prov::Loopback, OWNER, SEED, 1 << 20);
    let r = requester(4 << 20);
    let mut qp = r.qp(OWNER, 1, limits(3, 16));
    qp.connect(&served.connector, r.cq.clone()).unwrap();
    let mut p = plan(&r, (&served.pool, SEED), 50, 4096 + 5, 1, 0);
    let p2 = plan(&r, (&served.pool, SEED), 30, 9000, 16, 1 << 20);
    p.reads.extend(p2.reads);
    p.pieces.extend(p2.pieces);
    let (done, errs) = post_and_drive(&mut qp, &r.cq, &p.reads);
    assert!(errs.is_empty() && all_ok(&done));
    assert_in_order(&done, &p.reads);
    assert_eq!(qp.max_in_flight_seen(), 3);
    verify(&r.dest, &p, &done);
    // max-sge is enforced before anything is posted.
    let mut too_many = plan(&r, (&served.pool, SEED), 1, 9000, 17, 3 << 20);
    too_many.reads[0].wr_id = 1;
    assert!(matches!(
        qp.post(&too_many.reads, Instant::now()),
        Err(QpError::Queue { .. })
    ));
    // A destination outside the local registration is refused locally.
    let mut bad = plan(&r, (&served.pool, SEED), 1, 100, 1, 0);
    bad.reads[0].local[0].addr = r.dest.addr() + r.dest.len() as u64 - 50;
    assert!(matches!(
        qp.post(&bad.reads, Instant::now()),
        Err(QpError::LocalSegment { .. })
    ));
    assert_eq!(qp.outstanding(), 0);
    assert_eq!(r.table.gauges().uses, 0);
}

#[test]
fn simultaneous_handshakes_from_both_sides() {
    let a = serve(Prov::Tcp, NodeId(10), 0xAA, 1 << 20);
    let b = serve(Prov::Tcp, NodeId(20), 0xBB, 1 << 20);
    let a_addr = a.tcp.as_ref().unwrap().local_addr();
    let b_addr = b.tcp.as_ref().unwrap().local_addr();
    // One grant per requester, shared by its connections.
    let to_b = b.auth.issue(NodeId(10)).unwrap();
    let to_a = a.auth.issue(NodeId(20)).unwrap();
    let barrier = Arc::new(std::sync::Barrier::new(8));
    let mut threads = Vec::new();
    for i in 0..8u32 {
        let (from, to, addr, grant) = if i % 2 == 0 {
            (NodeId(10), NodeId(20), b_addr, to_b.clone())
        } else {
            (NodeId(20), NodeId(10), a_addr, to_a.clone())
        };
        let barrier = barrier.clone();
        threads.push(std::thread::spawn(move || {
            let r = requester(1 << 16);
            let mut qp = r.qp(to, i, limits(2, 2));
            let c = TcpConnector::new(from, to, addr, grant);
            barrier.wait();
            qp.connect(&c, r.cq.clone()).map(|()| qp.state())
        }));
    }
    for t in threads {
        assert_eq!(t.join().unwrap().unwrap(), QpState::ReadyToSend);
    }
    // A connector that expects the wrong node is refused with a typed error.
    let r = requester(1 << 16);
    let mut qp = r.qp(NodeId(30), 1, limits(2, 2));
    let c = TcpConnector::new(ME, NodeId(30), a_addr, a.auth.issue(ME).unwrap());
    assert!(matches!(
        qp.connect(&c, r.cq.clone()),
        Err(QpError::Connect { .. })
    ));
    drop((a, b));
}

#[test]
fn two_peers_with_the_same_qp_number() {
    let p1 = serve(Prov::Tcp, NodeId(1001), 0x11, 1 << 20);
    let p2 = serve(Prov::Loopback, NodeId(1002), 0x22, 1 << 20);
    let r = requester(4 << 20);
    let mut qps: HashMap<QpKey, Qp> = HashMap::new();
    for (peer, s) in [(NodeId(1001), &p1), (NodeId(1002), &p2)] {
        let mut qp = r.qp(peer, 1, limits(4, 4));
        qp.connect(&s.connector, r.cq.clone()).unwrap();
        qps.insert(qp.key(), qp);
    }
    assert_eq!(qps.len(), 2);
    let plan1 = plan(&r, (&p1.pool, 0x11), 10, 3000, 2, 0);
    let plan2 = plan(&r, (&p2.pool, 0x22), 10, 3000, 2, 1 << 20);
    let k1 = QpKey::new(NodeId(1001), NicId(0), QpNum(1));
    let k2 = QpKey::new(NodeId(1002), NicId(0), QpNum(1));
    let now = Instant::now();
    qps.get_mut(&k1).unwrap().post(&plan1.reads, now).unwrap();
    qps.get_mut(&k2).unwrap().post(&plan2.reads, now).unwrap();
    // One poller-style loop over the shared CQ, routing by the full key.
    let mut done: HashMap<QpKey, Vec<WorkCompletion>> = HashMap::new();
    let end = Instant::now() + Duration::from_secs(10);
    let mut raw = Vec::new();
    while qps.values().any(|q| q.outstanding() > 0) {
        assert!(Instant::now() < end);
        raw.clear();
        r.cq.wait(&mut raw, 16, Duration::from_millis(10));
        for wc in &raw {
            qps.get_mut(&wc.qp)
                .unwrap()
                .handle_completion(wc, Instant::now())
                .unwrap();
        }
        for (k, q) in qps.iter_mut() {
            q.poll_completions(done.entry(*k).or_default());
        }
    }
    assert_in_order(&done[&k1], &plan1.reads);
    assert_in_order(&done[&k2], &plan2.reads);
    verify_region_pieces(&r.dest, &plan1);
    verify_region_pieces(&r.dest, &plan2);
}

#[test]
fn deregistration_waits_for_reads_in_flight() {
    const SEED: u8 = 0x66;
    let served = serve(Prov::Loopback, OWNER, SEED, 1 << 20);
    let faulty = FaultyConnector::new(served.connector.clone(), OWNER);
    let mut r = requester(1 << 20);
    let mut qp = r.qp(OWNER, 1, limits(4, 4));
    qp.connect(&faulty, r.cq.clone()).unwrap();
    faulty.inject(Fault {
        at: 1,
        kind: FaultKind::Delay(Duration::from_millis(150)),
    });
    let p = plan(&r, (&served.pool, SEED), 4, 10_000, 2, 0);
    qp.post(&p.reads, Instant::now()).unwrap();
    let key = r.lkey();
    // The last handle drops while the reads are in flight: deregistration is deferred.
    drop(r.mr.take());
    assert!(r.table.is_registered(key));
    assert_eq!(r.table.gauges().deferred, 1);
    // Owner side too: dropping the pool handle mid-flight.
    let (done, errs) = drive(&mut qp, &r.cq, Duration::from_secs(5));
    assert!(errs.is_empty() && all_ok(&done), "{done:?}");
    verify(&r.dest, &p, &done);
    // Reported and released: the deregistration completed.
    assert!(!r.table.is_registered(key));
    assert_eq!(r.table.gauges().registered, 0);
    assert_eq!(r.table.gauges().deregistered, 1);
}

/// Emulated device memory behind the sink trait.
struct VecSink {
    base: u64,
    mem: Mutex<Vec<u8>>,
    flushes: AtomicU32,
}

impl DeviceSink for VecSink {
    fn write(&self, dst: u64, data: &[u8]) -> Result<(), SinkError> {
        let off = (dst - self.base) as usize;
        let mut m = self.mem.lock().unwrap();
        m.get_mut(off..off + data.len())
            .ok_or(SinkError::Write {
                dst,
                len: data.len() as u64,
                reason: "out of range".into(),
            })?
            .copy_from_slice(data);
        Ok(())
    }
    fn flush(&self) -> Result<(), SinkError> {
        self.flushes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

#[test]
fn device_destinations_through_the_sink() {
    const SEED: u8 = 0x99;
    for prov in [Prov::Loopback, Prov::Tcp, Prov::Shm] {
        let served = serve(prov, OWNER, SEED, 2 << 20);
        let r = requester(1 << 20);
        let base = 0x7f00_0000_0000u64;
        let dev_len = 1 << 20;
        let sink = Arc::new(VecSink {
            base,
            mem: Mutex::new(vec![CANARY; dev_len]),
            flushes: AtomicU32::new(0),
        });
        let dev = r
            .table
            .register_device(base, dev_len as u64, sink.clone())
            .unwrap();
        let mut qp = r.qp(OWNER, 1, limits(4, 4));
        qp.connect(&served.connector, r.cq.clone()).unwrap();
        // Read 300 KiB: a host piece, a device piece larger than the tcp bounce buffer, a host
        // piece.
        let src = 12_345u64;
        let pieces = [
            (true, 1000u64, 100u64),
            (false, 4096, 300_000),
            (true, 5000, 7_000),
        ];
        let total: u64 = pieces.iter().map(|p| p.2).sum();
        let local = pieces
            .iter()
            .map(|&(host, off, len)| LocalSegment {
                lkey: if host { r.lkey() } else { dev.key() },
                addr: if host {
                    r.dest.addr() + off
                } else {
                    base + off
                },
                len,
            })
            .collect();
        let read = ReadRequest {
            wr_id: 5,
            remote: RemoteDescriptor {
                addr: served.pool.region.addr() + src,
                len: total,
                rkey: served.pool.mr.key(),
            },
            local,
        };
        let (done, errs) = post_and_drive(&mut qp, &r.cq, &[read]);
        assert!(errs.is_empty() && all_ok(&done), "{prov:?} {done:?}");
        let mut at = src;
        let host = r.dest.to_vec();
        let devm = sink.mem.lock().unwrap().clone();
        for &(is_host, off, len) in &pieces {
            let mem = if is_host { &host } else { &devm };
            for k in 0..len {
                assert_eq!(mem[(off + k) as usize], pat(SEED, at + k), "{prov:?}");
            }
            assert_eq!(mem[(off - 1) as usize], CANARY);
            assert_eq!(mem[(off + len) as usize], CANARY);
            at += len;
        }
        assert!(sink.flushes.load(Ordering::Relaxed) >= 1);
        // The device region is never remotely readable.
        assert!(r.table.acquire_remote_read(dev.key(), base, 16).is_err());
    }
}
