//! Frames shared by the tcp and shm providers: the hello exchange, read requests and read
//! responses. Little-endian, fixed size.
//!
//! shm (version 1): requester [`Hello`], owner [`HelloAck`] and its exports. tcp (version 2,
//! [`TCP_VERSION`]): owner [`Challenge`] (a fresh nonce), requester [`Hello`] + [`Proof`]
//! (the link id, its own nonce, an HMAC over both and the connection's identity), owner
//! [`HelloAck`] + its own HMAC ([`crate::data_auth`]); then [`ReadReq`]s and [`ReadResp`]s.

use std::io;
use std::os::fd::RawFd;

use crate::completion::CompletionStatus;
use crate::data_auth::{NONCE_LEN, PROOF_LEN};
use crate::mr_table::MrKey;
use crate::qp_key::NodeId;

pub(crate) const MAGIC: u32 = 0x4B56_4654; // "KVFT"
pub(crate) const VERSION: u16 = 1;
/// The tcp data plane's revision: 2 proves a link grant in the hello and names 64-bit keys.
pub(crate) const TCP_VERSION: u16 = 2;

pub(crate) const KIND_TCP: u8 = 1;
pub(crate) const KIND_SHM: u8 = 2;

pub(crate) const ACK_OK: u8 = 0;
pub(crate) const ACK_WRONG_PEER: u8 = 1;
pub(crate) const ACK_BAD_VERSION: u8 = 2;
pub(crate) const ACK_WRONG_KIND: u8 = 3;
/// tcp: the link is unknown, stale, or the proof does not match (which one is not said).
pub(crate) const ACK_UNAUTHORIZED: u8 = 4;

/// Owner → requester, first on a tcp data connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Challenge {
    pub magic: u32,
    pub version: u16,
    pub node: NodeId,
    pub nonce: [u8; NONCE_LEN],
}

impl Challenge {
    pub const LEN: usize = 16 + NONCE_LEN;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0..4].copy_from_slice(&self.magic.to_le_bytes());
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[8..16].copy_from_slice(&self.node.0.to_le_bytes());
        b[16..].copy_from_slice(&self.nonce);
        b
    }

    pub fn decode(b: &[u8; Self::LEN]) -> Self {
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&b[16..]);
        Challenge {
            magic: u32_at(b, 0),
            version: u16_at(b, 4),
            node: NodeId(u64_at(b, 8)),
            nonce,
        }
    }
}

/// Requester → owner right after its [`Hello`] on tcp: which link, and the proof.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Proof {
    pub link: u64,
    pub nonce: [u8; NONCE_LEN],
    pub mac: [u8; PROOF_LEN],
}

impl Proof {
    pub const LEN: usize = 8 + NONCE_LEN + PROOF_LEN;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0..8].copy_from_slice(&self.link.to_le_bytes());
        b[8..8 + NONCE_LEN].copy_from_slice(&self.nonce);
        b[8 + NONCE_LEN..].copy_from_slice(&self.mac);
        b
    }

    pub fn decode(b: &[u8; Self::LEN]) -> Self {
        let (mut nonce, mut mac) = ([0u8; NONCE_LEN], [0u8; PROOF_LEN]);
        nonce.copy_from_slice(&b[8..8 + NONCE_LEN]);
        mac.copy_from_slice(&b[8 + NONCE_LEN..]);
        Proof {
            link: u64_at(b, 0),
            nonce,
            mac,
        }
    }
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Requester → owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    pub magic: u32,
    pub version: u16,
    pub kind: u8,
    pub node: NodeId,
    pub expected_peer: NodeId,
    pub qp: u32,
}

impl Hello {
    pub const LEN: usize = 32;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0..4].copy_from_slice(&self.magic.to_le_bytes());
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[6] = self.kind;
        b[8..16].copy_from_slice(&self.node.0.to_le_bytes());
        b[16..24].copy_from_slice(&self.expected_peer.0.to_le_bytes());
        b[24..28].copy_from_slice(&self.qp.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; Self::LEN]) -> Self {
        Hello {
            magic: u32_at(b, 0),
            version: u16_at(b, 4),
            kind: b[6],
            node: NodeId(u64_at(b, 8)),
            expected_peer: NodeId(u64_at(b, 16)),
            qp: u32_at(b, 24),
        }
    }
}

/// Owner → requester; for shm followed by `count` [`Export`]s.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HelloAck {
    pub magic: u32,
    pub version: u16,
    pub status: u8,
    pub node: NodeId,
    pub qp: u32,
    pub count: u32,
}

impl HelloAck {
    pub const LEN: usize = 24;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0..4].copy_from_slice(&self.magic.to_le_bytes());
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[6] = self.status;
        b[8..16].copy_from_slice(&self.node.0.to_le_bytes());
        b[16..20].copy_from_slice(&self.qp.to_le_bytes());
        b[20..24].copy_from_slice(&self.count.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Self {
        HelloAck {
            magic: u32_at(b, 0),
            version: u16_at(b, 4),
            status: b[6],
            node: NodeId(u64_at(b, 8)),
            qp: u32_at(b, 16),
            count: u32_at(b, 20),
        }
    }
}

/// One exported region (shm).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Export {
    pub key: MrKey,
    pub addr: u64,
    pub len: u64,
}

