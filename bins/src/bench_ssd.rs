//! `kvferry bench ssd`: loads of N blocks held only on SSD (a node restarted on the
//! directory its predecessor wrote through to) against a raw `O_DIRECT` sequential read of
//! the same bytes from the same file at the same queue depth, in the same run.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use kvferry_actors::config::ByteSize;
use kvferry_actors::ssd::{format, io, SsdConfig, SsdDir};
use kvferry_actors::{InstanceId, LoadRequest, Node, NodeConfig, QueryRequest};
use kvferry_gpu::KvShape;
use kvferry_testkit::{median, put_pattern, DeviceKv, KvKind};
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

    // Write every block through to disk, then stop: what the runs find is only on SSD.
    rt.block_on(async {
        let node = Node::start(cfg.clone())?;
        let dev = node.device(0).context("device 0")?;
        let kv = DeviceKv::alloc(dev, shape, KvKind::Split, 1, SEGMENT, 0)?;
        kv.register(&node, "bench", "bench", 0).await?;
        put_pattern(&node, &instance, &shape, 0, 0..n).await?;
        node.ssd_sync().await?;
        let s = node.ssd_stats().await?.context("ssd stats")?;
        if s.blocks as u64 != n {
            bail!("{} of {n} blocks reached the disk", s.blocks);
        }
        node.shutdown();
        anyhow::Ok(())
    })?;

    // The raw read: the same bytes, the same file, the same queue depth, without the tier:
    // one read per slot (its header and padding included), in file order. Interleaved with
    // the tier's runs so both meet the disk in the same state.
    let stride = format::slot_stride(format::round_up(block));
    let file = a.dir.join(format::FILE_NAME);
    let mut raw = Vec::new();
    let mut raw_mode = None;
    let mut total = Vec::new();
    let mut reads = Vec::new();
    let mut copies = Vec::new();
    let mut modes = None;
    for i in 0..a.iters {
        let (q_s, l_s, mode) = rt.block_on(async {
            let node = Node::start(cfg.clone())?;
            let dev = node.device(0).context("device 0")?;
            let kv = DeviceKv::alloc(dev, shape, KvKind::Split, a.blocks, SEGMENT, 0)?;
            kv.register(&node, "bench", "bench", 0).await?;
            let t0 = Instant::now();
            let q = node
                .query(QueryRequest {
                    instance: instance.clone(),
                    hashes: (0..n).map(kvferry_actors::BlockHash::from_u64).collect(),
                    direct_gpu: false,
                })
                .await?;
            let q_s = t0.elapsed().as_secs_f64();
            if q.local_blocks as u64 != n {
                bail!("{} of {n} blocks found after the restart", q.local_blocks);
            }
            let t1 = Instant::now();
            node.load(LoadRequest {
                lease: q.lease.context("a lease")?,
                instance: instance.clone(),
                rank: 0,
                dest_blocks: (0..a.blocks).collect(),
            })
            .await?;
            let l_s = t1.elapsed().as_secs_f64();
            if i == 0 {
                let want: Vec<(u32, u64)> = (0..a.blocks).map(|b| (b, b as u64)).collect();
                kv.verify(&want, 0).map_err(anyhow::Error::msg)?;
            }
            let s = node.ssd_stats().await?.context("ssd stats")?;
            if s.hits_ssd != n {
                bail!("{} of {n} blocks came from SSD", s.hits_ssd);
            }
            let mode = s.dirs.first().map(|d| (d.direct, d.uring));
            node.shutdown();
            anyhow::Ok((q_s, l_s, mode))
        })?;
        reads.push(q_s);
        copies.push(l_s);
        total.push(q_s + l_s);
        modes = mode;
        let (bytes, took, mode) = std::thread::scope(|s| {
            s.spawn(|| {
                io::raw_read(
                    &file,
                    true,
                    format::HEADER,
                    n * stride,
                    stride,
                    a.queue_depth,
                )
            })
            .join()
            .map_err(|_| anyhow::anyhow!("the raw read thread panicked"))
        })??;
        if bytes < n * stride {
            bail!("raw read returned {bytes} of {} bytes", n * stride);
        }
        raw.push(took.as_secs_f64());
        raw_mode = Some(mode);
    }

    let _ = std::fs::remove_file(&file);

    let (t, r, c, w) = (
        median(&mut total),
        median(&mut reads),
        median(&mut copies),
        median(&mut raw),
    );
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
                "dir": a.dir,
                "filesystem": fs,
                "o_direct": direct,
                "io_uring": uring,
                "raw_o_direct": raw_direct,
                "ssd_load_seconds": t,
                "ssd_read_seconds": r,
                "copy_seconds": c,
                "raw_read_seconds": w,
                "ssd_load_gbps": gbs(t),
                "ssd_read_gbps": gbs(r),
                "raw_read_gbps": gbs(w),
                "ssd_vs_raw": w / t,
                "ssd_read_vs_raw": w / r,
            })
        );
    } else {
        println!(
            "{n} blocks of {} on {} ({fs}), queue depth {}, O_DIRECT {direct}, io_uring {uring}",
            ByteSize(block),
            a.dir.display(),
            a.queue_depth
        );
        println!(
            "  ssd load (query with SSD reads + load): {:.1} ms  {:.2} GB/s",
            t * 1e3,
            gbs(t)
        );
        println!(
            "    of which SSD reads into RAM (query):  {:.1} ms  {:.2} GB/s",
            r * 1e3,
            gbs(r)
        );
        println!(
            "    of which copy to the device (load):   {:.1} ms",
            c * 1e3
        );
        println!(
            "  raw O_DIRECT sequential read:           {:.1} ms  {:.2} GB/s",
            w * 1e3,
            gbs(w)
        );
        println!("  ssd_vs_raw = {:.2} (reads alone: {:.2})", w / t, w / r);
    }
    Ok(())
}
