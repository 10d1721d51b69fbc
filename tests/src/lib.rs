//! Shared helpers for the integration tests: a node over a host-emulated device, instances
//! with canaried device KV (allocated by the node's device, or held by the test in a memfd
//! as a client without a GPU does: [`MemfdKv`]), and gauge checks.

use std::sync::Arc;
use std::time::Duration;

use kvferry_actors::config::ByteSize;
use kvferry_actors::fixture::{DeviceKv, KvKind};
use kvferry_actors::{BlockHash, Clock, InstanceId, Node, NodeConfig, Stats};
use kvferry_gpu::{Device, HostDevice, KvShape};

pub fn config(slot: u64, slots: u64) -> NodeConfig {
    let mut cfg = NodeConfig {
        node_id: "test".into(),
        ..Default::default()
    };
    cfg.pool.slot_bytes = ByteSize(slot);
    cfg.pool.size = ByteSize(slot * slots);
    cfg
}

/// A node over one host-emulated device.
pub fn node(slot: u64, slots: u64, clock: Clock) -> (Node, Arc<dyn Device>) {
    let dev: Arc<dyn Device> = HostDevice::new(0);
    let node = Node::start_with(config(slot, slots), vec![Arc::clone(&dev)], clock).unwrap();
    (node, dev)
}

pub fn hashes(range: std::ops::Range<u64>) -> Vec<BlockHash> {
    range.map(BlockHash::from_u64).collect()
}

/// Registers `rank` of `instance` over freshly allocated device KV.
// Every argument is one knob a test turns; a builder would only hide them.
#[allow(clippy::too_many_arguments)]
pub async fn register(
    node: &Node,
    dev: &Arc<dyn Device>,
    instance: &str,
    shape: KvShape,
    rank: u32,
    kind: KvKind,
    num_blocks: u32,
    view_offset: u64,
) -> DeviceKv {
    let kv = DeviceKv::alloc(
        Arc::clone(dev),
        shape,
        kind,
        num_blocks,
        shape.segment_bytes(),
        view_offset,
    )
    .unwrap();
    kv.register(node, instance, "m", rank).await.unwrap();
    kv
}

/// Puts pattern blocks `ids` (pattern block = hash value) for one rank.
pub async fn put(
    node: &Node,
    instance: &str,
    shape: &KvShape,
    rank: u32,
    ids: std::ops::Range<u64>,
) {
    kvferry_actors::fixture::put_pattern(node, &id(instance), shape, rank, ids)
        .await
        .unwrap();
}

pub fn id(s: &str) -> InstanceId {
    InstanceId::new(s).unwrap()
}

/// Waits (briefly) until the leak gauges are back to zero, then returns the stats.
pub async fn settled(node: &Node) -> Stats {
    for _ in 0..200 {
        let s = node.stats().await.unwrap();
        if s.leases_live == 0 && s.pinned_blocks == 0 && s.pins == 0 && s.transfers_in_flight == 0 {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let s = node.stats().await.unwrap();
    panic!("gauges did not return to zero: {s:?}");
}

/// A real `redis-server` on a free loopback port, killed on drop.
pub struct RedisServer {
    child: std::process::Child,
    pub addr: String,
}

impl RedisServer {
    pub fn start() -> Self {
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free loopback port")
                .port();
            let child = std::process::Command::new("redis-server")
                .args([
                    "--port",
                    &port.to_string(),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ])
                .args(["--bind", "127.0.0.1"])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap_or_else(|e| {
                    panic!(
                        "redis-server could not start ({e}): run ./scripts/test, which installs it"
                    )
                });
            let mut s = RedisServer {
                child,
                addr: format!("127.0.0.1:{port}"),
            };
            for _ in 0..500 {
                if matches!(s.child.try_wait(), Ok(Some(_))) {
                    break; // the port was taken meanwhile: try another
                }
                if std::net::TcpStream::connect(&s.addr).is_ok() {
                    return s;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        panic!("redis-server did not come up");
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Host KV of a client without a GPU, as the tests play that client (a memfd with the
/// fixture's pattern and canaries).
pub use kvferry_actors::fixture::MemfdKv;
