//! `kvferry demo --nodes B,A,C`: the demo against three running nodes, through their engine
//! API. This process plays the engine: its KV is a memfd it passes to each node's fd socket,
//! and each node's instance is tied to a session that ends with this process.

use std::time::Duration;

use anyhow::{bail, Context};
use kvferry_actors::BlockHash;
use kvferry_gpu::KvShape;
use kvferry_proto::v1::LoadStatus;
use kvferry_testkit::Attached;

use crate::demo::{print, Report, Run, DEST};

/// Block ids no earlier run against the same nodes used (their staged copies would hit).
pub(crate) fn fresh_ids() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos << 12
}

pub fn run(nodes: &[String], token: &str, json: bool) -> anyhow::Result<()> {
    let [b, a, c] = nodes else {
        bail!("--nodes takes three engine addresses: B (queries), then A and C (owners)");
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let (runs, device, providers) = rt.block_on(demo([b, a, c], token))?;
    print(&runs, &device, &providers, json)
}

async fn demo(addrs: [&String; 3], token: &str) -> anyhow::Result<(Vec<Run>, String, String)> {
    let shape = KvShape::new(4, 1, 2, 32 << 10)?;
    let mut nodes = Vec::new();
    for addr in addrs {
        nodes.push(
            Attached::connect(addr, token, shape, 32, "demo-engine", "demo-model")
                .await
                .with_context(|| format!("attaching to {addr}"))?,
        );
    }
    let base = fresh_ids();
    for (node, range) in nodes.iter().zip([0..4u64, 4..8, 8..12]) {
        node.put_pattern(base + range.start..base + range.end)
            .await?;
    }
    let b = &nodes[0];
    let caps = b.client.capabilities().await?;
    let hashes: Vec<BlockHash> = (base..base + 12).map(BlockHash::from_u64).collect();
    let expected: Vec<(u32, u64)> = DEST
        .iter()
        .enumerate()
        .map(|(i, d)| (*d, base + i as u64))
        .collect();
    let mut runs = Vec::new();
    for direct in [true, false] {
        b.kv.reset()?;
        let q = b.client.query(&b.instance, &hashes, direct).await?;
        if direct && !q.direct.is_granted() {
            bail!("direct loads were not granted: {:?}", q.direct);
        }
        let lease = q.lease.context("the demo's blocks did not hit")?;
        let done = b.load(lease, &DEST, Duration::from_secs(60)).await?;
        if done.status() != LoadStatus::LoadOk {
            bail!("the load failed: {}: {}", done.error_kind, done.error);
        }
        runs.push(Run {
            direct,
            local: q.local_blocks as usize,
            remote: q.remote_blocks as usize,
            report: Report {
                path: done.path.clone(),
                bytes: done.bytes,
                seconds: done.seconds,
                stages: done
                    .stages
                    .iter()
                    .map(|s| (s.name.clone(), s.seconds))
                    .collect(),
            },
            verified: b.kv.verify(&expected, 0),
        });
    }
    let device = caps.device_names.first().cloned().unwrap_or_default();
    Ok((runs, device, caps.providers.join(",")))
}
