//! Same-host provider: the owner passes read-only descriptors of its exported pool memfds over
//! a Unix socket (SCM_RIGHTS); the requester maps them `PROT_READ` and a read is a checked copy
//! out of the mapping. The socket stays open as the liveness signal: once the owner goes away,
//! reads fail with a lost connection.

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::completion::{CompletionSink, CompletionStatus, WorkCompletion};
use crate::connection::{Connection, ConnectionError, Connector, WorkRequest};
use crate::fd_passing::{self, MAX_FDS};
use crate::mr_table::{MrKey, MrTable};
use crate::owner_loop::OwnerServer;
use crate::qp_key::{NodeId, QpKey};
use crate::region::HostRegion;
use crate::tcp::check_ack;
use crate::wire::{self, Export, Hello, HelloAck};

/// Exports `table`'s remote-readable memfd regions to same-host requesters.
pub struct ShmOwner {
    server: OwnerServer<UnixStream>,
}

impl std::fmt::Debug for ShmOwner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmOwner")
            .field("connections", &self.connections())
            .finish()
    }
}

impl ShmOwner {
    /// Starts serving on an already-bound listener.
    pub fn spawn(listener: UnixListener, node: NodeId, table: MrTable) -> io::Result<ShmOwner> {
        Ok(ShmOwner {
            server: OwnerServer::spawn(
                listener,
                "kvferry-shm",
                None,
                Arc::new(move |s, qp| {
                    let _ = serve(s, node, qp, &table);
                }),
            )?,
        })
    }

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

fn serve(mut stream: UnixStream, node: NodeId, qp: u32, table: &MrTable) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut hb = [0u8; Hello::LEN];
    stream.read_exact(&mut hb)?;
    let hello = Hello::decode(&hb);
    let status = if hello.magic != wire::MAGIC || hello.version != wire::VERSION {
        wire::ACK_BAD_VERSION
    } else if hello.kind != wire::KIND_SHM {
        wire::ACK_WRONG_KIND
    } else if hello.expected_peer != node {
        wire::ACK_WRONG_PEER
    } else {
        wire::ACK_OK
    };
    // Only memfd-backed remote-readable host regions can be shared; each travels as a fresh
    // O_RDONLY descriptor so the peer's mapping can never be made writable.
    let mut exports: Vec<(Export, OwnedFd)> = Vec::new();
    if status == wire::ACK_OK {
        for e in table.exports() {
            if exports.len() == MAX_FDS {
                break;
            }
            if let Ok(Some(fd)) = e.region.reopen_read_only() {
                let export = Export {
                    key: e.key,
                    addr: e.addr,
                    len: e.len,
                };
                exports.push((export, fd));
            }
        }
    }
    let ack = HelloAck {
        magic: wire::MAGIC,
        version: wire::VERSION,
        status,
        node,
        qp,
        count: exports.len() as u32,
    };
    let mut msg = ack.encode().to_vec();
    for (e, _) in &exports {
        e.encode(&mut msg);
    }
    let fds: Vec<_> = exports.iter().map(|(_, f)| f.as_fd()).collect();
    fd_passing::send_with_fds(stream.as_raw_fd(), &msg, &fds)?;
    drop(fds);
    drop(exports);
    if status != wire::ACK_OK {
        return Ok(());
    }
    // Hold the socket open until the requester leaves or we are shut down.
    stream.set_read_timeout(None)?;
    let mut b = [0u8; 64];
    while matches!(stream.read(&mut b), Ok(n) if n > 0) {}
    Ok(())
}

/// Connects QPs to a same-host owner listening on a Unix socket.
#[derive(Clone, Debug)]
pub struct ShmConnector {
    local: NodeId,
    peer: NodeId,
    path: PathBuf,
    timeout: Duration,
}

impl ShmConnector {
    pub fn new(local: NodeId, peer: NodeId, path: impl AsRef<Path>) -> Self {
        ShmConnector {
            local,
            peer,
            path: path.as_ref().to_path_buf(),
            timeout: Duration::from_secs(2),
        }
    }
}

struct Mapped {
    key: MrKey,
    addr: u64,
    len: u64,
    map: HostRegion,
}

impl Connector for ShmConnector {
    fn connect(
        &self,
        qp: QpKey,
        sink: Arc<dyn CompletionSink>,
    ) -> Result<Box<dyn Connection>, ConnectionError> {
        Ok(Box::new(self.open(qp, sink)?))
    }
}

impl ShmConnector {
    /// Handshakes and maps the owner's exports without creating a QP.
    pub fn map_exports(&self) -> Result<ShmMapping, ConnectionError> {
        struct Discard;
        impl CompletionSink for Discard {
            fn push(&self, _: WorkCompletion) {}
        }
        let key = QpKey::new(self.peer, crate::qp_key::NicId(0), crate::qp_key::QpNum(0));
        Ok(ShmMapping {
            conn: self.open(key, Arc::new(Discard))?,
        })
    }

