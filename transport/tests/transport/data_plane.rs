//! The tcp data plane against clients that are not authorised peers: no grant, a stale one,
//! a wrong secret, a guessed key, garbage, a truncated hello, a slowloris, a source that
//! keeps trying. Each is refused and counted, and an authorised requester keeps reading.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvferry_transport::data_auth::SourceGuard;
use kvferry_transport::tcp::{TcpConnector, TcpOwner, TcpOwnerOptions};
use kvferry_transport::{
    ConnectionError, DataAuth, LinkGrant, LinkSecret, NodeId, QpError, Reject, Rejections,
};

use super::*;

const SEED: u8 = 0x3c;

/// Every refusal the owner reported, in order.
type Seen = Arc<Mutex<Vec<(Option<SocketAddr>, Reject)>>>;

struct Owner {
    pool: Pool,
    auth: DataAuth,
    tcp: TcpOwner,
    seen: Seen,
}

impl Owner {
    fn start(hello_deadline: Duration, max_pending: usize, guard: SourceGuard) -> Owner {
        let pool = pool(SEED, 4 << 20);
        let auth = DataAuth::new();
        let seen: Seen = Arc::default();
        let mut opts = TcpOwnerOptions::new(auth.clone());
        opts.hello_deadline = hello_deadline;
        opts.max_pending = max_pending;
        opts.guard = Arc::new(Mutex::new(guard));
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

    fn default() -> Owner {
        Owner::start(Duration::from_secs(5), 64, SourceGuard::default())
    }

    fn addr(&self) -> SocketAddr {
        self.tcp.local_addr()
    }

    fn rejections(&self) -> Arc<Rejections> {
        self.tcp.rejections()
    }

    /// Waits until `why` was counted `n` times (the owner's threads count asynchronously).
    fn wait_for(&self, why: Reject, n: u64) {
        let until = Instant::now() + Duration::from_secs(10);
        while self.rejections().get(why) < n {
            assert!(
                Instant::now() < until,
                "{why:?}: {} of {n}; {:?}",
                self.rejections().get(why),
                self.rejections().labelled()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Connects a QP with `grant` and reads a few ranges; true when every byte arrived.
fn reads_ok(owner: &Owner, grant: LinkGrant) -> Result<bool, QpError> {
    let r = requester(2 << 20);
    let c = TcpConnector::new(ME, OWNER, owner.addr(), grant)
        .with_connect_timeout(Duration::from_secs(2));
    let mut qp = r.qp(OWNER, 1, limits(4, 4));
    qp.connect(&c, r.cq.clone())?;
    let p = plan(&r, (&owner.pool, SEED), 6, 10_000, 2, 0);
    let (done, errs) = post_and_drive(&mut qp, &r.cq, &p.reads);
    if errs.is_empty() && all_ok(&done) {
        verify(&r.dest, &p, &done);
        return Ok(true);
    }
    Ok(false)
}

fn connect_err(owner: &Owner, grant: LinkGrant) -> QpError {
    let r = requester(1 << 16);
    let c = TcpConnector::new(ME, OWNER, owner.addr(), grant);
    let mut qp = r.qp(OWNER, 1, limits(2, 2));
    qp.connect(&c, r.cq.clone()).unwrap_err()
}

fn unauthorized(e: &QpError) -> bool {
    matches!(
        e,
        QpError::Connect {
            source: ConnectionError::Unauthorized { .. },
            ..
        }
    )
}

/// A stream from `ip` (any 127/8 address is loopback) to `to`.
fn connect_from(ip: [u8; 4], to: SocketAddr) -> TcpStream {
    let s = socket2_like_connect(ip, to);
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

fn socket2_like_connect(ip: [u8; 4], to: SocketAddr) -> TcpStream {
    // Bind the source address first: std has no bind-then-connect, so go through libc.
    use std::os::fd::FromRawFd;
    // SAFETY: plain socket calls on a descriptor this function owns until it is wrapped.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
        assert!(fd >= 0);
        let mut sa: libc::sockaddr_in = std::mem::zeroed();
        sa.sin_family = libc::AF_INET as _;
        sa.sin_addr.s_addr = u32::from_ne_bytes(ip);
        assert_eq!(
            libc::bind(
                fd,
                (&sa as *const libc::sockaddr_in).cast(),
                std::mem::size_of::<libc::sockaddr_in>() as _
            ),
            0
        );
        let SocketAddr::V4(v4) = to else { panic!() };
        let mut da: libc::sockaddr_in = std::mem::zeroed();
        da.sin_family = libc::AF_INET as _;
        da.sin_port = v4.port().to_be();
        da.sin_addr.s_addr = u32::from_ne_bytes(v4.ip().octets());
        assert_eq!(
            libc::connect(
                fd,
                (&da as *const libc::sockaddr_in).cast(),
                std::mem::size_of::<libc::sockaddr_in>() as _
            ),
            0
        );
        TcpStream::from_raw_fd(fd)
    }
}

/// Reads until the owner closes; the bytes it sent before (at most the challenge and a
/// refusal). Panics if it stays open past `within`.
fn closed_within(mut s: TcpStream, within: Duration) -> (Vec<u8>, Duration) {
    let t = Instant::now();
    s.set_read_timeout(Some(within)).unwrap();
    let mut got = Vec::new();
    let mut b = [0u8; 4096];
    loop {
        match s.read(&mut b) {
            Ok(0) => return (got, t.elapsed()),
            Ok(n) => got.extend_from_slice(&b[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return (got, t.elapsed()),
            Err(e) => panic!("still open after {:?}: {e}", t.elapsed()),
        }
    }
}

#[test]
fn only_a_granted_link_reads_and_the_rest_is_refused_and_counted() {
    let o = Owner::default();
    let grant = o.auth.issue(ME).unwrap();
    assert!(reads_ok(&o, grant.clone()).unwrap());

    // No grant of this owner: a link id it never issued.
    let made_up = LinkGrant {
        link: grant.link ^ 0xdead_beef,
        secret: grant.secret.clone(),
    };
    assert!(unauthorized(&connect_err(&o, made_up)));
    o.wait_for(Reject::UnknownLink, 1);

    // The right link id with a wrong secret.
    let wrong = LinkGrant {
        link: grant.link,
        secret: LinkSecret::from_bytes(&[7u8; 32]).unwrap(),
    };
    assert!(unauthorized(&connect_err(&o, wrong)));
    o.wait_for(Reject::BadProof, 1);

    // Another requester's grant, claimed by this one.
    let theirs = o.auth.issue(NodeId(555)).unwrap();
    assert!(unauthorized(&connect_err(&o, theirs)));
    o.wait_for(Reject::UnknownLink, 2);

    // A stale grant: the requester handshook again, which revoked the first.
    let fresh = o.auth.issue(ME).unwrap();
    assert!(unauthorized(&connect_err(&o, grant)));
    o.wait_for(Reject::StaleLink, 1);

    // The authorised link still reads, byte for byte, and nothing leaked a use.
    assert!(reads_ok(&o, fresh).unwrap());
    assert_eq!(o.pool.table.gauges().uses, 0);
    let log = o.seen.lock().unwrap().clone();
    assert!(log.iter().any(|(_, w)| *w == Reject::BadProof), "{log:?}");
    assert_eq!(o.rejections().get(Reject::Banned), 0);
}

#[test]
fn a_revoked_link_is_served_no_further() {
    let o = Owner::default();
    let grant = o.auth.issue(ME).unwrap();
    let r = requester(2 << 20);
    let c = TcpConnector::new(ME, OWNER, o.addr(), grant.clone());
    let mut qp = r.qp(OWNER, 1, limits(4, 4));
    qp.connect(&c, r.cq.clone()).unwrap();
    let p = plan(&r, (&o.pool, SEED), 4, 8_000, 1, 0);
    let (done, errs) = post_and_drive(&mut qp, &r.cq, &p.reads);
    assert!(errs.is_empty() && all_ok(&done));
    o.auth.revoke(grant.link);
    // The live connection reads nothing more: its next read closes it.
    let p2 = plan(&r, (&o.pool, SEED), 4, 8_000, 1, 1 << 20);
    let (done2, _) = post_and_drive(&mut qp, &r.cq, &p2.reads);
    assert!(done2.iter().all(|c| !c.status.is_success()), "{done2:?}");
    o.wait_for(Reject::StaleLink, 1);
    assert_eq!(r.table.gauges().uses, 0);
    untouched(&r.dest, &p2);
}

/// Every destination byte of `p` is still canary: nothing of a refused read landed.
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
fn a_guessed_key_reads_nothing_and_closes_the_connection() {
    let o = Owner::default();
    let grant = o.auth.issue(ME).unwrap();
    let r = requester(2 << 20);
    let c = TcpConnector::new(ME, OWNER, o.addr(), grant);
    let mut qp = r.qp(OWNER, 1, limits(4, 4));
    qp.connect(&c, r.cq.clone()).unwrap();
    let mut p = plan(&r, (&o.pool, SEED), 2, 4_000, 1, 0);
    let real = p.reads[0].remote.rkey;
    // A neighbour of the real key, as a guesser would try.
    p.reads[0].remote.rkey = MrKey(real.0 ^ 1);
    let (done, _) = post_and_drive(&mut qp, &r.cq, &p.reads);
    assert_eq!(done[0].status, CompletionStatus::RemoteAccessError);
    assert!(!done[1].status.is_success());
    o.wait_for(Reject::BadRead, 1);
    let refused = Plan {
        reads: p.reads[..1].to_vec(),
        pieces: p.pieces[..1].to_vec(),
        seed: SEED,
    };
    untouched(&r.dest, &refused);
    // The owner closed it: a rebuilt connection reads again.
    qp.reset().unwrap();
    qp.connect(&c, r.cq.clone()).unwrap();
    let p2 = plan(&r, (&o.pool, SEED), 3, 4_000, 1, 1 << 20);
    let (done2, errs) = post_and_drive(&mut qp, &r.cq, &p2.reads);
    assert!(errs.is_empty() && all_ok(&done2));
    verify(&r.dest, &p2, &done2);
    assert!(o.tcp.connections() <= 1);
}

#[test]
fn garbage_truncated_and_slow_hellos_are_cut_off_while_others_read() {
    let deadline = Duration::from_millis(400);
    let o = Owner::start(deadline, 64, SourceGuard::default());
    let grant = o.auth.issue(ME).unwrap();
    let addr = o.addr();
    // Garbage: a full hello's worth of noise.
    let mut g = connect_from([127, 0, 0, 11], addr);
    g.write_all(&[0x5a; 200]).unwrap();
    let (_, _) = closed_within(g, Duration::from_secs(5));
    o.wait_for(Reject::BadHello, 1);
    // Truncated: half a hello, then the client closes its side.
    let mut t = connect_from([127, 0, 0, 12], addr);
    t.write_all(&[0u8; 20]).unwrap();
    t.shutdown(std::net::Shutdown::Write).unwrap();
    closed_within(t, Duration::from_secs(5));
    o.wait_for(Reject::BadHello, 2);
    // Slowloris: connects and sends one byte every 100 ms; and one that sends nothing.
    let slow = connect_from([127, 0, 0, 13], addr);
    let silent = connect_from([127, 0, 0, 14], addr);
    let mut writer = slow.try_clone().unwrap();
    let drip = std::thread::spawn(move || {
        for _ in 0..40 {
            if writer.write_all(&[1]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    // While they hang, an authorised requester reads.
    assert!(reads_ok(&o, grant).unwrap());
    let (_, took) = closed_within(slow, Duration::from_secs(5));
    assert!(took < deadline + Duration::from_secs(1), "{took:?}");
    closed_within(silent, Duration::from_secs(5));
    o.wait_for(Reject::HelloTimeout, 2);
    drip.join().unwrap();
    // Only the authorised requester's connection was ever served past its hello.
    let until = Instant::now() + Duration::from_secs(5);
    while o.tcp.connections() > 0 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
    // (the requester in `reads_ok` has dropped its QP by now)
    assert_eq!(o.tcp.connections(), 0);
}

#[test]
fn too_many_pending_hellos_are_refused_at_once() {
    let o = Owner::start(Duration::from_secs(2), 2, SourceGuard::default());
    let hold: Vec<TcpStream> = (0..2)
        .map(|i| connect_from([127, 0, 0, 20 + i], o.addr()))
        .collect();
    // Both are in their hello (they got the challenge).
    for mut s in hold.iter().map(|s| s.try_clone().unwrap()) {
        let mut b = [0u8; 8];
        s.read_exact(&mut b).unwrap();
    }
    let third = connect_from([127, 0, 0, 30], o.addr());
    let (got, took) = closed_within(third, Duration::from_secs(2));
    assert!(got.is_empty(), "the refused one got {} bytes", got.len());
    assert!(took < Duration::from_secs(1), "{took:?}");
    o.wait_for(Reject::Busy, 1);
    drop(hold);
}

#[test]
fn connections_past_the_limit_are_refused_and_the_served_ones_go_on() {
    let pool = pool(SEED, 4 << 20);
    let auth = DataAuth::new();
    let mut opts = TcpOwnerOptions::new(auth.clone());
    opts.max_connections = 2;
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let tcp = TcpOwner::spawn_with(l, OWNER, pool.table.clone(), opts).unwrap();
    let grant = auth.issue(ME).unwrap();
    let r = requester(2 << 20);
    let c = TcpConnector::new(ME, OWNER, tcp.local_addr(), grant);
    let mut qps: Vec<Qp> = (1..=2).map(|n| r.qp(OWNER, n, limits(4, 4))).collect();
    for qp in &mut qps {
        qp.connect(&c, r.cq.clone()).unwrap();
    }
    // A third is closed before its hello: the requester gets no challenge.
    let mut third = r.qp(OWNER, 3, limits(4, 4));
    assert!(matches!(
        third.connect(&c, r.cq.clone()),
        Err(QpError::Connect { .. })
    ));
    assert_eq!(tcp.rejections().get(Reject::Busy), 1);
    // The two served ones still read.
    let p = plan(&r, (&pool, SEED), 4, 8_000, 2, 0);
    let (done, errs) = post_and_drive(&mut qps[0], &r.cq, &p.reads);
    assert!(errs.is_empty() && all_ok(&done));
    verify(&r.dest, &p, &done);
    // Once one closes, a new one is served.
    drop(qps.pop());
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let mut again = r.qp(OWNER, 4, limits(4, 4));
        if again.connect(&c, r.cq.clone()).is_ok() {
            break;
        }
        assert!(Instant::now() < until, "no room after a connection closed");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_source_that_keeps_failing_is_refused_while_others_read() {
    let guard = SourceGuard::new(4, Duration::from_secs(60), Duration::from_secs(60), 64);
    let o = Owner::start(Duration::from_secs(5), 64, guard);
    let grant = o.auth.issue(ME).unwrap();
    let attacker = [127, 0, 0, 40];
    for _ in 0..4 {
        let mut s = connect_from(attacker, o.addr());
        s.write_all(&[0xff; 104]).unwrap();
        closed_within(s, Duration::from_secs(5));
    }
    o.wait_for(Reject::BadHello, 4);
    // Now the source is refused before it is sent anything.
    let s = connect_from(attacker, o.addr());
    let (got, _) = closed_within(s, Duration::from_secs(5));
    assert!(got.is_empty());
    o.wait_for(Reject::Banned, 1);
    let log = o.seen.lock().unwrap().clone();
    assert!(log.iter().any(|(from, w)| *w == Reject::Banned
        && from.is_some_and(|a| a.ip().to_string() == "127.0.0.40")));
    // Another source (the authorised requester on 127.0.0.1) is served.
    assert!(reads_ok(&o, grant).unwrap());
}

#[test]
fn failures_beside_an_open_authorised_connection_do_not_shut_its_host_out() {
    let guard = SourceGuard::new(4, Duration::from_secs(60), Duration::from_secs(60), 64);
    let o = Owner::start(Duration::from_secs(5), 64, guard);
    let grant = o.auth.issue(ME).unwrap();
    // An authorised requester on 127.0.0.1 keeps its connection open...
    let r = requester(2 << 20);
    let c = TcpConnector::new(ME, OWNER, o.addr(), grant.clone())
        .with_connect_timeout(Duration::from_secs(2));
    let mut qp = r.qp(OWNER, 1, limits(4, 4));
    qp.connect(&c, r.cq.clone()).unwrap();
    // ...while another client of the same host sends garbage, past the ban's threshold.
    for _ in 0..6 {
        let mut s = connect_from([127, 0, 0, 1], o.addr());
        s.write_all(&[0xff; 104]).unwrap();
        closed_within(s, Duration::from_secs(5));
    }
    o.wait_for(Reject::BadHello, 6);
    assert_eq!(o.rejections().get(Reject::Banned), 0);
    // The peer's next connection (a lane reconnecting) is still served, and so is the open one.
    assert!(reads_ok(&o, grant).unwrap());
    let p = plan(&r, (&o.pool, SEED), 4, 20_000, 2, 0);
    let (done, errs) = post_and_drive(&mut qp, &r.cq, &p.reads);
    assert!(errs.is_empty() && all_ok(&done));
    verify(&r.dest, &p, &done);
}
