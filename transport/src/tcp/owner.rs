//! The owner side of a tcp link: accept, the hello, then serve each read from the MR table.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::data_auth::{
    self, Admitted, DataAuth, GrantRefusal, ProofContext, Reject, Rejections, SourceGuard,
    NONCE_LEN, PROOF_LEN,
};
use crate::mr_table::MrTable;
use crate::owner_loop::OwnerServer;
use crate::qp_key::NodeId;
use crate::tls::{self};
use crate::wire::{self, Challenge, Hello, HelloAck, Proof, ReadReq, ReadResp};

use super::{lock, POLL_INTERVAL};

/// for no longer.
pub const HELLO_DEADLINE: Duration = Duration::from_secs(5);
/// Connections in their hello at once by default; more are closed on accept.
pub const MAX_PENDING_HELLOS: usize = 64;
/// Connections served at once by default (a thread each), hellos included; more are closed
/// on accept. A requester opens `qps-per-peer` per link.
pub const MAX_CONNECTIONS: usize = 4096;

/// Refusals the owner reports as they happen (the node counts them in its metrics and writes
/// a rate-limited log line): the source address and why.
pub type RejectHook = Arc<dyn Fn(Option<SocketAddr>, Reject) + Send + Sync>;

/// How a [`TcpOwner`] admits connections.
#[derive(Clone)]
pub struct TcpOwnerOptions {
    /// The grants data connections must prove (issued by the Peer service's Handshake).
    pub auth: DataAuth,
    pub hello_deadline: Duration,
    pub max_pending: usize,
    pub max_connections: usize,
    /// Sources that keep failing are refused for a while.
    pub guard: Arc<Mutex<SourceGuard>>,
    pub on_reject: Option<RejectHook>,
    /// Serve over TLS with this config (which decides what client certificates it accepts);
    /// the TLS handshake counts against the hello deadline.
    pub tls: Option<Arc<rustls::ServerConfig>>,
}

impl TcpOwnerOptions {
    pub fn new(auth: DataAuth) -> Self {
        Self {
            auth,
            hello_deadline: HELLO_DEADLINE,
            max_pending: MAX_PENDING_HELLOS,
            max_connections: MAX_CONNECTIONS,
            guard: Arc::new(Mutex::new(SourceGuard::default())),
            on_reject: None,
            tls: None,
        }
    }
}

impl std::fmt::Debug for TcpOwnerOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpOwnerOptions")
            .field("hello_deadline", &self.hello_deadline)
            .field("max_pending", &self.max_pending)
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

/// Serves reads of `table`'s remote-readable regions to requesters that prove a link grant
/// of its [`DataAuth`].
pub struct TcpOwner {
    local_addr: SocketAddr,
    rejections: Arc<Rejections>,
    server: OwnerServer<TcpStream>,
}

impl std::fmt::Debug for TcpOwner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpOwner")
            .field("local_addr", &self.local_addr)
            .field("connections", &self.connections())
            .finish()
    }
}

/// What every serving thread of one owner shares.
struct OwnerCtx {
    node: NodeId,
    table: MrTable,
    opts: TcpOwnerOptions,
    pending: AtomicUsize,
    /// Connections with a serving thread (in their hello or past it).
    served: AtomicUsize,
    rejections: Arc<Rejections>,
}

impl OwnerCtx {
    fn reject(&self, from: Option<SocketAddr>, why: Reject) {
        self.rejections.count(why);
        if let (Some(a), true) = (from, why.counts_against_source()) {
            lock(&self.opts.guard).failed(a.ip(), Instant::now());
        }
        if let Some(h) = &self.opts.on_reject {
            h(from, why);
        }
    }
}

