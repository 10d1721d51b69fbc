//! The requester side of a tcp link: connect and prove the grant, then post reads and
//! receive their bytes into the destination (device pieces through a bounce buffer).

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::completion::{CompletionSink, CompletionStatus, WorkCompletion};
use crate::connection::{Connection, ConnectionError, Connector, WorkRequest};
use crate::data_auth::{self, LinkGrant, ProofContext, NONCE_LEN, PROOF_LEN};
use crate::qp_key::{NodeId, QpKey};
use crate::scatter::{self, ByteSource, FdSource, Scatter, ScatterError};
use crate::tls::{self, TlsPipe};
use crate::wire::{self, Challenge, Hello, HelloAck, Proof, ReadReq, ReadResp};

use super::{lock, BOUNCE, POLL_INTERVAL};

/// Connects QPs to an owner at a TCP address.
#[derive(Clone, Debug)]
pub struct TcpConnector {
    local: NodeId,
    peer: NodeId,
    addr: SocketAddr,
    grant: LinkGrant,
    connect_timeout: Duration,
    io_timeout: Duration,
    tls: Option<ClientTls>,
}

/// How a requester dials an owner over TLS: its client config (which presents the node's
/// certificate and trusts the cluster CA) and the name the owner's certificate must carry.
#[derive(Clone)]
pub struct ClientTls {
    pub config: Arc<rustls::ClientConfig>,
    pub server_name: rustls::pki_types::ServerName<'static>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl TcpConnector {
    /// Connections prove `grant` (from the owner's Handshake) in their hello.
    pub fn new(local: NodeId, peer: NodeId, addr: SocketAddr, grant: LinkGrant) -> Self {
        TcpConnector {
            local,
            peer,
            addr,
            grant,
            connect_timeout: Duration::from_secs(2),
            io_timeout: Duration::from_secs(5),
            tls: None,
        }
    }

