//! `kvferry bench engine`: what an engine sees. A `kvferry node` runs in its own process
//! (this binary re-executed); this process is the engine: it allocates KV the way vLLM does
//! (one allocation per layer: memfds on a host node, CUDA allocations by IPC handle on a
//! GPU), saves N blocks, then times the query of their hashes, the load of the lease into
//! every third block (Load RPC until the completion board shows the first layer, and the
//! end), and the save — each against a raw copy of the same bytes in the same run. Then the
//! duplex: a save of N new blocks and a load of N others issued at once (what an engine does
//! while it serves: saving new blocks while loading others' prefixes), timed until both
//! are done, against the same bytes copied host→device and device→host at once (two
//! streams from pinned memory on a GPU; two memcpys on two threads on the host device).
//! Every load is checked byte for byte, canaries included, and so are the duplex's saved
//! blocks (loaded back). Query, Load and Save go through a request mailbox (shared memory
//! beside the gRPC connection) unless `--no-mailbox` asks for the calls alone.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kvferry_actors::{BlockHash, InstanceId, LoadRequest, SaveRequest};
use kvferry_client::KvFd;
use kvferry_client::{EngineClient, MemoryRegion, RegisterRegions};
use kvferry_client::{LoadOptions, Registration};
use kvferry_gpu::{Device, KvShape};
use kvferry_proto::shm::board::{self, Board, SlotState, SlotView};
use kvferry_testkit::{median, DeviceKv, KvKind, MemfdRegionsKv};
use serde_json::json;

use crate::bench::Baseline;

#[derive(clap::Args)]
pub struct EngineArgs {
    #[arg(long)]
    json: bool,
    /// host (KV in memfds, node on the host device) or cuda (KV in CUDA allocations).
    #[arg(long, default_value = "host")]
    device: String,
    /// Block counts of the sweep.
    #[arg(long, value_delimiter = ',', default_values_t = [1u32, 16, 64, 256, 1024])]
    blocks: Vec<u32>,
    #[arg(long, default_value_t = 28)]
    layers: u32,
    /// Bytes of one K or V segment of one block, in KiB.
    #[arg(long, default_value_t = 32)]
    segment_kib: u64,
    /// Timed repetitions of each figure (after one warm-up); medians are reported.
    #[arg(long, default_value_t = 9)]
    iters: usize,
    /// Leave out the duplex figure (a save and a load at once).
    #[arg(long)]
    no_duplex: bool,
    /// The node's `[device] copy-path` (auto, staged, kernel, batch, per-op): measure one
    /// way of issuing copies against another.
    #[arg(long, default_value = "auto")]
    copy_path: String,
    /// How long the client polls the completion board before sleeping on it, in
    /// microseconds (what `Board::wait_spinning` takes; the default is `Board::wait`'s).
    #[arg(long, default_value_t = board::WAIT_SPIN.as_micros() as u64)]
    board_spin_us: u64,
    /// Query, Load and Save over gRPC calls only, without a request mailbox (what a client of
    /// engine protocol 4 does).
    #[arg(long)]
    no_mailbox: bool,
    /// More keys of the node's `[device]` table, `KEY=VALUE` in TOML (e.g.
    /// `staging-chunks=4`): measure one device setting against another. Repeatable.
    #[arg(long = "device-set", value_name = "KEY=VALUE")]
    device_set: Vec<String>,
    /// Measure the sweep twice in this run: against a node without `[events]`, then against
    /// one publishing KV events to a subscriber in this process that reads every one; prints
    /// both medians and their ratio (events must cost the data path nothing).
    #[arg(long)]
    events: bool,
    /// Loads ask for one copy batch per layer (what a vLLM worker's synchronous load does)
    /// instead of the planner's layer groups.
    #[arg(long)]
    per_layer: bool,
}

const INSTANCE: &str = "bench-engine";
const WAIT: Duration = Duration::from_secs(60);
/// Hash tags of the duplex's saves, apart from the sweep's own.
const DUPLEX_TAG: u64 = 1 << 24;