/// Counts a connection in its hello until it is done with it.
struct Pending<'a>(&'a AtomicUsize);

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl TcpOwner {
    /// Starts serving on an already-bound listener (tests bind `127.0.0.1:0`); connections
    /// must prove a grant of `auth`.
    pub fn spawn(
        listener: TcpListener,
        node: NodeId,
        table: MrTable,
        auth: DataAuth,
    ) -> io::Result<TcpOwner> {
        Self::spawn_with(listener, node, table, TcpOwnerOptions::new(auth))
    }

    pub fn spawn_with(
        listener: TcpListener,
        node: NodeId,
        table: MrTable,
        opts: TcpOwnerOptions,
    ) -> io::Result<TcpOwner> {
        let local_addr = listener.local_addr()?;
        let rejections = Arc::new(Rejections::default());
        let ctx = Arc::new(OwnerCtx {
            node,
            table,
            opts,
            pending: AtomicUsize::new(0),
            served: AtomicUsize::new(0),
            rejections: rejections.clone(),
        });
        let admit = {
            let ctx = ctx.clone();
            Box::new(move |s: &TcpStream| {
                let from = s.peer_addr().ok();
                if from.is_some_and(|a| lock(&ctx.opts.guard).is_refused(a.ip(), Instant::now())) {
                    ctx.reject(from, Reject::Banned);
                    return false;
                }
                if ctx.served.load(Ordering::Acquire) >= ctx.opts.max_connections {
                    ctx.reject(from, Reject::Busy);
                    return false;
                }
                if ctx.pending.fetch_add(1, Ordering::AcqRel) >= ctx.opts.max_pending {
                    ctx.pending.fetch_sub(1, Ordering::AcqRel);
                    ctx.reject(from, Reject::Busy);
                    return false;
                }
                // Counted here, on the accept thread, so the next accept sees it.
                ctx.served.fetch_add(1, Ordering::AcqRel);
                true
            })
        };
        let serve = Arc::new(move |s: TcpStream, qp: u32| serve(s, qp, &ctx));
        Ok(TcpOwner {
            local_addr,
            rejections,
            server: OwnerServer::spawn(listener, "kvferry-tcp", Some(admit), serve)?,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Requester connections currently served (those in their hello included).
    pub fn connections(&self) -> usize {
        self.server.connections()
    }

    /// Connections refused or closed, by reason.
    pub fn rejections(&self) -> Arc<Rejections> {
        self.rejections.clone()
    }

    /// Closes every connection (requesters see a lost connection) and keeps accepting.
    pub fn drop_connections(&self) {
        self.server.drop_connections();
    }

    /// Stops accepting, closes every connection and waits for the threads.
    pub fn shutdown(mut self) {
        self.server.stop();
    }
}

/// Receives exactly `buf.len()` bytes before `deadline`, however slowly they come.
fn recv_before(stream: &mut impl Read, buf: &mut [u8], deadline: Instant) -> Result<(), Reject> {
    let mut done = 0;
    while done < buf.len() {
        if Instant::now() >= deadline {
            return Err(Reject::HelloTimeout);
        }
        match stream.read(&mut buf[done..]) {
            Ok(0) => {
                // Closed before the hello was complete: a truncated hello.
                return Err(Reject::BadHello);
            }
            Ok(r) => done += r,
            Err(e) => match e.kind() {
                io::ErrorKind::Interrupted
                | io::ErrorKind::WouldBlock
                | io::ErrorKind::TimedOut => {}
                _ => return Err(Reject::BadHello),
            },
        }
    }
    Ok(())
}

/// Prepares an accepted socket for its hello: blocking, short receive timeouts so the
/// deadline is checked while a client sends nothing.
fn prepare_hello(stream: &TcpStream, ctx: &OwnerCtx) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(POLL_INTERVAL))?;
    stream.set_write_timeout(Some(ctx.opts.hello_deadline))
}

/// What the owner serves reads over: the socket itself, or TLS on it.
trait OwnerIo: Read + Write {
    fn socket(&self) -> &TcpStream;
    /// Sends a response head and its body.
    ///
    /// # Safety
    /// `body..body+len` must be readable for the duration of the call.
    unsafe fn send_head_and_body(
        &mut self,
        head: &[u8],
        body: *const u8,
        len: usize,
    ) -> io::Result<()>;
    fn recv_exact(&mut self, buf: &mut [u8]) -> Result<(), wire::RecvError>;
}

impl OwnerIo for TcpStream {
    fn socket(&self) -> &TcpStream {
        self
    }

    unsafe fn send_head_and_body(
        &mut self,
        head: &[u8],
        body: *const u8,
        len: usize,
    ) -> io::Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { wire::send_head_and_body(self.as_raw_fd(), head, body, len) }
    }

    fn recv_exact(&mut self, buf: &mut [u8]) -> Result<(), wire::RecvError> {
        wire::recv_exact(self.as_raw_fd(), buf, || true)
    }
}