    fn open(
        &self,
        qp: QpKey,
        sink: Arc<dyn CompletionSink>,
    ) -> Result<ShmConnection, ConnectionError> {
        let peer = self.peer;
        let mut stream =
            UnixStream::connect(&self.path).map_err(|source| ConnectionError::Connect {
                peer,
                addr: self.path.display().to_string(),
                source,
            })?;
        let io_err = |source| ConnectionError::HandshakeIo { peer, source };
        stream
            .set_read_timeout(Some(self.timeout))
            .map_err(io_err)?;
        stream
            .set_write_timeout(Some(self.timeout))
            .map_err(io_err)?;
        let hello = Hello {
            magic: wire::MAGIC,
            version: wire::VERSION,
            kind: wire::KIND_SHM,
            node: self.local,
            expected_peer: peer,
            qp: qp.qp.0,
        };
        stream.write_all(&hello.encode()).map_err(io_err)?;
        let mut buf = vec![0u8; HelloAck::LEN + MAX_FDS * Export::LEN];
        let (mut got, fds) =
            fd_passing::recv_with_fds(stream.as_raw_fd(), &mut buf).map_err(io_err)?;
        if got < HelloAck::LEN {
            stream
                .read_exact(&mut buf[got..HelloAck::LEN])
                .map_err(io_err)?;
            got = HelloAck::LEN;
        }
        let ack = HelloAck::decode(&buf[..HelloAck::LEN]);
        check_ack(&ack, peer, wire::VERSION)?;
        let count = ack.count as usize;
        if count > MAX_FDS || fds.len() != count {
            return Err(ConnectionError::Handshake {
                peer,
                reason: format!(
                    "{count} exports announced, {} descriptors received",
                    fds.len()
                ),
            });
        }
        let need = HelloAck::LEN + count * Export::LEN;
        if got < need {
            stream.read_exact(&mut buf[got..need]).map_err(io_err)?;
        }
        let mut regions = Vec::with_capacity(count);
        for (i, fd) in fds.into_iter().enumerate() {
            let at = HelloAck::LEN + i * Export::LEN;
            let e = Export::decode(&buf[at..at + Export::LEN]);
            let len = usize::try_from(e.len).map_err(|_| ConnectionError::Handshake {
                peer,
                reason: "export larger than the address space".into(),
            })?;
            let map = HostRegion::map_read_only(fd, len).map_err(|e| ConnectionError::Setup {
                peer,
                what: "read-only mapping",
                source: io::Error::other(e),
            })?;
            regions.push(Mapped {
                key: e.key,
                addr: e.addr,
                len: e.len,
                map,
            });
        }
        Ok(ShmConnection {
            peer,
            stream,
            regions,
            sink,
            aborted: false,
        })
    }
}

struct ShmConnection {
    peer: NodeId,
    stream: UnixStream,
    regions: Vec<Mapped>,
    sink: Arc<dyn CompletionSink>,
    aborted: bool,
}

impl ShmConnection {
    /// The owner never writes after the handshake, so readability means it hung up.
    fn peer_gone(&self) -> bool {
        let mut pfd = libc::pollfd {
            fd: self.stream.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; zero timeout.
        let r = unsafe { libc::poll(&mut pfd, 1, 0) };
        r != 0
    }
}

impl Connection for ShmConnection {
    fn peer(&self) -> NodeId {
        self.peer
    }

    fn issue(&mut self, wr: WorkRequest) -> Result<(), ConnectionError> {
        if self.aborted || self.peer_gone() {
            self.aborted = true;
            return Err(ConnectionError::ConnectionLost { peer: self.peer });
        }
        let (qp, wr_id, r) = (wr.qp, wr.wr_id, wr.remote);
        let region = self.regions.iter().find(|m| m.key == r.rkey);
        let offset = region.and_then(|m| {
            let off = r.addr.checked_sub(m.addr)?;
            (off.checked_add(r.len)? <= m.len).then_some((m, off as usize))
        });
        let status = match offset {
            None => CompletionStatus::RemoteAccessError,
            Some((m, off)) => {
                // SAFETY: off+len was checked against the mapping's length above and the
                // mapping lives as long as this connection.
                let copied = unsafe { wr.scatter.write_from_ptr(m.map.ptr_at(off), r.len) };
                match copied.and_then(|()| wr.scatter.finish()) {
                    Ok(()) => CompletionStatus::Success,
                    Err(_) => CompletionStatus::LocalWriteError,
                }
            }
        };
        drop(wr);
        self.sink.push(WorkCompletion {
            qp,
            wr_id,
            status,
            bytes: if status.is_success() { r.len } else { 0 },
        });
        Ok(())
    }

    fn abort(&mut self) {
        // Reads complete inside `issue`; nothing is in flight.
        self.aborted = true;
    }
}

/// One exported region as a requester mapped it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MappedRegion {
    pub rkey: MrKey,
    /// Address in the owner's address space (what descriptors name).
    pub remote_addr: u64,
    /// Where the read-only mapping lives in this process.
    pub local_addr: u64,
    pub len: u64,
}

/// A requester's view of an owner's exports without a QP (inspection, tests); the mappings
/// live as long as this value.
pub struct ShmMapping {
    conn: ShmConnection,
}

impl ShmMapping {
    pub fn regions(&self) -> Vec<MappedRegion> {
        self.conn
            .regions
            .iter()
            .map(|m| MappedRegion {
                rkey: m.key,
                remote_addr: m.addr,
                local_addr: m.map.addr(),
                len: m.len,
            })
            .collect()
    }
}
