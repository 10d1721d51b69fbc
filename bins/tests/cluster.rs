//! Three `kvferry node` processes started from config files on loopback, and engine clients
//! in other processes: this test (the Rust `EngineClient`) and a Python grpcio client. Host
//! KV reaches the nodes as memfds over their fd sockets; queries, asynchronous loads and
//! byte checks go through `kvferry.v1.Engine`. An owner is killed with SIGKILL mid-load and
//! restarted from the same file. Two hosts in network namespaces joined by a veth pair, with
//! the link cut under a load (where this machine can make namespaces: root and iproute2).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvferry_actors::BlockHash;
use kvferry_gpu::KvShape;
use kvferry_harness::{free_port, wait_listening};
use kvferry_proto::v1::{LoadCompletion, LoadStatus};
use kvferry_testkit::Attached;

/// 4 layers x split K/V x 16 KiB: 128 KiB per block.
fn shape() -> KvShape {
    KvShape::new(4, 1, 2, 16 << 10).unwrap()
}

/// Device blocks of every client's KV.
const KV_BLOCKS: u32 = 80;

/// The blocks an owner killed mid-load holds beyond the worked example's: a prompt of
/// B's 0..4 then these 64 (8 MiB) is what the kill lands in.
const LONG: std::ops::Range<u64> = 100..164;

/// One `kvferry node` process.
struct NodeProc {
    name: String,
    config: PathBuf,
    child: Option<Child>,
    engine: String,
}

impl NodeProc {
    /// Starts `kvferry node --config FILE` and waits for its engine, fd socket and peer
    /// listening lines.
    fn start(name: &str, config: &Path) -> Self {
        Self::start_in(name, config, None)
    }

    /// [`NodeProc::start`] inside network namespace `netns` (`ip netns exec` execs the node,
    /// so the child is the node itself).
    fn start_in(name: &str, config: &Path, netns: Option<&str>) -> Self {
        let bin = env!("CARGO_BIN_EXE_kvferry");
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, bin]);
                c
            }
            None => Command::new(bin),
        };
        let mut child = cmd
            .args(["node", "--config", config.to_str().unwrap()])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let addrs = match wait_listening(
            out,
            &["engine", "engine-fd", "peer"],
            Duration::from_secs(60),
        ) {
            Ok(addrs) => addrs,
            Err(seen) => {
                let _ = child.kill();
                panic!("node {name} did not start serving: {seen}");
            }
        };
        Self {
            name: name.into(),
            config: config.into(),
            child: Some(child),
            engine: addrs[0].clone(),
        }
    }

    /// SIGKILL: no drain, no goodbye to anyone.
    fn kill9(&mut self) {
        let mut c = self.child.take().unwrap();
        c.kill().unwrap();
        let status = c.wait().unwrap();
        assert!(!status.success(), "{} survived SIGKILL", self.name);
    }

    fn restart(&mut self) {
        assert!(self.child.is_none());
        *self = Self::start(&self.name.clone(), &self.config.clone());
    }

    /// SIGTERM and a clean exit.
    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: signalling our own child process by its pid.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let status = c.wait().unwrap();
            assert!(status.success(), "{} exited with {status:?}", self.name);
        }
    }
}

impl Drop for NodeProc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The config file of node `name`: host device, an engine service and fd socket, the
/// `provider` (tcp or shm), static peers; every node on loopback.
fn write_config(dir: &Path, name: &str, ports: &[(&str, u16)], provider: &str) -> PathBuf {
    let hosts: Vec<(&str, &str, u16)> = ports.iter().map(|&(n, p)| (n, "127.0.0.1", p)).collect();
    write_config_at(dir, name, &hosts, provider)
}

