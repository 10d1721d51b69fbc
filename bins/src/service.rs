//! `kvferry node`: a long-running node from a config file. With a `[cluster]` section it
//! serves `kvferry.v1.Peer` and its pool to peers, and reads remote suffixes from them; with
//! an `[engine]` section it serves `kvferry.v1.Engine` and its fd socket to engines.

use std::sync::Arc;

use anyhow::Context;
use kvferry_actors::config::{ClientAuth, TlsListener};
use kvferry_actors::peer::{
    Directory, GrpcPeers, GrpcPeersConfig, Peers, Provider, RedisDirectory, RedisError,
    StaticDirectory,
};
use kvferry_actors::tls::{TlsAccept, TlsContext, TlsServing, TlsSide};
use kvferry_actors::{node::open_devices, Clock, Node, NodeConfig};

use crate::logging::lifecycle;

/// How long open peer calls may take to finish after SIGTERM.
const DRAIN: std::time::Duration = std::time::Duration::from_secs(5);

/// Takes SIGINT and SIGTERM over at once — before the node announces itself, since a
/// signal that arrives before the handlers are in place ends the process by its default
/// action — and resolves on either. Called inside the runtime.
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = &'static str>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("handling SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("handling SIGINT")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        }
    })
}

/// Why a running node stops: a signal (a clean stop, status 0), or its actor system ended
/// under it (an error, status 1; a panic has already ended the process with 101).
async fn until_stopped(
    stop: impl std::future::Future<Output = &'static str>,
    node: &Node,
) -> anyhow::Result<()> {
    let id = &node.config().node_id;
    tokio::select! {
        signal = stop => {
            lifecycle(&format!("kvferry node {id}: stopping on {signal}"));
            Ok(())
        }
        () = node.actors_stopped() => {
            anyhow::bail!("kvferry node {id}: its actor system stopped; exiting")
        }
    }
}

/// The start-up line, on stderr, once every listener is bound: supervisors and log
/// searches match `kvferry node <id>: started`.
fn announce_started(node: &Node, how: &str) {
    lifecycle(&format!(
        "kvferry node {}: started (pid {}, version {}); {how}",
        node.config().node_id,
        std::process::id(),
        env!("CARGO_PKG_VERSION"),
    ));
    crash_test(node);
}

/// Crash tests of the `kvferry` binary: `KVFERRY_TEST_CRASH=actor-panic` panics a task on
/// the actor thread once the node has started, which must end the process with status 101
/// (the panic hook in `main.rs`). Nothing else reads this variable.
fn crash_test(node: &Node) {
    if std::env::var("KVFERRY_TEST_CRASH").as_deref() == Ok("actor-panic") {
        node.actor_arbiter().spawn(async {
            panic!("KVFERRY_TEST_CRASH=actor-panic: a panic on the actor thread");
        });
    }
}

/// The shutdown line, on stderr, the last the process prints on a clean stop.
fn announce_stopped(node_id: &str) {
    lifecycle(&format!("kvferry node {node_id}: stopped"));
}

/// The effective config, once, before anything starts: what an operator needs to read a
/// log without the file at hand.
fn log_config_summary(cfg: &NodeConfig, log_filter: &str) {
    let (provider, directory, peers, peer_listen) = match &cfg.cluster {
        Some(c) => (
            c.provider.as_str(),
            kvferry_actors::peer::redact_url(&c.directory),
            c.peers.len(),
            c.peer_listen.as_str(),
        ),
        None => ("off", "off".to_owned(), 0, "off"),
    };
    tracing::info!(
        node = %cfg.node_id,
        pool_size = %cfg.pool.size,
        slot_bytes = %cfg.pool.slot_bytes,
        hugepages = cfg.pool.hugepages,
        device = %cfg.device.kind,
        devices = cfg.device.count,
        lease_ttl_secs = cfg.lease.ttl().as_secs(),
        provider,
        directory = %directory,
        peers,
        peer_listen,
        engine = cfg.engine.as_ref().map_or("off", |e| e.listen.as_str()),
        metrics = if cfg.metrics.listen.is_empty() { "off" } else { cfg.metrics.listen.as_str() },
        nics = cfg.nic.len(),
        log = %log_filter,
        log_format = cfg.log.format.as_str(),
        "starting with this config",
    );
}