    /// Dials the owner over TLS.
    pub fn with_tls(mut self, tls: ClientTls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// A read outstanding this long with no bytes arriving counts as a lost connection.
    pub fn with_io_timeout(mut self, t: Duration) -> Self {
        self.io_timeout = t;
        self
    }

    pub fn with_connect_timeout(mut self, t: Duration) -> Self {
        self.connect_timeout = t;
        self
    }

    fn prepare(&self, stream: &TcpStream) -> Result<(), ConnectionError> {
        let peer = self.peer;
        let io_err = |source| ConnectionError::HandshakeIo { peer, source };
        stream.set_nodelay(true).map_err(io_err)?;
        stream
            .set_read_timeout(Some(self.connect_timeout))
            .map_err(io_err)?;
        stream
            .set_write_timeout(Some(self.io_timeout))
            .map_err(io_err)
    }

    fn handshake<S: Read + Write>(&self, stream: &mut S, qp: QpKey) -> Result<(), ConnectionError> {
        let peer = self.peer;
        let io_err = |source| ConnectionError::HandshakeIo { peer, source };
        let no_answer = |what: &str| {
            let what = what.to_owned();
            move |e: io::Error| match e.kind() {
                io::ErrorKind::UnexpectedEof => ConnectionError::Handshake {
                    peer,
                    reason: format!("no {what}"),
                },
                _ => ConnectionError::HandshakeIo { peer, source: e },
            }
        };
        let mut cb = [0u8; Challenge::LEN];
        stream.read_exact(&mut cb).map_err(no_answer("challenge"))?;
        let challenge = Challenge::decode(&cb);
        if challenge.magic != wire::MAGIC {
            return Err(ConnectionError::Handshake {
                peer,
                reason: "bad magic".into(),
            });
        }
        if challenge.version != wire::TCP_VERSION {
            return Err(ConnectionError::VersionMismatch {
                peer,
                ours: wire::TCP_VERSION,
                theirs: challenge.version,
            });
        }
        if challenge.node != peer {
            return Err(ConnectionError::PeerMismatch {
                expected: peer,
                found: challenge.node,
            });
        }
        let mut nonce = [0u8; NONCE_LEN];
        data_auth::random(&mut nonce).map_err(|e| ConnectionError::Handshake {
            peer,
            reason: e.to_string(),
        })?;
        let pc = ProofContext {
            owner_nonce: challenge.nonce,
            requester_nonce: nonce,
            link: self.grant.link,
            requester: self.local,
            owner: peer,
            qp: qp.qp.0,
        };
        let hello = Hello {
            magic: wire::MAGIC,
            version: wire::TCP_VERSION,
            kind: wire::KIND_TCP,
            node: self.local,
            expected_peer: peer,
            qp: qp.qp.0,
        };
        let proof = Proof {
            link: self.grant.link,
            nonce,
            mac: pc.requester_proof(&self.grant.secret),
        };
        let mut out = [0u8; Hello::LEN + Proof::LEN];
        out[..Hello::LEN].copy_from_slice(&hello.encode());
        out[Hello::LEN..].copy_from_slice(&proof.encode());
        stream.write_all(&out).map_err(io_err)?;
        stream.flush().map_err(io_err)?;
        let mut ab = [0u8; HelloAck::LEN + PROOF_LEN];
        stream
            .read_exact(&mut ab)
            .map_err(no_answer("answer to hello"))?;
        let ack = HelloAck::decode(&ab[..HelloAck::LEN]);
        if ack.magic == wire::MAGIC && ack.status == wire::ACK_UNAUTHORIZED {
            return Err(ConnectionError::Unauthorized { peer });
        }
        check_ack(&ack, peer, wire::TCP_VERSION)?;
        let mut mac = [0u8; PROOF_LEN];
        mac.copy_from_slice(&ab[HelloAck::LEN..]);
        // Only the owner that issued the grant knows its secret: anything else listening on
        // the owner's address is not it.
        if !pc.check_owner(&self.grant.secret, &mac) {
            return Err(ConnectionError::Handshake {
                peer,
                reason: "the owner did not prove the link's secret".into(),
            });
        }
        Ok(())
    }
}

pub(crate) fn check_ack(ack: &HelloAck, peer: NodeId, version: u16) -> Result<(), ConnectionError> {
    if ack.magic != wire::MAGIC {
        return Err(ConnectionError::Handshake {
            peer,
            reason: "bad magic".into(),
        });
    }
    if ack.version != version || ack.status == wire::ACK_BAD_VERSION {
        return Err(ConnectionError::VersionMismatch {
            peer,
            ours: version,
            theirs: ack.version,
        });
    }
    if ack.status == wire::ACK_WRONG_PEER || ack.node != peer {
        return Err(ConnectionError::PeerMismatch {
            expected: peer,
            found: ack.node,
        });
    }
    if ack.status != wire::ACK_OK {
        return Err(ConnectionError::Handshake {
            peer,
            reason: format!("refused with status {}", ack.status),
        });
    }
    Ok(())
}

impl Connector for TcpConnector {
    fn connect(
        &self,
        qp: QpKey,
        sink: Arc<dyn CompletionSink>,
    ) -> Result<Box<dyn Connection>, ConnectionError> {
        let peer = self.peer;
        let mut stream =
            TcpStream::connect_timeout(&self.addr, self.connect_timeout).map_err(|source| {
                ConnectionError::Connect {
                    peer,
                    addr: self.addr.to_string(),
                    source,
                }
            })?;
        self.prepare(&stream)?;
        let setup = |source| ConnectionError::Setup {
            peer,
            what: "receiver",
            source,
        };
        let tx = match &self.tls {
            None => {
                self.handshake(&mut stream, qp)?;
                stream
                    .set_read_timeout(Some(POLL_INTERVAL))
                    .map_err(setup)?;
                Tx::Plain(stream)
            }
            Some(t) => {
                let tls_err = |source| ConnectionError::Tls { peer, source };
                let mut conn =
                    rustls::ClientConnection::new(t.config.clone(), t.server_name.clone())
                        .map_err(|e| tls_err(io::Error::new(io::ErrorKind::InvalidData, e)))?;
                tls::handshake(
                    &mut conn,
                    &mut stream,
                    Instant::now() + self.connect_timeout,
                )
                .map_err(tls_err)?;
                // TLS 1.3 judges this node's certificate after the client's side of the
                // handshake is done: a refusal arrives as an alert during the hello.
                self.handshake(&mut rustls::Stream::new(&mut conn, &mut stream), qp)
                    .map_err(|e| match e {
                        ConnectionError::HandshakeIo { peer, source } if tls::is_tls(&source) => {
                            ConnectionError::Tls { peer, source }
                        }
                        e => e,
                    })?;
                Tx::Tls(Arc::new(TlsPipe::new(conn, stream).map_err(setup)?))
            }
        };
        let shared = Arc::new(Shared {
            inflight: Mutex::new(Inflight {
                dead: false,
                queue: VecDeque::new(),
            }),
            closing: AtomicBool::new(false),
        });
        let receiver = {
            let (shared, io_timeout) = (shared.clone(), self.io_timeout);
            let spawn = std::thread::Builder::new().name("kvferry-tcp-recv".into());
            match &tx {
                Tx::Plain(stream) => {
                    let rx = stream.try_clone().map_err(setup)?;
                    spawn.spawn(move || {
                        let src = FdSource(rx.as_raw_fd());
                        receive_loop(src, &rx, qp, shared, sink, io_timeout)
                    })
                }
                Tx::Tls(pipe) => {
                    let pipe = pipe.clone();
                    spawn.spawn(move || {
                        receive_loop(&*pipe, pipe.socket(), qp, shared, sink, io_timeout)
                    })
                }
            }
            .map_err(setup)?
        };
        Ok(Box::new(TcpConnection {
            peer,
            tx,
            shared,
            receiver: Some(receiver),
        }))
    }
}

struct Entry {
    wr_id: u64,
    scatter: Arc<Scatter>,
    issued_at: Instant,
}

struct Inflight {
    dead: bool,
    queue: VecDeque<Entry>,
}

struct Shared {
    inflight: Mutex<Inflight>,
    closing: AtomicBool,
}

/// How requests leave: straight onto the socket, or through the TLS connection the receiver
/// shares.
enum Tx {
    Plain(TcpStream),
    Tls(Arc<TlsPipe>),
}

impl Tx {
    fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        match self {
            Tx::Plain(s) => s.write_all(bytes),
            Tx::Tls(p) => p.send(bytes),
        }
    }

