//! A node's engine service (`kvferry.v1.Engine`) on loopback with its fd socket, as an engine
//! process on the same host reaches it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvferry_actors::service::{self, EngineOptions, EngineServeError};
use kvferry_actors::{Clock, Node};
use kvferry_client::EngineClient;
use kvferry_gpu::{Device, HostDevice};
use tokio::sync::oneshot;

/// A node (32 slots of 64 KiB) over one host device, serving the engine API on 127.0.0.1
/// (any port) and an fd socket in a fresh directory, until [`EngineServer::stop`].
pub struct EngineServer {
    pub node: Node,
    /// The host device under the node (its allocation gauges: a client's memfd is one).
    pub dev: Arc<HostDevice>,
    pub addr: String,
    pub fd_path: std::path::PathBuf,
    dir: std::path::PathBuf,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), EngineServeError>>,
}

impl EngineServer {
    pub async fn start(options: EngineOptions) -> Self {
        let dev = HostDevice::new(0);
        Self::start_on(options, Arc::clone(&dev) as Arc<dyn Device>, dev).await
    }

    /// Serves a node over `device` (`dev` is the host device under it, for its gauges).
    pub async fn start_on(
        options: EngineOptions,
        device: Arc<dyn Device>,
        dev: Arc<HostDevice>,
    ) -> Self {
        let node =
            Node::start_with(super::config(64 << 10, 32), vec![device], Clock::system()).unwrap();
        Self::serve(options, node, dev).await
    }

    /// Serves a node over `hooked`, whose hook sees every copy batch the node submits.
    pub async fn start_hooked<H: crate::SubmitHook>(
        options: EngineOptions,
        hooked: &Arc<crate::HookedDevice<H>>,
    ) -> Self {
        let device = Arc::clone(hooked) as Arc<dyn Device>;
        Self::start_on(options, device, Arc::clone(&hooked.inner)).await
    }

    /// Serves `node` (whose device 0 is `dev`).
    pub async fn serve(options: EngineOptions, node: Node, dev: Arc<HostDevice>) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "kvferry-engine-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let fd = service::FdSocket::bind(&dir, "test").unwrap();
        let fd_path = fd.path().to_owned();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(service::serve_engine(
            listener,
            Some(fd),
            node.clone(),
            options,
            async move {
                let _ = stopped.await;
            },
        ));
        Self {
            node,
            dev,
            addr,
            fd_path,
            dir,
            stop: Some(stop),
            task,
        }
    }

    /// A client of the service and its fd socket, presenting `token`.
    pub async fn client(&self, token: &str) -> EngineClient {
        EngineClient::connect(self.addr.clone(), Some(self.fd_path.clone()), token)
            .await
            .unwrap()
    }

    /// Stops the service (it ends sessions and streams itself) within 10 s and the node;
    /// asserts that the fd socket is gone afterwards.
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        tokio::time::timeout(Duration::from_secs(10), &mut self.task)
            .await
            .expect("the engine service stops after its shutdown signal")
            .unwrap()
            .unwrap();
        assert!(!self.fd_path.exists(), "fd socket left behind");
        self.node.shutdown();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
