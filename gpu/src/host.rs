//! The `host` backend: device memory emulated in host RAM, with a copy thread per direction
//! (as a GPU has a copy engine and stream per direction) and completion events, so every path
//! above it runs without a GPU.

use std::alloc::{self, Layout};
use std::collections::BTreeMap;
use std::fmt;
use std::os::fd::OwnedFd;
use std::sync::{mpsc, Arc, Mutex, RwLock};
use std::time::Instant;

use crate::device::Release;
use crate::{
    CopyDirection, CopyDone, CopyEvent, CopyList, CopyStats, Device, DeviceBuffer, DeviceError,
    DeviceKind, HostRegistration, Landed,
};

const ALIGN: usize = 4096;

/// Emulated device memory: allocations in host RAM, addressed by their host address.
pub struct HostDevice {
    inner: Arc<Inner>,
    /// Host→device and device→host jobs, each to its own thread: a save and a load run at
    /// once, as on a GPU, instead of one waiting behind the other.
    jobs: [Mutex<mpsc::Sender<Job>>; 2],
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
    done: CopyDone,
}

impl HostDevice {
    /// Starts an emulated device with its copy threads.
    pub fn new(ordinal: u32) -> Arc<Self> {
        let inner = Arc::new(Inner {
            ordinal,
            allocs: RwLock::new(BTreeMap::new()),
        });
        let lane = |dir: &str| {
            let (tx, rx) = mpsc::channel::<Job>();
            let worker = Arc::clone(&inner);
            std::thread::Builder::new()
                .name(format!("kvferry-hostdev-{ordinal}-{dir}"))
                .spawn(move || {
                    while let Ok(job) = rx.recv() {
                        let r = worker.run(job.dir, &job.list, job.submitted);
                        // The waiter may have gone away (a cancelled load); nothing to report.
                        let _ = job.done.send(r);
                    }
                })
                .expect("spawning a host device copy thread");
            Mutex::new(tx)
        };
        let jobs = [lane("h2d"), lane("d2h")];
        Arc::new(Self { inner, jobs })
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

/// A client's memfd mapped shared: device memory until the last user drops it.
struct MappedMemfd {
    inner: Arc<Inner>,
    map: Option<crate::memfd::ClientMap>,
}

impl Release for MappedMemfd {
    fn release(&mut self) {
        let Some(map) = self.map.take() else { return };
        let mut allocs = match self.inner.allocs.write() {
            Ok(a) => a,
            Err(p) => p.into_inner(),
        };
        allocs.remove(&map.ptr());
        // Unmapped under the write lock: no copy is using it.
        drop(map);
    }
}

impl HostDevice {
    /// See [`Device::import_memfd`].
    fn map_memfd(&self, fd: OwnedFd, len: u64) -> Result<DeviceBuffer, DeviceError> {
        let ordinal = self.inner.ordinal;
        let map = crate::memfd::map_client(fd, len).map_err(|reason| DeviceError::Import {
            ordinal,
            what: "memfd",
            reason,
        })?;
        let ptr = map.ptr();
        match self.inner.allocs.write() {
            Ok(mut a) => {
                a.insert(ptr, len);
            }
            // `map` unmaps as it drops: nobody else knows it.
            Err(_) => return Err(DeviceError::Stopped { ordinal }),
        }
        let release = MappedMemfd {
            inner: Arc::clone(&self.inner),
            map: Some(map),
        };
        Ok(DeviceBuffer::new(ptr, len, ordinal, Box::new(release)))
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

    fn import_memfd(&self, fd: OwnedFd, len: u64) -> Result<DeviceBuffer, DeviceError> {
        self.map_memfd(fd, len)
    }

    unsafe fn submit_then(
        &self,
        dir: CopyDirection,
        list: CopyList,
        landed: Option<Landed>,
    ) -> Result<CopyEvent, DeviceError> {
        let ordinal = self.inner.ordinal;
        let (done, event) = CopyEvent::channel(ordinal);
        let job = Job {
            dir,
            list,
            submitted: Instant::now(),
            done: done.then(landed),
        };
        let lane = match dir {
            CopyDirection::HostToDevice => 0,
            CopyDirection::DeviceToHost => 1,
        };
        self.jobs[lane]
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
    use std::os::fd::AsRawFd;

    use super::*;

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn landed_runs_on_the_copy_thread_with_the_result_before_the_event_resolves() {
        let dev = HostDevice::new(0);
        let buf = dev.alloc(4096).unwrap();
        let src = vec![7u8; 4096];
        let seen = Arc::new(Mutex::new(Vec::new()));
        let tell = |seen: &Arc<Mutex<Vec<_>>>| -> Option<Landed> {
            let seen = Arc::clone(seen);
            Some(Box::new(move |r: &Result<CopyStats, DeviceError>| {
                let thread = std::thread::current().name().map(str::to_owned);
                seen.lock()
                    .unwrap()
                    .push((r.as_ref().map(|s| s.bytes).ok(), thread));
            }))
        };
        let mut list = CopyList::default();
        list.push(src.as_ptr() as u64, buf.ptr(), 4096);
        // SAFETY: `src` outlives the awaited event.
        let ev = unsafe { dev.submit_then(CopyDirection::HostToDevice, list, tell(&seen)) };
        // Resolved only after the hook ran: it is there when the event is.
        assert_eq!(block_on(ev.unwrap()).unwrap().bytes, 4096);
        let thread = Some("kvferry-hostdev-0-h2d".to_owned());
        assert_eq!(*seen.lock().unwrap(), vec![(Some(4096), thread.clone())]);
        // A failed batch tells the hook its error.
        let mut list = CopyList::default();
        list.push(src.as_ptr() as u64, buf.ptr() + 1, 4096);
        // SAFETY: as above.
        let ev = unsafe { dev.submit_then(CopyDirection::HostToDevice, list, tell(&seen)) };
        assert!(block_on(ev.unwrap()).is_err());
        assert_eq!(seen.lock().unwrap()[1], (None, thread));
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

    fn memfd(len: usize, flags: libc::c_uint) -> OwnedFd {
        use std::os::fd::FromRawFd;
        // SAFETY: a NUL-terminated name; the returned descriptor is checked and then owned.
        let fd = unsafe { libc::memfd_create(c"kvferry-test".as_ptr(), flags) };
        assert!(fd >= 0, "{}", std::io::Error::last_os_error());
        // SAFETY: `fd` was just created and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate on a descriptor we own.
        let sized = unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) };
        assert_eq!(sized, 0);
        fd
    }

    #[test]
    fn imported_memfd_is_device_memory_shared_with_the_client() {
        let dev = HostDevice::new(0);
        let fd = memfd(8192, libc::MFD_ALLOW_SEALING);
        // The client's view of the same memory.
        // SAFETY: a fresh shared mapping of the 8192-byte memfd.
        let client = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                8192,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(client, libc::MAP_FAILED);
        let dup = fd.try_clone().unwrap();
        let buf = dev.import_memfd(dup, 4096).unwrap();
        assert_eq!(dev.live_allocations(), 1);
        assert!(dev.check_range(buf.ptr(), 4096).is_ok());
        assert!(
            dev.check_range(buf.ptr() + 4000, 200).is_err(),
            "past the announced length"
        );
        let src = [9u8; 100];
        let mut list = CopyList::default();
        list.push(src.as_ptr() as u64, buf.ptr() + 10, 100);
        // SAFETY: `src` outlives the awaited event.
        let ev = unsafe { dev.submit(CopyDirection::HostToDevice, list) }.unwrap();
        block_on(ev).unwrap();
        // SAFETY: the client mapping is 8192 bytes long and still mapped.
        let seen = unsafe { std::slice::from_raw_parts(client as *const u8, 200) };
        assert!(seen[..10].iter().all(|b| *b == 0));
        assert!(seen[10..110].iter().all(|b| *b == 9));
        assert!(seen[110..].iter().all(|b| *b == 0));
        // Sealed against shrinking by the import.
        // SAFETY: ftruncate on a descriptor we own.
        let shrunk = unsafe { libc::ftruncate(fd.as_raw_fd(), 10) };
        assert_ne!(shrunk, 0);
        drop(buf);
        assert_eq!(dev.live_allocations(), 0);
        // SAFETY: unmapping the client mapping made above.
        unsafe { libc::munmap(client, 8192) };
    }

    #[test]
    fn memfd_imports_are_refused_clearly() {
        let dev = HostDevice::new(0);
        let short = memfd(4096, libc::MFD_ALLOW_SEALING);
        let err = dev.import_memfd(short, 8192).unwrap_err();
        assert!(err.to_string().contains("8192 were announced"), "{err}");
        let unsealable = memfd(4096, 0);
        let err = dev.import_memfd(unsealable, 4096).unwrap_err();
        assert!(err.to_string().contains("MFD_ALLOW_SEALING"), "{err}");
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        let err = dev.import_memfd(file.into(), 16).unwrap_err();
        assert!(err.to_string().contains("not a memfd"), "{err}");
        assert_eq!(dev.live_allocations(), 0);
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
