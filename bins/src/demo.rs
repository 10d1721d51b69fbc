//! `kvferry demo`: three in-process nodes. B holds blocks 0–3, A holds 4–7, C holds 8–11
//! (4 layers, TP 1, split K/V). B queries 0–11 and loads them into device KV at
//! non-consecutive blocks, once direct (remote blocks read straight into device KV) and once
//! staged (through B's host pool), verifying every byte and the canaries after each.
//! `--nodes B,A,C` runs the same against three running `kvferry node`s by their engine
//! addresses: this process is then the engine, its KV a memfd it passes to B.

use std::sync::Arc;

use anyhow::{bail, Context};
use kvferry_actors::config::ByteSize;
use kvferry_actors::peer::{LocalCluster, Provider};
use kvferry_actors::{
    BlockHash, Clock, InstanceId, LoadRequest, Node, NodeConfig, QueryRequest, TransferReport,
};
use kvferry_gpu::{Device, HostDevice, KvShape};
use kvferry_harness::{put_pattern, RegisterKv};
use kvferry_testkit::{DeviceKv, KvKind};
use serde_json::json;

#[derive(clap::Args)]
pub struct DemoArgs {
    /// Print one JSON object instead of the readable report.
    #[arg(long)]
    json: bool,
    /// Device of the querying node: host, cuda or auto.
    #[arg(long, default_value = "auto")]
    device: String,
    /// How nodes read each other's pools: tcp, shm or loopback.
    #[arg(long, default_value = "tcp")]
    provider: String,
    /// Engine addresses of three running nodes B,A,C (B must list A and C as peers): the
    /// demo then runs against them instead of in-process nodes.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    nodes: Vec<String>,
    /// The nodes' engine token, where they require one.
    #[arg(long, default_value = "")]
    token: String,
}

/// Non-consecutive destinations, so every block lands in a different place than its index.
pub(crate) const DEST: [u32; 12] = [1, 3, 4, 7, 8, 9, 13, 17, 20, 21, 26, 30];
const ENGINE: &str = "demo-engine";

pub(crate) struct Run {
    pub(crate) direct: bool,
    pub(crate) local: usize,
    pub(crate) remote: usize,
    pub(crate) report: Report,
    pub(crate) verified: Result<u64, String>,
}

/// What one load did, from an in-process transfer report or an engine completion.
pub(crate) struct Report {
    pub(crate) path: String,
    pub(crate) bytes: u64,
    pub(crate) seconds: f64,
    pub(crate) stages: Vec<(String, f64)>,
}

impl From<TransferReport> for Report {
    fn from(r: TransferReport) -> Self {
        Self {
            path: r.path.as_str().into(),
            bytes: r.bytes,
            seconds: r.seconds,
            stages: r
                .stages
                .iter()
                .map(|s| (s.name.as_str().into(), s.seconds))
                .collect(),
        }
    }
}

fn config(name: &str) -> NodeConfig {
    let mut cfg = NodeConfig {
        node_id: name.into(),
        ..Default::default()
    };
    cfg.pool.size = ByteSize(8 << 20);
    cfg.pool.slot_bytes = ByteSize(256 << 10);
    cfg
}

pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    if !args.nodes.is_empty() {
        return crate::demo_cluster::run(&args.nodes, &args.token, args.json);
    }
    let provider = Provider::parse(&args.provider)?;
    let cluster = LocalCluster::new(provider);
    let device = Arc::clone(&crate::bench::open(&args.device)?[0]);
    let start = |name: &str, dev: Arc<dyn Device>| {
        Node::start_in(
            config(name),
            vec![dev],
            Clock::system(),
            Some(Arc::clone(&cluster)),
        )
        .with_context(|| format!("starting node {name}"))
    };
    let b = start("b", Arc::clone(&device))?;
    let owners = [("a", 4..8u64), ("c", 8..12u64)];
    let owner_nodes: Vec<Node> = owners
        .iter()
        .map(|(n, _)| start(n, HostDevice::new(0)))
        .collect::<Result<_, _>>()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let result = rt.block_on(demo(&b, &owner_nodes, &owners, device));
    for n in owner_nodes.iter().chain([&b]) {
        n.shutdown();
    }
    print(
        &result?,
        &node_device_name(&b),
        provider.as_str(),
        args.json,
    )
}

