//! Cross-process provider over TCP. The owner checks key, access and bounds of every read
//! against its MR table and streams the bytes from its registered memory; the requester
//! receives them straight into the destination region (device pieces through a bounce buffer
//! and the sink).

use std::collections::VecDeque;
use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::completion::{CompletionSink, CompletionStatus, WorkCompletion};
use crate::connection::{Connection, ConnectionError, Connector, WorkRequest};
use crate::mr_table::MrTable;
use crate::owner_loop::OwnerServer;
use crate::qp_key::{NodeId, QpKey};
use crate::scatter::{Scatter, ScatterError};
use crate::wire::{self, Hello, HelloAck, ReadReq, ReadResp, RecvError};

/// How often blocked receivers wake to check for aborts and timeouts.
const POLL_INTERVAL: Duration = Duration::from_millis(20);
/// Bounce buffer for device destinations: a run of device pieces is received in chunks of
/// this size.
const BOUNCE: usize = 1 << 20;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section here leaves the data consistent, so poisoning carries no meaning.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Serves reads of `table`'s remote-readable regions to requesters.
pub struct TcpOwner {
    local_addr: SocketAddr,
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

impl TcpOwner {
    /// Starts serving on an already-bound listener (tests bind `127.0.0.1:0`).
    pub fn spawn(listener: TcpListener, node: NodeId, table: MrTable) -> io::Result<TcpOwner> {
        let local_addr = listener.local_addr()?;
        Ok(TcpOwner {
            local_addr,
            server: OwnerServer::spawn(listener, node, table, "kvferry-tcp", serve)?,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Requester connections currently served.
    pub fn connections(&self) -> usize {
        self.server.connections()
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

fn serve(mut stream: TcpStream, node: NodeId, qp: u32, table: &MrTable) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.set_write_timeout(Some(Duration::from_secs(5)))?;
    let fd = stream.as_raw_fd();
    let mut hb = [0u8; Hello::LEN];
    wire::recv_exact(fd, &mut hb, || false).map_err(|_| io::ErrorKind::UnexpectedEof)?;
    let hello = Hello::decode(&hb);
    let status = if hello.magic != wire::MAGIC || hello.version != wire::VERSION {
        wire::ACK_BAD_VERSION
    } else if hello.kind != wire::KIND_TCP {
        wire::ACK_WRONG_KIND
    } else if hello.expected_peer != node {
        wire::ACK_WRONG_PEER
    } else {
        wire::ACK_OK
    };
    let ack = HelloAck {
        magic: wire::MAGIC,
        version: wire::VERSION,
        status,
        node,
        qp,
        count: 0,
    };
    stream.write_all(&ack.encode())?;
    if status != wire::ACK_OK {
        return Ok(());
    }
    // Idle requesters are fine; a shutdown from `TcpOwner` ends the read.
    stream.set_read_timeout(None)?;
    let mut rb = [0u8; ReadReq::LEN];
    loop {
        if wire::recv_exact(fd, &mut rb, || true).is_err() {
            return Ok(());
        }
        let req = ReadReq::decode(&rb);
        match table.acquire_remote_read(req.rkey, req.addr, req.len) {
            Ok(src) => {
                let head = ReadResp {
                    wr_id: req.wr_id,
                    len: req.len,
                    status: wire::RESP_OK,
                }
                .encode();
                // SAFETY: `src` pins the region and the table checked the range, so
                // `src.ptr()..+len` stays readable while we send.
                unsafe { wire::send_head_and_body(fd, &head, src.ptr(), src.len())? };
            }
            Err(_) => {
                let head = ReadResp {
                    wr_id: req.wr_id,
                    len: 0,
                    status: wire::RESP_ACCESS,
                }
                .encode();
                stream.write_all(&head)?;
            }
        }
    }
}

/// Connects QPs to an owner at a TCP address.
#[derive(Clone, Debug)]
pub struct TcpConnector {
    local: NodeId,
    peer: NodeId,
    addr: SocketAddr,
    connect_timeout: Duration,
    io_timeout: Duration,
}

impl TcpConnector {
    pub fn new(local: NodeId, peer: NodeId, addr: SocketAddr) -> Self {
        TcpConnector {
            local,
            peer,
            addr,
            connect_timeout: Duration::from_secs(2),
            io_timeout: Duration::from_secs(5),
        }
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

    fn handshake(&self, stream: &mut TcpStream, qp: QpKey) -> Result<(), ConnectionError> {
        let peer = self.peer;
        let io_err = |source| ConnectionError::HandshakeIo { peer, source };
        stream.set_nodelay(true).map_err(io_err)?;
        stream
            .set_read_timeout(Some(self.connect_timeout))
            .map_err(io_err)?;
        stream
            .set_write_timeout(Some(self.io_timeout))
            .map_err(io_err)?;
        let hello = Hello {
            magic: wire::MAGIC,
            version: wire::VERSION,
            kind: wire::KIND_TCP,
            node: self.local,
            expected_peer: peer,
            qp: qp.qp.0,
        };
        stream.write_all(&hello.encode()).map_err(io_err)?;
        let mut ab = [0u8; HelloAck::LEN];
        wire::recv_exact(stream.as_raw_fd(), &mut ab, || false).map_err(|e| match e {
            RecvError::Io(source) => ConnectionError::HandshakeIo { peer, source },
            _ => ConnectionError::Handshake {
                peer,
                reason: "no answer to hello".into(),
            },
        })?;
        check_ack(&HelloAck::decode(&ab), peer)
    }
}

pub(crate) fn check_ack(ack: &HelloAck, peer: NodeId) -> Result<(), ConnectionError> {
    if ack.magic != wire::MAGIC {
        return Err(ConnectionError::Handshake {
            peer,
            reason: "bad magic".into(),
        });
    }
    if ack.version != wire::VERSION || ack.status == wire::ACK_BAD_VERSION {
        return Err(ConnectionError::VersionMismatch {
            peer,
            ours: wire::VERSION,
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
        self.handshake(&mut stream, qp)?;
        let setup = |source| ConnectionError::Setup {
            peer,
            what: "receiver",
            source,
        };
        stream
            .set_read_timeout(Some(POLL_INTERVAL))
            .map_err(setup)?;
        let rx_stream = stream.try_clone().map_err(setup)?;
        let shared = Arc::new(Shared {
            inflight: Mutex::new(Inflight {
                dead: false,
                queue: VecDeque::new(),
            }),
            closing: AtomicBool::new(false),
        });
        let receiver = {
            let (shared, io_timeout) = (shared.clone(), self.io_timeout);
            std::thread::Builder::new()
                .name("kvferry-tcp-recv".into())
                .spawn(move || receive_loop(rx_stream, qp, shared, sink, io_timeout))
                .map_err(setup)?
        };
        Ok(Box::new(TcpConnection {
            peer,
            stream,
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

struct TcpConnection {
    peer: NodeId,
    stream: TcpStream,
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
        if let Err(source) = self.stream.write_all(&req.encode()) {
            let _ = self.stream.shutdown(Shutdown::Both);
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
        let _ = self.stream.shutdown(Shutdown::Both);
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
    stream: TcpStream,
    qp: QpKey,
    shared: Arc<Shared>,
    sink: Arc<dyn CompletionSink>,
    io_timeout: Duration,
) {
    let fd = stream.as_raw_fd();
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
    // The entry being received stays at the front of the queue until its completion is pushed,
    // so the timeout check and the drain below always see it.
    loop {
        let mut hb = [0u8; ReadResp::LEN];
        if wire::recv_exact(fd, &mut hb, keep_waiting).is_err() {
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
                match scatter.fill_from_fd(fd, &mut bounce, keep_waiting) {
                    Ok(()) => match scatter.finish() {
                        Ok(()) => CompletionStatus::Success,
                        Err(_) => CompletionStatus::LocalWriteError,
                    },
                    Err(ScatterError::Sink { .. }) => CompletionStatus::LocalWriteError,
                    Err(_) => break,
                }
            }
            other => other,
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
    let mut blamed = aborted;
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
