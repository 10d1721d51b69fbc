//! `kvferry.v1.Engine` over a [`crate::node::Node`]: what inference engines call.
//! [`serve`] puts the `EngineService` behind the token check and the connection limits
//! on a bound listener, starts the [`FdSocket`] and the handle sweep, and drains on
//! shutdown. Every request is checked (token, then each field) before it reaches the node,
//! so a refused request changes nothing; the handlers are grouped by what they serve
//! (`info`, `registration`, `load`, `save`, `session`) over the `Shared` state.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::transport::server::TcpIncoming;
use tonic::Request;

use crate::config::EngineConfig;
use crate::node::Node;
use crate::service::engine::completions::CompletionBook;
use crate::service::engine::fd_socket::{self, FdSocket};
use crate::service::engine::memory_handles::MemoryHandles;
use crate::statuses::AsPromised;
use kvferry_proto::v1::engine_server::EngineServer;

// Where the fd socket and the mailboxes name them.
pub(crate) use crate::service::engine::service::EngineService;
pub(crate) use crate::service::engine::shared::Shared;

/// Requests in flight on one connection; more wait for a free slot.
const MAX_IN_FLIGHT_PER_CONNECTION: usize = 256;

/// Memory handles waiting for RegisterInstance, over all clients.
const MAX_HANDLES: usize = 1024;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum EngineServeError {
    #[error("engine service on {addr}: reading the listener's address")]
    LocalAddr {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("engine service on {addr} failed")]
    Serve {
        addr: String,
        #[source]
        source: tonic::transport::Error,
    },
    /// The fd socket's directory is not private to the node's user (or cannot be made so).
    #[error("engine fd socket directory {source}")]
    FdDir {
        #[source]
        source: crate::private_fs::PrivateDirError,
    },
    #[error("engine fd socket {path}: {what}")]
    FdSocket {
        what: &'static str,
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// How the engine service runs.
#[derive(Clone)]
pub struct EngineOptions {
    /// Bearer token every call must carry; empty: not checked.
    pub token: String,
    pub max_message_bytes: usize,
    /// Completed results kept per instance rank.
    pub completion_retention: usize,
    pub handle_ttl: Duration,
    /// Longest a unary call may take on the server (the client's `grpc-timeout` may be
    /// shorter).
    pub call_timeout: Duration,
    /// How long a mailbox thread polls after a request (`engine.mailbox-spin-us`).
    pub mailbox_spin: Duration,
    /// TLS on the listener (`[tls]` with "engine"); none: plaintext.
    pub tls: Option<crate::tls::TlsServing>,
}

impl std::fmt::Debug for EngineOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // As the config's: the token is a secret. Taken apart so no field is missed.
        let Self {
            token,
            max_message_bytes,
            completion_retention,
            handle_ttl,
            call_timeout,
            mailbox_spin,
            tls,
        } = self;
        f.debug_struct("EngineOptions")
            .field("token", &crate::config::redact::Redacted(token))
            .field("max_message_bytes", max_message_bytes)
            .field("completion_retention", completion_retention)
            .field("handle_ttl", handle_ttl)
            .field("call_timeout", call_timeout)
            .field("mailbox_spin", mailbox_spin)
            .field("tls", &tls.as_ref().map(|t| t.side))
            .finish()
    }
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self::from_config(&EngineConfig::default())
    }
}

impl EngineOptions {
    pub fn from_config(c: &EngineConfig) -> Self {
        Self {
            token: c.token.clone(),
            max_message_bytes: usize::try_from(c.max_message_bytes.0).unwrap_or(usize::MAX),
            completion_retention: c.completion_retention as usize,
            handle_ttl: c.handle_ttl(),
            call_timeout: Duration::from_secs(30),
            mailbox_spin: c.mailbox_spin(),
            tls: None,
        }
    }
}

/// Serves `kvferry.v1.Engine` on `listener` (and memory fds on `fd_socket`, whose file is
/// removed at the end) until `shutdown` resolves; then ends the open sessions, answers the
/// waiting polls and waits for the calls in flight.
pub async fn serve(
    listener: TcpListener,
    fd_socket: Option<FdSocket>,
    node: Node,
    options: EngineOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<(), EngineServeError> {
    let addr = listener
        .local_addr()
        .map(|a| a.to_string())
        .map_err(|source| EngineServeError::LocalAddr {
            addr: "?".into(),
            source,
        })?;
    let (stop_tx, stop) = watch::channel(false);
    let shared = Arc::new(Shared {
        handles: Mutex::new(MemoryHandles::new(options.handle_ttl, MAX_HANDLES)),
        book: Mutex::new(CompletionBook::new(options.completion_retention)),
        ended: tokio::sync::Notify::new(),
        boards: Mutex::new(HashMap::new()),
        sessions: AtomicUsize::new(0),
        mailboxes: AtomicUsize::new(0),
        mailbox_requests: std::sync::atomic::AtomicU64::new(0),
        fd_path: fd_socket.as_ref().map(|s| s.path.display().to_string()),
        stop: stop.clone(),
        node,
        options: options.clone(),
    });
    let probe: Arc<dyn crate::metrics::EngineProbe> = shared.clone();
    shared.node.attach_engine(Arc::downgrade(&probe));
    let fd_path = fd_socket.as_ref().map(|s| s.path.clone());
    if let Some(sock) = fd_socket {
        tokio::spawn(fd_socket::serve(sock, Arc::clone(&shared), stop.clone()));
    }
    tokio::spawn(sweep_handles(Arc::clone(&shared), stop.clone()));
    let auth = Arc::clone(&shared);
    let closing = Arc::clone(&shared);
    let service = EngineServer::new(EngineService {
        shared: Arc::clone(&shared),
    })
    .max_decoding_message_size(options.max_message_bytes)
    .max_encoding_message_size(options.max_message_bytes);
    let service =
        tonic::service::interceptor::InterceptedService::new(service, move |req: Request<()>| {
            let got = req
                .metadata()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .unwrap_or("");
            auth.check_token(got)?;
            Ok(req)
        });
    let builder = tonic::transport::Server::builder()
        .concurrency_limit_per_connection(MAX_IN_FLIGHT_PER_CONNECTION)
        .timeout(options.call_timeout)
        // A client that vanished without closing its session is noticed within ~40 s.
        .http2_keepalive_interval(Some(Duration::from_secs(20)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)));
    let shutdown = async {
        shutdown.await;
        // No new memory is taken, sessions end and waiting polls answer, so the drain can
        // finish.
        let _ = stop_tx.send(true);
        closing.ended.notify_waiters();
        if let Some(p) = &fd_path {
            let _ = std::fs::remove_file(p);
        }
    };
    let served = match options.tls.clone() {
        Some(tls) => {
            builder
                .serve_with_incoming_shutdown(
                    AsPromised(service),
                    crate::tls::tls_incoming(listener, tls),
                    shutdown,
                )
                .await
        }
        None => {
            builder
                .serve_with_incoming_shutdown(
                    AsPromised(service),
                    TcpIncoming::from(listener).with_nodelay(Some(true)),
                    shutdown,
                )
                .await
        }
    }
    .map_err(|source| EngineServeError::Serve { addr, source });
    let _ = stop_tx.send(true);
    if let Some(p) = &fd_path {
        let _ = std::fs::remove_file(p);
    }
    served
}

async fn sweep_handles(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tick.tick() => {
                shared.handles().expire(Instant::now());
            }
            _ = stop.wait_for(|s| *s) => break,
        }
    }
}
