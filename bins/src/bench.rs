//! `kvferry bench`: each figure next to a baseline measured in the same run; medians.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use kvferry_actors::config::ByteSize;
use kvferry_actors::{BlockHash, Clock, InstanceId, LoadRequest, Node, NodeConfig, QueryRequest};
use kvferry_gpu::{Device, DeviceKind, KvShape};
use kvferry_harness::{put_pattern, RegisterKv};
use kvferry_testkit::{DeviceKv, KvKind};
use serde_json::json;

#[derive(clap::Subcommand)]
pub enum BenchCmd {
    /// Query + lease latency, and local-prefix loads against a baseline copy.
    Local(LocalArgs),
    /// A remote suffix loaded direct and staged from an owner node, in the same run.
    Remote(crate::bench_remote::RemoteArgs),
    /// What an engine in another process sees: query, load (first layer and whole) and save
    /// over the Engine API, against a raw copy of the same bytes.
    Engine(crate::bench_engine::EngineArgs),
    /// Providers against plain copies of the same bytes: tcp vs socket, shm vs memcpy,
    /// and loopback 4 KiB reads per second.
    Transport(TransportArgs),
    /// Loads of blocks held only on SSD against a raw O_DIRECT read of the same bytes.
    Ssd(crate::bench_ssd::SsdArgs),
}

#[derive(clap::Args)]
pub struct TransportArgs {
    #[arg(long)]
    json: bool,
    /// Measured repetitions of each figure (after one warm-up).
    #[arg(long, default_value_t = 5)]
    repetitions: usize,
    /// MiB moved per repetition by the throughput figures.
    #[arg(long, default_value_t = 64)]
    mib: usize,
    /// Also the tcp provider over mutual TLS (certificates made in-process) against the same
    /// provider in clear.
    #[arg(long)]
    tls: bool,
}

#[derive(clap::Args)]
pub struct LocalArgs {
    #[arg(long)]
    json: bool,
    /// host, cuda or auto.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Timed repetitions of each measurement (the median is reported).
    #[arg(long, default_value_t = 11)]
    iters: usize,
    /// Hit-set blocks for the load measurement (28 layers x split K/V x 64 KiB each).
    #[arg(long, default_value_t = 64)]
    blocks: u32,
    /// Prefix length for the query + lease measurement.
    #[arg(long, default_value_t = 1024)]
    query_blocks: u32,
    /// Load into consecutive destination blocks instead of every third block.
    #[arg(long)]
    contiguous: bool,
}

/// Opens device 0 of a kind (`auto`: the GPU where a driver and device are present).
pub fn open(kind: &str) -> anyhow::Result<Vec<Arc<dyn Device>>> {
    Ok(vec![
        kvferry_gpu::open_device(kind, 0).with_context(|| format!("opening a {kind} device"))?
    ])
}

pub fn run(cmd: BenchCmd) -> anyhow::Result<()> {
    match cmd {
        BenchCmd::Local(a) => local(a),
        BenchCmd::Remote(a) => crate::bench_remote::run(a),
        BenchCmd::Engine(a) => crate::bench_engine::run(a),
        BenchCmd::Transport(a) => transport(a),
        BenchCmd::Ssd(a) => crate::bench_ssd::run(a),
    }
}

