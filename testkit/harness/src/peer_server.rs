//! A node's Peer service on loopback, and the gRPC peers of a node that reads from others'.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvferry_actors::peer::{self, PeerBackend, PeerServeError};
use kvferry_actors::peer::{Directory, GrpcPeers, GrpcPeersConfig, Provider, StaticDirectory};
use tokio::sync::oneshot;

/// `kvferry.v1.Peer` served from `backend` on 127.0.0.1 (any port) until [`PeerServer::stop`].
pub struct PeerServer {
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), PeerServeError>>,
}

impl PeerServer {
    /// Serves `backend` (a node's [`kvferry_actors::Node::peer_backend`]) to peers that
    /// present `token`.
    pub async fn start(backend: PeerBackend, token: &str) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(peer::serve(listener, backend, token.into(), async move {
            let _ = stopped.await;
        }));
        Self {
            addr,
            stop: Some(stop),
            task,
        }
    }

    /// Stops serving (drop the clients first: a graceful stop waits for them) and asserts
    /// that it stopped within 10 s without an error.
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        tokio::time::timeout(Duration::from_secs(10), &mut self.task)
            .await
            .expect("the server stops after its shutdown signal")
            .unwrap()
            .unwrap();
    }
}

/// The peers of node `node_id` that reads over `provider` from `owners` (`(node id,
/// Peer service address)`), presenting `token`; `directory` says who holds what (a
/// [`StaticDirectory`] of every owner where None).
pub fn grpc_peers(
    node_id: &str,
    provider: Provider,
    token: &str,
    owners: &[(&str, String)],
    directory: Option<Arc<dyn Directory>>,
) -> Arc<GrpcPeers> {
    let directory = directory.unwrap_or_else(|| {
        Arc::new(StaticDirectory::new(
            owners.iter().map(|(n, _)| (*n).to_string()).collect(),
        ))
    });
    GrpcPeers::new(
        GrpcPeersConfig {
            node_id: node_id.into(),
            provider,
            token: token.into(),
            peers: owners
                .iter()
                .map(|(n, a)| ((*n).to_string(), a.clone()))
                .collect(),
            shm_dir: std::env::temp_dir().join(format!("kvferry-{node_id}-{}", std::process::id())),
            data_listen: "127.0.0.1:0".into(),
            data_lanes: kvferry_actors::config::DEFAULT_DATA_LANES,
        },
        directory,
    )
}
