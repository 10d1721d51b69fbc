//! TLS on the tcp data plane (rustls). The owner wraps an accepted stream in a
//! `ServerConnection` before its challenge, so the link-grant proof runs inside TLS; the
//! requester's [`TlsPipe`] shares one `ClientConnection` between the issuing thread and the
//! receiver thread: a mutex held only while bytes move between rustls and a non-blocking
//! socket, never across a wait, so an issue never waits for a read to arrive. The receiver
//! reads ciphertext in large pieces and hands it to rustls from memory.

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
    conn.set_buffer_limit(Some(SEND_BUFFER));
    match handshake(&mut conn, &mut sock, deadline) {
        Ok(()) => Ok(rustls::StreamOwned::new(conn, sock)),
        Err(e) => Err((sock, e)),
    }
}

/// Ciphertext read from the socket at once: rustls' `read_tls` asks a reader for at most
/// 4 KiB, so reading the socket through it cost a `recv(2)` (and a `poll(2)`) per 4 KiB;
/// reads of this size are served to rustls from memory.
const CIPHERTEXT_BUF: usize = 256 << 10;

/// Plaintext an owner's connection queues before writing: rustls' default (64 KiB) made a
/// large read's reply four records per `write_tls`.
pub(crate) const SEND_BUFFER: usize = 1 << 20;

/// The rustls side of a requester's connection: the connection, and ciphertext received
/// but not yet handed to it (`ct[start..end]`).
struct Rx {
    conn: ClientConnection,
    ct: Box<[u8]>,
    start: usize,
    end: usize,
    /// The socket reported its end; rustls has been told.
    eof: bool,
}

/// A requester's TLS data connection after its handshake, shared by the issuer and the
/// receiver.
pub(crate) struct TlsPipe {
    rx: Mutex<Rx>,
    sock: TcpStream,
}

impl TlsPipe {
    /// `sock` carries `conn`, whose handshake (and the data-plane hello) is done.
    pub(crate) fn new(conn: ClientConnection, sock: TcpStream) -> io::Result<Self> {
        sock.set_nonblocking(true)?;
        Ok(Self {
            rx: Mutex::new(Rx {
                conn,
                ct: vec![0; CIPHERTEXT_BUF].into_boxed_slice(),
                start: 0,
                end: 0,
                eof: false,
            }),
            sock,
        })
    }

    pub(crate) fn socket(&self) -> &TcpStream {
        &self.sock
    }

    /// Encrypts `bytes` and sends what the socket takes now; the receiver sends the rest when
    /// the socket is writable again.
    pub(crate) fn send(&self, bytes: &[u8]) -> io::Result<()> {
        let mut rx = lock(&self.rx);
        rx.conn.writer().write_all(bytes)?;
        flush(&mut rx.conn, &self.sock)
    }

    /// Hands rustls more ciphertext under the lock: what `rx` holds, else what the socket
    /// has now (one large read); `WouldBlock` when neither has any.
    fn feed(&self, rx: &mut Rx) -> io::Result<()> {
        if rx.start == rx.end && !rx.eof {
            match (&self.sock).read(&mut rx.ct) {
                Ok(0) => rx.eof = true,
                Ok(n) => (rx.start, rx.end) = (0, n),
                Err(e) => return Err(e),
            }
            if rx.eof {
                // Tells rustls the stream ended (a truncated record is its error).
                rx.conn.read_tls(&mut io::empty())?;
                rx.conn.process_new_packets().map_err(tls_err)?;
                return Ok(());
            }
        }
        if rx.start == rx.end {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let Rx {
            conn,
            ct,
            start,
            end,
            ..
        } = rx;
        let n = conn.read_tls(&mut &ct[*start..*end])?;
        *start += n;
        conn.process_new_packets().map_err(tls_err)?;
        Ok(())
    }

    /// Waits up to one poll interval for the socket (readable, or writable while rustls has
    /// output queued) and flushes that output; `WouldBlock` when nothing happened.
    fn wait(&self) -> io::Result<()> {
        let wants_write = lock(&self.rx).conn.wants_write();
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
        if pfd.revents & libc::POLLOUT != 0 {
            flush(&mut lock(&self.rx).conn, &self.sock)?;
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
            {
                let mut rx = lock(&self.rx);
                loop {
                    match rx.conn.reader().read(buf) {
                        Ok(r) => return Ok(r),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        Err(e) => return Err(e),
                    }
                    match self.feed(&mut rx) {
                        Ok(()) => {}
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) => return Err(e),
                    }
                }
            }
            // Nothing buffered and nothing on the socket: wait for it without the lock, so
            // the issuer can send meanwhile.
            match self.wait() {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
            // Let the caller check its deadline now and then.
            if started.elapsed() > Duration::from_millis(POLL_MS as u64) {
                return Err(io::ErrorKind::WouldBlock.into());
            }
        }
    }
}
