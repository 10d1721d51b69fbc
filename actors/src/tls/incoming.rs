//! TLS on an accepted TCP listener, as a stream of connections for tonic's
//! `serve_with_incoming`: each accepted socket gets its handshake on a task of its own,
//! within a deadline, so a slow or silent client (slowloris) holds one task and a few
//! kilobytes until the deadline closes it, never the accept loop. At most
//! [`MAX_PENDING_HANDSHAKES`] handshakes run at once; a connection past that is closed at
//! once and counted. A failed handshake is counted by listener and logged, rate-limited,
//! with the peer's address and rustls' reason.

use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use rustls::ServerConfig;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use crate::tls::{TlsSide, TlsStats};

/// Handshakes in progress on one listener at once.
pub const MAX_PENDING_HANDSHAKES: usize = 512;

/// Handshake failures, logged at most once per listener and reason kind each period.
static FAILED: crate::log_limit::LogLimit =
    crate::log_limit::LogLimit::new(Duration::from_secs(10));

/// How a listener serves TLS.
#[derive(Clone, Debug)]
pub struct TlsServing {
    pub config: Arc<ServerConfig>,
    pub side: TlsSide,
    pub handshake_timeout: Duration,
    pub stats: Arc<TlsStats>,
}

/// Logs (rate-limited) and counts one failed handshake of `side`.
pub(crate) fn handshake_failed(
    stats: &TlsStats,
    side: TlsSide,
    peer: &str,
    why: &dyn std::fmt::Display,
) {
    stats.handshake_failed(side);
    let why = why.to_string();
    // The kind of failure, not the whole message: one line per kind per period.
    let kind: String = why.chars().take_while(|c| *c != ':' && *c != '(').collect();
    if let Some(held_back) = FAILED.allow(&format!("{}/{kind}", side.as_str())) {
        tracing::warn!(
            listener = side.as_str(),
            peer,
            error = %why,
            held_back,
            "TLS handshake failed; connection closed"
        );
    }
}

/// A server-side TLS connection of a listener.
pub type ServerTlsStream = TlsStream<TcpStream>;

/// Accepts on `listener` and yields the connections whose handshake completed. The accept
/// loop ends when the stream is dropped (the server shutting down).
pub fn tls_incoming(
    listener: TcpListener,
    tls: TlsServing,
) -> impl Stream<Item = Result<ServerTlsStream, std::io::Error>> + Send + 'static {
    let mut accept = TlsAccept::new(listener, tls);
    futures::stream::poll_fn(move |cx| accept.rx.poll_recv(cx).map(|c| c.map(Ok)))
}

/// [`tls_incoming`] as a listener with an `accept` of its own, for servers that take one
/// (axum's `Listener`).
#[derive(Debug)]
pub struct TlsAccept {
    rx: mpsc::Receiver<ServerTlsStream>,
    local: std::io::Result<std::net::SocketAddr>,
}

impl TlsAccept {
    pub fn new(listener: TcpListener, tls: TlsServing) -> Self {
        let local = listener.local_addr();
        let (tx, rx) = mpsc::channel::<ServerTlsStream>(64);
        tokio::spawn(accept_loop(listener, tls, tx));
        Self { rx, local }
    }

    /// The next connection whose handshake completed, with its peer's address; None once
    /// the accept loop ended.
    pub async fn accept(&mut self) -> Option<(ServerTlsStream, std::net::SocketAddr)> {
        loop {
            let s = self.rx.recv().await?;
            // A connection reset since its handshake has no address: skip it.
            if let Ok(peer) = s.get_ref().0.peer_addr() {
                return Some((s, peer));
            }
        }
    }

    pub fn local_addr(&self) -> std::io::Result<std::net::SocketAddr> {
        match &self.local {
            Ok(a) => Ok(*a),
            Err(e) => Err(std::io::Error::new(e.kind(), e.to_string())),
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    tls: TlsServing,
    tx: mpsc::Sender<TlsStream<TcpStream>>,
) {
    let acceptor = TlsAcceptor::from(Arc::clone(&tls.config));
    let pending = Arc::new(Semaphore::new(MAX_PENDING_HANDSHAKES));
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = tx.closed() => return,
        };
        let (sock, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of fds and the like: wait a little rather than spin.
                tracing::warn!(listener = tls.side.as_str(), error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = Arc::clone(&pending).try_acquire_owned() else {
            handshake_failed(
                &tls.stats,
                tls.side,
                &peer.to_string(),
                &format_args!("{MAX_PENDING_HANDSHAKES} handshakes already in progress"),
            );
            drop(sock);
            continue;
        };
        let _ = sock.set_nodelay(true);
        let (acceptor, tx, tls) = (acceptor.clone(), tx.clone(), tls.clone());
        tokio::spawn(async move {
            let _permit = permit;
            match tokio::time::timeout(tls.handshake_timeout, acceptor.accept(sock)).await {
                Ok(Ok(stream)) => {
                    let _ = tx.send(stream).await;
                }
                Ok(Err(e)) => handshake_failed(&tls.stats, tls.side, &peer.to_string(), &e),
                Err(_) => handshake_failed(
                    &tls.stats,
                    tls.side,
                    &peer.to_string(),
                    &format_args!("no handshake within {:?}", tls.handshake_timeout),
                ),
            }
        });
    }
}
