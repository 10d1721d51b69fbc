//! `kvferry bench ssd`: loads of N blocks held only on SSD (a node restarted on the
//! directory its predecessor wrote through to; the query holds them, the load reads them
//! and copies them to the device, pipelined) against the same done raw, in the same run: an
//! `O_DIRECT` read of the same bytes from the same file at the same queue depth into pinned
//! buffers, each chunk copied to the device as it lands (`ssd_vs_raw`), and the raw read
//! alone (`ssd_vs_raw_read`).

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kvferry_actors::config::ByteSize;
use kvferry_actors::load::plan::{SSD_CHUNK, SSD_STAGING_CHUNKS};
use kvferry_actors::tier::ssd::format::BlockHeader;
use kvferry_actors::tier::ssd::io::{AlignedBuf, DirIo, Op};
use kvferry_actors::tier::ssd::{format, io, SsdConfig, SsdDir, SsdError};
use kvferry_actors::{
    BlockHash, InstanceId, LoadRequest, Node, NodeConfig, PutBlocks, QueryRequest,
};
use kvferry_gpu::{CopyDirection, CopyEvent, CopyList, Device, KvShape};
use kvferry_harness::RegisterKv;
use kvferry_testkit::{median, rank_part, DeviceKv, KvKind};
use serde_json::json;

#[derive(clap::Args)]
pub struct SsdArgs {
    #[arg(long)]
    json: bool,
    /// Blocks loaded per run (28 layers x split K/V x 32 KiB = 1.75 MiB each).
    #[arg(long, default_value_t = 256)]
    blocks: u32,
    /// Directory of the SSD tier (created; its block file is rewritten).
    #[arg(long, default_value = "/tmp/kvferry-bench-ssd")]
    dir: PathBuf,
    /// I/O in flight, for the tier and for the raw read alike.
    #[arg(long, default_value_t = 32)]
    queue_depth: u32,
    /// Timed runs of each (medians are reported); every tier run is a fresh restart.
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Device loaded into: host (emulated), cuda or auto.
    #[arg(long, default_value = "host")]
    device: String,
}

const LAYERS: u32 = 28;
/// Blocks per timed put (what a connector's save of one request's blocks looks like).
const PUT_BLOCKS: usize = 16;
const SEGMENT: u64 = 32 << 10;

fn shape() -> anyhow::Result<KvShape> {
    Ok(KvShape::new(LAYERS, 1, 2, SEGMENT)?)
}

fn config(a: &SsdArgs, block: u64) -> NodeConfig {
    let slot = format::round_up(block);
    let mut cfg = NodeConfig {
        node_id: "bench-ssd".into(),
        ..Default::default()
    };
    cfg.device.kind = a.device.clone();
    cfg.pool.slot_bytes = ByteSize(slot);
    cfg.pool.size = ByteSize(slot * (a.blocks as u64 + 4));
    cfg.ssd = Some(SsdConfig {
        dir: vec![SsdDir {
            path: a.dir.clone(),
            capacity: ByteSize(format::HEADER + (a.blocks as u64 + 4) * format::slot_stride(slot)),
        }],
        queue_depth: a.queue_depth,
        write_through: true,
        direct_io: true,
        ..Default::default()
    });
    cfg
}

/// Filesystem type of `path` as `statfs` names the common ones.
fn filesystem(path: &std::path::Path) -> String {
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return "unknown".into();
    };
    // SAFETY: a zeroed statfs is a valid out-parameter; `c` is NUL-terminated.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statfs(c.as_ptr(), &mut s) } != 0 {
        return "unknown".into();
    }
    match s.f_type {
        0xEF53 => "ext4".into(),
        0x5846_5342 => "xfs".into(),
        0x9123_683E => "btrfs".into(),
        0x0102_1994 => "tmpfs".into(),
        0x794C_7630 => "overlayfs".into(),
        t => format!("{t:#x}"),
    }
}