/// `GET /metrics`: the node's Prometheus text; `GET /health`: 200 `ok` while the node's
/// actors answer, 503 with the reason when they do not; anything else 404. Served with axum
/// (its router and hyper's HTTP/1.1) rather than a hand-written parser; the exporter's own
/// listener does not fit, since a scrape first asks the actors for their gauges.
fn metrics_router(node: Node) -> axum::Router {
    use axum::extract::State;
    use axum::http::{header, StatusCode};
    use axum::routing::get;

    type Reply = (StatusCode, [(header::HeaderName, &'static str); 1], String);
    const TEXT: &str = "text/plain; charset=utf-8";
    const PROMETHEUS: &str = "text/plain; version=0.0.4; charset=utf-8";

    async fn metrics(State(node): State<Node>) -> Reply {
        match node.metrics_text().await {
            Ok(t) => (StatusCode::OK, [(header::CONTENT_TYPE, PROMETHEUS)], t),
            Err(e) => (
                StatusCode::SERVICE_UNAVAILABLE,
                [(header::CONTENT_TYPE, TEXT)],
                format!("{e}\n"),
            ),
        }
    }
    async fn health(State(node): State<Node>) -> Reply {
        match node.stats().await {
            Ok(_) => (
                StatusCode::OK,
                [(header::CONTENT_TYPE, TEXT)],
                "ok\n".into(),
            ),
            Err(e) => (
                StatusCode::SERVICE_UNAVAILABLE,
                [(header::CONTENT_TYPE, TEXT)],
                format!("{e}\n"),
            ),
        }
    }
    async fn not_found() -> Reply {
        (
            StatusCode::NOT_FOUND,
            [(header::CONTENT_TYPE, TEXT)],
            "try /metrics or /health\n".into(),
        )
    }
    axum::Router::new()
        .route("/metrics", get(metrics))
        .route("/health", get(health))
        .fallback(not_found)
        .with_state(node)
}

/// Says where the event publisher bound (its sockets are the node's, started with it).
fn print_event_endpoints(node: &Node) {
    if let Some((publish, replay)) = node.event_endpoints() {
        println!("listening events={publish}");
        if let Some(r) = replay {
            println!("listening events-replay={r}");
        }
    }
}

/// Starts the metrics endpoint if the config names one (over TLS where `[tls]` says so).
async fn start_metrics(
    cfg: &NodeConfig,
    node: &Node,
    tls: Option<&TlsContext>,
) -> anyhow::Result<()> {
    if cfg.metrics.listen.is_empty() {
        return Ok(());
    }
    let listener = tokio::net::TcpListener::bind(&cfg.metrics.listen)
        .await
        .with_context(|| format!("binding metrics.listen {}", cfg.metrics.listen))?;
    println!("listening metrics={}", listener.local_addr()?);
    let app = metrics_router(node.clone());
    let served = tls_serving(cfg, tls, TlsListener::Metrics)?;
    tokio::spawn(async move {
        // axum retries failed accepts itself; an end is an error worth a line.
        let r = match served {
            Some(t) => axum::serve(MetricsTls(TlsAccept::new(listener, t)), app).await,
            None => axum::serve(listener, app).await,
        };
        if let Err(e) = r {
            tracing::error!(error = %e, "the metrics endpoint stopped serving");
        }
    });
    Ok(())
}

/// The metrics listener over TLS, as axum takes a listener.
struct MetricsTls(TlsAccept);

impl axum::serve::Listener for MetricsTls {
    type Io = kvferry_actors::tls::ServerTlsStream;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.0.accept().await {
            Some(c) => c,
            // The accept loop ended (it does not on its own): serve nothing more.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.0.local_addr()
    }
}

/// A running engine service.
struct Engine {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), kvferry_actors::service::EngineServeError>>,
}

impl Engine {
    /// Stops accepting, ends sessions, answers waiting polls, and waits (bounded) for the
    /// calls in flight; the fd socket is removed.
    async fn stop(self) -> anyhow::Result<()> {
        tracing::info!(drain = ?DRAIN, "engine service: no new calls; open calls and streams drain");
        let _ = self.stop.send(());
        match tokio::time::timeout(DRAIN, self.task).await {
            Ok(r) => Ok(r??),
            Err(_) => {
                tracing::warn!(drain = ?DRAIN, "engine calls still open; stopping anyway");
                Ok(())
            }
        }
    }
}

/// The TLS context of `[tls]`, loaded once at start (the files were checked by
/// `validate`, so this fails only if they changed since).
fn load_tls(cfg: &NodeConfig) -> anyhow::Result<Option<TlsContext>> {
    match &cfg.tls {
        Some(t) => Ok(Some(
            TlsContext::load_with(t.files(), t.expiry_warning())
                .context("loading the [tls] files")?,
        )),
        None => Ok(None),
    }
}

/// Shows `ctx`'s counters in the node's scrapes and watches its reload triggers (SIGHUP,
/// file changes) until the process ends. Inside the runtime.
fn watch_tls(cfg: &NodeConfig, node: &Node, ctx: &TlsContext) {
    node.attach_tls(Arc::clone(ctx.stats()));
    let Some(t) = &cfg.tls else { return };
    let (watched, sighup, poll) = (
        ctx.clone(),
        t.reload_on_sighup,
        std::time::Duration::from_secs(t.reload_poll_secs),
    );
    tokio::spawn(async move {
        let stop = std::future::pending();
        if let Err(e) = kvferry_actors::tls::reload::watch(watched, sighup, poll, stop).await {
            tracing::warn!(error = %e, "cannot watch for SIGHUP; TLS files are not reloaded");
        }
    });
}

/// How `listener` serves TLS, if `[tls]` puts it on it.
fn tls_serving(
    cfg: &NodeConfig,
    ctx: Option<&TlsContext>,
    listener: TlsListener,
) -> anyhow::Result<Option<TlsServing>> {
    let (Some(t), Some(ctx)) = (&cfg.tls, ctx) else {
        return Ok(None);
    };
    if !t.covers(listener) {
        return Ok(None);
    }
    let (auth, side) = match listener {
        TlsListener::Engine => (t.engine_client_cert, TlsSide::Engine),
        TlsListener::Peer => (ClientAuth::Required, TlsSide::Peer),
        TlsListener::Data => (ClientAuth::Required, TlsSide::Data),
        TlsListener::Metrics => (ClientAuth::None, TlsSide::Metrics),
    };
    // gRPC is HTTP/2 only; the metrics endpoint (axum's http1) HTTP/1.1.
    let alpn: &[u8] = if listener == TlsListener::Metrics {
        b"http/1.1"
    } else {
        kvferry_actors::tls::ALPN_H2
    };
    Ok(Some(TlsServing {
        config: ctx.server_config(auth, &[alpn])?,
        side,
        handshake_timeout: t.handshake_timeout(),
        stats: Arc::clone(ctx.stats()),
    }))
}

/// Starts the engine service if the config has an `[engine]` section.
async fn start_engine(
    cfg: &NodeConfig,
    node: &Node,
    tls: Option<&TlsContext>,
) -> anyhow::Result<Option<Engine>> {
    use kvferry_actors::service::{serve_engine, EngineOptions, FdSocket};
    let Some(e) = &cfg.engine else {
        return Ok(None);
    };
    let listener = tokio::net::TcpListener::bind(&e.listen)
        .await
        .with_context(|| format!("binding engine.listen {}", e.listen))?;
    let fd = if e.fd_dir.is_empty() {
        None
    } else {
        Some(FdSocket::bind(e.fd_dir.as_ref(), &cfg.node_id).context("engine.fd-dir")?)
    };
    println!("listening engine={}", listener.local_addr()?);
    if let Some(f) = &fd {
        println!("listening engine-fd={}", f.path().display());
    }
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let mut options = EngineOptions::from_config(e);
    options.tls = tls_serving(cfg, tls, TlsListener::Engine)?;
    let task = tokio::spawn(serve_engine(
        listener,
        fd,
        node.clone(),
        options,
        async move {
            let _ = stopped.await;
        },
    ));
    // The service attaches its gauges when it first runs: wait for that (briefly), so the
    // first scrape after the `listening` lines already shows them.
    for _ in 0..1000 {
        if node.engine_attached() || task.is_finished() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    Ok(Some(Engine { stop, task }))
}

/// The Redis directory at `url`. A server that does not answer at start does not keep the
/// node from starting (Redis may come up after the nodes): it starts without it, answers
/// queries from its own blocks, and announces what it holds once Redis answers. A bad
/// address fails.
fn redis_directory(cfg: &NodeConfig, url: &str) -> anyhow::Result<RedisDirectory> {
    let (prefix, options) = (&cfg.directory.key_prefix, cfg.directory.redis_options());
    // Errors and logs name the address without its password.
    let shown = kvferry_actors::peer::redact_url(url);
    match RedisDirectory::connect_with(url, prefix, options.clone()) {
        Ok(d) => Ok(d),
        Err(e @ RedisError::Connect { .. }) => {
            tracing::warn!(
                node = %cfg.node_id,
                error = %e,
                "the directory does not answer; starting without it until it answers"
            );
            RedisDirectory::start(url, prefix, options)
                .with_context(|| format!("starting the directory at {shown}"))
        }
        Err(e) => Err(e).with_context(|| format!("connecting to the directory at {shown}")),
    }
}

/// Runs a node until SIGTERM or SIGINT; `log_filter` is the log filter in force, for the
/// start-up summary.
pub fn run(cfg: NodeConfig, log_filter: &str) -> anyhow::Result<()> {
    log_config_summary(&cfg, log_filter);
    let devices = open_devices(&cfg)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let Some(c) = cfg.cluster.clone() else {
        let node =
            Node::start_with(cfg.clone(), devices, Clock::system()).context("starting the node")?;
        let served = rt.block_on(async {
            let stop = shutdown_signal()?;
            let tls = load_tls(&cfg)?;
            if let Some(ctx) = &tls {
                watch_tls(&cfg, &node, ctx);
            }
            print_event_endpoints(&node);
            let engine = start_engine(&cfg, &node, tls.as_ref()).await?;
            start_metrics(&cfg, &node, tls.as_ref()).await?;
            announce_started(&node, "running on its own; Ctrl-C or SIGTERM stops it");
            let stopped = until_stopped(stop, &node).await;
            if let Some(e) = engine {
                e.stop().await?;
            }
            stopped
        });
        node.shutdown();
        if served.is_ok() {
            announce_stopped(&cfg.node_id);
        }
        return served;
    };
    let provider = Provider::parse(&c.provider)?;
    let directory: Arc<dyn Directory> = if c.directory == "static" {
        Arc::new(StaticDirectory::new(
            c.peers.iter().map(|p| p.node_id.clone()).collect(),
        ))
    } else {
        Arc::new(redis_directory(&cfg, &c.directory)?)
    };
    // Loaded before the node, so that its calls to peers use it.
    let tls = load_tls(&cfg)?;
    let peers_config = GrpcPeersConfig {
        node_id: cfg.node_id.clone(),
        provider,
        token: c.token.clone(),
        peers: c
            .peers
            .iter()
            .map(|p| (p.node_id.clone(), p.address.clone()))
            .collect(),
        shm_dir: c.shm_dir.clone().into(),
        data_listen: c.data_listen.clone(),
        data_lanes: c.lanes(cfg.tls_on(TlsListener::Data) && tls.is_some()),
    };
    let (peer_tls, data_tls) = (cfg.tls_on(TlsListener::Peer), cfg.tls_on(TlsListener::Data));
    let peers = match &tls {
        Some(ctx) if peer_tls || data_tls => {
            GrpcPeers::new_secured(peers_config, directory, ctx.clone(), peer_tls, data_tls)?
        }
        _ => GrpcPeers::new(peers_config, directory),
    };
    let node = Node::start_in(
        cfg.clone(),
        devices,
        Clock::system(),
        Some(Arc::clone(&peers)),
    )
    .context("starting the node")?;
    let served = rt.block_on(async {
        let stop_signal = shutdown_signal()?;
        if let Some(ctx) = &tls {
            watch_tls(&cfg, &node, ctx);
        }
        print_event_endpoints(&node);
        let engine = start_engine(&cfg, &node, tls.as_ref()).await?;
        start_metrics(&cfg, &node, tls.as_ref()).await?;
        let listener = tokio::net::TcpListener::bind(&c.peer_listen)
            .await
            .with_context(|| format!("binding cluster.peer-listen {}", c.peer_listen))?;
        let addr = listener.local_addr()?;
        let mut backend = node.peer_backend();
        let endpoint = peers.data_endpoint();
        if let Some(e) = &endpoint {
            backend = backend.with_endpoint(e.clone());
        }
        // One line on stdout for supervisors and tests; the rest goes to stderr.
        println!("listening peer={addr}");
        // Where peers read the pool: a tcp address or shm socket, or the RDMA NICs (and
        // why direct loads over them are refused, if they are).
        let at = match (&endpoint, node.nics()) {
            (Some(e), _) => format!("at {}", e.endpoint),
            (None, Some(n)) => match &n.direct_refusal {
                Some(why) => format!("on its [[nic]]s ({why})"),
                None => "on its [[nic]]s".to_owned(),
            },
            (None, None) => "nowhere (no data endpoint)".to_owned(),
        };
        announce_started(
            &node,
            &format!(
                "Peer service on {addr}, pool served over {} {at}; SIGTERM stops it",
                provider.as_str()
            ),
        );
        // On SIGTERM: stop accepting and let open calls finish, but not forever: peers keep
        // their connections open, so the drain is bounded.
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let peer_tls = tls_serving(&cfg, tls.as_ref(), TlsListener::Peer)?;
        let serve = kvferry_actors::peer::serve_with_tls(
            listener,
            backend,
            c.token.clone(),
            peer_tls,
            async move {
                let _ = stopped.await;
            },
        );
        tokio::pin!(serve);
        let stopped = tokio::select! {
            r = &mut serve => { r?; Ok(()) }
            stopped = until_stopped(stop_signal, &node) => {
                tracing::info!(drain = ?DRAIN, "peer service: no new calls; open calls drain");
                let _ = stop.send(());
                match tokio::time::timeout(DRAIN, &mut serve).await {
                    Ok(r) => r?,
                    Err(_) => tracing::warn!(drain = ?DRAIN, "peers still connected; stopping anyway"),
                }
                stopped
            }
        };
        if let Some(e) = engine {
            e.stop().await?;
        }
        stopped
    });
    node.shutdown();
    // Leaving queued this node's withdrawal: let it reach the directory (bounded by the
    // directory's own deadlines) before the process ends.
    rt.block_on(peers.directory().flush());
    tracing::info!(node = %cfg.node_id, "this node's withdrawal handed to the directory");
    if served.is_ok() {
        announce_stopped(&cfg.node_id);
    }
    served
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GETs `path` from the router served on a loopback port: the status code and body.
    async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
        let mut resp = String::new();
        s.read_to_string(&mut resp).await.unwrap();
        let code = resp.split_whitespace().nth(1).unwrap().parse().unwrap();
        let body = resp.split_once("\r\n\r\n").unwrap().1.to_owned();
        (code, body)
    }

    /// `/health` is 200 `ok` while the actors answer and 503 with the reason once they are
    /// gone (the node was shut down under the endpoint); `/metrics` too; others are 404.
    #[test]
    fn health_and_metrics_answer_503_once_the_actors_are_gone() {
        let mut cfg = NodeConfig::default();
        cfg.device.kind = "host".into();
        cfg.pool.size = kvferry_actors::config::ByteSize(4 << 20);
        let node = Node::start(cfg).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let app = metrics_router(node.clone());
            tokio::spawn(async move { axum::serve(listener, app).await });
            assert_eq!(get(addr, "/health").await, (200, "ok\n".into()));
            let (code, body) = get(addr, "/metrics").await;
            assert_eq!(code, 200);
            assert!(body.contains("kvferry_pool_slots 4\n"), "{body}");
            assert_eq!(get(addr, "/nope").await.0, 404);
            node.shutdown();
            let (code, body) = get(addr, "/health").await;
            assert_eq!(code, 503, "{body}");
            assert!(body.contains("shutting down"), "{body}");
            assert_eq!(get(addr, "/metrics").await.0, 503);
        });
    }
}