/// [`write_config`] with each node's address: `(name, ip, peer port)`; the node listens
/// (engine, peer, data) on its own ip.
fn write_config_at(dir: &Path, name: &str, hosts: &[(&str, &str, u16)], provider: &str) -> PathBuf {
    let (_, ip, port) = *hosts.iter().find(|(n, _, _)| *n == name).unwrap();
    let mut text = format!(
        "node-id = \"{name}\"\n\
         [pool]\nsize = \"64MiB\"\nslot-bytes = \"256KiB\"\n\
         [device]\nkind = \"host\"\n\
         [engine]\nlisten = \"{ip}:0\"\nfd-dir = \"{dir}\"\n{open}\
         [cluster]\nprovider = \"{provider}\"\npeer-listen = \"{ip}:{port}\"\n\
         data-listen = \"{ip}:0\"\nshm-dir = \"{dir}\"\ntoken = \"cluster-secret\"\n\
         directory = \"static\"\n",
        dir = dir.display(),
        // The engines of this test send no token; on a namespace's address that is refused
        // unless said to be meant.
        open = if ip.starts_with("127.") {
            ""
        } else {
            "allow-unauthenticated = true\n"
        },
    );
    for (peer, peer_ip, p) in hosts.iter().filter(|(n, _, _)| *n != name) {
        text.push_str(&format!(
            "[[cluster.peers]]\nnode-id = \"{peer}\"\naddress = \"{peer_ip}:{p}\"\n"
        ));
    }
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

async fn attach(node: &NodeProc) -> Attached {
    Attached::connect(&node.engine, "", shape(), KV_BLOCKS, "eng", "m")
        .await
        .unwrap()
}

fn hashes(ids: &[u64]) -> Vec<BlockHash> {
    ids.iter().map(|&i| BlockHash::from_u64(i)).collect()
}

/// Destinations for `n` blocks, scattered over the KV in reverse.
fn dests(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| KV_BLOCKS - 1 - i).collect()
}

/// Queries `ids`, expects `hit` blocks, loads them and returns the completion (from a
/// waiting poll), with the lease's destinations.
async fn query_and_load(
    e: &Attached,
    ids: &[u64],
    direct: bool,
    hit: u32,
) -> (LoadCompletion, Vec<u32>) {
    let q = e
        .client
        .query(&e.instance, &hashes(ids), direct)
        .await
        .unwrap();
    assert_eq!(q.hit_blocks(), hit, "{q:?}");
    if direct {
        assert!(q.direct.is_granted(), "{q:?}");
    }
    let dest = dests(hit as usize);
    let done = e
        .load(q.lease.unwrap(), &dest, Duration::from_secs(30))
        .await
        .unwrap();
    (done, dest)
}

fn verify(e: &Attached, ids: &[u64], dest: &[u32]) -> u64 {
    let expected: Vec<(u32, u64)> = dest.iter().copied().zip(ids.iter().copied()).collect();
    let checked = e.kv.verify(&expected, 0).unwrap();
    e.kv.reset().unwrap();
    checked
}