impl OwnerIo for tls::ServerStream {
    fn socket(&self) -> &TcpStream {
        &self.sock
    }

    unsafe fn send_head_and_body(
        &mut self,
        head: &[u8],
        body: *const u8,
        len: usize,
    ) -> io::Result<()> {
        // SAFETY: the caller guarantees `body..body+len` is readable during the call.
        let body = unsafe { std::slice::from_raw_parts(body, len) };
        self.write_all(head)?;
        self.write_all(body)?;
        self.flush()
    }

    fn recv_exact(&mut self, buf: &mut [u8]) -> Result<(), wire::RecvError> {
        self.read_exact(buf).map_err(|e| match e.kind() {
            io::ErrorKind::UnexpectedEof => wire::RecvError::Eof,
            _ => wire::RecvError::Io(e),
        })
    }
}

/// The owner's side of the hello: challenge, check the hello and its proof, answer. On
/// refusal the requester gets a status where one helps it (a version or peer mismatch,
/// unauthorised) and the connection is closed.
fn owner_hello<S: Read + Write>(
    stream: &mut S,
    qp: u32,
    ctx: &OwnerCtx,
    deadline: Instant,
) -> Result<(u64, Admitted), Reject> {
    let setup = |_| Reject::BadHello;
    let mut nonce = [0u8; NONCE_LEN];
    data_auth::random(&mut nonce).map_err(|_| Reject::BadHello)?;
    let challenge = Challenge {
        magic: wire::MAGIC,
        version: wire::TCP_VERSION,
        node: ctx.node,
        nonce,
    };
    stream.write_all(&challenge.encode()).map_err(setup)?;
    stream.flush().map_err(setup)?;
    let mut hb = [0u8; Hello::LEN + Proof::LEN];
    recv_before(stream, &mut hb, deadline)?;
    let mut h = [0u8; Hello::LEN];
    h.copy_from_slice(&hb[..Hello::LEN]);
    let hello = Hello::decode(&h);
    let mut p = [0u8; Proof::LEN];
    p.copy_from_slice(&hb[Hello::LEN..]);
    let proof = Proof::decode(&p);
    let answer = |stream: &mut S, status: u8, mac: [u8; PROOF_LEN]| {
        let ack = HelloAck {
            magic: wire::MAGIC,
            version: wire::TCP_VERSION,
            status,
            node: ctx.node,
            qp,
            count: 0,
        };
        let mut b = [0u8; HelloAck::LEN + PROOF_LEN];
        b[..HelloAck::LEN].copy_from_slice(&ack.encode());
        b[HelloAck::LEN..].copy_from_slice(&mac);
        stream.write_all(&b)?;
        stream.flush()
    };
    let refuse = |stream: &mut S, status: u8, why: Reject| {
        let _ = answer(stream, status, [0; PROOF_LEN]);
        Err(why)
    };
    if hello.magic != wire::MAGIC || hello.version != wire::TCP_VERSION {
        return refuse(stream, wire::ACK_BAD_VERSION, Reject::BadHello);
    }
    if hello.kind != wire::KIND_TCP {
        return refuse(stream, wire::ACK_WRONG_KIND, Reject::BadHello);
    }
    if hello.expected_peer != ctx.node {
        return refuse(stream, wire::ACK_WRONG_PEER, Reject::WrongPeer);
    }
    let admitted = match ctx.opts.auth.lookup(proof.link, hello.node) {
        Ok(a) => a,
        Err(r) => {
            let why = match r {
                GrantRefusal::Stale => Reject::StaleLink,
                GrantRefusal::Unknown | GrantRefusal::WrongPeer => Reject::UnknownLink,
            };
            return refuse(stream, wire::ACK_UNAUTHORIZED, why);
        }
    };
    let pc = ProofContext {
        owner_nonce: nonce,
        requester_nonce: proof.nonce,
        link: proof.link,
        requester: hello.node,
        owner: ctx.node,
        qp: hello.qp,
    };
    if !pc.check_requester(&admitted.secret, &proof.mac) {
        return refuse(stream, wire::ACK_UNAUTHORIZED, Reject::BadProof);
    }
    answer(stream, wire::ACK_OK, pc.owner_proof(&admitted.secret)).map_err(setup)?;
    Ok((proof.link, admitted))
}

