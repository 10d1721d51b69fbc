//! Memory sent on the node's fd socket: KV memfds, DMA-BUF and VMM fds, boards and
//! mailboxes, each answered with the handle a registration names.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::Path;

use super::EngineClient;
use crate::error::EngineClientError;
use kvferry_transport::fd_passing;
use tokio::io::{AsyncBufReadExt, Interest};
use tonic::Code;

use kvferry_proto::fd_line;
use kvferry_proto::model::InstanceId;
use kvferry_proto::shm::mailbox::Mailbox;

/// What an fd sent with [`EngineClient::send_kv`] holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvFd {
    /// A memfd holding `len` bytes of host KV (create it with `MFD_ALLOW_SEALING`: the node
    /// seals it against shrinking).
    Memfd { len: u64 },
    /// A DMA-BUF of GPU KV covering `[base, base + len)` as the node addresses it.
    Dmabuf { base: u64, len: u64 },
    /// The POSIX fd of a VMM allocation holding GPU KV (vLLM 0.34's extensible KV cache:
    /// `cuMemExportToShareableHandle`), `len` bytes (its mapping's whole size); the node maps
    /// it on the device, and layout offsets are from the allocation's byte 0.
    Vmm { len: u64 },
}

impl EngineClient {
    /// Sends the memory of `instance` rank `rank`'s KV on `device` (see [`KvFd`]); returns
    /// the memory handle to register with.
    pub async fn send_kv(
        &self,
        instance: &InstanceId,
        rank: u32,
        device: u32,
        fd: BorrowedFd<'_>,
        kv: KvFd,
    ) -> Result<u64, EngineClientError> {
        let line = match kv {
            KvFd::Memfd { len } => format!("memfd {instance} {rank} {device} {len}"),
            KvFd::Dmabuf { base, len } => format!("dmabuf {instance} {rank} {device} {len} {base}"),
            KvFd::Vmm { len } => format!("vmm {instance} {rank} {device} {len}"),
        };
        self.send_fd(line, fd).await
    }

    /// Sends a completion board (see [`kvferry_proto::shm::board`]) for `instance` rank `rank`; returns
    /// the handle to register with ([`crate::Registration::with_board`]). Refused here
    /// (the handle unused: it expires on the node) unless the node says it took the board as
    /// this build's version, whose final words a client reads as outcomes.
    pub async fn send_board(
        &self,
        instance: &InstanceId,
        rank: u32,
        board: &kvferry_proto::shm::board::Board,
    ) -> Result<u64, EngineClientError> {
        let line = format!("board {instance} {rank} 0 {}", board.len());
        let handle = self.send_fd(line, board.fd()).await?;
        board
            .accepted()
            .map_err(|source| EngineClientError::Board {
                addr: self.addr.clone(),
                handle,
                source,
            })?;
        Ok(handle)
    }

    /// Sends a request mailbox (see [`kvferry_proto::shm::mailbox`]); returns the handle a session
    /// attaches ([`crate::EngineSession::attach`]). [`Self::attach_mailbox`] does both.
    pub async fn send_mailbox(
        &self,
        instance: &InstanceId,
        mailbox: &Mailbox,
    ) -> Result<u64, EngineClientError> {
        let line = format!("mailbox {instance} 0 0 {}", mailbox.len());
        self.send_fd(line, mailbox.fd()).await
    }

    async fn send_fd(
        &self,
        mut line: String,
        fd: BorrowedFd<'_>,
    ) -> Result<u64, EngineClientError> {
        let path = self
            .fd_socket
            .as_ref()
            .ok_or(EngineClientError::NoFdSocket)?;
        if !self.token.is_empty() {
            line.push(' ');
            line.push_str(&self.token);
        }
        line.push('\n');
        let io = |what: &'static str| {
            let path = path.clone();
            move |source| EngineClientError::FdSocket { path, what, source }
        };
        let exchange = async {
            let stream = tokio::net::UnixStream::connect(path)
                .await
                .map_err(io("connecting"))?;
            loop {
                stream.writable().await.map_err(io("sending"))?;
                match stream.try_io(Interest::WRITABLE, || {
                    fd_passing::send_with_fds(stream.as_raw_fd(), line.as_bytes(), &[fd])
                }) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                    Err(e) => return Err(io("sending")(e)),
                }
            }
            let mut answer = String::new();
            tokio::io::BufReader::new(stream)
                .read_line(&mut answer)
                .await
                .map_err(io("reading the answer"))?;
            Ok(answer)
        };
        let answer = tokio::time::timeout(self.deadline, exchange)
            .await
            .map_err(|_| {
                io("waiting for the answer")(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no answer within {:?}", self.deadline),
                ))
            })??;
        parse_fd_answer(path, answer.trim_end())
    }
}

fn parse_fd_answer(path: &Path, answer: &str) -> Result<u64, EngineClientError> {
    let refused = |code, message: &str| EngineClientError::FdRefused {
        path: path.to_owned(),
        code,
        message: message.to_owned(),
    };
    if let Some(id) = answer.strip_prefix("ok ") {
        return id
            .parse()
            .map_err(|_| refused(Code::Unknown, &format!("malformed answer {answer:?}")));
    }
    if let Some(rest) = answer.strip_prefix("err ") {
        let (code, message) = rest.split_once(' ').unwrap_or((rest, ""));
        return Err(refused(fd_line::code_from_name(code), message));
    }
    Err(refused(
        Code::Unknown,
        &format!("malformed answer {answer:?}"),
    ))
}
