//! `kvferry bench remote`: a remote suffix loaded direct and staged in the same run, from an
//! owner node to a requester node of one process, over a chosen provider.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use kvferry_actors::config::ByteSize;
use kvferry_actors::peer::{GrpcPeers, GrpcPeersConfig, LocalCluster, Provider, StaticDirectory};
use kvferry_actors::tls::TlsContext;
use kvferry_actors::{
    BlockHash, Clock, InstanceId, LeaseId, LoadRequest, Node, NodeConfig, QueryRequest,
    TransferReport,
};
use kvferry_gpu::{Device, HostDevice, KvShape};
use kvferry_harness::{put_pattern, RegisterKv};
use kvferry_testkit::{DeviceKv, KvKind};
use serde_json::json;

#[derive(clap::Args)]
pub struct RemoteArgs {
    #[arg(long)]
    json: bool,
    /// Device of the requesting node: host, cuda or auto.
    #[arg(long, default_value = "auto")]
    device: String,
    /// tcp, shm or loopback.
    #[arg(long, default_value = "shm")]
    provider: String,
    /// Remote hit-set blocks (28 layers x split K/V x 64 KiB = 3.5 MiB each).
    #[arg(long, default_value_t = 64)]
    blocks: u32,
    /// Timed repetitions per path (medians are reported).
    #[arg(long, default_value_t = 7)]
    iters: usize,
    /// Also measure a range of hit-set sizes.
    #[arg(long)]
    sweep: bool,
    /// With --sweep: write GB/s against hit-set size for both paths as a PNG chart.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    /// Run the owner in its own process (`kvferry owner`), reached through its Peer service.
    #[arg(long)]
    owner_process: bool,
    /// TP ranks of the requesting instance; rank r goes to device r (GPU r with cuda), and
    /// every rank loads at once.
    #[arg(long, default_value_t = 1)]
    tp: u32,
    /// Engine addresses of two running nodes, REQUESTER,OWNER (the owner one of the
    /// requester's peers): measure them instead of nodes in this process.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    nodes: Vec<String>,
    /// The nodes' engine token, where they require one.
    #[arg(long, default_value = "")]
    token: String,
    /// With --nodes: layers of the benchmark's KV (split K/V, one segment each).
    #[arg(long, default_value_t = 28)]
    layers: u32,
    /// With --nodes: KiB of one K or V segment of one block (a block is layers x 2 x this;
    /// the nodes' slot-bytes must hold it).
    #[arg(long, default_value_t = 64)]
    segment_kib: u64,
    /// With --provider tcp: a second pair of nodes whose data plane is mutual TLS
    /// (certificates of a lab CA made in-process), measured in the same rounds as the pair
    /// in clear; reports both and TLS/plain.
    #[arg(long)]
    tls: bool,
    /// With --provider tcp: connections each link opens to the owner (`cluster.data-lanes`),
    /// read side by side; over TLS each encrypts and decrypts on its own core.
    #[arg(long, default_value_t = kvferry_actors::config::DEFAULT_DATA_LANES)]
    lanes: u32,
    /// With --tls: the TLS pair's connections per link (`cluster.tls-data-lanes`); default
    /// what a node derives from --lanes, `TLS_LANES_FACTOR` × lanes.
    #[arg(long)]
    tls_lanes: Option<u32>,
}

impl RemoteArgs {
    /// The TLS pair's connections per link: what a node derives from `--lanes` over TLS, or
    /// `--tls-lanes`.
    fn tls_lanes(&self) -> u32 {
        kvferry_actors::config::tls_lanes(self.lanes, self.tls_lanes)
    }
}

/// `kvferry owner`: an owner node in its own process holding blocks 0..N of the benchmark's
/// namespace (internal: started by `bench remote --owner-process`).
#[derive(clap::Args)]
pub struct OwnerArgs {
    #[arg(long, default_value = "shm")]
    provider: String,
    #[arg(long)]
    blocks: u64,
    #[arg(long, default_value = "owner")]
    node_id: String,
    #[arg(long, default_value = "")]
    token: String,
    #[arg(long, default_value_t = 1)]
    tp: u32,
}