pub fn run(a: SsdArgs) -> anyhow::Result<()> {
    if a.blocks == 0 || a.iters == 0 {
        bail!("--blocks and --iters must be at least 1");
    }
    let shape = shape()?;
    let block = shape.block_bytes();
    let cfg = config(&a, block);
    cfg.validate()?;
    let _ = std::fs::remove_file(a.dir.join(format::FILE_NAME));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let n = a.blocks as u64;
    let instance = InstanceId::new("bench")?;

    // What write-through costs a put: the same puts (made beforehand) into the same node
    // without an SSD tier, in this run. A write-through put is answered once on disk.
    let puts: Vec<Vec<(BlockHash, Vec<u8>)>> = (0..n)
        .collect::<Vec<_>>()
        .chunks(PUT_BLOCKS)
        .map(|c| {
            c.iter()
                .map(|&i| (BlockHash::from_u64(i), rank_part(&shape, i, 0)))
                .collect()
        })
        .collect();
    let timed_puts = |cfg: NodeConfig| {
        let puts = puts.clone();
        let instance = instance.clone();
        rt.block_on(async move {
            let node = Node::start(cfg)?;
            let dev = node.device(0).context("device 0")?;
            let kv = DeviceKv::alloc(dev, shape, KvKind::Split, 1, SEGMENT, 0)?;
            kv.register(&node, "bench", "bench", 0).await?;
            let t0 = Instant::now();
            for blocks in puts {
                node.put_blocks(PutBlocks {
                    instance: instance.clone(),
                    rank: 0,
                    blocks,
                })
                .await?;
            }
            let took = t0.elapsed().as_secs_f64();
            node.shutdown();
            anyhow::Ok(took)
        })
    };
    let mut ram_cfg = cfg.clone();
    ram_cfg.ssd = None;
    let put_ram_s = timed_puts(ram_cfg)?;
    // Write every block through to disk, then stop: what the runs find is only on SSD.
    let put_wt_s = timed_puts(cfg.clone())?;
    rt.block_on(async {
        let node = Node::start(cfg.clone())?;
        let dev = node.device(0).context("device 0")?;
        let kv = DeviceKv::alloc(dev, shape, KvKind::Split, 1, SEGMENT, 0)?;
        kv.register(&node, "bench", "bench", 0).await?;
        node.ssd_sync().await?;
        let s = node.ssd_stats().await?.context("ssd stats")?;
        if s.blocks as u64 != n {
            bail!("{} of {n} blocks reached the disk", s.blocks);
        }
        node.shutdown();
        anyhow::Ok(())
    })?;

    // The raw runs: the same bytes, the same file, the same queue depth, without the tier:
    // one read per slot (its header and padding included), in file order, copied to the
    // device ([`RawH2d`]) and read alone. Each run of the node does the tier's load and the
    // raw runs, in alternating order, so they meet the disk in the same state.
    let stride = format::slot_stride(format::round_up(block));
    let file = a.dir.join(format::FILE_NAME);
    let mut raw = Vec::new();
    let mut raw_h2d = Vec::new();
    let mut raw_mode = None;
    let mut total = Vec::new();
    let mut queries = Vec::new();
    let mut loads = Vec::new();
    let mut disk_waits = Vec::new();
    let mut h2d_waits = Vec::new();
    let mut modes = None;
    let mut device_name = String::new();
    for i in 0..a.iters {
        let (q_s, l_s, waits, raw_s, mode, name) = rt.block_on(async {
            let node = Node::start(cfg.clone())?;
            let dev = node.device(0).context("device 0")?;
            let kv = DeviceKv::alloc(dev, shape, KvKind::Split, a.blocks, SEGMENT, 0)?;
            kv.register(&node, "bench", "bench", 0).await?;
            // The raw read + copy to the same device, while the node (and its device) lives;
            // every other run goes first, so neither meets the disk (and whatever caches sit
            // under it) in a better state by its place in the run.
            let dev = node.device(0).context("device 0")?;
            let name = dev.name();
            let raw = RawH2d {
                path: file.clone(),
                blocks: n,
                stride,
                block,
                qd: a.queue_depth,
                verify: (i == 0).then_some(shape),
            };
            let (path, qd) = (file.clone(), a.queue_depth);
            // Raw read + copy, then the raw read alone (the same bytes into plain buffers).
            let mut raw_run = Some(move || async move {
                tokio::task::spawn_blocking(move || {
                    let h2d = raw.run(dev)?;
                    let (bytes, took, mode) =
                        io::raw_read(&path, true, format::HEADER, n * stride, stride, qd)?;
                    if bytes < n * stride {
                        bail!("raw read returned {bytes} of {} bytes", n * stride);
                    }
                    anyhow::Ok((h2d, took, mode))
                })
                .await
                .context("the raw read thread")?
            });
            let mut raw_s = None;
            if let Some(run) = raw_run.take_if(|_| i % 2 == 1) {
                raw_s = Some(run().await?);
            }
            let t0 = Instant::now();
            let q = node
                .query(QueryRequest {
                    instance: instance.clone(),
                    hashes: (0..n).map(kvferry_actors::BlockHash::from_u64).collect(),
                    direct_gpu: false,
                    tenant: None,
                })
                .await?;
            let q_s = t0.elapsed().as_secs_f64();
            if q.local_blocks as u64 != n {
                bail!("{} of {n} blocks found after the restart", q.local_blocks);
            }
            let t1 = Instant::now();
            let report = node
                .load(LoadRequest {
                    lease: q.lease.context("a lease")?,
                    instance: instance.clone(),
                    rank: 0,
                    dest_blocks: (0..a.blocks).collect(),
                    per_layer: false,
                })
                .await?;
            let l_s = t1.elapsed().as_secs_f64();
            let waits = (
                report.stage("disk").unwrap_or(0.0),
                report.stage("h2d").unwrap_or(0.0),
            );
            if i == 0 {
                let want: Vec<(u32, u64)> = (0..a.blocks).map(|b| (b, b as u64)).collect();
                kv.verify(&want, 0).map_err(anyhow::Error::msg)?;
            }
            let s = node.ssd_stats().await?.context("ssd stats")?;
            if s.hits_ssd != n {
                bail!("{} of {n} blocks came from SSD", s.hits_ssd);
            }
            let mode = s.dirs.first().map(|d| (d.direct, d.uring));
            if let Some(run) = raw_run.take() {
                raw_s = Some(run().await?);
            }
            let raw_s = raw_s.context("the raw run")?;
            node.shutdown();
            anyhow::Ok((q_s, l_s, waits, raw_s, mode, name))
        })?;
        let (raw_s, raw_read_s, raw_read_mode) = raw_s;
        queries.push(q_s);
        loads.push(l_s);
        total.push(q_s + l_s);
        disk_waits.push(waits.0);
        h2d_waits.push(waits.1);
        raw_h2d.push(raw_s.as_secs_f64());
        modes = mode;
        device_name = name;
        raw.push(raw_read_s.as_secs_f64());
        raw_mode = Some(raw_read_mode);
    }

    let _ = std::fs::remove_file(&file);

    let (t, q, l, w, wh) = (
        median(&mut total),
        median(&mut queries),
        median(&mut loads),
        median(&mut raw),
        median(&mut raw_h2d),
    );
    let (dw, hw) = (median(&mut disk_waits), median(&mut h2d_waits));
    let data = (n * block) as f64;
    let gbs = |s: f64| data / s / 1e9;
    let fs = filesystem(&a.dir);
    let (direct, uring) = modes.unwrap_or((false, false));
    let raw_direct = raw_mode.as_ref().is_some_and(|m| m.direct.is_ok());
    if a.json {
        println!(
            "{}",
            json!({
                "blocks": n,
                "block_bytes": block,
                "queue_depth": a.queue_depth,
                "iters": a.iters,
                "device": a.device,
                "device_name": device_name,
                "dir": a.dir,
                "filesystem": fs,
                "o_direct": direct,
                "io_uring": uring,
                "raw_o_direct": raw_direct,
                "ssd_load_seconds": t,
                "query_seconds": q,
                "load_seconds": l,
                "load_disk_wait_seconds": dw,
                "load_h2d_wait_seconds": hw,
                "raw_read_h2d_seconds": wh,
                "raw_read_seconds": w,
                "ssd_load_gbps": gbs(t),
                "raw_read_h2d_gbps": gbs(wh),
                "raw_read_gbps": gbs(w),
                "ssd_vs_raw": wh / t,
                "ssd_vs_raw_read": w / t,
                "put_ram_seconds": put_ram_s,
                "put_write_through_seconds": put_wt_s,
                "write_through_put_vs_ram": put_wt_s / put_ram_s,
                "verified": true,
            })
        );
    } else {
        println!(
            "{n} blocks of {} on {} ({fs}), queue depth {}, O_DIRECT {direct}, io_uring {uring}, \
             into {device_name}",
            ByteSize(block),
            a.dir.display(),
            a.queue_depth
        );
        println!(
            "  ssd load (query + load: disk reads pipelined with copies): {:.1} ms  {:.2} GB/s",
            t * 1e3,
            gbs(t)
        );
        println!(
            "    query {:.2} ms, load {:.1} ms (waited on disk {:.1} ms, on copies {:.1} ms)",
            q * 1e3,
            l * 1e3,
            dw * 1e3,
            hw * 1e3
        );
        println!(
            "  raw O_DIRECT read + copy to the device, pipelined:         {:.1} ms  {:.2} GB/s",
            wh * 1e3,
            gbs(wh)
        );
        println!(
            "  raw O_DIRECT sequential read alone:                         {:.1} ms  {:.2} GB/s",
            w * 1e3,
            gbs(w)
        );
        println!(
            "  ssd_vs_raw = {:.2} (against the raw read alone: {:.2}); bytes verified",
            wh / t,
            w / t
        );
        println!(
            "  puts of {PUT_BLOCKS} blocks: RAM only {:.1} ms  {:.2} GB/s; write-through \
             (answered once on disk) {:.1} ms  {:.2} GB/s; write_through_put_vs_ram = {:.2}",
            put_ram_s * 1e3,
            gbs(put_ram_s),
            put_wt_s * 1e3,
            gbs(put_wt_s),
            put_wt_s / put_ram_s
        );
    }
    Ok(())
}