impl Export {
    pub const LEN: usize = 24;

    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.key.0.to_le_bytes());
        out.extend_from_slice(&self.addr.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
    }

    pub fn decode(b: &[u8]) -> Self {
        Export {
            key: MrKey(u64_at(b, 0)),
            addr: u64_at(b, 8),
            len: u64_at(b, 16),
        }
    }
}

/// A read request (tcp).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ReadReq {
    pub wr_id: u64,
    pub addr: u64,
    pub len: u64,
    pub rkey: MrKey,
}

impl ReadReq {
    pub const LEN: usize = 32;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0..8].copy_from_slice(&self.wr_id.to_le_bytes());
        b[8..16].copy_from_slice(&self.addr.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b[24..32].copy_from_slice(&self.rkey.0.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; Self::LEN]) -> Self {
        ReadReq {
            wr_id: u64_at(b, 0),
            addr: u64_at(b, 8),
            len: u64_at(b, 16),
            rkey: MrKey(u64_at(b, 24)),
        }
    }
}

pub(crate) const RESP_OK: u32 = 0;
pub(crate) const RESP_ACCESS: u32 = 1;

/// A read response header (tcp); `len` payload bytes follow when `status == RESP_OK`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ReadResp {
    pub wr_id: u64,
    pub len: u64,
    pub status: u32,
}

impl ReadResp {
    pub const LEN: usize = 24;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0..8].copy_from_slice(&self.wr_id.to_le_bytes());
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..20].copy_from_slice(&self.status.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; Self::LEN]) -> Self {
        ReadResp {
            wr_id: u64_at(b, 0),
            len: u64_at(b, 8),
            status: u32_at(b, 16),
        }
    }

    pub fn completion_status(&self) -> CompletionStatus {
        match self.status {
            RESP_OK => CompletionStatus::Success,
            RESP_ACCESS => CompletionStatus::RemoteAccessError,
            _ => CompletionStatus::TransportError,
        }
    }
}

/// Why a framed receive stopped.
#[derive(Debug)]
pub(crate) enum RecvError {
    Eof,
    Abandoned,
    Io(io::Error),
}

/// Receives exactly `buf.len()` bytes; `keep_waiting` decides on each receive timeout.
pub(crate) fn recv_exact(
    fd: RawFd,
    buf: &mut [u8],
    mut keep_waiting: impl FnMut() -> bool,
) -> Result<(), RecvError> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: `rest` is a valid writable buffer of `rest.len()` bytes.
        let r = unsafe { libc::recv(fd, rest.as_mut_ptr().cast(), rest.len(), 0) };
        if r > 0 {
            done += r as usize;
            continue;
        }
        if r == 0 {
            return Err(RecvError::Eof);
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => {}
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                if !keep_waiting() {
                    return Err(RecvError::Abandoned);
                }
            }
            _ => return Err(RecvError::Io(e)),
        }
    }
    Ok(())
}

/// Sends `head` then `len` bytes at `body` with as few syscalls as the socket allows.
///
/// # Safety
/// `body..body+len` must be readable for the duration of the call.
pub(crate) unsafe fn send_head_and_body(
    fd: RawFd,
    head: &[u8],
    body: *const u8,
    len: usize,
) -> io::Result<()> {
    let total = head.len() + len;
    let mut sent = 0usize;
    while sent < total {
        let mut iov = [
            libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            },
            libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            },
        ];
        let mut n = 0;
        if sent < head.len() {
            iov[0] = libc::iovec {
                iov_base: head[sent..].as_ptr() as *mut libc::c_void,
                iov_len: head.len() - sent,
            };
            n = 1;
        }
        let body_off = sent.saturating_sub(head.len());
        if body_off < len {
            iov[n] = libc::iovec {
                iov_base: body.wrapping_add(body_off) as *mut libc::c_void,
                iov_len: len - body_off,
            };
            n += 1;
        }
        // SAFETY: zeroed msghdr is a valid empty message; we set only the iovec fields.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = n as _;
        // SAFETY: the iovecs point into `head` and the caller-guaranteed body range; the
        // kernel only reads them.
        let r = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        sent += r as usize;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_roundtrip() {
        let h = Hello {
            magic: MAGIC,
            version: VERSION,
            kind: KIND_TCP,
            node: NodeId(7),
            expected_peer: NodeId(9),
            qp: 3,
        };
        assert_eq!(Hello::decode(&h.encode()), h);
        let r = ReadReq {
            wr_id: 1,
            addr: 0xdead_beef,
            len: 4096,
            rkey: MrKey(0xfedc_ba98_7654_3210),
        };
        assert_eq!(ReadReq::decode(&r.encode()), r);
        let c = Challenge {
            magic: MAGIC,
            version: TCP_VERSION,
            node: NodeId(9),
            nonce: [7; NONCE_LEN],
        };
        assert_eq!(Challenge::decode(&c.encode()), c);
        let p = Proof {
            link: u64::MAX - 1,
            nonce: [3; NONCE_LEN],
            mac: [4; PROOF_LEN],
        };
        assert_eq!(Proof::decode(&p.encode()), p);
        let a = HelloAck {
            magic: MAGIC,
            version: VERSION,
            status: ACK_OK,
            node: NodeId(9),
            qp: 5,
            count: 2,
        };
        assert_eq!(HelloAck::decode(&a.encode()), a);
        let mut v = Vec::new();
        let e = Export {
            key: MrKey(u64::MAX - 5),
            addr: 10,
            len: 20,
        };
        e.encode(&mut v);
        assert_eq!(Export::decode(&v), e);
    }
}