pub fn owner(a: OwnerArgs) -> anyhow::Result<()> {
    kvferry_harness::run_owner_process(kvferry_harness::OwnerSpec {
        node_id: a.node_id,
        model: "bench".into(),
        provider: Provider::parse(&a.provider)?,
        shape: shape(a.tp)?,
        blocks: 0..a.blocks,
        token: a.token,
    })?;
    Ok(())
}

/// Starts `kvferry owner` and waits for its Peer address.
fn spawn_owner(
    provider: Provider,
    blocks: u32,
    tp: u32,
) -> anyhow::Result<(std::process::Child, String)> {
    use std::io::BufRead;
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args([
            "owner",
            "--provider",
            provider.as_str(),
            "--blocks",
            &blocks.to_string(),
            "--tp",
            &tp.to_string(),
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting the owner process")?;
    let out = child.stdout.take().context("owner stdout")?;
    for line in std::io::BufReader::new(out).lines() {
        let line = line?;
        if let Some(addr) = line.strip_prefix("READY ") {
            return Ok((child, addr.trim().to_owned()));
        }
    }
    let _ = child.kill();
    bail!("the owner process exited before it was ready")
}

const ENGINE: &str = "bench-remote";

fn shape(tp: u32) -> anyhow::Result<KvShape> {
    Ok(KvShape::new(28, tp, 2, 64 << 10)?)
}

fn node_config(name: &str, slot: u64, slots: u64) -> NodeConfig {
    let mut cfg = NodeConfig {
        node_id: name.into(),
        ..Default::default()
    };
    cfg.pool.slot_bytes = ByteSize(slot);
    cfg.pool.size = ByteSize(slot * slots);
    cfg
}

use crate::bench::median;

/// One hit-set size measured on both paths, on one pair of nodes.
struct Point {
    blocks: u32,
    bytes: u64,
    direct_s: f64,
    staged_s: f64,
    direct_report: TransferReport,
    staged_report: TransferReport,
    verified: bool,
}

/// Queries the hit set and returns its lease (every block must be remote).
async fn lease_remote(
    requester: &Node,
    instance: &InstanceId,
    hashes: &[BlockHash],
    direct: bool,
) -> anyhow::Result<LeaseId> {
    let q = requester
        .query(QueryRequest {
            instance: instance.clone(),
            hashes: hashes.to_vec(),
            direct_gpu: direct,
            tenant: None,
        })
        .await?;
    if q.remote_blocks != hashes.len() {
        bail!(
            "query found {} remote blocks of {}",
            q.remote_blocks,
            hashes.len()
        );
    }
    if direct && !q.direct.is_granted() {
        bail!("direct loads were not granted: {:?}", q.direct);
    }
    q.lease.context("no lease")
}

/// Starts every rank's load at once and waits for all; the report of rank 0.
async fn load_all_ranks(
    requester: &Node,
    instance: &InstanceId,
    lease: LeaseId,
    dest: &[u32],
    tp: u32,
) -> anyhow::Result<TransferReport> {
    let mut pending = Vec::new();
    for rank in 0..tp {
        pending.push(
            requester
                .start_load(LoadRequest {
                    lease,
                    instance: instance.clone(),
                    rank,
                    dest_blocks: dest.to_vec(),
                    per_layer: false,
                })
                .await?,
        );
    }
    let mut first = None;
    for (rank, rx) in pending.into_iter().enumerate() {
        let r = rx
            .await
            .map_err(|_| anyhow::anyhow!("rank {rank}: the transfer went away"))?
            .with_context(|| format!("rank {rank}"))?;
        first.get_or_insert(r);
    }
    first.context("no ranks")
}

/// A pair of nodes: the owner (in this process, or its own), the requester, and their KV.
struct Pair {
    /// "plain" or "tls": what its data plane is.
    label: &'static str,
    owner: Option<Node>,
    child: Option<std::process::Child>,
    requester: Node,
    /// The owner's registered KV, kept while it serves.
    _owner_kvs: Vec<DeviceKv>,
    kvs: Vec<DeviceKv>,
    inst: InstanceId,
}

impl Pair {
    /// Checks that nothing is left held, and stops both nodes.
    async fn finish(self) -> anyhow::Result<()> {
        let st = self.requester.stats().await?;
        let leaked = st.leases_live != 0 || st.pinned_blocks != 0 || st.transfers_in_flight != 0;
        let unregistered = self.requester.unregister_instance(self.inst).await;
        self.requester.shutdown();
        if let Some(o) = self.owner {
            o.shutdown();
        }
        if let Some(mut c) = self.child {
            drop(c.stdin.take());
            let _ = c.wait();
        }
        if leaked {
            bail!("{} pair: leak after the benchmark: {st:?}", self.label);
        }
        unregistered?;
        Ok(())
    }
}

/// Measures every pair at `blocks`: in each round every pair loads once on each path, the
/// pairs and the paths taking turns at going first, so that no pair or path always runs
/// on the heels of another (after its pool slots were dropped, its connections warm).
/// One point per pair.
async fn measure(pairs: &[Pair], blocks: u32, iters: usize) -> anyhow::Result<Vec<Point>> {
    let hashes: Vec<BlockHash> = (0..u64::from(blocks)).map(BlockHash::from_u64).collect();
    let dest: Vec<u32> = (0..blocks).map(|i| i * 3 + 1).collect();
    let tp = pairs[0].kvs.len() as u32;
    let bytes = u64::from(blocks) * pairs[0].kvs[0].shape.rank_bytes() * u64::from(tp);
    let n = pairs.len();
    let mut times: Vec<(Vec<f64>, Vec<f64>)> = (0..n).map(|_| Default::default()).collect();
    let mut reports: Vec<(Option<TransferReport>, Option<TransferReport>)> =
        (0..n).map(|_| (None, None)).collect();
    let mut verified = vec![true; n];
    let expected: Vec<(u32, u64)> = dest
        .iter()
        .enumerate()
        .map(|(i, x)| (*x, i as u64))
        .collect();
    for i in 0..iters + 1 {
        let paths = if i % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        };
        for k in (0..n).map(|k| (k + i) % n) {
            let pair = &pairs[k];
            for direct in paths {
                let lease = lease_remote(&pair.requester, &pair.inst, &hashes, direct).await?;
                let t = Instant::now();
                let r = load_all_ranks(&pair.requester, &pair.inst, lease, &dest, tp)
                    .await
                    .with_context(|| format!("{} pair", pair.label))?;
                let dt = t.elapsed().as_secs_f64();
                if i == iters {
                    // Check bytes on the last round of each path, then reset the destinations.
                    for (rank, kv) in pair.kvs.iter().enumerate() {
                        if let Err(e) = kv.verify(&expected, rank as u32) {
                            eprintln!("bench: {} rank {rank} direct={direct}: {e}", pair.label);
                            verified[k] = false;
                        }
                        kv.reset()?;
                    }
                }
                if i > 0 {
                    if direct {
                        times[k].0.push(dt);
                        reports[k].0 = Some(r);
                    } else {
                        times[k].1.push(dt);
                        reports[k].1 = Some(r);
                    }
                }
                // Staged copies would hit locally next time: start every load cold.
                pair.requester.drop_reclaimable().await?;
            }
        }
        eprintln!(
            "bench: {blocks} blocks ({} MiB), round {i}/{iters}{}",
            bytes >> 20,
            if i == 0 { " (warm-up)" } else { "" }
        );
    }
    times
        .into_iter()
        .zip(reports)
        .zip(verified)
        .map(|(((mut d, mut s), (dr, sr)), verified)| {
            Ok(Point {
                blocks,
                bytes,
                direct_s: median(&mut d),
                staged_s: median(&mut s),
                direct_report: dr.context("no direct run")?,
                staged_report: sr.context("no staged run")?,
                verified,
            })
        })
        .collect()
}

fn stages(r: &TransferReport) -> serde_json::Value {
    r.stages
        .iter()
        .map(|s| (s.name.to_string(), json!(s.seconds)))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// The owner and requester nodes of one pair, started (the owner in its own process with
/// `--owner-process`); `tls`: their data plane over mutual TLS.
fn start_pair(
    a: &RemoteArgs,
    provider: Provider,
    devices: &[Arc<dyn Device>],
    slot: u64,
    max: u32,
    tls: Option<TlsContext>,
) -> anyhow::Result<(Option<Node>, Option<std::process::Child>, Node)> {
    let requester_cfg = node_config("requester", slot, u64::from(max) + 1);
    if a.owner_process {
        let (child, addr) = spawn_owner(provider, max, a.tp)?;
        let peers = GrpcPeers::new(
            GrpcPeersConfig {
                node_id: "requester".into(),
                provider,
                token: String::new(),
                peers: vec![("owner".into(), addr)],
                shm_dir: std::env::temp_dir().join(format!("kvferry-bench-{}", std::process::id())),
                data_listen: "127.0.0.1:0".into(),
                data_lanes: a.lanes,
            },
            Arc::new(StaticDirectory::new(vec!["owner".into()])),
        );
        let requester = Node::start_in(
            requester_cfg,
            devices.to_vec(),
            Clock::system(),
            Some(peers),
        )?;
        return Ok((None, Some(child), requester));
    }
    let lanes = if tls.is_some() {
        a.tls_lanes()
    } else {
        a.lanes
    };
    let cluster = match tls {
        Some(ctx) => LocalCluster::with_tls(provider, ctx).context("TLS for the data plane")?,
        None => LocalCluster::new(provider),
    };
    cluster.set_data_lanes(lanes as usize);
    let owner = Node::start_in(
        node_config("owner", slot, u64::from(max)),
        vec![HostDevice::new(0) as Arc<dyn Device>],
        Clock::system(),
        Some(Arc::clone(&cluster)),
    )?;
    let requester = Node::start_in(
        requester_cfg,
        devices.to_vec(),
        Clock::system(),
        Some(Arc::clone(&cluster)),
    )?;
    Ok((Some(owner), None, requester))
}

/// Fills the owner's blocks 0..max (in process) and registers the requester's KV.
async fn prepare_pair(
    label: &'static str,
    (owner, child, requester): (Option<Node>, Option<std::process::Child>, Node),
    devices: &[Arc<dyn Device>],
    shape: KvShape,
    max: u32,
) -> anyhow::Result<Pair> {
    let mut owner_kvs = Vec::new();
    if let Some(owner) = &owner {
        for rank in 0..shape.tp_size() {
            let okv = DeviceKv::alloc(
                owner.device(0).context("owner device")?,
                shape,
                KvKind::Split,
                1,
                64 << 10,
                0,
            )?;
            let oinst = okv.register(owner, ENGINE, "bench", rank).await?;
            put_pattern(owner, &oinst, &shape, rank, 0..u64::from(max)).await?;
            owner_kvs.push(okv);
        }
    }
    let mut kvs = Vec::new();
    let mut inst = None;
    for (rank, dev) in devices.iter().enumerate() {
        let kv = DeviceKv::alloc(Arc::clone(dev), shape, KvKind::Split, max * 3, 64 << 10, 0)?;
        inst = Some(
            kv.register(&requester, ENGINE, "bench", rank as u32)
                .await?,
        );
        kvs.push(kv);
    }
    Ok(Pair {
        label,
        owner,
        child,
        requester,
        _owner_kvs: owner_kvs,
        kvs,
        inst: inst.context("no ranks")?,
    })
}

/// A lab CA and one certificate naming both nodes of a pair (they share the process's
/// identity), in a private directory removed when this drops.
struct LabTls {
    dir: std::path::PathBuf,
    ctx: TlsContext,
}

impl LabTls {
    fn new() -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(format!("kvferry-bench-tls-{}", std::process::id()));
        let ca = kvferry_testkit::LabCa::new(&dir, "kvferry bench CA")?;
        let files = kvferry_harness::tls_files(ca.issue("node", &["owner", "requester"])?);
        let ctx = TlsContext::load(files).context("loading the bench certificates")?;
        Ok(Self { dir, ctx })
    }
}

impl Drop for LabTls {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn run(a: RemoteArgs) -> anyhow::Result<()> {
    let provider = Provider::parse(&a.provider)?;
    if a.tp == 0 {
        bail!("--tp must be at least 1");
    }
    let max_lanes = kvferry_actors::config::MAX_DATA_LANES;
    if !(1..=max_lanes).contains(&a.lanes) {
        bail!("--lanes must be 1 to {max_lanes}");
    }
    if a.tls_lanes.is_some_and(|n| !(1..=max_lanes).contains(&n)) {
        bail!("--tls-lanes must be 1 to {max_lanes}");
    }
    if a.tls && (provider != Provider::Tcp || a.owner_process || !a.nodes.is_empty()) {
        bail!(
            "--tls measures the tcp data plane of nodes in this process: it takes --provider \
             tcp, without --owner-process or --nodes"
        );
    }
    if !a.nodes.is_empty() {
        let shape = KvShape::new(a.layers, 1, 2, a.segment_kib << 10)?;
        return crate::bench_cluster::run(&a.nodes, &a.token, shape, a.blocks, a.iters, a.json);
    }
    let devices = (0..a.tp)
        .map(|r| {
            kvferry_gpu::open_device(&a.device, r)
                .with_context(|| format!("opening {} device {r} for rank {r}", a.device))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let device = Arc::clone(&devices[0]);
    let shape = shape(a.tp)?;
    let sizes: Vec<u32> = if a.sweep {
        let mut v: Vec<u32> = [2u32, 4, 8, 16, 32, 64, 128]
            .into_iter()
            .filter(|s| *s < a.blocks)
            .collect();
        v.push(a.blocks);
        v
    } else {
        vec![a.blocks]
    };
    let max = *sizes.iter().max().unwrap_or(&a.blocks);
    let slot = shape.block_bytes();
    let lab = if a.tls { Some(LabTls::new()?) } else { None };
    let plain = start_pair(&a, provider, &devices, slot, max, None)?;
    let tls = match &lab {
        Some(l) => Some(start_pair(
            &a,
            provider,
            &devices,
            slot,
            max,
            Some(l.ctx.clone()),
        )?),
        None => None,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    eprintln!(
        "bench: remote suffix over {}{} into {}{}, {} blocks of {} KiB per rank",
        provider.as_str(),
        if a.tls {
            ", in clear and over mutual TLS"
        } else {
            ""
        },
        device.name(),
        if a.tp > 1 {
            format!(" and {} more (TP {}, one rank per device)", a.tp - 1, a.tp)
        } else {
            String::new()
        },
        max,
        shape.rank_bytes() >> 10
    );
    // The raw copy of the same bytes: a pinned cuMemcpyHtoDAsync on a GPU, memcpy on host;
    // with TP, one per device at once, timed by the slowest.
    let mut baselines = devices
        .iter()
        .map(|d| crate::bench::Baseline::new(d, u64::from(a.blocks) * shape.rank_bytes()))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut base_s = Vec::new();
    for _ in 0..a.iters + 1 {
        let times = std::thread::scope(|s| {
            let runs: Vec<_> = baselines
                .iter_mut()
                .map(|b| s.spawn(move || b.run()))
                .collect();
            runs.into_iter()
                .map(|h| {
                    h.join()
                        .map_err(|_| anyhow::anyhow!("baseline thread panicked"))?
                })
                .collect::<anyhow::Result<Vec<f64>>>()
        })?;
        base_s.push(times.into_iter().fold(0.0, f64::max));
    }
    base_s.remove(0);
    let base_median = median(&mut base_s);
    let baseline = &baselines[0];
    // Per size, one point per pair: [plain] or [plain, tls].
    let points: anyhow::Result<Vec<Vec<Point>>> = rt.block_on(async {
        let mut pairs = vec![prepare_pair("plain", plain, &devices, shape, max).await?];
        if let Some(t) = tls {
            pairs.push(prepare_pair("tls", t, &devices, shape, max).await?);
        }
        let mut points = Vec::new();
        let mut failed = None;
        for &n in &sizes {
            match measure(&pairs, n, a.iters).await {
                Ok(p) => points.push(p),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        for p in pairs {
            p.finish().await?;
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(points),
        }
    });
    drop(lab);
    let points = points?;
    let main = points.last().context("no measurement")?;
    let (plain_main, tls_main) = (&main[0], main.get(1));
    let ratio = plain_main.staged_s / plain_main.direct_s;
    let gbps = |b: u64, s: f64| b as f64 / s / 1e9;
    // TLS throughput over plain throughput (medians), per path.
    let tls_vs_plain = |p: &[Point]| {
        p.get(1)
            .map(|t| (p[0].direct_s / t.direct_s, p[0].staged_s / t.staged_s))
    };
    if let Some(path) = &a.plot {
        if !a.sweep {
            bail!("--plot needs --sweep");
        }
        let series = |name: &str, at: usize, secs: fn(&Point) -> f64| crate::plot::Series {
            name: name.into(),
            points: points
                .iter()
                .filter_map(|p| p.get(at))
                .map(|p| ((p.bytes >> 20) as f64, gbps(p.bytes, secs(p))))
                .collect(),
        };
        let mut lines = vec![
            series("direct", 0, |p| p.direct_s),
            series("staged", 0, |p| p.staged_s),
        ];
        if tls_main.is_some() {
            lines.push(series("direct, TLS", 1, |p| p.direct_s));
            lines.push(series("staged, TLS", 1, |p| p.staged_s));
        }
        crate::plot::line_chart(
            path,
            &format!(
                "remote suffix over {} into {}",
                provider.as_str(),
                device.name()
            ),
            "hit set (MiB)",
            "GB/s",
            &lines,
        )?;
        eprintln!("bench: chart written to {}", path.display());
    }
    let verified = points.iter().flatten().all(|p| p.verified);
    let path_json = |p: &Point| {
        json!({
            "direct": {
                "median_s": p.direct_s,
                "gbps": gbps(p.bytes, p.direct_s),
                "stages": stages(&p.direct_report),
            },
            "staged": {
                "median_s": p.staged_s,
                "gbps": gbps(p.bytes, p.staged_s),
                "stages": stages(&p.staged_report),
            },
            "verified": p.verified,
        })
    };
    if a.json {
        let plain = path_json(plain_main);
        let mut out = json!({
            "device": device.name(),
            "provider": provider.as_str(),
            "tp": a.tp,
            "devices": devices.iter().map(|d| d.name()).collect::<Vec<_>>(),
            "blocks": plain_main.blocks,
            "bytes": plain_main.bytes,
            "iters": a.iters,
            "lanes": a.lanes,
            "tls_lanes": a.tls.then(|| a.tls_lanes()),
            "direct": plain["direct"],
            "staged": plain["staged"],
            "direct_vs_staged": ratio,
            "baseline": baseline.name(),
            "baseline_gbps": gbps(plain_main.bytes, base_median),
            "direct_vs_baseline": base_median / plain_main.direct_s,
            "verified": verified,
            "sweep": points.iter().map(|p| {
                let mut row = json!({
                    "blocks": p[0].blocks,
                    "bytes": p[0].bytes,
                    "direct_gbps": gbps(p[0].bytes, p[0].direct_s),
                    "staged_gbps": gbps(p[0].bytes, p[0].staged_s),
                });
                if let Some(t) = p.get(1) {
                    row["tls_direct_gbps"] = json!(gbps(t.bytes, t.direct_s));
                    row["tls_staged_gbps"] = json!(gbps(t.bytes, t.staged_s));
                }
                row
            }).collect::<Vec<_>>(),
        });
        if let (Some(t), Some((d, s))) = (tls_main, tls_vs_plain(main)) {
            out["plain"] = plain;
            out["tls"] = path_json(t);
            out["tls_vs_plain"] = json!({ "direct": d, "staged": s });
        }
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        for p in &points {
            let q = &p[0];
            println!(
                "{:>4} blocks {:>5} MiB: direct {:>6.2} GB/s, staged {:>6.2} GB/s, direct/staged {:.2}",
                q.blocks,
                q.bytes >> 20,
                gbps(q.bytes, q.direct_s),
                gbps(q.bytes, q.staged_s),
                q.staged_s / q.direct_s
            );
            if let (Some(t), Some((d, s))) = (p.get(1), tls_vs_plain(p)) {
                println!(
                    "{:>4} blocks over TLS: direct {:>6.2} GB/s, staged {:>6.2} GB/s; \
                     tls_vs_plain direct {d:.2}, staged {s:.2}",
                    t.blocks,
                    gbps(t.bytes, t.direct_s),
                    gbps(t.bytes, t.staged_s),
                );
            }
        }
        println!(
            "direct_vs_staged ({} blocks): {ratio:.2}; verified: {verified}",
            plain_main.blocks
        );
        if let Some((d, s)) = tls_vs_plain(main) {
            println!(
                "tls_vs_plain ({} blocks, GB/s over TLS on {} lanes / in clear on {}): direct \
                 {d:.2}, staged {s:.2}",
                plain_main.blocks,
                a.tls_lanes(),
                a.lanes
            );
        }
        println!(
            "{}: {:.2} GB/s; direct_vs_baseline {:.2}",
            baseline.name(),
            gbps(plain_main.bytes, base_median),
            base_median / plain_main.direct_s
        );
    }
    if !verified {
        bail!("verification failed");
    }
    Ok(())
}
