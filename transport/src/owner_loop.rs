//! The owner side's server, shared by the tcp and shm providers: an accept thread that polls
//! the listener so a stop request is noticed, one thread per connection served as a new QP,
//! and a clone of every live stream so dropping connections or stopping can shut them down.

use std::io;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// Live connections: a clone of each stream (to shut it down) and its serving thread.
pub(crate) type Conns<S> = Arc<Mutex<Vec<(S, JoinHandle<()>)>>>;

/// A listener whose accepted streams can be cloned and shut down.
pub(crate) trait OwnerListener: AsRawFd + Send + 'static {
    type Stream: Send + 'static;
    fn accept_one(&self) -> io::Result<Self::Stream>;
    fn clone_stream(s: &Self::Stream) -> io::Result<Self::Stream>;
    fn shutdown_stream(s: &Self::Stream);
    fn set_nonblocking(&self) -> io::Result<()>;
}

impl OwnerListener for TcpListener {
    type Stream = TcpStream;

    fn accept_one(&self) -> io::Result<TcpStream> {
        self.accept().map(|(s, _)| s)
    }

    fn clone_stream(s: &TcpStream) -> io::Result<TcpStream> {
        s.try_clone()
    }

    fn shutdown_stream(s: &TcpStream) {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }

    fn set_nonblocking(&self) -> io::Result<()> {
        TcpListener::set_nonblocking(self, true)
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

    fn shutdown_stream(s: &UnixStream) {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }

    fn set_nonblocking(&self) -> io::Result<()> {
        UnixListener::set_nonblocking(self, true)
    }
}

/// What serves one connection (its stream and QP number), on the connection's own thread.
pub(crate) type Serve<S> = Arc<dyn Fn(S, u32) + Send + Sync>;
/// Decides on the accept thread whether a new connection gets a thread at all (a source that
/// is refused, too many connections in their hello); a refused stream is dropped (closed).
pub(crate) type Admit<S> = Box<dyn Fn(&S) -> bool + Send>;

/// A running owner server; stops (closing every connection and joining the threads) on
/// `stop` or drop.
pub(crate) struct OwnerServer<S: Send + 'static> {
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
    conns: Conns<S>,
    live: Arc<AtomicUsize>,
    shutdown_stream: fn(&S),
}

impl<S: Send + 'static> OwnerServer<S> {
    /// Serves `listener` on threads named `name`-owner and `name`-serve.
    pub(crate) fn spawn<L: OwnerListener<Stream = S>>(
        listener: L,
        name: &'static str,
        admit: Option<Admit<S>>,
        serve: Serve<S>,
    ) -> io::Result<Self> {
        listener.set_nonblocking()?;
        let stop = Arc::new(AtomicBool::new(false));
        let conns: Conns<S> = Arc::default();
        let live = Arc::new(AtomicUsize::new(0));
        let accept = {
            let (stop, conns, live) = (stop.clone(), conns.clone(), live.clone());
            std::thread::Builder::new()
                .name(format!("{name}-owner"))
                .spawn(move || accept_loop(listener, stop, conns, live, name, admit, serve))?
        };
        Ok(Self {
            stop,
            accept: Some(accept),
            conns,
            live,
            shutdown_stream: L::shutdown_stream,
        })
    }

    /// Requester connections currently served.
    pub(crate) fn connections(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// Closes every connection (requesters see a lost connection) and keeps accepting.
    pub(crate) fn drop_connections(&self) {
        for (s, _) in self
            .conns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
        {
            (self.shutdown_stream)(s);
        }
    }

    /// Stops accepting, closes every connection and waits for the threads.
    pub(crate) fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(a) = self.accept.take() {
            let _ = a.join();
        }
        let conns = std::mem::take(&mut *self.conns.lock().unwrap_or_else(PoisonError::into_inner));
        for (s, _) in &conns {
            (self.shutdown_stream)(s);
        }
        for (_, t) in conns {
            let _ = t.join();
        }
    }
}

impl<S: Send + 'static> Drop for OwnerServer<S> {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Accepts until `stop` is set. Each connection is served on a thread named `name`-serve.
fn accept_loop<L: OwnerListener>(
    listener: L,
    stop: Arc<AtomicBool>,
    conns: Conns<L::Stream>,
    live: Arc<AtomicUsize>,
    name: &'static str,
    admit: Option<Admit<L::Stream>>,
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
        if admit.as_ref().is_some_and(|a| !a(&stream)) {
            continue;
        }
        let Ok(handle_copy) = L::clone_stream(&stream) else {
            continue;
        };
        let qp = next_qp.fetch_add(1, Ordering::Relaxed);
        let (serve, live2) = (serve.clone(), live.clone());
        live.fetch_add(1, Ordering::Relaxed);
        let spawned = std::thread::Builder::new()
            .name(format!("{name}-serve"))
            .spawn(move || {
                serve(stream, qp);
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
