//! Turning one [`CopyList`] into driver work: device-side validation, host address
//! translation and the choice between copy engines and the gather kernel. Pure logic over a
//! [`Resolver`], so it is tested without a GPU.

use crate::{CopyDirection, CopyList, CopyOp, DeviceError};

use super::kernel::{push_chunked, Desc};

/// How a batch's copies are issued.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CopyPath {
    /// Copy engines for short lists of long ranges; the gather kernel for fragmented batches
    /// whose host side is mapped; the batched copy call (or one call per range) for the rest.
    #[default]
    Auto,
    /// The gather kernel wherever it can run (mapped host side, 16-byte alignment).
    Kernel,
    /// The driver's batched copy call for every range.
    Batch,
    /// One `cuMemcpyAsync` per range (the baseline).
    PerOp,
}

/// Below this many ranges, or at this average size and above, copy engines win: each call is
/// long enough that its launch cost vanishes, and they run at full link speed.
pub const ENGINE_MAX_OPS: usize = 4;
pub const ENGINE_MIN_AVG_BYTES: u64 = 4 << 20;

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

/// The work for one batch.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Descriptors for one gather-kernel launch (device-visible addresses).
    pub kernel: Vec<Desc>,
    /// Ranges for the copy engines (unified addresses, as the caller gave them).
    pub engine: Vec<CopyOp>,
    /// Issue `engine` as one batched call rather than one call each.
    pub engine_batched: bool,
}

