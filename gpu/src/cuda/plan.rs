//! Turning one [`CopyList`] into driver work: device-side validation, host address
//! translation and the choice between copy engines, the gather kernel and the staged path.
//! Pure logic over a [`Resolver`], so it is tested without a GPU.

use std::ops::Range;

use crate::{CopyDirection, CopyList, CopyOp, DeviceError};

use super::kernel::{push_chunked, Desc};

/// How a batch's copies are issued.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CopyPath {
    /// Copy engines for short lists of long ranges; the staged path for fragmented batches
    /// whose host side is long pinned runs; the gather kernel for other fragmented batches
    /// whose host side is mapped; the batched copy call (or one call per range) for the rest.
    #[default]
    Auto,
    /// The gather kernel wherever it can run (mapped host side, 16-byte alignment).
    Kernel,
    /// The driver's batched copy call for every range.
    Batch,
    /// One `cuMemcpyAsync` per range (the baseline).
    PerOp,
    /// Every host-contiguous run through the copy engines into a device staging buffer, then
    /// one device-to-device scatter per staging chunk (gather then copy out for D2H). Falls
    /// back to the copy engines where the kernel is not loaded.
    Staged,
}

impl CopyPath {
    /// Every path by its config name, in declaration order.
    pub const NAMES: [(&'static str, CopyPath); 5] = [
        ("auto", CopyPath::Auto),
        ("kernel", CopyPath::Kernel),
        ("batch", CopyPath::Batch),
        ("per-op", CopyPath::PerOp),
        ("staged", CopyPath::Staged),
    ];

    /// The path a config names (`auto`, `kernel`, `batch`, `per-op`, `staged`).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::NAMES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, p)| *p)
    }
}

/// Below this many ranges, or at this average size and above, copy engines win: each call is
/// long enough that its launch cost vanishes, and they run at full link speed.
pub const ENGINE_MAX_OPS: usize = 4;
pub const ENGINE_MIN_AVG_BYTES: u64 = 4 << 20;

/// Host runs at least this long on average make staging pay in `Auto`: the copy engines move
/// them at link speed, where the kernel reading host memory over PCIe tops out near 0.88 of
/// it; shorter runs would cost one engine call each for little data.
pub const STAGE_MIN_AVG_RUN: u64 = 256 << 10;
/// Below this a batch is latency-bound and the extra hop (engine copy, event, launch) of the
/// staged path is not worth it. Measured on the H200 (56 segments of 32 KiB per block,
/// submission to completion): one block 57 us through the kernel against 69 staged, four
/// blocks (7 MiB) 174 against 172.
pub const STAGE_MIN_BYTES: u64 = 4 << 20;

/// Where a host address is visible to the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostMap {
    /// The registered (or pinned) host span that holds the address.
    pub start: u64,
    pub end: u64,
    /// Device address of `start`.
    pub device: u64,
}

/// What the planner asks of the driver.
pub trait Resolver {
    /// The allocation `[start, end)` of this device that holds `ptr`, or the error that names
    /// why `ptr` is not this device's memory.
    fn device_alloc(&self, ptr: u64, len: u64) -> Result<(u64, u64), DeviceError>;
    /// The device mapping of host range `[addr, addr + len)`, `None` where the device cannot
    /// address all of it (pageable memory): such ranges go through the copy engines.
    fn host_map(&self, addr: u64, len: u64) -> Option<HostMap>;
}

/// The paths a device can take for a batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Paths {
    /// The gather kernel is loaded.
    pub kernel: bool,
    /// The driver has the batched copy call.
    pub batch: bool,
    /// Bytes of one staging chunk; 0 where the device has no staging buffers.
    pub stage_chunk: u64,
}

/// One host-contiguous piece the copy engines move between host memory and a staging chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// Host address (unified address, as the caller gave it).
    pub host: u64,
    /// Offset inside the chunk's staging buffer.
    pub offset: u64,
    pub len: u64,
}

/// The work of one staging chunk: engine copies and the kernel descriptors that scatter (H2D)
/// or gather (D2H) the same bytes on the device.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StageChunk {
    pub spans: Vec<Span>,
    /// This chunk's descriptors in [`Staged::descs`].
    pub descs: Range<usize>,
}

