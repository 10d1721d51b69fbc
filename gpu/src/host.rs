//! The `host` backend: device memory emulated in host RAM, with its own copy thread and
//! completion events, so every path above it runs without a GPU.

use std::alloc::{self, Layout};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::{mpsc, Arc, Mutex, RwLock};
use std::time::Instant;

use tokio::sync::oneshot;

use crate::device::Release;
use crate::{
    CopyDirection, CopyEvent, CopyList, CopyStats, Device, DeviceBuffer, DeviceError, DeviceKind,
    HostRegistration,
};

const ALIGN: usize = 4096;

/// Emulated device memory: allocations in host RAM, addressed by their host address.
pub struct HostDevice {
    inner: Arc<Inner>,
    jobs: Mutex<mpsc::Sender<Job>>,
}

struct Inner {
    ordinal: u32,
    /// base → length of every live allocation. Copies hold the read lock for a whole batch, so
    /// a free (write lock) can never land in the middle of a copy.
    allocs: RwLock<BTreeMap<u64, u64>>,
}

struct Job {
    dir: CopyDirection,
    list: CopyList,
    submitted: Instant,
    done: oneshot::Sender<Result<CopyStats, DeviceError>>,
}

impl HostDevice {
    /// Starts an emulated device with its copy thread.
    pub fn new(ordinal: u32) -> Arc<Self> {
        let inner = Arc::new(Inner {
            ordinal,
            allocs: RwLock::new(BTreeMap::new()),
        });
        let (tx, rx) = mpsc::channel::<Job>();
        let worker = Arc::clone(&inner);
        std::thread::Builder::new()
            .name(format!("kvferry-hostdev-{ordinal}"))
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    let r = worker.run(job.dir, &job.list, job.submitted);
                    // The waiter may have gone away (a cancelled load); nothing to report then.
                    let _ = job.done.send(r);
                }
            })
            .expect("spawning the host device copy thread");
        Arc::new(Self {
            inner,
            jobs: Mutex::new(tx),
        })
    }

    /// Number of live allocations (a gauge for tests: leaks show up here).
    pub fn live_allocations(&self) -> usize {
        self.inner.allocs.read().map(|a| a.len()).unwrap_or(0)
    }
}

impl Inner {
    fn check(&self, allocs: &BTreeMap<u64, u64>, ptr: u64, len: u64) -> Result<(), DeviceError> {
        let err = || DeviceError::NotDeviceMemory {
            ordinal: self.ordinal,
            ptr,
            len,
        };
        let (base, size) = allocs.range(..=ptr).next_back().ok_or_else(err)?;
        let end = ptr.checked_add(len).ok_or_else(err)?;
        if end > base + size {
            return Err(err());
        }
        Ok(())
    }

    fn run(
        &self,
        dir: CopyDirection,
        list: &CopyList,
        submitted: Instant,
    ) -> Result<CopyStats, DeviceError> {
        let allocs = self.allocs.read().map_err(|_| DeviceError::Stopped {
            ordinal: self.ordinal,
        })?;
        for op in list.ops() {
            let dev = match dir {
                CopyDirection::HostToDevice => op.dst,
                CopyDirection::DeviceToHost => op.src,
            };
            self.check(&allocs, dev, op.len)?;
        }
        for op in list.ops() {
            // SAFETY: the device side was checked against the live allocation table above and
            // cannot be freed while we hold the read lock; the host side is guaranteed valid
            // by the caller of `Device::submit` (its safety contract). Source and destination
            // never overlap: one is device memory, the other host memory outside it.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    op.src as usize as *const u8,
                    op.dst as usize as *mut u8,
                    op.len as usize,
                );
            }
        }
        Ok(CopyStats {
            bytes: list.bytes(),
            ops: list.len(),
            seconds: submitted.elapsed().as_secs_f64(),
        })
    }
}

struct HostAlloc {
    inner: Arc<Inner>,
    ptr: u64,
    len: u64,
}

impl Release for HostAlloc {
    fn release(&mut self) {
        let mut allocs = match self.inner.allocs.write() {
            Ok(a) => a,
            Err(p) => p.into_inner(),
        };
        if allocs.remove(&self.ptr).is_some() {
            let layout = Layout::from_size_align(self.len as usize, ALIGN)
                .expect("layout was valid at allocation");
            // SAFETY: `ptr` came from `alloc_zeroed` with this exact layout and was still in
            // the table, so it has not been freed; holding the write lock means no copy is
            // using it.
            unsafe { alloc::dealloc(self.ptr as usize as *mut u8, layout) };
        }
    }
}

impl fmt::Debug for HostDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostDevice")
            .field("ordinal", &self.inner.ordinal)
            .finish()
    }
}

