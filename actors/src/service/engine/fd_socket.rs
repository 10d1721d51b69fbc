//! The engine's fd socket: a Unix socket (mode 0600) on which clients hand the node the
//! memory their KV lives in, one descriptor per request with SCM_RIGHTS, and get back a
//! memory handle id that `RegisterInstance` names.
//!
//! One request is one line, sent together with its descriptor:
//! `memfd <instance> <rank> <device> <len> [<token>]`,
//! `dmabuf <instance> <rank> <device> <len> <base> [<token>]`,
//! `vmm <instance> <rank> <device> <len> [<token>]` (the POSIX fd of a VMM allocation of GPU
//! KV and the size of its mapping, mapped on the device), or `board` / `mailbox` with
//! the memfd's fields (a completion board a registration names, a request mailbox a session
//! attaches); the answer is one line,
//! `ok <handle>` or `err <code> <message>` (code: the gRPC code name, e.g.
//! `invalid-argument`). Every refusal is an `err` line and leaves the connection usable (a
//! message with too many descriptors included), except a line longer than 1024 bytes, which
//! is answered and then closed. A connection may carry any number of requests, one at a
//! time; at most 256 connections are served at once, and one idle for a minute is closed.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use kvferry_transport::fd_passing;
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::UnixStream;
use tokio::sync::watch;
use tonic::Status;

use kvferry_proto::fd_line::code_name;

use crate::lease::registry::Memory;
use crate::model::InstanceId;
use crate::service::engine::memory_handles::{Held, MemoryHandle, MemoryKind};
use crate::service::engine::server::{EngineServeError, Shared};

/// Longest request line.
const MAX_LINE: usize = 1024;

/// Largest memory one handle may announce.
const MAX_MEMORY: u64 = 1 << 40;

/// Connections served at once; more are closed on accept.
const MAX_CONNECTIONS: usize = 256;

/// A connection that sends no byte for this long is closed.
const IDLE: std::time::Duration = std::time::Duration::from_secs(60);

/// A bound fd socket and its path (removed when the engine service stops).
#[derive(Debug)]
pub struct FdSocket {
    pub(crate) listener: std::os::unix::net::UnixListener,
    pub(crate) path: PathBuf,
}

impl FdSocket {
    /// Binds `<dir>/<node_id>.engine.sock` with mode 0600, creating `dir` (0700) if missing
    /// (refusing it if group or others may write it) and replacing a stale socket of an
    /// earlier run.
    pub fn bind(dir: &Path, node_id: &str) -> Result<Self, EngineServeError> {
        let path = dir.join(format!("{node_id}.engine.sock"));
        let err = |what: &'static str| {
            let path = path.clone();
            move |source| EngineServeError::FdSocket { what, path, source }
        };
        // Another user who may write the directory could replace the socket with their own.
        crate::private_fs::private_dir(dir).map_err(|source| EngineServeError::FdDir { source })?;
        if path.as_os_str().len() >= 108 {
            return Err(err("checking its path")(io::Error::new(
                io::ErrorKind::InvalidInput,
                "longer than a Unix socket path may be (107 bytes)",
            )));
        }
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(err("removing a stale socket")(e)),
        }
        let listener = std::os::unix::net::UnixListener::bind(&path).map_err(err("binding"))?;
        std::fs::set_permissions(
            &path,
            std::fs::Permissions::from_mode(crate::private_fs::FILE_MODE),
        )
        .map_err(err("setting its mode"))?;
        listener.set_nonblocking(true).map_err(err("binding"))?;
        Ok(Self { listener, path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// One parsed request.
#[derive(PartialEq)]
pub(crate) struct FdRequest {
    pub kind: MemoryKind,
    pub instance: InstanceId,
    pub rank: u32,
    pub device: u32,
    pub len: u64,
    /// Device address of byte 0 (DMA-BUF only).
    pub base: u64,
    pub token: String,
}

// Written out so that a client's token never reaches a log line or a failed test's output.
impl std::fmt::Debug for FdRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FdRequest")
            .field("kind", &self.kind)
            .field("instance", &self.instance)
            .field("rank", &self.rank)
            .field("device", &self.device)
            .field("len", &self.len)
            .field("base", &self.base)
            .field("token", &crate::statuses::Redacted(&self.token))
            .finish()
    }
}

fn invalid(what: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("fd socket: {what}"))
}