/// A batch cut into staging chunks, in order. Chunk `i` uses staging buffer `i % n`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Staged {
    pub chunks: Vec<StageChunk>,
    /// Kernel descriptors whose staging side (`src` for H2D, `dst` for D2H) is an offset into
    /// the chunk's buffer until [`Staged::relocate`] turns it into an address.
    pub descs: Vec<Desc>,
}

/// The work for one batch.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Descriptors for one gather-kernel launch (device-visible addresses).
    pub kernel: Vec<Desc>,
    /// Ranges for the copy engines (unified addresses, as the caller gave them).
    pub engine: Vec<CopyOp>,
    /// Issue `engine` as one batched call rather than one call each.
    pub engine_batched: bool,
    /// The staged path; when set, `kernel` and `engine` are empty.
    pub staged: Option<Staged>,
}

/// `(host, device)` addresses of an op.
fn sides(dir: CopyDirection, op: &CopyOp) -> (u64, u64) {
    match dir {
        CopyDirection::HostToDevice => (op.src, op.dst),
        CopyDirection::DeviceToHost => (op.dst, op.src),
    }
}

/// The host-contiguous runs of `ops` as `(host, len)`: consecutive ops whose host ranges are
/// adjacent (a block-major pool makes one run of each block's rank part).
pub fn host_runs(dir: CopyDirection, ops: &[CopyOp]) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for op in ops {
        let (host, _) = sides(dir, op);
        match runs.last_mut() {
            Some((start, len)) if *start + *len == host => *len += op.len,
            _ => runs.push((host, op.len)),
        }
    }
    runs
}

/// Cuts `ops` into staging chunks of `chunk` bytes (a multiple of 16, at least 32). Each run
/// is copied into consecutive staging bytes, cut where a chunk ends; a new run starts at a
/// staging offset congruent to its host address modulo 16, so the kernel's 16-byte path
/// applies wherever the device side allows it.
pub fn stage(dir: CopyDirection, ops: &[CopyOp], chunk: u64) -> Staged {
    let mut out = Staged::default();
    let mut spans: Vec<Span> = Vec::new();
    let mut first = 0usize;
    let mut cursor = 0u64;
    let close = |out: &mut Staged, spans: &mut Vec<Span>, first: &mut usize| {
        let end = out.descs.len();
        out.chunks.push(StageChunk {
            spans: std::mem::take(spans),
            descs: *first..end,
        });
        *first = end;
    };
    for op in ops {
        let (mut host, mut dev) = sides(dir, op);
        let mut left = op.len;
        while left > 0 {
            let continues = cursor < chunk && spans.last().is_some_and(|s| s.host + s.len == host);
            if !continues {
                let mut at = (cursor & !15) + host % 16;
                if at < cursor {
                    at += 16;
                }
                if at >= chunk {
                    close(&mut out, &mut spans, &mut first);
                    at = host % 16;
                }
                spans.push(Span {
                    host,
                    offset: at,
                    len: 0,
                });
                cursor = at;
            }
            let take = left.min(chunk - cursor);
            if let Some(s) = spans.last_mut() {
                s.len += take;
            }
            match dir {
                CopyDirection::HostToDevice => push_chunked(&mut out.descs, cursor, dev, take),
                CopyDirection::DeviceToHost => push_chunked(&mut out.descs, dev, cursor, take),
            }
            cursor += take;
            host += take;
            dev += take;
            left -= take;
        }
    }
    if !spans.is_empty() {
        close(&mut out, &mut spans, &mut first);
    }
    out
}

impl Staged {
    /// The descriptors with staging offsets turned into addresses: chunk `i` uses
    /// `bases[i % bases.len()]`.
    pub fn relocate(&self, dir: CopyDirection, bases: &[u64]) -> Vec<Desc> {
        let mut out = self.descs.clone();
        if bases.is_empty() {
            return out;
        }
        for (i, c) in self.chunks.iter().enumerate() {
            let base = bases[i % bases.len()];
            for d in &mut out[c.descs.clone()] {
                match dir {
                    CopyDirection::HostToDevice => d.src += base,
                    CopyDirection::DeviceToHost => d.dst += base,
                }
            }
        }
        out
    }
}