impl Device for HostDevice {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Host
    }

    fn ordinal(&self) -> u32 {
        self.inner.ordinal
    }

    fn name(&self) -> String {
        format!("host-emulated #{}", self.inner.ordinal)
    }

    fn check_range(&self, ptr: u64, len: u64) -> Result<(), DeviceError> {
        let allocs = self.inner.allocs.read().map_err(|_| DeviceError::Stopped {
            ordinal: self.inner.ordinal,
        })?;
        self.inner.check(&allocs, ptr, len)
    }

    fn alloc(&self, bytes: u64) -> Result<DeviceBuffer, DeviceError> {
        let ordinal = self.inner.ordinal;
        let fail = |reason: &str| DeviceError::Alloc {
            ordinal,
            bytes,
            reason: reason.into(),
        };
        if bytes == 0 {
            return Err(fail("zero-sized allocation"));
        }
        let size = usize::try_from(bytes).map_err(|_| fail("size exceeds the address space"))?;
        let layout = Layout::from_size_align(size, ALIGN).map_err(|_| fail("size too large"))?;
        // SAFETY: the layout has a nonzero size.
        let p = unsafe { alloc::alloc_zeroed(layout) };
        if p.is_null() {
            return Err(fail("out of host memory"));
        }
        let ptr = p as usize as u64;
        self.inner
            .allocs
            .write()
            .map_err(|_| DeviceError::Stopped { ordinal })?
            .insert(ptr, bytes);
        Ok(DeviceBuffer::new(
            ptr,
            bytes,
            ordinal,
            Box::new(HostAlloc {
                inner: Arc::clone(&self.inner),
                ptr,
                len: bytes,
            }),
        ))
    }

    fn register_host(
        &self,
        _addr: u64,
        _len: u64,
        _read_only: bool,
    ) -> Result<HostRegistration, DeviceError> {
        Ok(HostRegistration::noop())
    }

    unsafe fn submit(&self, dir: CopyDirection, list: CopyList) -> Result<CopyEvent, DeviceError> {
        let ordinal = self.inner.ordinal;
        let (done, event) = CopyEvent::channel(ordinal);
        let job = Job {
            dir,
            list,
            submitted: Instant::now(),
            done,
        };
        self.jobs
            .lock()
            .map_err(|_| DeviceError::Stopped { ordinal })?
            .send(job)
            .map_err(|_| DeviceError::Stopped { ordinal })?;
        Ok(event)
    }

    fn write(&self, dst: u64, data: &[u8]) -> Result<(), DeviceError> {
        let allocs = self.inner.allocs.read().map_err(|_| DeviceError::Stopped {
            ordinal: self.ordinal(),
        })?;
        self.inner.check(&allocs, dst, data.len() as u64)?;
        // SAFETY: the destination lies inside a live allocation (checked under the lock we
        // hold), and `data` is a distinct Rust slice.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), dst as usize as *mut u8, data.len())
        };
        Ok(())
    }

    fn read(&self, src: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        let allocs = self.inner.allocs.read().map_err(|_| DeviceError::Stopped {
            ordinal: self.ordinal(),
        })?;
        self.inner.check(&allocs, src, out.len() as u64)?;
        // SAFETY: the source lies inside a live allocation (checked under the lock we hold),
        // and `out` is a distinct Rust slice.
        unsafe {
            std::ptr::copy_nonoverlapping(src as usize as *const u8, out.as_mut_ptr(), out.len())
        };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn h2d_and_d2h_round_trip_with_merging() {
        let dev = HostDevice::new(0);
        let buf = dev.alloc(8192).unwrap();
        let src: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
        let mut list = CopyList::default();
        list.push(src.as_ptr() as u64, buf.ptr() + 100, 2048);
        list.push(src.as_ptr() as u64 + 2048, buf.ptr() + 2148, 2048);
        assert_eq!(list.len(), 1);
        // SAFETY: `src` outlives the awaited event.
        let ev = unsafe { dev.submit(CopyDirection::HostToDevice, list) }.unwrap();
        let stats = block_on(ev).unwrap();
        assert_eq!(stats.bytes, 4096);
        let mut back = vec![0u8; 4196];
        dev.read(buf.ptr(), &mut back).unwrap();
        assert!(
            back[..100].iter().all(|b| *b == 0),
            "canary before destination"
        );
        assert_eq!(&back[100..], &src[..]);

        let mut out = vec![0u8; 4096];
        let mut list = CopyList::default();
        list.push(buf.ptr() + 100, out.as_mut_ptr() as u64, 4096);
        // SAFETY: `out` outlives the awaited event.
        let ev = unsafe { dev.submit(CopyDirection::DeviceToHost, list) }.unwrap();
        block_on(ev).unwrap();
        assert_eq!(out, src);
    }

    #[test]
    fn out_of_allocation_batch_copies_nothing() {
        let dev = HostDevice::new(3);
        let buf = dev.alloc(4096).unwrap();
        let src = vec![7u8; 8192];
        let mut list = CopyList::default();
        list.push(src.as_ptr() as u64, buf.ptr(), 64);
        list.push(src.as_ptr() as u64 + 1000, buf.ptr() + 4000, 200); // runs past the end
                                                                      // SAFETY: `src` outlives the awaited event.
        let ev = unsafe { dev.submit(CopyDirection::HostToDevice, list) }.unwrap();
        let err = block_on(ev).unwrap_err();
        assert!(
            matches!(err, DeviceError::NotDeviceMemory { ordinal: 3, .. }),
            "{err}"
        );
        let mut back = vec![1u8; 64];
        dev.read(buf.ptr(), &mut back).unwrap();
        assert!(
            back.iter().all(|b| *b == 0),
            "nothing written by a refused batch"
        );
    }

    #[test]
    fn free_removes_allocation() {
        let dev = HostDevice::new(0);
        let buf = dev.alloc(4096).unwrap();
        let p = buf.ptr();
        assert!(dev.check_range(p, 4096).is_ok());
        assert_eq!(dev.live_allocations(), 1);
        drop(buf);
        assert_eq!(dev.live_allocations(), 0);
        assert!(matches!(
            dev.check_range(p, 1),
            Err(DeviceError::NotDeviceMemory { .. })
        ));
        assert!(dev.alloc(0).is_err());
    }
}