fn serve(stream: TcpStream, qp: u32, ctx: &OwnerCtx) {
    // Admission counted this connection as served and pending; it stays pending until its
    // hello is done and served until this returns.
    let _served = Pending(&ctx.served);
    let pending = Pending(&ctx.pending);
    let from = stream.peer_addr().ok();
    let deadline = Instant::now() + ctx.opts.hello_deadline;
    if prepare_hello(&stream, ctx).is_err() {
        let _ = stream.shutdown(Shutdown::Both);
        ctx.reject(from, Reject::BadHello);
        return;
    }
    match &ctx.opts.tls {
        None => serve_on(stream, qp, ctx, pending, from, deadline),
        Some(config) => match tls::accept(config.clone(), stream, deadline) {
            Ok(s) => serve_on(s, qp, ctx, pending, from, deadline),
            Err((s, e)) => {
                let _ = s.shutdown(Shutdown::Both);
                let why = if e.kind() == io::ErrorKind::TimedOut {
                    Reject::TlsTimeout
                } else {
                    Reject::Tls
                };
                ctx.reject(from, why);
            }
        },
    }
}

fn serve_on<S: OwnerIo>(
    mut stream: S,
    qp: u32,
    ctx: &OwnerCtx,
    pending: Pending<'_>,
    from: Option<SocketAddr>,
    deadline: Instant,
) {
    let hello = owner_hello(&mut stream, qp, ctx, deadline);
    drop(pending);
    let (link, admitted) = match hello {
        Ok(a) => a,
        Err(why) => {
            // The owner server keeps a clone of the stream until it reaps this thread, so
            // dropping ours would not close the connection: shut it down.
            let _ = stream.socket().shutdown(Shutdown::Both);
            ctx.reject(from, why);
            return;
        }
    };
    if let Some(a) = from {
        lock(&ctx.opts.guard).succeeded(a.ip());
    }
    ctx.opts.auth.attach(link);
    let ended = serve_reads(&mut stream, ctx, &admitted);
    let _ = stream.socket().shutdown(Shutdown::Both);
    ctx.opts.auth.detach(link);
    if let Some(a) = from {
        lock(&ctx.opts.guard).closed(a.ip());
    }
    if let Some(why) = ended {
        ctx.reject(from, why);
    }
}

/// Serves read requests until the requester closes or errs; `Some` when the owner closed the
/// connection for a reason worth counting.
fn serve_reads<S: OwnerIo>(stream: &mut S, ctx: &OwnerCtx, admitted: &Admitted) -> Option<Reject> {
    // Idle requesters are fine; a shutdown from `TcpOwner` ends the read.
    if stream.socket().set_read_timeout(None).is_err() {
        return None;
    }
    let mut rb = [0u8; ReadReq::LEN];
    loop {
        if let Err(e) = stream.recv_exact(&mut rb) {
            // A broken TLS record is worth counting; a closed connection is not.
            let tls_broke =
                matches!(&e, wire::RecvError::Io(io) if io.kind() == io::ErrorKind::InvalidData);
            return tls_broke.then_some(Reject::Tls);
        }
        // A revoked or expired link is served no further, whatever the request.
        if admitted.revoked.load(Ordering::Acquire) {
            return Some(Reject::StaleLink);
        }
        let req = ReadReq::decode(&rb);
        match ctx.table.acquire_remote_read(req.rkey, req.addr, req.len) {
            Ok(src) => {
                let head = ReadResp {
                    wr_id: req.wr_id,
                    len: req.len,
                    status: wire::RESP_OK,
                }
                .encode();
                // SAFETY: `src` pins the region and the table checked the range, so
                // `src.ptr()..+len` stays readable while we send.
                if unsafe { stream.send_head_and_body(&head, src.ptr(), src.len()) }.is_err() {
                    return None;
                }
            }
            Err(_) => {
                // The requester learns its read was refused, then the connection closes: a
                // guessed key or address gets one answer per connection, not a stream of them.
                let head = ReadResp {
                    wr_id: req.wr_id,
                    len: 0,
                    status: wire::RESP_ACCESS,
                }
                .encode();
                let _ = stream.write_all(&head).and_then(|()| stream.flush());
                let _ = stream.socket().shutdown(Shutdown::Both);
                return Some(Reject::BadRead);
            }
        }
    }
}
