//! An owner node in a process of its own, for multi-process tests and benchmarks.

use std::sync::Arc;

use kvferry_actors::config::ByteSize;
use kvferry_actors::peer::{GrpcPeers, GrpcPeersConfig, Provider, StaticDirectory};
use kvferry_actors::{Clock, Node, NodeConfig, NodeError};
use kvferry_gpu::{Device, KvShape};

use kvferry_testkit::{DeviceKv, KvKind};

use crate::{put_pattern, stdin_closed, RegisterKv};

/// An owner node in its own process, for multi-process tests and benchmarks: it holds every
/// rank's part of pattern blocks `blocks` of namespace `model/bf16/<shape>`, serves
/// `kvferry.v1.Peer` on 127.0.0.1 (any port) and its pool over `provider`.
#[derive(Clone, Debug)]
pub struct OwnerSpec {
    pub node_id: String,
    pub model: String,
    pub provider: Provider,
    pub shape: KvShape,
    pub blocks: std::ops::Range<u64>,
    pub token: String,
}

/// Runs an owner until `stdin` closes: prints `READY <peer address>` on stdout once it
/// serves. The parent process closes our stdin to stop us.
pub fn run_owner_process(spec: OwnerSpec) -> Result<(), NodeError> {
    let stopped = |what| NodeError::Stopped { what };
    let peers = GrpcPeers::new(
        GrpcPeersConfig {
            node_id: spec.node_id.clone(),
            provider: spec.provider,
            token: spec.token.clone(),
            peers: Vec::new(),
            shm_dir: std::env::temp_dir().join(format!("kvferry-owner-{}", std::process::id())),
            data_listen: "127.0.0.1:0".into(),
            data_lanes: kvferry_actors::config::DEFAULT_DATA_LANES,
        },
        Arc::new(StaticDirectory::new(Vec::new())),
    );
    let n = spec.blocks.end - spec.blocks.start;
    let mut cfg = NodeConfig {
        node_id: spec.node_id.clone(),
        ..Default::default()
    };
    cfg.pool.slot_bytes = ByteSize(spec.shape.block_bytes().div_ceil(64) * 64);
    cfg.pool.size = ByteSize(cfg.pool.slot_bytes.0 * n.max(1));
    let dev: Arc<dyn Device> = kvferry_gpu::HostDevice::new(0);
    let node = Node::start_in(
        cfg,
        vec![Arc::clone(&dev)],
        Clock::system(),
        Some(Arc::clone(&peers)),
    )?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|_| stopped("owner runtime"))?;
    let r = rt.block_on(async {
        // Every rank's part of every block: a TP requester reads each rank's from here.
        let mut kvs = Vec::new();
        for rank in 0..spec.shape.tp_size() {
            let kv = DeviceKv::alloc(
                Arc::clone(&dev),
                spec.shape,
                KvKind::Split,
                1,
                spec.shape.segment_bytes(),
                0,
            )?;
            let instance = kv
                .register(&node, "owner-engine", &spec.model, rank)
                .await?;
            put_pattern(&node, &instance, &spec.shape, rank, spec.blocks.clone()).await?;
            kvs.push(kv);
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|_| stopped("binding the peer service"))?;
        let addr = listener
            .local_addr()
            .map_err(|_| stopped("peer service address"))?;
        let mut backend = node.peer_backend();
        if let Some(e) = peers.data_endpoint() {
            backend = backend.with_endpoint(e);
        }
        let (stop, stopped_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(kvferry_actors::peer::serve(
            listener,
            backend,
            spec.token.clone(),
            async move {
                let _ = stopped_rx.await;
            },
        ));
        println!("READY {addr}");
        use std::io::Write;
        let _ = std::io::stdout().flush();
        // Serve until the parent closes our stdin.
        stdin_closed().await;
        let _ = stop.send(());
        let _ = server.await;
        drop(kvs);
        Ok::<_, NodeError>(())
    });
    node.shutdown();
    r
}