/// Validates every device-side range of `list` and splits the batch between the kernel and
/// the copy engines. `kernel_ok` and `batch_ok` say whether those paths exist.
pub fn plan(
    dir: CopyDirection,
    list: &CopyList,
    path: CopyPath,
    kernel_ok: bool,
    batch_ok: bool,
    r: &dyn Resolver,
) -> Result<Plan, DeviceError> {
    let ops = list.ops();
    // Validate first: a batch with one bad range copies nothing. A KV batch cycles through
    // every layer's tensors (split K/V: one allocation per segment), so remember every
    // allocation already seen in this batch instead of only the last one: one driver query
    // per allocation rather than one per range.
    let mut seen: Vec<(u64, u64)> = Vec::new();
    for op in ops {
        let dev = match dir {
            CopyDirection::HostToDevice => op.dst,
            CopyDirection::DeviceToHost => op.src,
        };
        let inside =
            |&(s, e): &(u64, u64)| dev >= s && dev.checked_add(op.len).is_some_and(|x| x <= e);
        if seen.iter().rev().any(inside) {
            continue;
        }
        seen.push(r.device_alloc(dev, op.len)?);
    }

    let avg = if ops.is_empty() {
        0
    } else {
        list.bytes() / ops.len() as u64
    };
    let use_kernel = kernel_ok
        && match path {
            CopyPath::Auto => ops.len() > ENGINE_MAX_OPS && avg < ENGINE_MIN_AVG_BYTES,
            CopyPath::Kernel => true,
            CopyPath::Batch | CopyPath::PerOp => false,
        };
    let mut out = Plan::default();
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
            CopyPath::Auto => out.engine.len() > ENGINE_MAX_OPS,
            CopyPath::Kernel | CopyPath::PerOp => false,
        };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Device memory: one allocation at [1M, 2M); host: registered [10M, 11M) mapped at 50M.
    struct Fake;

    impl Resolver for Fake {
        fn device_alloc(&self, ptr: u64, len: u64) -> Result<(u64, u64), DeviceError> {
            if ptr >= 1 << 20 && ptr + len <= 2 << 20 {
                Ok((1 << 20, 2 << 20))
            } else {
                Err(DeviceError::NotDeviceMemory {
                    ordinal: 0,
                    ptr,
                    len,
                })
            }
        }
        fn host_map(&self, addr: u64, _len: u64) -> Option<HostMap> {
            ((10 << 20..11 << 20).contains(&addr)).then_some(HostMap {
                start: 10 << 20,
                end: 11 << 20,
                device: 50 << 20,
            })
        }
    }

    fn fragmented(n: u64, host: u64) -> CopyList {
        let mut l = CopyList::default();
        for i in 0..n {
            l.push(host + i * 4096, (1 << 20) + i * 8192, 4096);
        }
        l
    }

    /// Two allocations, [1M, 2M) and [4M, 5M); counts the driver queries.
    struct Counting(std::cell::Cell<usize>);

    impl Resolver for Counting {
        fn device_alloc(&self, ptr: u64, len: u64) -> Result<(u64, u64), DeviceError> {
            self.0.set(self.0.get() + 1);
            [(1u64 << 20, 2u64 << 20), (4 << 20, 5 << 20)]
                .into_iter()
                .find(|&(s, e)| ptr >= s && ptr + len <= e)
                .ok_or(DeviceError::NotDeviceMemory {
                    ordinal: 0,
                    ptr,
                    len,
                })
        }
        fn host_map(&self, _: u64, _: u64) -> Option<HostMap> {
            None
        }
    }

    #[test]
    fn validation_queries_each_allocation_once_per_batch() {
        // Alternating between two tensors, as a split K/V load does.
        let mut l = CopyList::default();
        for i in 0..64u64 {
            let dst = if i % 2 == 0 { 1 << 20 } else { 4 << 20 };
            l.push(10 << 20 | (i * 8192), dst + i * 4096, 1024);
        }
        let r = Counting(std::cell::Cell::new(0));
        plan(
            CopyDirection::HostToDevice,
            &l,
            CopyPath::PerOp,
            false,
            false,
            &r,
        )
        .unwrap();
        assert_eq!(r.0.get(), 2);
        // A range outside both is still refused.
        l.push(0, 3 << 20, 64);
        assert!(plan(
            CopyDirection::HostToDevice,
            &l,
            CopyPath::PerOp,
            false,
            false,
            &r
        )
        .is_err());
    }

    #[test]
    fn fragmented_mapped_batches_go_to_the_kernel() {
        let l = fragmented(16, 10 << 20);
        let p = plan(
            CopyDirection::HostToDevice,
            &l,
            CopyPath::Auto,
            true,
            true,
            &Fake,
        )
        .unwrap();
        assert_eq!(p.kernel.len(), 16);
        assert!(p.engine.is_empty());
        assert_eq!(
            p.kernel[3],
            Desc {
                src: (50 << 20) + 3 * 4096,
                dst: (1 << 20) + 3 * 8192,
                len: 4096
            }
        );
    }

    #[test]
    fn pageable_or_unaligned_ranges_fall_back_to_engines() {
        let mut l = fragmented(8, 10 << 20);
        l.push(20 << 20, (1 << 20) + 200_000, 64); // host not mapped
        l.push((10 << 20) + 500_001, (1 << 20) + 300_000, 64); // unaligned
        let p = plan(
            CopyDirection::HostToDevice,
            &l,
            CopyPath::Auto,
            true,
            true,
            &Fake,
        )
        .unwrap();
        assert_eq!(p.kernel.len(), 8);
        assert_eq!(p.engine.len(), 2);
        assert!(!p.engine_batched, "two leftovers go one call each");
        let p = plan(
            CopyDirection::HostToDevice,
            &l,
            CopyPath::Auto,
            false,
            true,
            &Fake,
        )
        .unwrap();
        assert!(p.kernel.is_empty());
        assert_eq!(p.engine.len(), 10);
        assert!(p.engine_batched);
    }

    #[test]
    fn long_contiguous_ranges_use_engines() {
        let mut l = CopyList::default();
        l.push(10 << 20, 1 << 20, 512 << 10);
        let p = plan(
            CopyDirection::HostToDevice,
            &l,
            CopyPath::Auto,
            true,
            true,
            &Fake,
        )
        .unwrap();
        assert!(p.kernel.is_empty());
        assert_eq!(p.engine.len(), 1);
        let p = plan(
            CopyDirection::HostToDevice,
            &l,
            CopyPath::Kernel,
            true,
            true,
            &Fake,
        )
        .unwrap();
        assert_eq!(p.kernel.len(), 8, "cut into 64 KiB chunks");
    }

    #[test]
    fn d2h_maps_the_destination() {
        let mut l = CopyList::default();
        for i in 0..8u64 {
            l.push((1 << 20) + i * 8192, (10 << 20) + i * 4096, 4096);
        }
        let p = plan(
            CopyDirection::DeviceToHost,
            &l,
            CopyPath::Auto,
            true,
            true,
            &Fake,
        )
        .unwrap();
        assert_eq!(p.kernel.len(), 8);
        assert_eq!(p.kernel[1].dst, (50 << 20) + 4096);
        assert_eq!(p.kernel[1].src, (1 << 20) + 8192);
    }

    #[test]
    fn one_bad_device_range_refuses_the_batch() {
        let mut l = fragmented(8, 10 << 20);
        l.push(10 << 20, (2 << 20) - 32, 64); // runs past the allocation
        let err = plan(
            CopyDirection::HostToDevice,
            &l,
            CopyPath::Auto,
            true,
            true,
            &Fake,
        )
        .unwrap_err();
        assert!(
            matches!(err, DeviceError::NotDeviceMemory { len: 64, .. }),
            "{err}"
        );
    }

    #[test]
    fn forced_paths() {
        let l = fragmented(16, 10 << 20);
        let p = plan(
            CopyDirection::HostToDevice,
            &l,
            CopyPath::Batch,
            true,
            true,
            &Fake,
        )
        .unwrap();
        assert!(p.kernel.is_empty() && p.engine_batched && p.engine.len() == 16);
        let p = plan(
            CopyDirection::HostToDevice,
            &l,
            CopyPath::PerOp,
            true,
            true,
            &Fake,
        )
        .unwrap();
        assert!(p.kernel.is_empty() && !p.engine_batched);
        let p = plan(
            CopyDirection::HostToDevice,
            &l,
            CopyPath::Batch,
            true,
            false,
            &Fake,
        )
        .unwrap();
        assert!(!p.engine_batched, "no batch call in this driver");
    }
}
