//! `kvferry bench remote --nodes REQUESTER,OWNER`: the remote-suffix benchmark against two
//! running nodes through their engine API. This process is the engine (its KV a memfd it
//! passes to the requester); the owner gets the blocks through its engine API too. Loads
//! are timed from the Load call to the completion, direct and staged alternately; staged
//! runs read fresh blocks each time (their copies would hit locally afterwards).

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kvferry_actors::BlockHash;
use kvferry_gpu::KvShape;
use kvferry_proto::v1::LoadStatus;
use kvferry_testkit::Attached;
use serde_json::json;

use crate::bench::median;

pub fn run(
    nodes: &[String],
    token: &str,
    shape: KvShape,
    blocks: u32,
    iters: usize,
    as_json: bool,
) -> anyhow::Result<()> {
    let [requester, owner] = nodes else {
        bail!("--nodes takes two engine addresses: the requester, then the owner");
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let req = Attached::connect(requester, token, shape, blocks * 3, "bench-engine", "bench")
            .await
            .with_context(|| format!("attaching to the requester at {requester}"))?;
        let own = Attached::connect(owner, token, shape, 1, "bench-engine", "bench")
            .await
            .with_context(|| format!("attaching to the owner at {owner}"))?;
        let n = u64::from(blocks);
        // Range 0 serves every direct run; range k the k-th staged run.
        let base = crate::demo_cluster::fresh_ids();
        let ranges = iters as u64 + 2;
        eprintln!(
            "bench: putting {} blocks of {} KiB on {owner}",
            n * ranges,
            shape.rank_bytes() >> 10
        );
        own.put_pattern(base..base + n * ranges).await?;
        let dest: Vec<u32> = (0..blocks).map(|i| i * 3 + 1).collect();
        let bytes = n * shape.rank_bytes();
        let (mut d, mut s) = (Vec::new(), Vec::new());
        let mut verified = true;
        let mut range = 1;
        for i in 0..iters + 1 {
            for direct in [true, false] {
                let first = if direct { base } else { base + n * range };
                if !direct {
                    range += 1;
                }
                let hashes: Vec<BlockHash> = (first..first + n).map(BlockHash::from_u64).collect();
                let q = req.client.query(&req.instance, &hashes, direct).await?;
                if q.remote_blocks != blocks {
                    bail!(
                        "the requester found {} remote blocks of {blocks} (is {owner} its peer?)",
                        q.remote_blocks
                    );
                }
                if direct && !q.direct.is_granted() {
                    bail!("direct loads were not granted: {:?}", q.direct);
                }
                let lease = q.lease.context("no lease")?;
                let t = Instant::now();
                let done = req.load(lease, &dest, Duration::from_secs(120)).await?;
                let dt = t.elapsed().as_secs_f64();
                if done.status() != LoadStatus::LoadOk {
                    bail!("the load failed: {}: {}", done.error_kind, done.error);
                }
                if i == iters {
                    let expected: Vec<(u32, u64)> =
                        dest.iter().zip(first..).map(|(d, b)| (*d, b)).collect();
                    if let Err(e) = req.kv.verify(&expected, 0) {
                        eprintln!("bench: direct={direct}: {e}");
                        verified = false;
                    }
                    req.kv.reset()?;
                }
                if i > 0 {
                    if direct { &mut d } else { &mut s }.push(dt);
                }
            }
            eprintln!(
                "bench: {blocks} blocks ({} MiB), round {i}/{iters}{}",
                bytes >> 20,
                if i == 0 { " (warm-up)" } else { "" }
            );
        }
        let caps = req.client.capabilities().await?;
        let (dm, sm) = (median(&mut d), median(&mut s));
        let gbps = |t: f64| bytes as f64 / t / 1e9;
        if as_json {
            let out = json!({
                "requester": requester,
                "owner": owner,
                "device": caps.device_names.first(),
                "providers": caps.providers,
                "blocks": blocks,
                "bytes": bytes,
                "iters": iters,
                "direct": { "median_s": dm, "gbps": gbps(dm) },
                "staged": { "median_s": sm, "gbps": gbps(sm) },
                "direct_vs_staged": sm / dm,
                "verified": verified,
            });
            println!("{}", serde_json::to_string_pretty(&out)?);
        } else {
            println!(
                "{blocks} blocks {} MiB from {owner} into {requester}: direct {:.2} GB/s, staged \
                 {:.2} GB/s, direct/staged {:.2}; verified: {verified}",
                bytes >> 20,
                gbps(dm),
                gbps(sm),
                sm / dm
            );
        }
        if !verified {
            bail!("verification failed");
        }
        Ok(())
    })
}