/// The tier's load done raw: `O_DIRECT` reads of the block file's slots (header and padding
/// included, at the tier's queue depth, on the tier's own I/O engine) into pinned buffers,
/// each chunk of [`SSD_CHUNK`] blocks copied to a contiguous device buffer as one batch as
/// soon as it landed, [`SSD_STAGING_CHUNKS`] chunks of buffers in flight: the same pipeline
/// without the index, the checksums, the actors and the layer scatter.
struct RawH2d {
    path: PathBuf,
    blocks: u64,
    stride: u64,
    block: u64,
    qd: u32,
    /// Check every block's bytes on the device against its pattern (the first run).
    verify: Option<KvShape>,
}

impl RawH2d {
    fn run(self, dev: Arc<dyn Device>) -> anyhow::Result<Duration> {
        let (file, direct) = io::open_file(&self.path, true)?;
        let (dio, _) = DirIo::new(self.path.clone(), file, direct.is_ok(), self.qd);
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("kvferry-ssd-raw".into())
            .spawn(move || dio.run(rx))?;
        let out = self.pipeline(&dev, &tx);
        drop(tx);
        let _ = thread.join();
        out
    }

    fn pipeline(&self, dev: &Arc<dyn Device>, tx: &mpsc::Sender<Op>) -> anyhow::Result<Duration> {
        let chunk = SSD_CHUNK as u64;
        let ring = SSD_STAGING_CHUNKS;
        let mut bufs: Vec<Option<AlignedBuf>> = (0..ring * SSD_CHUNK)
            .map(|_| {
                // Touched now, as the node's pool is mapped before its loads.
                let mut b = AlignedBuf::new(self.stride as usize);
                b.as_mut_slice().fill(0);
                Some(b)
            })
            .collect();
        let addrs: Vec<u64> = bufs
            .iter()
            .flatten()
            .map(|b| b.as_slice().as_ptr() as u64)
            .collect();
        // Pinned once, before the clock starts (the node's pool is pinned at start too).
        let _pinned = addrs
            .iter()
            .map(|&a| dev.register_host(a, self.stride, false))
            .collect::<Result<Vec<_>, _>>()?;
        let dst = dev.alloc(self.blocks * self.block)?;
        let n_chunks = self.blocks.div_ceil(chunk);
        type Reads = Vec<tokio::sync::oneshot::Receiver<Result<AlignedBuf, SsdError>>>;
        let mut reading: VecDeque<(u64, Reads)> = VecDeque::new();
        let mut copying: VecDeque<CopyEvent> = VecDeque::new();
        let mut keys: Vec<BlockHash> = Vec::new();
        let stopped = || anyhow::anyhow!("the raw read thread stopped");
        let t0 = Instant::now();
        let mut next = 0u64;
        loop {
            while next < n_chunks && reading.len() + copying.len() < ring {
                let base = (next as usize % ring) * SSD_CHUNK;
                let first = next * chunk;
                let mut rxs = Vec::new();
                for j in 0..chunk.min(self.blocks - first) {
                    let buf = bufs[base + j as usize].take().context("a buffer in use")?;
                    let (reply, r) = tokio::sync::oneshot::channel();
                    let offset = format::slot_offset(first + j, self.stride);
                    tx.send(Op::Raw { offset, buf, reply })
                        .map_err(|_| stopped())?;
                    rxs.push(r);
                }
                reading.push_back((next, rxs));
                next += 1;
            }
            if let Some((k, rxs)) = reading.pop_front() {
                let base = (k as usize % ring) * SSD_CHUNK;
                let first = k * chunk;
                let mut list = CopyList::with_capacity(rxs.len());
                for (j, r) in rxs.into_iter().enumerate() {
                    let buf = r.blocking_recv().map_err(|_| stopped())??;
                    if self.verify.is_some() {
                        let h = BlockHeader::decode(&buf.as_slice()[..format::HEADER as usize])
                            .map_err(|d| {
                                anyhow::anyhow!("slot {}: {}", first + j as u64, d.as_str())
                            })?;
                        keys.push(h.key.hash);
                    }
                    bufs[base + j] = Some(buf);
                    list.push(
                        addrs[base + j] + format::HEADER,
                        dst.ptr() + (first + j as u64) * self.block,
                        self.block,
                    );
                }
                // Buffers go back into `bufs` above but are not reused until this copy is
                // done: the next read of this ring position waits for it below.
                // SAFETY: the sources are this run's pinned buffers, neither freed nor read
                // into again before the event resolves (`copying` is drained first); the
                // destination is `dst`, alive until the end of this function.
                copying.push_back(unsafe { dev.submit(CopyDirection::HostToDevice, list) }?);
                if next < n_chunks && reading.len() + copying.len() >= ring {
                    if let Some(ev) = copying.pop_front() {
                        ev.wait_blocking()?;
                    }
                }
                continue;
            }
            match copying.pop_front() {
                Some(ev) => {
                    ev.wait_blocking()?;
                }
                None => break,
            }
        }
        let took = t0.elapsed();
        if let Some(shape) = self.verify {
            verify_raw(dev, dst.ptr(), &shape, &keys, self.blocks)?;
        }
        Ok(took)
    }
}

/// Every block the raw run copied holds the pattern of the block its slot's header names,
/// and every block was found once.
fn verify_raw(
    dev: &Arc<dyn Device>,
    dst: u64,
    shape: &KvShape,
    keys: &[BlockHash],
    blocks: u64,
) -> anyhow::Result<()> {
    let ids: HashMap<BlockHash, u64> = (0..blocks).map(|b| (BlockHash::from_u64(b), b)).collect();
    let mut seen = vec![false; blocks as usize];
    let len = shape.rank_bytes();
    let mut got = vec![0u8; len as usize];
    for (i, k) in keys.iter().enumerate() {
        let b = *ids
            .get(k)
            .with_context(|| format!("slot {i} holds an unknown block"))?;
        if std::mem::replace(&mut seen[b as usize], true) {
            bail!("block {b} found twice");
        }
        dev.read(dst + i as u64 * len, &mut got)?;
        if got != rank_part(shape, b, 0) {
            bail!("raw read + copy: block {b} (slot {i}) differs on the device");
        }
    }
    if keys.len() as u64 != blocks {
        bail!("the raw run saw {} of {blocks} blocks", keys.len());
    }
    Ok(())
}