/// True where every run lies in pinned, device-mapped host memory: the copy engines move
/// those asynchronously at link speed; pageable runs keep the old paths.
fn runs_pinned(runs: &[(u64, u64)], r: &dyn Resolver) -> bool {
    let mut map: Option<HostMap> = None;
    runs.iter().all(|&(host, len)| {
        let fits = |m: &HostMap| host >= m.start && host + len <= m.end;
        if !map.as_ref().is_some_and(fits) {
            map = r.host_map(host, len).filter(fits);
        }
        map.is_some()
    })
}

/// Validates every device-side range of `list` and splits the batch between the kernel and
/// the copy engines, or cuts it into staging chunks. `paths` says which paths exist.
pub fn plan(
    dir: CopyDirection,
    list: &CopyList,
    path: CopyPath,
    paths: Paths,
    r: &dyn Resolver,
) -> Result<Plan, DeviceError> {
    let (kernel_ok, batch_ok) = (paths.kernel, paths.batch);
    let ops = list.ops();
    // Validate first: a batch with one bad range copies nothing. A KV batch cycles through
    // every layer's tensors (split K/V: one allocation per segment, and a block's segments
    // one after another), so remember every allocation already seen in this batch, sorted
    // by start: one driver query per allocation, and a binary search per range (a linear
    // scan cost 0.4 ms for a 7168-range batch over 56 allocations on the H200's host).
    let mut seen: Vec<(u64, u64)> = Vec::new();
    for op in ops {
        let dev = match dir {
            CopyDirection::HostToDevice => op.dst,
            CopyDirection::DeviceToHost => op.src,
        };
        let end = dev.checked_add(op.len);
        // The last allocation starting at or below `dev` is the only one that can hold it
        // (allocations do not overlap).
        let at = seen.partition_point(|&(s, _)| s <= dev);
        if at > 0 && end.is_some_and(|x| x <= seen[at - 1].1) {
            continue;
        }
        // Ok only where the whole range lies inside the allocation, so a known allocation
        // is never found again.
        let found = r.device_alloc(dev, op.len)?;
        seen.insert(seen.partition_point(|&(s, _)| s < found.0), found);
    }

    let avg = if ops.is_empty() {
        0
    } else {
        list.bytes() / ops.len() as u64
    };
    let fragmented = ops.len() > ENGINE_MAX_OPS && avg < ENGINE_MIN_AVG_BYTES;
    let mut out = Plan::default();
    if kernel_ok && paths.stage_chunk > 0 {
        let staged = match path {
            CopyPath::Staged => true,
            CopyPath::Auto if fragmented && list.bytes() >= STAGE_MIN_BYTES => {
                let runs = host_runs(dir, ops);
                list.bytes() / runs.len() as u64 >= STAGE_MIN_AVG_RUN && runs_pinned(&runs, r)
            }
            _ => false,
        };
        if staged {
            out.staged = Some(stage(dir, ops, paths.stage_chunk));
            return Ok(out);
        }
    }
    let use_kernel = kernel_ok
        && match path {
            CopyPath::Auto => fragmented,
            CopyPath::Kernel => true,
            CopyPath::Batch | CopyPath::PerOp | CopyPath::Staged => false,
        };
    if !use_kernel {
        out.engine = ops.to_vec();
    } else {
        let mut map: Option<HostMap> = None;
        for op in ops {
            let host = match dir {
                CopyDirection::HostToDevice => op.src,
                CopyDirection::DeviceToHost => op.dst,
            };
            let fits = |m: &HostMap| host >= m.start && host + op.len <= m.end;
            if !map.as_ref().is_some_and(fits) {
                map = r.host_map(host, op.len).filter(fits);
            }
            let aligned = (op.src | op.dst | op.len) % 16 == 0;
            match map {
                Some(m) if aligned => {
                    let h = m.device + (host - m.start);
                    let (src, dst) = match dir {
                        CopyDirection::HostToDevice => (h, op.dst),
                        CopyDirection::DeviceToHost => (op.src, h),
                    };
                    push_chunked(&mut out.kernel, src, dst, op.len);
                }
                _ => out.engine.push(*op),
            }
        }
    }
    out.engine_batched = batch_ok
        && out.engine.len() > 1
        && match path {
            CopyPath::Batch => true,
            CopyPath::Auto | CopyPath::Staged => out.engine.len() > ENGINE_MAX_OPS,
            CopyPath::Kernel | CopyPath::PerOp => false,
        };
    Ok(out)
}

#[cfg(test)]
mod tests;