pub(crate) fn parse(line: &str) -> Result<FdRequest, Status> {
    let words: Vec<&str> = line.split_ascii_whitespace().collect();
    let kind = words
        .first()
        .and_then(|k| MemoryKind::parse(k))
        .ok_or_else(|| invalid("a request starts with memfd, dmabuf, vmm, board or mailbox"))?;
    let fixed = match kind {
        MemoryKind::Memfd | MemoryKind::Board | MemoryKind::Mailbox | MemoryKind::Vmm => 5,
        MemoryKind::Dmabuf => 6,
    };
    if words.len() != fixed && words.len() != fixed + 1 {
        return Err(invalid(match kind {
            MemoryKind::Memfd => "expected: memfd <instance> <rank> <device> <len> [<token>]",
            MemoryKind::Board => "expected: board <instance> <rank> <device> <len> [<token>]",
            MemoryKind::Mailbox => "expected: mailbox <instance> <rank> <device> <len> [<token>]",
            MemoryKind::Vmm => "expected: vmm <instance> <rank> <device> <len> [<token>]",
            MemoryKind::Dmabuf => {
                "expected: dmabuf <instance> <rank> <device> <len> <base> [<token>]"
            }
        }));
    }
    let num = |i: usize, what: &str| {
        words[i]
            .parse::<u64>()
            .map_err(|_| invalid(format!("{what} {:?} is not a number", words[i])))
    };
    let instance = InstanceId::new(words[1]).map_err(invalid)?;
    let rank = num(2, "rank")?;
    let device = num(3, "device")?;
    let len = num(4, "len")?;
    // A KV shape's TP world is at most 64 ranks.
    if rank >= 64 {
        return Err(invalid(format!(
            "rank {rank} is out of range (tp at most 64)"
        )));
    }
    if device > 64 {
        return Err(invalid(format!("device {device} is out of range")));
    }
    if len == 0 || len > MAX_MEMORY {
        return Err(invalid(format!("len {len} must be 1 byte to 1 TiB")));
    }
    let base = match kind {
        MemoryKind::Memfd | MemoryKind::Board | MemoryKind::Mailbox | MemoryKind::Vmm => 0,
        MemoryKind::Dmabuf => num(5, "base")?,
    };
    Ok(FdRequest {
        kind,
        instance,
        rank: rank as u32,
        device: device as u32,
        len,
        base,
        token: words
            .get(fixed)
            .map(|t| (*t).to_owned())
            .unwrap_or_default(),
    })
}

/// Imports one descriptor as the request says; returns the new handle id.
fn handle(shared: &Shared, line: &str, mut fds: Vec<OwnedFd>) -> Result<u64, Status> {
    let req = parse(line)?;
    shared.check_token(&req.token)?;
    if fds.len() != 1 {
        return Err(invalid(format!(
            "send exactly one descriptor with each request, got {}",
            fds.len()
        )));
    }
    let fd = fds.remove(0);
    if matches!(req.kind, MemoryKind::Board | MemoryKind::Mailbox) {
        // Not device memory: mapped here, checked, and kept until a registration (a board)
        // or a session (a mailbox) takes it.
        let memory = if req.kind == MemoryKind::Board {
            Held::Board(Arc::new(
                kvferry_proto::shm::board::Board::open(fd, req.len).map_err(invalid)?,
            ))
        } else {
            Held::Mailbox(Arc::new(
                kvferry_proto::shm::mailbox::Mailbox::open(fd, req.len).map_err(invalid)?,
            ))
        };
        let h = MemoryHandle {
            instance: req.instance,
            rank: req.rank,
            device: req.device,
            kind: req.kind,
            base: 0,
            len: req.len,
            memory,
        };
        return shared
            .handles()
            .insert(h, Instant::now())
            .map_err(|e| Status::resource_exhausted(format!("fd socket: {e}")));
    }
    let node = shared.node();
    let device = node.device(req.device).ok_or_else(|| {
        invalid(format!(
            "device {} is not configured on this node ({} devices)",
            req.device,
            node.devices().len()
        ))
    })?;
    let imported = |e: kvferry_gpu::DeviceError| match e {
        kvferry_gpu::DeviceError::Unsupported { .. } => {
            Status::failed_precondition(format!("fd socket: {e}"))
        }
        _ => invalid(e),
    };
    let (base, memory) = match req.kind {
        MemoryKind::Memfd => {
            let buf = device.import_memfd(fd, req.len).map_err(imported)?;
            (buf.ptr(), Memory::Mapped(Arc::new(buf)))
        }
        MemoryKind::Dmabuf => {
            let buf = device
                .import_dmabuf(fd, req.base, req.len)
                .map_err(imported)?;
            (buf.base(), Memory::DmaBuf(Arc::new(buf)))
        }
        MemoryKind::Vmm => {
            let buf = device.import_vmm_fd(fd, req.len).map_err(imported)?;
            (buf.ptr(), Memory::Mapped(Arc::new(buf)))
        }
        // Taken above; kept total so no request can reach a panic.
        MemoryKind::Board | MemoryKind::Mailbox => {
            return Err(invalid(
                "a completion board or mailbox is not device memory",
            ))
        }
    };
    let h = MemoryHandle {
        instance: req.instance,
        rank: req.rank,
        device: req.device,
        kind: req.kind,
        base,
        len: req.len,
        memory: Held::Kv(memory),
    };
    shared
        .handles()
        .insert(h, Instant::now())
        .map_err(|e| Status::resource_exhausted(format!("fd socket: {e}")))
}