/// Waits until the node's gauges say nothing is leased, pinned or in flight.
async fn settled(e: &Attached) {
    let mut last = None;
    for _ in 0..400 {
        let s = e.client.stats().await.unwrap();
        if s.leases_live == 0 && s.pinned_blocks == 0 && s.pins == 0 && s.transfers_in_flight == 0 {
            return;
        }
        last = Some(s);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("gauges did not return to zero: {last:?}");
}

fn worked_example() -> Vec<u64> {
    (0..12).collect()
}

fn long_prompt() -> Vec<u64> {
    (0..4).chain(LONG).collect()
}

#[test]
fn three_node_processes_over_tcp_and_an_owner_killed_mid_load() {
    three_node_processes("tcp");
}

/// Over shm the requester maps each owner's pool: after the owner restarts, that mapping
/// is of a dead pool, and B must map the new one (the incarnation check) rather than read
/// stale bytes.
#[test]
fn three_node_processes_over_shm_and_an_owner_killed_mid_load() {
    three_node_processes("shm");
}

/// The runtime a test drives its clients on.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Nodes B, A and C as `kvferry node` processes over `provider`, in a fresh directory named
/// for `tag`; node i's config ends with `extra(i)`.
fn start_three(
    tag: &str,
    provider: &str,
    extra: impl Fn(usize) -> String,
) -> (PathBuf, Vec<NodeProc>) {
    let dir = std::env::temp_dir().join(format!("kvferry-cluster-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let ports = [("b", free_port()), ("a", free_port()), ("c", free_port())];
    let nodes = ["b", "a", "c"]
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let path = write_config(&dir, n, &ports, provider);
            let mut text = std::fs::read_to_string(&path).unwrap();
            text.push_str(&extra(i));
            std::fs::write(&path, text).unwrap();
            NodeProc::start(n, &path)
        })
        .collect();
    (dir, nodes)
}

/// The worked example through B, direct then staged, byte for byte; `after_direct` runs
/// between the two.
async fn worked_example_direct_and_staged(b: &Attached, mut after_direct: impl FnMut()) {
    for direct in [true, false] {
        let (done, dest) = query_and_load(b, &worked_example(), direct, 12).await;
        assert_eq!(done.status(), LoadStatus::LoadOk, "{done:?}");
        assert_eq!(done.path, if direct { "direct" } else { "staged" });
        assert_eq!(
            verify(b, &worked_example(), &dest),
            12 * shape().rank_bytes()
        );
        settled(b).await;
        if direct {
            after_direct();
        }
    }
}

/// `kvferry demo --nodes B,A,C` against the running nodes: 4 local and 8 remote blocks,
/// verified.
fn demo_against(nodes: &[NodeProc]) {
    let addrs: Vec<&str> = nodes.iter().map(|n| n.engine.as_str()).collect();
    let demo = kvferry_json(&["demo", "--json", "--nodes", &addrs.join(",")]);
    assert_eq!(demo["verified"], true, "{demo}");
    assert_eq!(
        (
            demo["local_blocks"].as_u64(),
            demo["remote_blocks"].as_u64()
        ),
        (Some(4), Some(8)),
        "{demo}"
    );
}

fn three_node_processes(provider: &str) {
    let (dir, mut nodes) = start_three(provider, provider, |_| String::new());
    let rt = runtime();
    rt.block_on(async {
        let mut engines = Vec::new();
        for n in &nodes {
            engines.push(attach(n).await);
        }
        // B holds 0..4, A 4..8 and the long run, C 8..12.
        engines[0].put_pattern(0..4).await.unwrap();
        engines[1].put_pattern((4..8).chain(LONG)).await.unwrap();
        engines[2].put_pattern(8..12).await.unwrap();
        let b = &engines[0];

        // The worked example through B, direct and staged; after the direct run (before the
        // staged run makes copies at B), a Python grpcio client of its own against B: its
        // memfd, its session, 4 local + 8 remote blocks direct.
        worked_example_direct_and_staged(b, || python_client(&nodes[0], 12, 4, 8)).await;

        // SIGKILL A while B reads the long run from it, direct (so no staged copy of it
        // lands at B whatever the timing: afterwards only B's own prefix may hit).
        let q = b
            .client
            .query(&b.instance, &hashes(&long_prompt()), true)
            .await
            .unwrap();
        assert_eq!((q.local_blocks, q.remote_blocks), (4, 64), "{q:?}");
        assert!(q.direct.is_granted(), "{q:?}");
        let dest = dests(68);
        let load = b.start_load(q.lease.unwrap(), &dest).await.unwrap();
        nodes[1].kill9();
        let done = b
            .client
            .wait_load(load, Duration::from_secs(30))
            .await
            .expect("the load neither completed nor failed within 30 s");
        match done.status() {
            LoadStatus::LoadOk => {
                // The kill landed after the last read: every byte must be there.
                eprintln!("cluster: the load finished before the owner died");
                verify(b, &long_prompt(), &dest);
            }
            _ => {
                eprintln!(
                    "cluster: load failed mid-flight: {}: {}",
                    done.error_kind, done.error
                );
                assert!(
                    !done.error.is_empty() && !done.error_kind.is_empty(),
                    "{done:?}"
                );
                assert_eq!(done.failed_blocks, dest, "{done:?}");
                b.kv.untouched_outside(&dest).unwrap();
                b.kv.reset().unwrap();
            }
        }
        settled(b).await;

        // With A gone, B answers with what is left: its own prefix, then loads it.
        let (done, dest) = query_and_load(b, &long_prompt(), false, 4).await;
        assert_eq!(done.status(), LoadStatus::LoadOk, "{done:?}");
        verify(b, &long_prompt()[..4], &dest);
        settled(b).await;

        // A restarts from the same file with an empty pool; its engine fills it again, in
        // another order, so a block's new slot is not its old one (a requester reading
        // through what it had mapped of the dead A would find other blocks there).
        nodes[1].restart();
        engines[1] = attach(&nodes[1]).await;
        engines[1]
            .put_pattern(LONG.rev().chain((4..8).rev()))
            .await
            .unwrap();
        let b = &engines[0];
        // B reaches the new A (its peer channel reconnects on its own).
        let mut hit = 0;
        for _ in 0..100 {
            let q = b
                .client
                .query(&b.instance, &hashes(&long_prompt()), false)
                .await
                .unwrap();
            hit = q.hit_blocks();
            b.client.release(q.lease.unwrap()).await.unwrap();
            if hit == 68 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(hit, 68, "B never saw the restarted owner");
        for direct in [true, false] {
            let (done, dest) = query_and_load(b, &long_prompt(), direct, 68).await;
            assert_eq!(done.status(), LoadStatus::LoadOk, "{done:?}");
            assert_eq!(done.path, if direct { "direct" } else { "staged" });
            verify(b, &long_prompt(), &dest);
            settled(b).await;
            let (done, dest) = query_and_load(b, &worked_example(), direct, 12).await;
            assert_eq!(done.status(), LoadStatus::LoadOk, "{done:?}");
            verify(b, &worked_example(), &dest);
            settled(b).await;
        }
        let st = b.client.stats().await.unwrap();
        assert!(st.loads_failed <= 1, "{st:?}");
        drop(engines);
    });
    if provider == "tcp" {
        // The demo and the benchmark, pointed at the running nodes by address.
        demo_against(&nodes);
        let addrs: Vec<&str> = nodes.iter().map(|n| n.engine.as_str()).collect();
        let bench = kvferry_json(&[
            "bench",
            "remote",
            "--json",
            "--nodes",
            &addrs[..2].join(","),
            "--layers",
            "4",
            "--segment-kib",
            "16",
            "--blocks",
            "8",
            "--iters",
            "2",
        ]);
        assert_eq!(bench["verified"], true, "{bench}");
        assert!(bench["direct_vs_staged"].as_f64().unwrap() > 0.0, "{bench}");
    }
    for n in &mut nodes {
        n.stop();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Three `kvferry node` processes reading each other's pools over the verbs provider on the
/// software verbs device (each node a `[[nic]] soft_mlx5_N`; the software fabric carries the
/// reads between the processes through shared memory): the worked example through B,
/// direct and staged, byte for byte with canaries; then the demo against the three nodes.
#[test]
fn three_node_processes_over_soft_verbs() {
    // Small registration chunks: the owners' pools are several MRs, reads cross none.
    let (dir, mut nodes) = start_three("verbs", "verbs", |i| {
        format!(
            "[[nic]]\nname = \"soft_mlx5_{}\"\nprovider = \"verbs\"\n\
             [verbs]\nregistration-chunk = 16777216\n",
            70 + i
        )
    });
    let rt = runtime();
    rt.block_on(async {
        let mut engines = Vec::new();
        for n in &nodes {
            engines.push(attach(n).await);
        }
        engines[0].put_pattern(0..4).await.unwrap();
        engines[1].put_pattern(4..8).await.unwrap();
        engines[2].put_pattern(8..12).await.unwrap();
        worked_example_direct_and_staged(&engines[0], || {}).await;
        drop(engines);
    });
    demo_against(&nodes);
    for n in &mut nodes {
        n.stop();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two hosts: owner A in a network namespace of its own, joined to requester B (in this
/// namespace) by a veth pair; B reads A's blocks over tcp through the veth, never loopback.
/// Removed (namespace and link) when dropped, whatever the test did.
struct TwoHosts {
    ns: String,
    veth: String,
    b_ip: String,
    a_ip: String,
}

impl TwoHosts {
    /// Sets them up, or says why this machine cannot.
    fn new() -> Result<Self, String> {
        let id = std::process::id();
        let net = format!("10.77.{}", id % 250);
        let t = Self {
            ns: format!("kvf-{id}-a"),
            veth: format!("kvf{}b", id % 10_000_000),
            b_ip: format!("{net}.1"),
            a_ip: format!("{net}.2"),
        };
        let peer = format!("kvf{}a", id % 10_000_000);
        t.ip(&["netns", "add", &t.ns])?;
        t.ip(&[
            "link", "add", &t.veth, "type", "veth", "peer", "name", &peer,
        ])?;
        t.ip(&["link", "set", &peer, "netns", &t.ns])?;
        t.ip(&["addr", "add", &format!("{}/24", t.b_ip), "dev", &t.veth])?;
        t.ip(&["link", "set", &t.veth, "up"])?;
        let addr = format!("{}/24", t.a_ip);
        for args in [
            vec!["addr", "add", addr.as_str(), "dev", peer.as_str()],
            vec!["link", "set", peer.as_str(), "up"],
            vec!["link", "set", "lo", "up"],
        ] {
            let mut full = vec!["netns", "exec", t.ns.as_str(), "ip"];
            full.extend(args);
            t.ip(&full)?;
        }
        Ok(t)
    }

    fn ip(&self, args: &[&str]) -> Result<(), String> {
        let out = Command::new("ip")
            .args(args)
            .output()
            .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "ip {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }

    /// Takes B's end of the link down (`up = false`) or up again.
    fn link(&self, up: bool) {
        self.ip(&["link", "set", &self.veth, if up { "up" } else { "down" }])
            .unwrap();
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        let _ = self.ip(&["link", "del", &self.veth]);
        let _ = self.ip(&["netns", "del", &self.ns]);
    }
}

/// Issue 15's two hosts: B reads a remote suffix from A across a veth pair over tcp; with
/// the link cut after the lease and before its load, the load fails typed, with exactly its
/// destinations failed and nothing written around them, B's gauges go back to zero; with the
/// link restored, the next load of the same prompt works, byte for byte.
#[test]
fn two_hosts_in_network_namespaces_and_a_cut_link() {
    let hosts = match TwoHosts::new() {
        Ok(h) => h,
        Err(why) => {
            eprintln!("SKIPPED two_hosts_in_network_namespaces_and_a_cut_link: {why}");
            return;
        }
    };
    let dir = std::env::temp_dir().join(format!("kvferry-netns-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (b_port, a_port) = (free_port(), free_port());
    let addrs = [
        ("b", hosts.b_ip.as_str(), b_port),
        ("a", hosts.a_ip.as_str(), a_port),
    ];
    let mut b = NodeProc::start("b", &write_config_at(&dir, "b", &addrs, "tcp"));
    let mut a = NodeProc::start_in(
        "a",
        &write_config_at(&dir, "a", &addrs, "tcp"),
        Some(&hosts.ns),
    );
    assert!(a.engine.starts_with(&hosts.a_ip), "{}", a.engine);
    let rt = runtime();
    rt.block_on(async {
        // This test reaches A's engine service through the veth too.
        let (eb, ea) = (attach(&b).await, attach(&a).await);
        eb.put_pattern(0..4).await.unwrap();
        ea.put_pattern(LONG).await.unwrap();
        let prompt = long_prompt();
        // Direct, so no staged copy of A's blocks lands in B's pool: they stay remote.
        let (done, dest) = query_and_load(&eb, &prompt, true, 68).await;
        assert_eq!(done.status(), LoadStatus::LoadOk, "{done:?}");
        assert_eq!(done.path, "direct");
        verify(&eb, &prompt, &dest);
        settled(&eb).await;

        // The lease is granted (A pinned its 64 blocks), then the link goes down.
        let q = eb
            .client
            .query(&eb.instance, &hashes(&prompt), true)
            .await
            .unwrap();
        assert_eq!((q.local_blocks, q.remote_blocks), (4, 64), "{q:?}");
        hosts.link(false);
        let t = Instant::now();
        let done = eb
            .load(q.lease.unwrap(), &dest, Duration::from_secs(60))
            .await
            .unwrap();
        eprintln!(
            "netns: load over a cut link: {:?} after {:.1} s: {}: {}",
            done.status(),
            t.elapsed().as_secs_f64(),
            done.error_kind,
            done.error
        );
        assert_eq!(done.status(), LoadStatus::LoadFailed, "{done:?}");
        assert_eq!(done.error_kind, "remote", "{done:?}");
        assert_eq!(done.failed_blocks, dest, "{done:?}");
        eb.kv.untouched_outside(&dest).unwrap();
        eb.kv.reset().unwrap();
        settled(&eb).await;

        // Restored: the same prompt hits again and loads, byte for byte (B rebuilds its
        // link to A on its own; a query in between may still find the old one dead).
        hosts.link(true);
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            let q = eb
                .client
                .query(&eb.instance, &hashes(&prompt), true)
                .await
                .unwrap();
            if q.hit_blocks() == 68 {
                let done = eb
                    .load(q.lease.unwrap(), &dest, Duration::from_secs(60))
                    .await
                    .unwrap();
                if done.status() == LoadStatus::LoadOk {
                    verify(&eb, &prompt, &dest);
                    break;
                }
                eb.kv.untouched_outside(&dest).unwrap();
                eb.kv.reset().unwrap();
            } else if let Some(l) = q.lease {
                eb.client.release(l).await.unwrap();
            }
            assert!(
                Instant::now() < end,
                "no load worked within 30 s of the link's return"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        settled(&eb).await;
        // A's pins for the failed lease are gone too.
        settled(&ea).await;
        drop((eb, ea));
    });
    b.stop();
    a.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs `kvferry ARGS` and parses its stdout as JSON.
fn kvferry_json(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kvferry {args:?}: {:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Runs tests/python/engine_client.py (a user of the `kvferry` Python package) against
/// `node`: query `query` hashes, expect `local` and `remote` blocks.
fn python_client(node: &NodeProc, query: u32, local: u32, remote: u32) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = python_with_kvferry(&root);
    let s = shape();
    let out = Command::new(&python)
        .arg(root.join("tests/python/engine_client.py"))
        .args(["--address", &node.engine])
        .args(["--layers", &s.layers().to_string()])
        .args(["--segment-bytes", &s.segment_bytes().to_string()])
        .args(["--query", &query.to_string()])
        .args(["--expect-local", &local.to_string()])
        .args(["--expect-remote", &remote.to_string()])
        .arg("--direct")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("PY-OK"),
        "python client failed ({:?}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("cluster: {}", stdout.trim());
}

/// A Python with the `kvferry` package: `$KVFERRY_PYTHON` where it has it, else the
/// virtualenv that scripts/python-env creates (outside the checkout) and installs ./python
/// into (once per test process).
fn python_with_kvferry(root: &Path) -> PathBuf {
    static PYTHON: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PYTHON
        .get_or_init(|| {
            let has_kvferry = |p: &Path| {
                Command::new(p)
                    .args(["-c", "import kvferry, numpy"])
                    .status()
                    .is_ok_and(|s| s.success())
            };
            if let Some(p) = std::env::var_os("KVFERRY_PYTHON") {
                let p = PathBuf::from(p);
                if has_kvferry(&p) {
                    return p;
                }
                eprintln!("cluster: {} has no kvferry package", p.display());
            }
            eprintln!("cluster: running scripts/python-env");
            let out = Command::new(root.join("scripts/python-env"))
                .stderr(Stdio::inherit())
                .output()
                .unwrap();
            let python = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
            assert!(
                out.status.success() && has_kvferry(&python),
                "no Python with the kvferry package: scripts/python-env failed ({:?}); it \
                 needs python3 with venv and PyPI, or set KVFERRY_PYTHON",
                out.status
            );
            python
        })
        .clone()
}

/// A CA for the TLS cluster test: signs node certificates naming their node id.
struct Ca {
    issuer: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
    pem: PathBuf,
}

impl Ca {
    fn new(dir: &Path, name: &str) -> Self {
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name.push(rcgen::DnType::CommonName, name);
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        p.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
        ];
        let issuer =
            rcgen::CertifiedIssuer::self_signed(p, rcgen::KeyPair::generate().unwrap()).unwrap();
        let pem = dir.join(format!("{name}.pem"));
        std::fs::write(&pem, issuer.pem()).unwrap();
        Self { issuer, pem }
    }

    /// (Re)writes `<dir>/<node>.pem` and `.key`: a fresh key and certificate for `node`.
    fn issue(&self, dir: &Path, node: &str) {
        let mut p = rcgen::CertificateParams::new(vec![node.to_owned()]).unwrap();
        p.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &self.issuer).unwrap();
        // Written beside, then renamed over: a reload never reads half a file.
        for (ext, text) in [("key", key.serialize_pem()), ("pem", cert.pem())] {
            let tmp = dir.join(format!("{node}.{ext}.new"));
            std::fs::write(&tmp, text).unwrap();
            std::fs::rename(&tmp, dir.join(format!("{node}.{ext}"))).unwrap();
        }
    }
}

fn sighup(node: &NodeProc) {
    let pid = node.child.as_ref().unwrap().id() as i32;
    // SAFETY: signalling our own child process by its pid.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGHUP) }, 0);
}

/// Issue 29: the Peer calls between nodes over mutual TLS. B and A hold certificates of the
/// cluster CA, C one of another CA (it trusts the cluster's). B reads A's blocks over mTLS
/// while C's are out of reach (B refuses C's certificate), and A refuses C's calls. Then
/// A's and B's certificates are rotated and reloaded on SIGHUP: B's link to A, made before,
/// keeps loading, and A's first link to B, made after, handshakes with the new ones.
#[test]
fn three_nodes_with_mutual_tls_a_stranger_refused_and_a_rotation() {
    three_nodes_with_mutual_tls("tls", "[\"peer\"]");
}

/// The same with the tcp data plane over mutual TLS too: B's reads from A, before and after
/// the rotation, and A's reads from B made after it, each byte-exact.
#[test]
fn three_nodes_with_mutual_tls_on_the_data_plane_too() {
    three_nodes_with_mutual_tls("tls-data", "[\"peer\", \"data\"]");
}

/// `what` names the test's directories; `listeners` is `[tls] listeners`.
fn three_nodes_with_mutual_tls(what: &str, listeners: &str) {
    let dir = std::env::temp_dir().join(format!(
        "kvferry-cluster-{what}-certs-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let cluster = Ca::new(&dir, "cluster-ca");
    let other = Ca::new(&dir, "other-ca");
    cluster.issue(&dir, "b");
    cluster.issue(&dir, "a");
    other.issue(&dir, "c");
    let names = ["b", "a", "c"];
    let (node_dir, mut nodes) = start_three(what, "tcp", |i| {
        format!(
            "[tls]\ncert = \"{d}/{n}.pem\"\nkey = \"{d}/{n}.key\"\nca = \"{ca}\"\n\
             listeners = {listeners}\n",
            d = dir.display(),
            n = names[i],
            ca = cluster.pem.display()
        )
    });
    let rt = runtime();
    rt.block_on(async {
        let mut engines = Vec::new();
        for n in &nodes {
            engines.push(attach(n).await);
        }
        engines[0].put_pattern(0..4).await.unwrap();
        engines[1].put_pattern(4..8).await.unwrap();
        engines[2].put_pattern(8..12).await.unwrap();
        let (b, a, c) = (&engines[0], &engines[1], &engines[2]);

        // B: its own 4 and A's 4; C's certificate is refused, so its 4 are not reachable.
        let ids: Vec<u64> = (0..12).collect();
        let (done, dest) = query_and_load(b, &ids, false, 8).await;
        assert_eq!(done.status(), LoadStatus::LoadOk, "{done:?}");
        assert_eq!(verify(b, &ids[..8], &dest), 8 * shape().rank_bytes());
        settled(b).await;
        // C cannot reach A: A refuses its certificate.
        let q = c
            .client
            .query(&c.instance, &hashes(&[4, 5, 6, 7]), false)
            .await
            .unwrap();
        assert_eq!(q.hit_blocks(), 0, "{q:?}");

        // Rotate A's and B's certificates and keys; SIGHUP rereads them.
        cluster.issue(&dir, "a");
        cluster.issue(&dir, "b");
        sighup(&nodes[0]);
        sighup(&nodes[1]);
        tokio::time::sleep(Duration::from_millis(500)).await;
        // B's link to A, made before the rotation, goes on loading (A's staged copies at B
        // are dropped first, so the 4 come from A again).
        b.client.stats().await.unwrap();
        let (done, dest) = query_and_load(b, &ids[..8], true, 8).await;
        assert_eq!(done.status(), LoadStatus::LoadOk, "{done:?}");
        assert_eq!(verify(b, &ids[..8], &dest), 8 * shape().rank_bytes());
        settled(b).await;
        // A's first link to B handshakes now, both sides presenting rotated certificates.
        let (done, dest) = query_and_load(a, &[0, 1, 2, 3, 4, 5, 6, 7], false, 8).await;
        assert_eq!(done.status(), LoadStatus::LoadOk, "{done:?}");
        assert_eq!(verify(a, &ids[..8], &dest), 8 * shape().rank_bytes());
        settled(a).await;
    });
    // Both survived SIGHUP (a node without the handler would have died of it) and stop
    // cleanly.
    for n in &mut nodes {
        n.stop();
    }
    let _ = std::fs::remove_dir_all(&node_dir);
    let _ = std::fs::remove_dir_all(&dir);
}