/// A `kvferry node` child process; killed on drop.
struct NodeProcess {
    child: std::process::Child,
    dir: std::path::PathBuf,
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn spawn_node(
    a: &EngineArgs,
    slot: u64,
    slots: u64,
    events: Option<&str>,
) -> anyhow::Result<(NodeProcess, String)> {
    let (device, copy_path) = (&a.device, &a.copy_path);
    let mut device_keys = String::new();
    for kv in &a.device_set {
        let Some((k, v)) = kv.split_once('=') else {
            bail!("--device-set takes KEY=VALUE, not {kv:?}");
        };
        device_keys.push_str(&format!("{} = {}\n", k.trim(), v.trim()));
    }
    if let Some(publish) = events {
        device_keys.push_str(&format!("[events]\npublish = \"{publish}\"\n"));
    }
    let dir = std::env::temp_dir().join(format!(
        "kvferry-bench-engine-{}{}",
        std::process::id(),
        if events.is_some() { "-events" } else { "" }
    ));
    std::fs::create_dir_all(&dir)?;
    let addr = format!("127.0.0.1:{}", free_port()?);
    let cfg = dir.join("node.toml");
    std::fs::write(
        &cfg,
        format!(
            "node-id = \"bench-engine\"\n[pool]\nsize = \"{}B\"\nslot-bytes = \"{slot}B\"\n\
             [device]\nkind = \"{device}\"\ncount = 1\ncopy-path = \"{copy_path}\"\n{device_keys}\
             [metrics]\nlisten = \"\"\n\
             [engine]\nlisten = \"{addr}\"\nfd-dir = \"{}\"\n",
            slot * slots,
            dir.display()
        ),
    )?;
    let log = std::fs::File::create(dir.join("node.log"))?;
    let child = std::process::Command::new(std::env::current_exe()?)
        .arg("node")
        .arg("--config")
        .arg(&cfg)
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("starting the node process")?;
    Ok((NodeProcess { child, dir }, addr))
}

async fn connect(p: &mut NodeProcess, addr: &str) -> anyhow::Result<EngineClient> {
    let end = Instant::now() + WAIT;
    loop {
        if let Ok(c) = EngineClient::connect(addr.to_owned(), None, "").await {
            if let Ok(caps) = c.capabilities().await {
                let fd = std::path::PathBuf::from(caps.fd_socket);
                return Ok(EngineClient::connect(addr.to_owned(), Some(fd), "").await?);
            }
        }
        if let Some(status) = p.child.try_wait()? {
            let log = std::fs::read_to_string(p.dir.join("node.log")).unwrap_or_default();
            bail!("the node exited ({status}): {}", log.trim_end());
        }
        if Instant::now() > end {
            bail!("the node did not answer within {WAIT:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The engine's KV and how it is registered.
enum Kv {
    Host(MemfdRegionsKv),
    Cuda(
        DeviceKv,
        Vec<MemoryRegion>,
        Vec<kvferry_client::RegionLayer>,
    ),
}

impl Kv {
    fn kv(&self) -> &DeviceKv {
        match self {
            Kv::Host(k) => k,
            Kv::Cuda(k, ..) => k,
        }
    }
}

fn alloc_kv(device: &str, shape: KvShape, blocks: u32) -> anyhow::Result<Kv> {
    let seg = shape.segment_bytes();
    if device == "host" {
        return Ok(Kv::Host(MemfdRegionsKv::create(
            shape,
            KvKind::Split,
            blocks,
            seg,
            0,
        )?));
    }
    let cuda = kvferry_gpu::CudaDevice::open(0)?;
    let kv = DeviceKv::alloc(
        Arc::clone(&cuda) as Arc<dyn Device>,
        shape,
        KvKind::Split,
        blocks,
        seg,
        0,
    )?;
    let mut regions = Vec::new();
    let mut offsets = Vec::new();
    for ptr in kv.buffer_ptrs() {
        let ipc = cuda.ipc_handle(ptr)?;
        regions.push(MemoryRegion::CudaIpc(ipc.bytes.to_vec()));
        offsets.push(ipc.offset);
    }
    let mut layers = kv.placements();
    for l in &mut layers {
        l.k.offset += offsets[l.k.region as usize];
        if let Some(v) = l.v.as_mut() {
            v.offset += offsets[v.region as usize];
        }
    }
    Ok(Kv::Cuda(kv, regions, layers))
}

async fn register(c: &EngineClient, kv: &Kv, board: u64) -> anyhow::Result<()> {
    let id = InstanceId::new(INSTANCE)?;
    let req = match kv {
        Kv::Host(k) => {
            let mut handles = Vec::new();
            for (i, len) in k.buffer_lens().into_iter().enumerate() {
                handles.push(
                    c.send_kv(&id, 0, 0, k.fd_of(i), KvFd::Memfd { len })
                        .await?,
                );
            }
            k.registration(&id, "bench", 0, &handles)
        }
        Kv::Cuda(k, regions, layers) => RegisterRegions {
            instance: id,
            model: "bench".into(),
            dtype: "bf16".into(),
            shape: k.shape,
            rank: 0,
            device: 0,
            kind: k.spec().kind,
            block_stride: k.block_stride,
            num_blocks: k.num_blocks,
            regions: regions.clone(),
            layers: layers.clone(),
        },
    };
    c.register(Registration::regions(&req).with_board(board))
        .await?;
    Ok(())
}

fn hashes(tag: u64, n: u32) -> Vec<BlockHash> {
    (0..u64::from(n))
        .map(|i| BlockHash::from_u64(tag << 32 | i))
        .collect()
}

/// One row of the sweep.
struct Row {
    blocks: u32,
    bytes: u64,
    query: f64,
    load: f64,
    first_layer: f64,
    /// Until the board showed every layer landed (before the end, which comes once the
    /// node has released what the load held).
    last_layer: f64,
    save: f64,
    raw: f64,
    /// The load as the node itself timed it (from its start to its reply), and its stages:
    /// what the load costs beyond these is the RPC and the completion's way to the client.
    node_load: f64,
    stages: BTreeMap<String, f64>,
    verified: bool,
    duplex: Option<Duplex>,
}

/// A save and a load of N blocks each at once, against the raw copies of the same bytes in
/// both directions at once.
struct Duplex {
    /// Issue of both until both are done.
    both: f64,
    /// Issue until each is done (the client's view).
    save: f64,
    load: f64,
    raw: f64,
    verified: bool,
}

/// A load as an engine watches it: when its first layer and its end showed on the board.
struct Watched {
    load_id: u64,
    first_s: f64,
    last_s: f64,
    done_s: f64,
    view: SlotView,
}

/// Sends `req` naming board slot 0 and `tag`, and watches the board while the RPC's answer
/// is on its way: the board shows the landed layers and the end without waiting for it, as
/// it would for an engine. Times are from the send. The watch runs on a blocking thread and
/// the RPC in this task: a watch blocking a runtime worker would leave the RPC's tasks to
/// whichever worker steals them (on the H200 that delayed the request's arrival by up to
/// 0.2 ms). An RPC refused before the board was touched ends the watch with its error.
async fn load_watched(
    c: &EngineClient,
    board: &Arc<Board>,
    spin: Duration,
    req: LoadRequest,
    tag: u32,
) -> anyhow::Result<Watched> {
    let refused = Arc::new(AtomicBool::new(false));
    let t = Instant::now();
    let watch = {
        let (board, refused) = (Arc::clone(board), Arc::clone(&refused));
        tokio::task::spawn_blocking(move || watch_board(&board, spin, tag, t, &refused))
    };
    let r = c.load(&req, LoadOptions::on_board(0, tag)).await;
    if r.is_err() {
        refused.store(true, Ordering::Release);
    }
    let w = watch.await??;
    let load_id = r?;
    let Some(view) = w.view else {
        bail!("the load RPC failed but the board did not say so");
    };
    Ok(Watched {
        load_id,
        first_s: w.first_s,
        last_s: w.last_s,
        done_s: w.done_s,
        view,
    })
}

/// What [`watch_board`] saw, in seconds from the send.
struct Watch {
    first_s: f64,
    last_s: f64,
    done_s: f64,
    /// None where the RPC was refused.
    view: Option<SlotView>,
}

/// Waits for slot 0 to show `tag` with its first layer, every layer, and its end.
fn watch_board(
    board: &Board,
    spin: Duration,
    tag: u32,
    t: Instant,
    refused: &AtomicBool,
) -> anyhow::Result<Watch> {
    let wait = |layers: u32| -> anyhow::Result<Option<SlotView>> {
        loop {
            let v = board.wait_spinning(0, tag, layers, Duration::from_millis(2), spin)?;
            if v.tag == tag && (v.state.is_done() || v.layers >= layers) {
                return Ok(Some(v));
            }
            if refused.load(Ordering::Acquire) {
                return Ok(None);
            }
            if t.elapsed() > WAIT {
                bail!("no end on the board after {WAIT:?}");
            }
        }
    };
    let first = wait(1)?;
    let first_s = t.elapsed().as_secs_f64();
    let total = board.total(0).unwrap_or(u32::MAX);
    let last = match first {
        Some(v) if v.state.is_done() || v.layers >= total => Some(v),
        Some(_) => wait(total)?,
        None => None,
    };
    let last_s = t.elapsed().as_secs_f64();
    let view = match last {
        Some(v) if v.state.is_done() => Some(v),
        Some(_) => wait(u32::MAX)?,
        None => None,
    };
    Ok(Watch {
        first_s,
        last_s,
        done_s: t.elapsed().as_secs_f64(),
        view,
    })
}

/// What a duplex round needs of the sweep's state.
struct DuplexCtx<'a> {
    c: &'a EngineClient,
    board: &'a Arc<Board>,
    id: &'a InstanceId,
    kv: &'a DeviceKv,
    n: u32,
    src: &'a [u32],
    dest: &'a [u32],
    spin: Duration,
}

/// Pattern blocks of the duplex's saved sources: apart from the loaded blocks' (0..n), so
/// a save that wrote the loaded bytes (or the reverse) fails the check.
const DUPLEX_PATTERN: u64 = 1 << 20;

impl DuplexCtx<'_> {
    /// Leases `hashes` (all must hit).
    async fn lease(&self, hashes: &[BlockHash]) -> anyhow::Result<kvferry_actors::LeaseId> {
        let q = self.c.query(self.id, hashes, false).await?;
        match q.lease.filter(|_| q.local_blocks == self.n) {
            Some(l) => Ok(l),
            None => bail!("a query of {} saved blocks hit {}", self.n, q.local_blocks),
        }
    }

    /// Loads `lease` into the destinations and waits for the board to say done; returns
    /// when the board said so (what the load's figure is: the board's word is the outcome,
    /// and the PollLoad that checks it afterwards is not part of it, as in the sweep).
    async fn load(&self, lease: kvferry_actors::LeaseId, tag: u32) -> anyhow::Result<Instant> {
        let req = LoadRequest {
            lease,
            instance: self.id.clone(),
            rank: 0,
            dest_blocks: self.dest.to_vec(),
            per_layer: false,
        };
        let sent = Instant::now();
        let w = load_watched(self.c, self.board, self.spin, req, tag).await?;
        let done = sent + Duration::from_secs_f64(w.done_s);
        let load_id = w.load_id;
        if w.view.state != SlotState::Ok {
            let done = self.c.poll_load(load_id).await?;
            bail!(
                "the load of {} blocks failed ({} on the board): {done:?}",
                self.n,
                w.view.failed_blocks
            );
        }
        match self.c.poll_load(load_id).await? {
            Some(p) if p.status == 1 => Ok(done),
            other => bail!("the board says done, PollLoad says {other:?}"),
        }
    }

    /// One round: saves the sources under `fresh` while `prev` (saved earlier) loads into
    /// the destinations. Seconds from issuing both until both are done, and until each is.
    async fn round(
        &self,
        prev: &[BlockHash],
        fresh: &[BlockHash],
        tag: u32,
    ) -> anyhow::Result<(f64, f64, f64)> {
        let lease = self.lease(prev).await?;
        let c = self.c.clone();
        let req = SaveRequest {
            instance: self.id.clone(),
            rank: 0,
            hashes: fresh.to_vec(),
            src_blocks: self.src.to_vec(),
            tenant: None,
        };
        let t = Instant::now();
        // The save runs on the runtime's workers while this thread waits on the board.
        let save = tokio::spawn(async move {
            let r = c.save(&req).await;
            (r, t.elapsed().as_secs_f64())
        });
        let loaded = self.load(lease, tag).await;
        let load_s = loaded
            .as_ref()
            .map_or_else(|_| t.elapsed(), |done| done.duration_since(t))
            .as_secs_f64();
        // The save's own end, taken where it finished: waiting on the board above may have
        // seen it late.
        let (saved, save_s) = save.await?;
        loaded?;
        let saved = saved?;
        if saved.written != self.n {
            bail!("a save of {} blocks wrote {}", self.n, saved.written);
        }
        Ok((load_s.max(save_s), save_s, load_s))
    }

    /// Warm-up round, checked: the loaded blocks and, loaded back, the saved ones.
    async fn checked_round(
        &self,
        prev: &[BlockHash],
        fresh: &[BlockHash],
        tag: &mut u32,
    ) -> anyhow::Result<bool> {
        // Destinations back to canaries (so the load must write them), sources given a
        // pattern of their own (so the saved blocks differ from the loaded ones).
        self.kv.reset()?;
        for (&b, i) in self.src.iter().zip(0u64..) {
            self.kv.write_block(b, DUPLEX_PATTERN + i, 0)?;
        }
        *tag = tag.wrapping_add(1);
        self.round(prev, fresh, *tag).await?;
        let sources = self
            .src
            .iter()
            .zip(0u64..)
            .map(|(&b, i)| (b, DUPLEX_PATTERN + i));
        let loaded: Vec<(u32, u64)> = sources
            .clone()
            .chain(self.dest.iter().zip(0u64..).map(|(&d, i)| (d, i)))
            .collect();
        let mut ok = true;
        if let Err(e) = self.kv.verify(&loaded, 0) {
            eprintln!(
                "kvferry bench engine: duplex of {} blocks, loaded: {e}",
                self.n
            );
            ok = false;
        }
        // The saved blocks, loaded into the destinations: they hold the sources' pattern.
        let lease = self.lease(fresh).await?;
        *tag = tag.wrapping_add(1);
        self.load(lease, *tag).await?;
        let saved: Vec<(u32, u64)> = sources
            .chain(
                self.dest
                    .iter()
                    .zip(0u64..)
                    .map(|(&d, i)| (d, DUPLEX_PATTERN + i)),
            )
            .collect();
        if let Err(e) = self.kv.verify(&saved, 0) {
            eprintln!(
                "kvferry bench engine: duplex of {} blocks, saved: {e}",
                self.n
            );
            ok = false;
        }
        Ok(ok)
    }
}

/// Seconds of `bytes` copied host→device and device→host at once, as the hardware does it
/// without kvferry: median of `iters` after a warm-up.
fn raw_duplex(device: &str, bytes: u64, iters: usize) -> anyhow::Result<f64> {
    let len = usize::try_from(bytes)?;
    if device == "host" {
        // Two memcpys on two threads: what the host device's two copy threads could do.
        let (up_src, down_src) = (vec![1u8; len], vec![2u8; len]);
        let (mut up_dst, mut down_dst) = (vec![0u8; len], vec![0u8; len]);
        let mut times = Vec::with_capacity(iters);
        for i in 0..=iters {
            let go = std::sync::Barrier::new(2);
            let copy = |dst: &mut [u8], src: &[u8]| {
                go.wait();
                let t = Instant::now();
                dst.copy_from_slice(src);
                std::hint::black_box(&dst);
                (t, Instant::now())
            };
            let (copy, up_dst, up_src) = (&copy, &mut up_dst, &up_src);
            let ((a0, a1), (b0, b1)) = std::thread::scope(|s| {
                let up = s.spawn(move || copy(up_dst, up_src));
                let down = copy(&mut down_dst, &down_src);
                (up.join().unwrap_or(down), down)
            });
            if i > 0 {
                times.push((a1.max(b1) - a0.min(b0)).as_secs_f64());
            }
        }
        return Ok(median(&mut times));
    }
    let dev = kvferry_gpu::open_device(device, 0)?;
    // Mappings of their own: heap buffers can share a page with memory registered elsewhere
    // in this process, which the driver refuses to register twice.
    let up_src = kvferry_transport::HostRegion::anonymous(len)?;
    up_src.fill(1)?;
    let down_dst = kvferry_transport::HostRegion::anonymous(len)?;
    // Locals drop in reverse order: the device buffers, the registrations, then the memory.
    let _pin_up = dev.register_host(up_src.addr(), bytes, true)?;
    let _pin_down = dev.register_host(down_dst.addr(), bytes, false)?;
    let (up_dst, down_src) = (dev.alloc(bytes)?, dev.alloc(bytes)?);
    let ranges = kvferry_testkit::DuplexRanges {
        h2d_src: up_src.addr(),
        h2d_dst: up_dst.ptr(),
        d2h_src: down_src.ptr(),
        d2h_dst: down_dst.addr(),
        bytes,
    };
    // SAFETY: both host buffers are live, pinned, and untouched until the call returns.
    let s = unsafe { kvferry_testkit::bench_raw_duplex(dev.as_ref(), ranges, iters as u32) }?;
    Ok(s)
}

pub fn run(a: EngineArgs) -> anyhow::Result<()> {
    if !matches!(a.device.as_str(), "host" | "cuda") {
        bail!("--device is host or cuda, not {:?}", a.device);
    }
    if a.blocks.is_empty() || a.blocks.contains(&0) || a.iters == 0 {
        bail!("--blocks needs block counts above 0 and --iters at least 1");
    }
    let shape = KvShape::new(a.layers, 1, 2, a.segment_kib << 10)?;
    let max = *a.blocks.iter().max().unwrap_or(&1);
    // Sources 0..n, destinations every third block after them.
    let num_blocks = 4 * max + 4;
    // Each save uses fresh hashes; the pool evicts the oldest (unpinned) ones.
    let slots = 2 * u64::from(max) + 64;
    let (rows, caps, _) = measure(&a, shape, num_blocks, slots, false)?;
    let with_events = if a.events {
        Some(measure(&a, shape, num_blocks, slots, true)?)
    } else {
        None
    };
    report(&a, shape, rows, caps, with_events)
}

/// One sweep against a node of its own; `events`: the node publishes KV events and a
/// subscriber here reads them all.
fn measure(
    a: &EngineArgs,
    shape: KvShape,
    num_blocks: u32,
    slots: u64,
    events: bool,
) -> anyhow::Result<(Vec<Row>, kvferry_proto::v1::CapabilitiesResponse, u64)> {
    let publish = format!("tcp://127.0.0.1:{}", free_port()?);
    let (mut node, addr) = spawn_node(
        a,
        shape.block_bytes(),
        slots,
        events.then_some(publish.as_str()),
    )?;
    let spin = Duration::from_micros(a.board_spin_us);
    let kv = alloc_kv(&a.device, shape, num_blocks)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let seen = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let out = rt.block_on(async {
        let c = connect(&mut node, &addr).await?;
        if events {
            use zeromq::{Socket, SocketRecv};
            let mut sub = zeromq::SubSocket::new();
            sub.connect(&publish).await.context("connecting to the event publisher")?;
            sub.subscribe("").await?;
            let seen = Arc::clone(&seen);
            tokio::spawn(async move {
                while sub.recv().await.is_ok() {
                    seen.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        let caps = c.capabilities().await?;
        let id = InstanceId::new(INSTANCE)?;
        let board = Arc::new(Board::create(8)?);
        let board_handle = c.send_board(&id, 0, &board).await?;
        register(&c, &kv, board_handle).await?;
        let _session = c.open_session(std::slice::from_ref(&id)).await?;
        if !a.no_mailbox && !c.attach_mailbox(&id).await? {
            bail!("the node (protocol {}) takes no request mailbox", caps.protocol);
        }
        let device_kv = kv.kv();
        let mut rows = Vec::new();
        let mut tag = 0u32;
        for &n in &a.blocks {
            let bytes = u64::from(n) * shape.rank_bytes();
            device_kv.reset()?;
            for i in 0..n {
                device_kv.write_block(i, u64::from(i), 0)?;
            }
            let src: Vec<u32> = (0..n).collect();
            let dest: Vec<u32> = (0..n).map(|i| n + 1 + 3 * i).collect();
            // Sources hold their pattern, destinations the same; every other byte a canary.
            let expected: Vec<(u32, u64)> = src
                .iter()
                .map(|&b| (b, u64::from(b)))
                .chain(dest.iter().zip(0u64..).map(|(&d, i)| (d, i)))
                .collect();
            let (mut query, mut load, mut first, mut save) = (vec![], vec![], vec![], vec![]);
            let mut last_layer = vec![];
            let mut node_load = vec![];
            let mut stages: BTreeMap<String, Vec<f64>> = BTreeMap::new();
            let mut verified = true;
            let mut last = Vec::new();
            for it in 0..=a.iters {
                // Save: fresh hashes each time, so every block is copied.
                let hs = hashes(u64::from(n) << 8 | it as u64, n);
                last.clone_from(&hs);
                let t = Instant::now();
                let saved = c
                    .save(&SaveRequest {
                        instance: id.clone(),
                        rank: 0,
                        hashes: hs.clone(),
                        src_blocks: src.clone(),
                        tenant: None,
                    })
                    .await?;
                let save_s = t.elapsed().as_secs_f64();
                if saved.written != n {
                    bail!("a save of {n} blocks wrote {}", saved.written);
                }
                let t = Instant::now();
                let q = c.query(&id, &hs, false).await?;
                let query_s = t.elapsed().as_secs_f64();
                let Some(lease) = q.lease.filter(|_| q.local_blocks == n) else {
                    bail!("a query of {n} saved blocks hit {}", q.local_blocks);
                };
                tag = tag.wrapping_add(1);
                let req = LoadRequest {
                    lease,
                    instance: id.clone(),
                    rank: 0,
                    dest_blocks: dest.clone(),
                    per_layer: a.per_layer,
                };
                let w = load_watched(&c, &board, spin, req, tag).await?;
                let (load_id, first_s, load_s) = (w.load_id, w.first_s, w.done_s);
                let last_s = w.last_s;
                if w.view.state != SlotState::Ok {
                    let done = c.poll_load(load_id).await?;
                    bail!(
                        "the load of {n} blocks failed ({} on the board): {done:?}",
                        w.view.failed_blocks
                    );
                }
                // The board's ok is the outcome; PollLoad only for the node's own timing.
                let done = match c.poll_load(load_id).await? {
                    Some(done) if done.status == 1 => done,
                    other => bail!("the board says ok, PollLoad says {other:?}"),
                };
                if it == 0 {
                    // The warm-up's bytes are checked; later loads write the same.
                    let checked = device_kv.verify(&expected, 0);
                    let untouched = device_kv
                        .untouched_outside(&src.iter().chain(&dest).copied().collect::<Vec<_>>());
                    if let Err(e) = checked.map(|_| ()).and(untouched) {
                        eprintln!("kvferry bench engine: {n} blocks: {e}");
                        verified = false;
                    }
                    continue;
                }
                query.push(query_s);
                load.push(load_s);
                node_load.push(done.seconds);
                for st in &done.stages {
                    stages.entry(st.name.clone()).or_default().push(st.seconds);
                }
                first.push(first_s);
                last_layer.push(last_s);
                save.push(save_s);
            }
            let duplex = if a.no_duplex {
                None
            } else {
                let ctx = DuplexCtx {
                    c: &c,
                    board: &board,
                    id: &id,
                    kv: device_kv,
                    n,
                    src: &src,
                    dest: &dest,
                    spin,
                };
                // Each round loads what the previous one saved and saves under new hashes.
                let mut prev = last;
                let mut fresh = hashes(DUPLEX_TAG | u64::from(n) << 8, n);
                let ok = ctx.checked_round(&prev, &fresh, &mut tag).await?;
                let (mut both, mut save, mut load) = (vec![], vec![], vec![]);
                for it in 1..=a.iters {
                    prev = std::mem::replace(
                        &mut fresh,
                        hashes(DUPLEX_TAG | u64::from(n) << 8 | it as u64, n),
                    );
                    tag = tag.wrapping_add(1);
                    let (b, s, l) = ctx.round(&prev, &fresh, tag).await?;
                    both.push(b);
                    save.push(s);
                    load.push(l);
                }
                Some(Duplex {
                    both: median(&mut both),
                    save: median(&mut save),
                    load: median(&mut load),
                    raw: raw_duplex(&a.device, bytes, a.iters)?,
                    verified: ok,
                })
            };
            let device = kvferry_gpu::open_device(&a.device, 0)?;
            let mut base = Baseline::new(&device, bytes)?;
            base.run()?;
            let mut raw: Vec<f64> = (0..a.iters).map(|_| base.run()).collect::<Result<_, _>>()?;
            rows.push(Row {
                blocks: n,
                bytes,
                query: median(&mut query),
                load: median(&mut load),
                first_layer: median(&mut first),
                last_layer: median(&mut last_layer),
                save: median(&mut save),
                raw: median(&mut raw),
                node_load: median(&mut node_load),
                stages: stages
                    .into_iter()
                    .map(|(k, mut v)| (k, median(&mut v)))
                    .collect(),
                verified: verified && duplex.as_ref().is_none_or(|d| d.verified),
                duplex,
            });
            // Progress on stderr, one line per size as it finishes: a run cut short still
            // says what it measured (the table and the JSON come at the end).
            if let Some(r) = rows.last() {
                eprintln!(
                    "kvferry bench engine: {n} blocks: query {:.3} ms, load {:.3} ms ({:.2} of raw), \
                     save {:.3} ms ({:.2} of raw){}{}",
                    r.query * 1e3,
                    r.load * 1e3,
                    r.raw / r.load,
                    r.save * 1e3,
                    r.raw / r.save,
                    r.duplex
                        .as_ref()
                        .map(|d| format!(", duplex {:.2} of raw", d.raw / d.both))
                        .unwrap_or_default(),
                    if r.verified { "" } else { ", NOT VERIFIED" },
                );
            }
        }
        c.unregister(&id).await?;
        Ok::<_, anyhow::Error>((rows, caps))
    })?;
    let (rows, caps) = out;
    Ok((rows, caps, seen.load(Ordering::Relaxed)))
}

fn report(
    a: &EngineArgs,
    shape: KvShape,
    rows: Vec<Row>,
    caps: kvferry_proto::v1::CapabilitiesResponse,
    with_events: Option<(Vec<Row>, kvferry_proto::v1::CapabilitiesResponse, u64)>,
) -> anyhow::Result<()> {
    let ok = rows.iter().all(|r| r.verified)
        && with_events
            .as_ref()
            .is_none_or(|(r, ..)| r.iter().all(|r| r.verified));
    let events_cmp: Vec<_> = with_events
        .as_ref()
        .map(|(ev, _, seen)| {
            rows.iter()
                .zip(ev)
                .map(|(off, on)| {
                    json!({
                        "blocks": off.blocks,
                        "save_ms": [off.save * 1e3, on.save * 1e3],
                        "load_ms": [off.load * 1e3, on.load * 1e3],
                        "query_ms": [off.query * 1e3, on.query * 1e3],
                        "save_ratio": on.save / off.save,
                        "load_ratio": on.load / off.load,
                        "query_ratio": on.query / off.query,
                        "events_received": seen,
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    if a.json {
        let sweep: Vec<_> = rows
            .iter()
            .map(|r| {
                json!({
                    "blocks": r.blocks,
                    "bytes": r.bytes,
                    "query_ms": r.query * 1e3,
                    "load_ms": r.load * 1e3,
                    "load_node_ms": r.node_load * 1e3,
                    "load_stages_ms": r.stages.iter().map(|(k, v)| (k.clone(), json!(v * 1e3))).collect::<serde_json::Map<_, _>>(),
                    "first_layer_ms": r.first_layer * 1e3,
                    "last_layer_ms": r.last_layer * 1e3,
                    "save_ms": r.save * 1e3,
                    "raw_ms": r.raw * 1e3,
                    "load_vs_raw": r.raw / r.load,
                    "save_vs_raw": r.raw / r.save,
                    "duplex_ms": r.duplex.as_ref().map(|d| d.both * 1e3),
                    "duplex_save_ms": r.duplex.as_ref().map(|d| d.save * 1e3),
                    "duplex_load_ms": r.duplex.as_ref().map(|d| d.load * 1e3),
                    "duplex_raw_ms": r.duplex.as_ref().map(|d| d.raw * 1e3),
                    "duplex_vs_raw": r.duplex.as_ref().map(|d| d.raw / d.both),
                    "duplex_gbps": r.duplex.as_ref().map(|d| 2.0 * r.bytes as f64 / d.both / 1e9),
                    "duplex_raw_gbps": r.duplex.as_ref().map(|d| 2.0 * r.bytes as f64 / d.raw / 1e9),
                    "verified": r.verified,
                })
            })
            .collect();
        println!(
            "{}",
            json!({
                "device": a.device,
                "copy_path": a.copy_path,
                "device_set": a.device_set,
                "board_spin_us": a.board_spin_us,
                "mailbox": !a.no_mailbox,
                "node_device": caps.device_kind,
                "layers": a.layers,
                "segment_bytes": shape.segment_bytes(),
                "block_bytes": shape.rank_bytes(),
                "iters": a.iters,
                "baseline": if a.device == "cuda" { "raw cuMemcpyHtoDAsync from pinned memory" } else { "memcpy (one contiguous copy)" },
                "duplex_baseline": if a.device == "cuda" { "raw cuMemcpyHtoDAsync and cuMemcpyDtoHAsync at once on two streams, pinned memory" } else { "two memcpys at once on two threads" },
                "sweep": sweep,
                "events": events_cmp,
                "verified": ok,
            })
        );
    } else {
        println!(
            "kvferry bench engine: {} layers x K/V x {} KiB on {} (node in its own process, {}), medians of {}",
            a.layers,
            a.segment_kib,
            a.device,
            if a.no_mailbox { "gRPC calls" } else { "request mailbox" },
            a.iters
        );
        println!(
            "{:>6} {:>10} {:>9} {:>9} {:>11} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10} {:>8} {:>9}  bytes",
            "blocks",
            "MiB",
            "query ms",
            "load ms",
            "1st layer",
            "save ms",
            "raw ms",
            "load/raw",
            "save/raw",
            "duplex ms",
            "dx raw ms",
            "dx/raw",
            "dx GB/s"
        );
        for r in &rows {
            let dx = match &r.duplex {
                Some(d) => format!(
                    "{:>10.3} {:>10.3} {:>8.2} {:>9.1}",
                    d.both * 1e3,
                    d.raw * 1e3,
                    d.raw / d.both,
                    2.0 * r.bytes as f64 / d.both / 1e9
                ),
                None => format!("{:>10} {:>10} {:>8} {:>9}", "-", "-", "-", "-"),
            };
            println!(
                "{:>6} {:>10.1} {:>9.3} {:>9.3} {:>11.3} {:>9.3} {:>9.3} {:>9.2} {:>9.2} {dx}  {}",
                r.blocks,
                r.bytes as f64 / (1 << 20) as f64,
                r.query * 1e3,
                r.load * 1e3,
                r.first_layer * 1e3,
                r.save * 1e3,
                r.raw * 1e3,
                r.raw / r.load,
                r.raw / r.save,
                if r.verified { "verified" } else { "WRONG" }
            );
        }
    }
    if let (false, Some((ev, _, seen))) = (a.json, &with_events) {
        println!(
            "with KV events published to a subscriber that read {seen} of them (medians, ms; ratio = with / without):"
        );
        println!(
            "{:>6} {:>9} {:>9} {:>7} {:>9} {:>9} {:>7} {:>9} {:>9} {:>7}",
            "blocks",
            "save",
            "+events",
            "ratio",
            "load",
            "+events",
            "ratio",
            "query",
            "+events",
            "ratio"
        );
        for (off, on) in rows.iter().zip(ev) {
            println!(
                "{:>6} {:>9.3} {:>9.3} {:>7.3} {:>9.3} {:>9.3} {:>7.3} {:>9.3} {:>9.3} {:>7.3}",
                off.blocks,
                off.save * 1e3,
                on.save * 1e3,
                on.save / off.save,
                off.load * 1e3,
                on.load * 1e3,
                on.load / off.load,
                off.query * 1e3,
                on.query * 1e3,
                on.query / off.query
            );
        }
    }
    if !ok {
        bail!("a load's bytes were wrong");
    }
    Ok(())
}