/// Accepts connections until `stop` turns true.
pub(crate) async fn serve(socket: FdSocket, shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    let listener = match tokio::net::UnixListener::from_std(socket.listener) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("kvferry: engine fd socket {}: {e}", socket.path.display());
            return;
        }
    };
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let child_stop = stop.clone();
        tokio::select! {
            r = listener.accept() => {
                // Past the limit the connection is dropped at once: the client sees it closed.
                if let (Ok((stream, _)), Ok(slot)) = (r, Arc::clone(&slots).try_acquire_owned()) {
                    let shared = Arc::clone(&shared);
                    tokio::spawn(async move {
                        connection(stream, shared, child_stop).await;
                        drop(slot);
                    });
                }
            }
            _ = stop.wait_for(|s| *s) => break,
        }
    }
}

async fn connection(mut stream: UnixStream, shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    let mut line = Vec::new();
    let mut fds = Vec::new();
    let mut chunk = [0u8; 256];
    loop {
        let got = tokio::select! {
            r = tokio::time::timeout(IDLE, stream.readable()) => match r {
                Ok(r) => r.and_then(|()| stream.try_io(Interest::READABLE, || {
                    fd_passing::recv_with_fds(stream.as_raw_fd(), &mut chunk)
                })),
                Err(_) => return,
            },
            _ = stop.wait_for(|s| *s) => return,
        };
        match got {
            Ok((0, _)) => return,
            Ok((n, more)) => {
                line.extend_from_slice(&chunk[..n]);
                fds.extend(more);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                // More descriptors than one message may carry: the kernel closed those that did
                // not fit and `recv_with_fds` the others. The request they came with is lost
                // with them; it is refused, and the connection stays usable.
                line.clear();
                fds.clear();
                let reply = format!(
                    "err invalid-argument fd socket: send exactly one descriptor with each \
                     request (a message carried more than {})\n",
                    fd_passing::MAX_FDS
                );
                if stream.write_all(reply.as_bytes()).await.is_err() {
                    return;
                }
                continue;
            }
            Err(_) => return,
        }
        while let Some(end) = line.iter().position(|b| *b == b'\n') {
            let text: Vec<u8> = line.drain(..=end).collect();
            let reply = match std::str::from_utf8(&text) {
                Ok(t) => handle(&shared, t.trim_end(), std::mem::take(&mut fds)),
                Err(_) => Err(invalid("request is not UTF-8")),
            };
            let reply = match reply {
                Ok(id) => format!("ok {id}\n"),
                Err(s) => format!(
                    "err {} {}\n",
                    code_name(s.code()),
                    s.message().replace('\n', " ")
                ),
            };
            if stream.write_all(reply.as_bytes()).await.is_err() {
                return;
            }
        }
        if line.len() > MAX_LINE {
            let _ = stream
                .write_all(
                    format!("err invalid-argument request longer than {MAX_LINE} bytes\n")
                        .as_bytes(),
                )
                .await;
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    #[test]
    fn requests_parse_and_refuse_clearly() {
        let r = parse("memfd eng 1 0 4096 tok").unwrap();
        assert_eq!(
            (
                r.kind,
                r.instance.as_str(),
                r.rank,
                r.device,
                r.len,
                r.token.as_str()
            ),
            (MemoryKind::Memfd, "eng", 1, 0, 4096, "tok")
        );
        let r = parse("dmabuf eng 0 0 4096 65536").unwrap();
        assert_eq!((r.base, r.token.as_str()), (65536, ""));
        let r = parse("vmm eng 2 1 2097152 tok").unwrap();
        assert_eq!(
            (r.kind, r.rank, r.device, r.len, r.base, r.token.as_str()),
            (MemoryKind::Vmm, 2, 1, 2 << 20, 0, "tok")
        );
        for bad in [
            "",
            "shm eng 0 0 4096",
            "memfd eng 0 0",
            "memfd eng x 0 4096",
            "memfd eng 64 0 4096",
            "memfd eng 0 0 0",
            "memfd eng 0 0 4096 tok extra",
            "dmabuf eng 0 0 4096",
            "vmm eng 0 0",
            "vmm eng 0 0 0",
            "vmm eng 0 0 4096 tok extra",
        ] {
            let e = parse(bad).unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "{bad:?}");
        }
    }
}
