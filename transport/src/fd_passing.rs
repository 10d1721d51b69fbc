//! Passing file descriptors over Unix sockets (SCM_RIGHTS): the shm provider's pool memfds,
//! and the memory fds engines hand their node. Blocking or non-blocking sockets alike: on a
//! non-blocking one a call that would block fails with `WouldBlock`.
//!
//! The control-message encoding (alignment, `CMSG_*` walking, taking ownership of each
//! received descriptor once) is rustix's; this module adds the limits and the retry on `EINTR`.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd, RawFd};

use rustix::io::Errno;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

/// Most descriptors one message carries (the kernel allows 253).
pub const MAX_FDS: usize = 64;

/// Sends `data` with `fds` attached in one `sendmsg`. `sock` is an open socket of the caller's
/// for the duration of the call.
pub fn send_with_fds(sock: RawFd, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    if fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "too many descriptors",
        ));
    }
    // SAFETY: the caller passes a socket it keeps open for this call, which is as long as the
    // borrow lives.
    let sock = unsafe { BorrowedFd::borrow_raw(sock) };
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        // Cannot happen: the buffer is sized for MAX_FDS, checked above.
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "descriptors do not fit the control buffer",
        ));
    }
    let iov = [IoSlice::new(data)];
    loop {
        match rustix::net::sendmsg(sock, &iov, &mut control, SendFlags::NOSIGNAL) {
            Ok(n) if n == data.len() => return Ok(()),
            Ok(_) => return Err(io::Error::new(io::ErrorKind::WriteZero, "short sendmsg")),
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Receives into `buf` and takes ownership of any descriptors that came with it. `sock` is an
/// open socket of the caller's for the duration of the call.
pub fn recv_with_fds(sock: RawFd, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    // SAFETY: as in `send_with_fds`.
    let sock = unsafe { BorrowedFd::borrow_raw(sock) };
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = loop {
        match rustix::net::recvmsg(sock, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC) {
            Ok(m) => break m,
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    let mut fds = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = m {
            fds.extend(received);
        }
    }
    // Whatever did arrive is closed with `fds`: a request missing some of its descriptors
    // is not one to act on.
    if msg.flags.contains(ReturnFlags::CTRUNC) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "descriptors truncated",
        ));
    }
    Ok((msg.bytes, fds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};
    use std::os::fd::{AsFd, AsRawFd};
    use std::os::unix::net::UnixStream;

    fn temp_file(contents: &[u8]) -> std::fs::File {
        let fd =
            rustix::fs::memfd_create("fd-passing-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let mut f = std::fs::File::from(fd);
        f.write_all(contents).unwrap();
        f
    }

    #[test]
    fn descriptors_arrive_with_their_bytes_and_name_the_same_files() {
        let (a, b) = UnixStream::pair().unwrap();
        let files = [temp_file(b"first"), temp_file(b"second")];
        let borrowed: Vec<_> = files.iter().map(|f| f.as_fd()).collect();
        send_with_fds(a.as_raw_fd(), b"hello", &borrowed).unwrap();
        let mut buf = [0u8; 16];
        let (n, fds) = recv_with_fds(b.as_raw_fd(), &mut buf).unwrap();
        assert_eq!(&buf[..n], b"hello");
        assert_eq!(fds.len(), 2);
        for (fd, want) in fds.into_iter().zip([&b"first"[..], b"second"]) {
            let mut f = std::fs::File::from(fd);
            f.rewind().unwrap();
            let mut got = Vec::new();
            f.read_to_end(&mut got).unwrap();
            assert_eq!(got, want);
            // Received close-on-exec: a node's children never inherit an engine's memory.
            let flags = rustix::io::fcntl_getfd(&f).unwrap();
            assert!(flags.contains(rustix::io::FdFlags::CLOEXEC));
        }
    }

    #[test]
    fn bytes_without_descriptors_and_too_many_refused() {
        let (a, b) = UnixStream::pair().unwrap();
        send_with_fds(a.as_raw_fd(), b"plain", &[]).unwrap();
        let mut buf = [0u8; 8];
        let (n, fds) = recv_with_fds(b.as_raw_fd(), &mut buf).unwrap();
        assert_eq!((&buf[..n], fds.len()), (&b"plain"[..], 0));

        let f = temp_file(b"x");
        let many = vec![f.as_fd(); MAX_FDS + 1];
        let e = send_with_fds(a.as_raw_fd(), b"x", &many).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        let full = vec![f.as_fd(); MAX_FDS];
        send_with_fds(a.as_raw_fd(), b"y", &full).unwrap();
        let (_, fds) = recv_with_fds(b.as_raw_fd(), &mut buf).unwrap();
        assert_eq!(fds.len(), MAX_FDS);
    }

    #[test]
    fn a_non_blocking_socket_with_nothing_to_read_would_block() {
        let (_a, b) = UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        let mut buf = [0u8; 4];
        let e = recv_with_fds(b.as_raw_fd(), &mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
    }
}
