//! The integration tests' harness (`tests/tests/integration`): a node over a host-emulated device, instances
//! with canaried device KV (allocated by the node's device, or held by the test in a memfd
//! as a client without a GPU does: [`MemfdKv`]), and gauge checks.

pub mod raw;

use std::sync::Arc;
use std::time::Duration;

use crate::{DeviceKv, KvKind};
use kvferry_actors::config::ByteSize;
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

/// The runtime every test drives its async calls on (two workers: the node's actors run
/// on their own thread, so this only drives clients and servers).
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
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
    crate::put_pattern(node, &id(instance), shape, rank, ids)
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

/// A real `redis-server` on a free loopback port, killed on drop (continued first, if a
/// test hung it).
pub struct RedisServer {
    child: std::process::Child,
    pub addr: String,
    port: u16,
}

impl RedisServer {
    pub fn start() -> Self {
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free loopback port")
                .port();
            if let Some(s) = Self::start_on(port) {
                return s;
            }
        }
        panic!("redis-server did not come up");
    }

    /// None when it exits at once (the port was taken meanwhile) or never accepts.
    fn start_on(port: u16) -> Option<Self> {
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
                panic!("redis-server could not start ({e}): run ./scripts/test, which installs it")
            });
        let mut s = RedisServer {
            child,
            addr: format!("127.0.0.1:{port}"),
            port,
        };
        for _ in 0..500 {
            if matches!(s.child.try_wait(), Ok(Some(_))) {
                return None;
            }
            if std::net::TcpStream::connect(&s.addr).is_ok() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Signals the server while it runs (never a reaped pid, which may be reused).
    fn signal(&mut self, sig: libc::c_int) {
        if matches!(self.child.try_wait(), Ok(None)) {
            // SAFETY: kill(2) on our own child, not yet reaped; no memory is involved.
            let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, sig) };
            assert_eq!(rc, 0, "kill({}, {sig})", self.child.id());
        }
    }

    /// Hangs it (SIGSTOP): connections are still accepted, nothing is answered.
    pub fn hang(&mut self) {
        self.signal(libc::SIGSTOP);
    }

    pub fn resume(&mut self) {
        self.signal(libc::SIGCONT);
    }

    pub fn kill(&mut self) {
        self.resume();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Kills it and starts an empty one on the same port.
    pub fn restart(mut self) -> Self {
        self.kill();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(s) = Self::start_on(self.port) {
                return s;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "redis-server did not come back on port {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Host KV of a client without a GPU, as the tests play that client (a memfd with the
/// fixture's pattern and canaries).
pub use crate::MemfdKv;

/// This test binary re-executed to run one ignored test as a child process (an owner or a
/// node of its own), with `env` set; its stdout is read line by line. The child serves until
/// its stdin closes ([`ChildTest::finish`]); it is killed if the test fails first.
pub struct ChildTest {
    child: Option<std::process::Child>,
    stdin: Option<std::process::ChildStdin>,
    lines: std::sync::mpsc::Receiver<String>,
}

impl ChildTest {
    /// `test` is the child test's `module_path!()`-qualified name (`integration::remote::
    /// child_owner_process`); libtest names it without the crate.
    pub fn spawn(test: &str, env: &[(&str, &str)]) -> Self {
        use std::io::{BufRead, BufReader};
        use std::process::{Command, Stdio};
        let test = test.split_once("::").map_or(test, |(_, t)| t);
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "--ignored",
            "--exact",
            test,
            "--nocapture",
            "--test-threads=1",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let stdin = child.stdin.take();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            child: Some(child),
            stdin,
            lines,
        }
    }

    /// Waits (at most a minute) for a line holding `prefix` and returns what follows it
    /// (libtest may print "test NAME ... " on the same line first).
    pub fn wait_for(&self, prefix: &str) -> String {
        loop {
            let line = self
                .lines
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("the child never printed {prefix}"));
            if let Some(at) = line.find(prefix) {
                return line[at + prefix.len()..].trim().to_owned();
            }
        }
    }

    /// Closes the child's stdin (its signal to check itself and stop), waits for
    /// `last_line` where given, and asserts a clean exit.
    pub fn finish(mut self, last_line: Option<&str>) {
        drop(self.stdin.take());
        if let Some(l) = last_line {
            self.wait_for(l);
        }
        let status = self.child.take().unwrap().wait().unwrap();
        assert!(status.success(), "the child exited with {status}");
    }
}

impl Drop for ChildTest {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