    fn socket(&self) -> &TcpStream {
        match self {
            Tx::Plain(s) => s,
            Tx::Tls(p) => p.socket(),
        }
    }
}

struct TcpConnection {
    peer: NodeId,
    tx: Tx,
    shared: Arc<Shared>,
    receiver: Option<JoinHandle<()>>,
}

impl Connection for TcpConnection {
    fn peer(&self) -> NodeId {
        self.peer
    }

    fn issue(&mut self, wr: WorkRequest) -> Result<(), ConnectionError> {
        let req = ReadReq {
            wr_id: wr.wr_id,
            addr: wr.remote.addr,
            len: wr.remote.len,
            rkey: wr.remote.rkey,
        };
        {
            let mut inf = lock(&self.shared.inflight);
            if inf.dead {
                return Err(ConnectionError::ConnectionLost { peer: self.peer });
            }
            inf.queue.push_back(Entry {
                wr_id: wr.wr_id,
                scatter: wr.scatter,
                issued_at: Instant::now(),
            });
        }
        if let Err(source) = self.tx.send(&req.encode()) {
            let _ = self.tx.socket().shutdown(Shutdown::Both);
            let mut inf = lock(&self.shared.inflight);
            if let Some(pos) = inf.queue.iter().rposition(|e| e.wr_id == wr.wr_id) {
                inf.queue.remove(pos);
                return Err(ConnectionError::Send {
                    peer: self.peer,
                    wr_id: wr.wr_id,
                    source,
                });
            }
            // The receiver already took it over and will complete it.
        }
        Ok(())
    }

    fn abort(&mut self) {
        self.shared.closing.store(true, Ordering::Relaxed);
        lock(&self.shared.inflight).dead = true;
        let _ = self.tx.socket().shutdown(Shutdown::Both);
    }
}

impl Drop for TcpConnection {
    fn drop(&mut self) {
        self.abort();
        if let Some(t) = self.receiver.take() {
            let _ = t.join();
        }
    }
}

fn receive_loop(
    mut src: impl ByteSource,
    stream: &TcpStream,
    qp: QpKey,
    shared: Arc<Shared>,
    sink: Arc<dyn CompletionSink>,
    io_timeout: Duration,
) {
    let mut bounce = vec![0u8; BOUNCE];
    let keep_waiting = || {
        if shared.closing.load(Ordering::Relaxed) {
            return false;
        }
        let inf = lock(&shared.inflight);
        match inf.queue.front() {
            Some(e) => e.issued_at.elapsed() < io_timeout,
            None => !inf.dead,
        }
    };
    let complete = |wr_id: u64, status: CompletionStatus, bytes: u64| {
        sink.push(WorkCompletion {
            qp,
            wr_id,
            status,
            bytes,
        })
    };
    let mut refused = false;
    // The entry being received stays at the front of the queue until its completion is pushed,
    // so the timeout check and the drain below always see it.
    loop {
        let mut hb = [0u8; ReadResp::LEN];
        if scatter::recv_exact_from(&mut src, &mut hb, keep_waiting).is_err() {
            break;
        }
        let resp = ReadResp::decode(&hb);
        let front = lock(&shared.inflight)
            .queue
            .front()
            .map(|e| (e.wr_id, e.scatter.clone()));
        let Some((wr_id, scatter)) = front else { break };
        if wr_id != resp.wr_id {
            // The owner answers in order; anything else is a broken stream.
            break;
        }
        let status = match resp.completion_status() {
            CompletionStatus::Success if resp.len != scatter.len() => break,
            CompletionStatus::Success => {
                match scatter.fill_from(&mut src, &mut bounce, keep_waiting) {
                    Ok(()) => match scatter.finish() {
                        Ok(()) => CompletionStatus::Success,
                        Err(_) => CompletionStatus::LocalWriteError,
                    },
                    Err(ScatterError::Sink { .. }) => CompletionStatus::LocalWriteError,
                    Err(_) => break,
                }
            }
            other => {
                // The owner closes after refusing a read: what is still queued only flushes.
                refused = true;
                other
            }
        };
        let bytes = scatter.len();
        drop(scatter);
        drop(lock(&shared.inflight).queue.pop_front());
        complete(wr_id, status, if status.is_success() { bytes } else { 0 });
    }
    // The connection is finished: refuse new requests, then drain everything outstanding.
    let _ = stream.shutdown(Shutdown::Both);
    let rest = {
        let mut inf = lock(&shared.inflight);
        inf.dead = true;
        std::mem::take(&mut inf.queue)
    };
    let aborted = shared.closing.load(Ordering::Relaxed);
    let mut blamed = aborted || refused;
    let mut finish = |e: Entry| {
        let status = if blamed {
            CompletionStatus::Flushed
        } else {
            blamed = true;
            CompletionStatus::TransportError
        };
        let wr_id = e.wr_id;
        drop(e);
        complete(wr_id, status, 0);
    };
    for e in rest {
        finish(e);
    }
}
