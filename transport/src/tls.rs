//! TLS on the tcp data plane (rustls). The owner wraps an accepted stream in a
//! `ServerConnection` before its challenge, so the link-grant proof runs inside TLS; the
//! requester's [`TlsPipe`] shares one `ClientConnection` between the issuing thread and the
//! receiver thread: a mutex held only while bytes move between rustls and a non-blocking
//! socket, never across a wait, so an issue never waits for a read to arrive.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rustls::{ClientConnection, ServerConnection};

use crate::scatter::ByteSource;

/// How long the receiver waits in `poll(2)` before asking whether to keep waiting.
const POLL_MS: i32 = 20;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn tls_err(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// Whether `e` is rustls' (a bad record, an alert from the peer, a certificate refused),
/// not the socket's.
pub(crate) fn is_tls(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|e| e.is::<rustls::Error>())
}

/// Drives a handshake on a socket with a short read timeout until it completes or
/// `deadline` passes (`TimedOut`).
pub(crate) fn handshake<C, D>(
    conn: &mut C,
    sock: &mut TcpStream,
    deadline: Instant,
) -> io::Result<()>
where
    C: std::ops::DerefMut<Target = rustls::ConnectionCommon<D>>,
    D: rustls::SideData,
{
    while conn.is_handshaking() {
        if Instant::now() >= deadline {
            return Err(io::ErrorKind::TimedOut.into());
        }
        match conn.complete_io(sock) {
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(e),
        }
    }
    // A TLS 1.3 server's tickets or a final flight may still be queued.
    while conn.wants_write() {
        conn.write_tls(sock)?;
    }
    Ok(())
}

/// The owner's side of a TLS data connection, once its handshake is done.
pub(crate) type ServerStream = rustls::StreamOwned<ServerConnection, TcpStream>;

/// Runs the server handshake before `deadline`.
pub(crate) fn accept(
    config: std::sync::Arc<rustls::ServerConfig>,
    mut sock: TcpStream,
    deadline: Instant,
) -> Result<ServerStream, (TcpStream, io::Error)> {
    let mut conn = match ServerConnection::new(config) {
        Ok(c) => c,
        Err(e) => return Err((sock, tls_err(e))),
    };
    match handshake(&mut conn, &mut sock, deadline) {
        Ok(()) => Ok(rustls::StreamOwned::new(conn, sock)),
        Err(e) => Err((sock, e)),
    }
}

/// A requester's TLS data connection after its handshake, shared by the issuer and the
/// receiver.
pub(crate) struct TlsPipe {
    conn: Mutex<ClientConnection>,
    sock: TcpStream,
}

impl TlsPipe {
    /// `sock` carries `conn`, whose handshake (and the data-plane hello) is done.
    pub(crate) fn new(conn: ClientConnection, sock: TcpStream) -> io::Result<Self> {
        sock.set_nonblocking(true)?;
        Ok(Self {
            conn: Mutex::new(conn),
            sock,
        })
    }

    pub(crate) fn socket(&self) -> &TcpStream {
        &self.sock
    }

    /// Encrypts `bytes` and sends what the socket takes now; the receiver sends the rest when
    /// the socket is writable again.
    pub(crate) fn send(&self, bytes: &[u8]) -> io::Result<()> {
        let mut conn = lock(&self.conn);
        conn.writer().write_all(bytes)?;
        flush(&mut conn, &self.sock)
    }

    /// Waits up to one poll interval for the socket (readable, or writable while rustls has
    /// output queued), then moves ciphertext between it and rustls under the lock;
    /// `WouldBlock` when nothing happened.
    fn pump(&self) -> io::Result<()> {
        let wants_write = lock(&self.conn).wants_write();
        let mut events = libc::POLLIN;
        if wants_write {
            events |= libc::POLLOUT;
        }
        let mut pfd = libc::pollfd {
            fd: self.sock.as_raw_fd(),
            events,
            revents: 0,
        };
        // SAFETY: `pfd` is one valid pollfd for the duration of the call.
        let r = unsafe { libc::poll(&mut pfd, 1, POLL_MS) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        if r == 0 {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let mut conn = lock(&self.conn);
        if pfd.revents & libc::POLLOUT != 0 {
            flush(&mut conn, &self.sock)?;
        }
        if pfd.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
            match conn.read_tls(&mut &self.sock) {
                Ok(0) => return Ok(()),
                Ok(_) => {
                    conn.process_new_packets().map_err(tls_err)?;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

fn flush(conn: &mut ClientConnection, mut sock: &TcpStream) -> io::Result<()> {
    while conn.wants_write() {
        match conn.write_tls(&mut sock) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl ByteSource for &TlsPipe {
    unsafe fn recv_raw(&mut self, ptr: *mut u8, n: usize) -> io::Result<usize> {
        // SAFETY: the caller guarantees `ptr..ptr+n` is writable; nothing else holds it.
        let buf = unsafe { std::slice::from_raw_parts_mut(ptr, n) };
        let started = Instant::now();
        loop {
            match lock(&self.conn).reader().read(buf) {
                Ok(r) => return Ok(r),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
            self.pump()?;
            // The socket had bytes but not a whole record yet: keep going, but still let the
            // caller check its deadline now and then.
            if started.elapsed() > Duration::from_millis(POLL_MS as u64) {
                return Err(io::ErrorKind::WouldBlock.into());
            }
        }
    }
}
