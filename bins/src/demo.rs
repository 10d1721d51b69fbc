//! `kvferry demo`: 12 blocks (4 layers, TP 1, split K/V) put into an embedded node, queried,
//! loaded into device KV at non-consecutive blocks and verified byte for byte.

use std::sync::Arc;

use anyhow::{bail, Context};
use kvferry_actors::fixture::{rank_part, DeviceKv, KvKind};
use kvferry_actors::{
    BlockHash, Clock, InstanceId, LoadRequest, Node, NodeConfig, PutBlocks, QueryRequest,
    RegisterInstance, TransferReport,
};
use kvferry_gpu::{Device, KvShape};
use serde_json::json;

#[derive(clap::Args)]
pub struct DemoArgs {
    /// Print one JSON object instead of the readable report.
    #[arg(long)]
    json: bool,
    /// host, cuda or auto.
    #[arg(long, default_value = "auto")]
    device: String,
}

const BLOCKS: u64 = 12;
/// Non-consecutive destinations, so every block lands in a different place than its index.
const DEST: [u32; 12] = [1, 3, 4, 7, 8, 9, 13, 17, 20, 21, 26, 30];

pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    let mut cfg = NodeConfig {
        node_id: "demo".into(),
        ..Default::default()
    };
    cfg.pool.size = kvferry_actors::config::ByteSize(8 << 20);
    cfg.pool.slot_bytes = kvferry_actors::config::ByteSize(256 << 10);
    cfg.device.kind = args.device.clone();
    let devices = crate::bench::open(&args.device)?;
    let device = Arc::clone(&devices[0]);
    let node = Node::start_with(cfg, devices, Clock::system()).context("starting the node")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let result = rt.block_on(demo(&node, device));
    node.shutdown();
    let (report, verified, lease) = result?;
    let stages: serde_json::Map<String, serde_json::Value> = report
        .stages
        .iter()
        .map(|s| (s.name.to_string(), json!(s.seconds)))
        .collect();
    if args.json {
        let out = json!({
            "verified": verified.is_ok(),
            "error": verified.as_ref().err(),
            "device": node_device_name(&node),
            "local_blocks": report.blocks,
            "remote_blocks": 0,
            "lease": lease,
            "runs": [{
                "path": report.path,
                "bytes": report.bytes,
                "copies": report.copies,
                "seconds": report.seconds,
                "stages": stages,
            }],
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("kvferry demo on {}", node_device_name(&node));
        println!("  put      {BLOCKS} blocks (4 layers, TP 1, split K/V, 32 KiB segments)");
        println!(
            "  query    {BLOCKS} hashes -> lease {lease}: {} local, 0 remote",
            report.blocks
        );
        println!(
            "  load     {} bytes in {} copies to device blocks {:?}",
            report.bytes, report.copies, DEST
        );
        for s in &report.stages {
            println!("           {:<6} {:>9.3} ms", s.name, s.seconds * 1e3);
        }
        println!(
            "           total  {:>9.3} ms ({:.2} GB/s)",
            report.seconds * 1e3,
            report.bytes as f64 / report.seconds / 1e9
        );
        match &verified {
            Ok(n) => println!("  verify   ok: {n} bytes match, every canary intact"),
            Err(e) => println!("  verify   FAILED: {e}"),
        }
    }
    if let Err(e) = verified {
        bail!("verification failed: {e}");
    }
    Ok(())
}

fn node_device_name(node: &Node) -> String {
    node.device(0).map(|d| d.name()).unwrap_or_default()
}

async fn demo(
    node: &Node,
    device: Arc<dyn Device>,
) -> anyhow::Result<(TransferReport, Result<u64, String>, String)> {
    let shape = KvShape::new(4, 1, 2, 32 << 10)?;
    let kv = DeviceKv::alloc(device, shape, KvKind::Split, 32, 32 << 10, 256)?;
    let instance = InstanceId::new("demo-engine")?;
    node.register_instance(RegisterInstance {
        instance: instance.clone(),
        model: "demo-model".into(),
        dtype: "bf16".into(),
        shape,
        rank: 0,
        device: 0,
        layout: kv.spec(),
    })
    .await?;
    let hashes: Vec<BlockHash> = (0..BLOCKS).map(BlockHash::from_u64).collect();
    let blocks = hashes
        .iter()
        .enumerate()
        .map(|(i, h)| (*h, rank_part(&shape, i as u64, 0)))
        .collect();
    node.put_blocks(PutBlocks {
        instance: instance.clone(),
        rank: 0,
        blocks,
    })
    .await?;
    let q = node
        .query(QueryRequest {
            instance: instance.clone(),
            hashes,
            direct_gpu: false,
        })
        .await?;
    let lease = q.lease.context("the demo's blocks did not hit")?;
    let report = node
        .load(LoadRequest {
            lease,
            instance: instance.clone(),
            rank: 0,
            dest_blocks: DEST.to_vec(),
        })
        .await?;
    let expected: Vec<(u32, u64)> = DEST
        .iter()
        .enumerate()
        .map(|(i, d)| (*d, i as u64))
        .collect();
    let verified = kv.verify(&expected, 0);
    node.unregister_instance(instance).await?;
    Ok((report, verified, lease.to_hex()))
}