fn transport(a: TransportArgs) -> anyhow::Result<()> {
    use kvferry_testkit::transport_bench as bench;
    let cfg = bench::BenchConfig {
        bytes: a.mib << 20,
        repetitions: a.repetitions.max(1),
        ..Default::default()
    };
    progress(
        a.json,
        &format!(
            "tcp provider vs plain socket, {} MiB x {}",
            a.mib, cfg.repetitions
        ),
    );
    let tcp = bench::tcp_vs_socket(&cfg)?;
    progress(
        a.json,
        &format!(
            "shm provider vs memcpy, {} MiB x {}",
            a.mib, cfg.repetitions
        ),
    );
    let shm = bench::shm_vs_memcpy(&cfg)?;
    progress(a.json, "loopback provider, 4 KiB reads");
    let lo = bench::loopback_rate(&cfg)?;
    let tls = if a.tls {
        progress(
            a.json,
            &format!(
                "tcp provider over TLS vs in clear, {} MiB x {}",
                a.mib, cfg.repetitions
            ),
        );
        Some(bench::tcp_tls_vs_plain(&cfg)?)
    } else {
        None
    };
    let tp = |r: &bench::ThroughputResult| {
        json!({
            "bytes": r.bytes,
            "repetitions": r.repetitions,
            "provider_gib_s": r.provider_gib_s,
            "baseline_gib_s": r.baseline_gib_s,
            "ratio": r.ratio,
        })
    };
    if a.json {
        let out = json!({
            "tcp_tls_vs_plain": tls.as_ref().map(|t| t.ratio),
            "tcp_tls": tls.as_ref().map(tp),
            "tcp_vs_socket": tcp.ratio,
            "shm_vs_memcpy": shm.ratio,
            "loopback_reads_per_sec": lo.reads_per_sec,
            "tcp": tp(&tcp),
            "shm": tp(&shm),
            "loopback": {
                "read_size": lo.read_size,
                "reads": lo.reads,
                "repetitions": lo.repetitions,
                "reads_per_sec": lo.reads_per_sec,
            },
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "tcp  {:.2} GiB/s vs socket {:.2} GiB/s: tcp_vs_socket {:.2} (target 0.7)",
            tcp.provider_gib_s, tcp.baseline_gib_s, tcp.ratio
        );
        println!(
            "shm  {:.2} GiB/s vs memcpy {:.2} GiB/s: shm_vs_memcpy {:.2} (target 0.8)",
            shm.provider_gib_s, shm.baseline_gib_s, shm.ratio
        );
        println!(
            "loopback {} B reads: {:.0} reads/s",
            lo.read_size, lo.reads_per_sec
        );
        if let Some(t) = &tls {
            println!(
                "tcp over TLS {:.2} GiB/s vs in clear {:.2} GiB/s: tcp_tls_vs_plain {:.2} \
                 (target 0.8)",
                t.provider_gib_s, t.baseline_gib_s, t.ratio
            );
        }
    }
    Ok(())
}

pub(crate) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

fn progress(json: bool, msg: &str) {
    // Progress goes to stderr so `--json` output stays one object on stdout.
    let _ = json;
    eprintln!("bench: {msg}");
}

fn node(slot: u64, slots: u64, devices: Vec<Arc<dyn Device>>) -> anyhow::Result<Node> {
    let mut cfg = NodeConfig {
        node_id: "bench".into(),
        ..Default::default()
    };
    cfg.pool.slot_bytes = ByteSize(slot);
    cfg.pool.size = ByteSize(slot * slots);
    Ok(Node::start_with(cfg, devices, Clock::system())?)
}

/// Registers `kv` under `name` (model "bench") and puts pattern blocks 0..n.
async fn register_and_put(
    node: &Node,
    name: &str,
    kv: &DeviceKv,
    n: u32,
) -> anyhow::Result<(InstanceId, Vec<BlockHash>)> {
    let instance = kv.register(node, name, "bench", 0).await?;
    put_pattern(node, &instance, &kv.shape, 0, 0..u64::from(n)).await?;
    Ok((
        instance,
        (0..u64::from(n)).map(BlockHash::from_u64).collect(),
    ))
}

fn local(a: LocalArgs) -> anyhow::Result<()> {
    let devices = open(&a.device)?;
    let device = Arc::clone(&devices[0]);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;

    // 1. Query + lease for a long prefix, in process.
    progress(
        a.json,
        &format!("query + lease, {}-block prefix", a.query_blocks),
    );
    let qshape = KvShape::new(2, 1, 2, 512)?;
    let qnode = node(
        qshape.block_bytes(),
        u64::from(a.query_blocks),
        devices.clone(),
    )?;
    let qkv = DeviceKv::alloc(Arc::clone(&device), qshape, KvKind::Split, 4, 512, 0)?;
    let mut query_us = rt.block_on(async {
        let (inst, hashes) = register_and_put(&qnode, "bench-query", &qkv, a.query_blocks).await?;
        let mut v = Vec::new();
        for i in 0..(a.iters * 20).max(50) {
            let t = Instant::now();
            let q = qnode
                .query(QueryRequest {
                    instance: inst.clone(),
                    hashes: hashes.clone(),
                    direct_gpu: false,
                    tenant: None,
                })
                .await?;
            let dt = t.elapsed().as_secs_f64();
            if q.local_blocks != a.query_blocks as usize {
                bail!("query hit {} of {} blocks", q.local_blocks, a.query_blocks);
            }
            qnode.release(q.lease.context("no lease")?).await?;
            if i >= 5 {
                v.push(dt * 1e6);
            }
        }
        let s = qnode.stats().await?;
        if s.leases_live != 0 || s.pinned_blocks != 0 {
            bail!("leak after the query benchmark: {s:?}");
        }
        Ok::<_, anyhow::Error>(v)
    })?;
    qnode.shutdown();
    let q_median = median(&mut query_us);

    // 2. Local load vs a plain copy of the same bytes.
    let shape = KvShape::new(28, 1, 2, 64 << 10)?;
    let bytes = u64::from(a.blocks) * shape.rank_bytes();
    progress(
        a.json,
        &format!(
            "local load, {} blocks x 28 layers x split K/V x 64 KiB = {} MiB",
            a.blocks,
            bytes >> 20
        ),
    );
    let lnode = node(shape.block_bytes(), u64::from(a.blocks), devices.clone())?;
    let spread = if a.contiguous { 1 } else { 3 };
    let kv = DeviceKv::alloc(
        Arc::clone(&device),
        shape,
        KvKind::Split,
        a.blocks * spread,
        64 << 10,
        0,
    )?;
    // Fragmented: every third block; contiguous: blocks 0..n in order.
    let dest: Vec<u32> = (0..a.blocks)
        .map(|i| i * spread + u32::from(spread > 1))
        .collect();
    let mut baseline = Baseline::new(&device, bytes)?;
    let (mut load_s, mut base_s, copies) = rt.block_on(async {
        let (inst, hashes) = register_and_put(&lnode, "bench-load", &kv, a.blocks).await?;
        let (mut l, mut b, mut copies) = (Vec::new(), Vec::new(), 0);
        for i in 0..a.iters + 2 {
            let q = lnode
                .query(QueryRequest {
                    instance: inst.clone(),
                    hashes: hashes.clone(),
                    direct_gpu: false,
                    tenant: None,
                })
                .await?;
            let lease = q.lease.context("no lease")?;
            let t = Instant::now();
            let r = lnode
                .load(LoadRequest {
                    lease,
                    instance: inst.clone(),
                    rank: 0,
                    dest_blocks: dest.clone(),
                    per_layer: false,
                })
                .await?;
            let dt = t.elapsed().as_secs_f64();
            copies = r.copies;
            let bt = baseline.run()?;
            if i >= 2 {
                l.push(dt);
                b.push(bt);
            }
            progress(
                a.json,
                &format!(
                    "  iter {i}: load {:.2} GB/s, baseline {:.2} GB/s",
                    bytes as f64 / dt / 1e9,
                    bytes as f64 / bt / 1e9
                ),
            );
        }
        let s = lnode.stats().await?;
        if s.leases_live != 0 || s.pinned_blocks != 0 || s.transfers_in_flight != 0 {
            bail!("leak after the load benchmark: {s:?}");
        }
        Ok::<_, anyhow::Error>((l, b, copies))
    })?;
    let expected: Vec<(u32, u64)> = dest
        .iter()
        .enumerate()
        .map(|(i, d)| (*d, i as u64))
        .collect();
    let verified = kv.verify(&expected, 0);
    lnode.shutdown();
    let (lm, bm) = (median(&mut load_s), median(&mut base_s));
    let ratio = bm / lm;
    if a.json {
        let out = json!({
            "device": device.name(),
            "query_lease": { "blocks": a.query_blocks, "median_us": q_median, "samples": query_us.len() },
            "local_load": {
                "blocks": a.blocks,
                "destinations": if a.contiguous { "contiguous" } else { "fragmented" },
                "layers": 28,
                "segment_bytes": 65536,
                "bytes": bytes,
                "copies": copies,
                "median_s": lm,
                "gbps": bytes as f64 / lm / 1e9,
                "baseline": baseline.name(),
                "baseline_median_s": bm,
                "baseline_gbps": bytes as f64 / bm / 1e9,
                "ratio_vs_baseline": ratio,
                "iters": load_s.len(),
                "verified": verified.is_ok(),
            },
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("device: {}", device.name());
        println!(
            "query + lease, {}-block prefix: median {:.1} us",
            a.query_blocks, q_median
        );
        println!(
            "local load, {} MiB in {copies} copies: median {:.3} ms ({:.2} GB/s)",
            bytes >> 20,
            lm * 1e3,
            bytes as f64 / lm / 1e9
        );
        println!(
            "{}: median {:.3} ms ({:.2} GB/s)",
            baseline.name(),
            bm * 1e3,
            bytes as f64 / bm / 1e9
        );
        println!("ratio load / baseline: {ratio:.3}");
        println!(
            "verified: {}",
            verified
                .as_ref()
                .map(|_| "ok".to_string())
                .unwrap_or_else(|e| e.clone())
        );
    }
    if let Err(e) = verified {
        bail!("verification failed: {e}");
    }
    Ok(())
}

/// The baseline copy of the same number of bytes: a plain memcpy on the host device, one
/// raw `cuMemcpyHtoDAsync` from pinned memory on a GPU.
pub(crate) enum Baseline {
    Memcpy {
        src: Vec<u8>,
        dst: Vec<u8>,
    },
    RawH2d {
        device: Arc<dyn Device>,
        // Field order matters: the registration is undone before the memory is freed.
        _pin: kvferry_gpu::HostRegistration,
        // Its own pages: a heap buffer can share a page with memory registered elsewhere in
        // the process, which the driver refuses to register twice.
        src: kvferry_transport::HostRegion,
        dst: kvferry_gpu::DeviceBuffer,
    },
}

impl Baseline {
    pub(crate) fn new(device: &Arc<dyn Device>, bytes: u64) -> anyhow::Result<Self> {
        let src: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
        match device.kind() {
            DeviceKind::Host => Ok(Baseline::Memcpy {
                src,
                dst: vec![1u8; bytes as usize],
            }),
            DeviceKind::Cuda => {
                let region = kvferry_transport::HostRegion::anonymous(usize::try_from(bytes)?)?;
                region.write_at(0, &src)?;
                let src = region;
                let pin = device.register_host(src.addr(), bytes, true)?;
                let dst = device.alloc(bytes)?;
                Ok(Baseline::RawH2d {
                    device: Arc::clone(device),
                    _pin: pin,
                    src,
                    dst,
                })
            }
        }
    }

    pub(crate) fn name(&self) -> &'static str {
        match self {
            Baseline::Memcpy { .. } => "memcpy (one contiguous copy)",
            Baseline::RawH2d { .. } => "raw cuMemcpyHtoDAsync from pinned memory",
        }
    }

    pub(crate) fn run(&mut self) -> anyhow::Result<f64> {
        match self {
            Baseline::Memcpy { src, dst } => {
                let t = Instant::now();
                dst.copy_from_slice(src);
                std::hint::black_box(&dst);
                Ok(t.elapsed().as_secs_f64())
            }
            Baseline::RawH2d {
                device, src, dst, ..
            } => {
                // SAFETY: `src` is a live, pinned mapping that outlives the call.
                let s = unsafe {
                    kvferry_testkit::bench_raw_h2d(
                        device.as_ref(),
                        src.addr(),
                        dst.ptr(),
                        src.len() as u64,
                        1,
                    )
                }?;
                Ok(s)
            }
        }
    }
}
