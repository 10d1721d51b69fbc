//! The owner side's accept loop, shared by the tcp and shm providers: poll the listener so a
//! stop request is noticed, serve each connection on its own thread as a new QP, and keep a
//! clone of every live stream so stopping can shut them down.

use std::io;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::mr_table::MrTable;
use crate::qp_key::NodeId;

const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// Live connections: a clone of each stream (to shut it down) and its serving thread.
pub(crate) type Conns<S> = Arc<Mutex<Vec<(S, JoinHandle<()>)>>>;

/// A listener whose accepted streams can be cloned.
pub(crate) trait OwnerListener: AsRawFd {
    type Stream: Send + 'static;
    fn accept_one(&self) -> io::Result<Self::Stream>;
    fn clone_stream(s: &Self::Stream) -> io::Result<Self::Stream>;
}

impl OwnerListener for TcpListener {
    type Stream = TcpStream;

    fn accept_one(&self) -> io::Result<TcpStream> {
        self.accept().map(|(s, _)| s)
    }

    fn clone_stream(s: &TcpStream) -> io::Result<TcpStream> {
        s.try_clone()
    }
}

impl OwnerListener for UnixListener {
    type Stream = UnixStream;

    fn accept_one(&self) -> io::Result<UnixStream> {
        self.accept().map(|(s, _)| s)
    }

    fn clone_stream(s: &UnixStream) -> io::Result<UnixStream> {
        s.try_clone()
    }
}

/// What serves one connection.
pub(crate) type Serve<S> = fn(S, NodeId, u32, &MrTable) -> io::Result<()>;

/// Accepts until `stop` is set. Each connection is served on a thread named `thread`.
#[allow(clippy::too_many_arguments)] // the owner's shared state, handed over once
pub(crate) fn accept_loop<L: OwnerListener>(
    listener: L,
    node: NodeId,
    table: MrTable,
    stop: Arc<AtomicBool>,
    conns: Conns<L::Stream>,
    live: Arc<AtomicUsize>,
    thread: &'static str,
    serve: Serve<L::Stream>,
) {
    let next_qp = AtomicU32::new(1);
    while !stop.load(Ordering::Relaxed) {
        let mut pfd = libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe { libc::poll(&mut pfd, 1, POLL_INTERVAL.as_millis() as i32) };
        let Ok(stream) = listener.accept_one() else {
            continue;
        };
        let Ok(handle_copy) = L::clone_stream(&stream) else {
            continue;
        };
        let qp = next_qp.fetch_add(1, Ordering::Relaxed);
        let (table, live2) = (table.clone(), live.clone());
        live.fetch_add(1, Ordering::Relaxed);
        let spawned = std::thread::Builder::new()
            .name(thread.into())
            .spawn(move || {
                let _ = serve(stream, node, qp, &table);
                live2.fetch_sub(1, Ordering::Relaxed);
            });
        let mut list = conns.lock().unwrap_or_else(PoisonError::into_inner);
        // Reap finished connections so the list stays bounded by live ones.
        let (done, running): (Vec<_>, Vec<_>) = std::mem::take(&mut *list)
            .into_iter()
            .partition(|(_, t)| t.is_finished());
        *list = running;
        match spawned {
            Ok(t) => list.push((handle_copy, t)),
            Err(_) => {
                live.fetch_sub(1, Ordering::Relaxed);
            }
        }
        drop(list);
        for (_, t) in done {
            let _ = t.join();
        }
    }
}