/// Prints the runs (readable or JSON) and fails unless every byte verified.
pub(crate) fn print(
    runs: &[Run],
    device: &str,
    provider: &str,
    as_json: bool,
) -> anyhow::Result<()> {
    let verified = runs.iter().all(|r| r.verified.is_ok());
    if as_json {
        let out = json!({
            "verified": verified,
            "device": device,
            "provider": provider,
            "nodes": { "b": "0-3", "a": "4-7", "c": "8-11" },
            "local_blocks": runs[0].local,
            "remote_blocks": runs[0].remote,
            "runs": runs.iter().map(|r| json!({
                "path": r.report.path,
                "direct": r.direct,
                "verified": r.verified.is_ok(),
                "error": r.verified.as_ref().err(),
                "bytes": r.report.bytes,
                "seconds": r.report.seconds,
                "stages": r.report.stages.iter()
                    .map(|(name, s)| (name.clone(), json!(s)))
                    .collect::<serde_json::Map<_, _>>(),
            })).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("kvferry demo: three nodes over {provider}; B queries on {device}");
        println!("  B holds blocks 0-3, A holds 4-7, C holds 8-11 (4 layers, TP 1, split K/V, 32 KiB segments)");
        for r in runs {
            println!(
                "  {:<6} {} local + {} remote blocks, {} bytes in {:.3} ms ({:.2} GB/s) to device blocks {:?}",
                r.report.path,
                r.local,
                r.remote,
                r.report.bytes,
                r.report.seconds * 1e3,
                r.report.bytes as f64 / r.report.seconds / 1e9,
                DEST
            );
            for (name, s) in &r.report.stages {
                println!("           {:<8} {:>9.3} ms", name, s * 1e3);
            }
            match &r.verified {
                Ok(n) => println!("           verify ok: {n} bytes match, every canary intact"),
                Err(e) => println!("           verify FAILED: {e}"),
            }
        }
    }
    if !verified {
        bail!("verification failed");
    }
    Ok(())
}

fn node_device_name(node: &Node) -> String {
    node.device(0).map(|d| d.name()).unwrap_or_default()
}

async fn demo(
    b: &Node,
    owners: &[Node],
    ranges: &[(&str, std::ops::Range<u64>)],
    device: Arc<dyn Device>,
) -> anyhow::Result<Vec<Run>> {
    let shape = KvShape::new(4, 1, 2, 32 << 10)?;
    let kv = DeviceKv::alloc(device, shape, KvKind::Split, 32, 32 << 10, 256)?;
    let instance = kv.register(b, ENGINE, "demo-model", 0).await?;
    put_pattern(b, &instance, &shape, 0, 0..4).await?;
    let mut owner_kv = Vec::new();
    for (node, (_, range)) in owners.iter().zip(ranges) {
        let okv = DeviceKv::alloc(
            node.device(0).context("owner device")?,
            shape,
            KvKind::Split,
            4,
            32 << 10,
            0,
        )?;
        let inst = okv.register(node, ENGINE, "demo-model", 0).await?;
        put_pattern(node, &inst, &shape, 0, range.clone()).await?;
        owner_kv.push(okv);
    }
    let instance = InstanceId::new(ENGINE)?;
    let hashes: Vec<BlockHash> = (0..12).map(BlockHash::from_u64).collect();
    let expected: Vec<(u32, u64)> = DEST
        .iter()
        .enumerate()
        .map(|(i, d)| (*d, i as u64))
        .collect();
    let mut runs = Vec::new();
    for direct in [true, false] {
        kv.reset()?;
        let q = b
            .query(QueryRequest {
                instance: instance.clone(),
                hashes: hashes.clone(),
                direct_gpu: direct,
                tenant: None,
            })
            .await?;
        if direct && !q.direct.is_granted() {
            bail!("direct loads were not granted: {:?}", q.direct);
        }
        let lease = q.lease.context("the demo's blocks did not hit")?;
        let report = b
            .load(LoadRequest {
                lease,
                instance: instance.clone(),
                rank: 0,
                dest_blocks: DEST.to_vec(),
                per_layer: false,
            })
            .await?;
        let verified = kv.verify(&expected, 0);
        runs.push(Run {
            direct,
            local: q.local_blocks,
            remote: q.remote_blocks,
            report: report.into(),
            verified,
        });
        // Start the next run cold: the staged copies B just made would otherwise hit locally.
        b.drop_reclaimable().await?;
    }
    b.unregister_instance(instance).await?;
    Ok(runs)
}
