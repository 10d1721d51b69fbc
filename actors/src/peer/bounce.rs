//! The device side of a tcp read: received bytes for device destinations are copied into a
//! ring of pinned host slots and go to the device as one asynchronous copy batch per full
//! slot, so the socket keeps draining while earlier slots are in flight, instead of one
//! synchronous device write per piece. The link drains the sink once the load's reads are
//! done, before it lets the destinations go. Rings are kept per device by the link and reused
//! by later loads.
//!
//! One load's reads may arrive on several connections at once (the link spreads them over
//! its QPs, one receive thread each): every provider thread gets a ring of its own, so the
//! receives run side by side and never share a slot.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::ThreadId;

use kvferry_gpu::{
    CopyBatch, CopyDirection, CopyList, Device, DeviceError, HostMemory, HostRegistration,
    HostSpan, OwnedCopyEvent,
};
use kvferry_transport::{DeviceSink, HostRegion, SinkError, StagingArea};

/// Bytes of one slot: one copy batch.
pub(crate) const SLOT_BYTES: usize = 4 << 20;
/// Slots per ring: how many batches may be in flight while the next one fills.
const SLOTS: usize = 4;

/// Pinned staging memory registered with one device. Shared: every batch out of it holds
/// it until its copies have resolved, so it is unregistered and freed only after them.
pub struct Ring {
    // Field order: the registration is undone before the memory is freed.
    _reg: HostRegistration,
    /// Reached only through raw-pointer copies (a region hands out no references), as the
    /// device reads one slot while the receive thread fills the next.
    mem: HostRegion,
}

impl Ring {
    fn new(device: &dyn Device) -> Result<Self, DeviceError> {
        let len = SLOT_BYTES * SLOTS;
        let mem = HostRegion::anonymous(len).map_err(|e| DeviceError::HostRegister {
            addr: 0,
            len: len as u64,
            reason: format!("mapping a bounce ring: {e}"),
        })?;
        let reg = device.register_host(mem.addr(), mem.len() as u64, false)?;
        Ok(Self { _reg: reg, mem })
    }

    /// Host address of byte `at` of slot `i`.
    fn addr(&self, i: usize, at: usize) -> u64 {
        self.mem.addr() + (i * SLOT_BYTES + at) as u64
    }
}

// SAFETY: the region is this ring's own mapping, unmapped only when the ring drops, and
// never handed out as a reference (`HostRegion` copies in and out).
unsafe impl HostMemory for Ring {
    fn span(&self) -> (u64, u64) {
        (self.mem.addr(), self.mem.len() as u64)
    }
}

/// Idle rings by device ordinal, owned by a link.
pub type RingPool = Arc<Mutex<HashMap<u32, Vec<Arc<Ring>>>>>;

/// One provider thread's ring and where it is in it.
struct Lane {
    ring: Option<Arc<Ring>>,
    /// The slot being filled and how far.
    cur: usize,
    fill: usize,
    list: CopyList,
    /// Submitted slots, oldest first; each holds the ring until it resolved.
    pending: VecDeque<(usize, OwnedCopyEvent)>,
    /// Bytes of the current slot lent to this lane's thread (from `fill`).
    lent: Option<usize>,
}

/// A [`DeviceSink`] for one load's device destinations.
pub struct BounceSink {
    device: Arc<dyn Device>,
    pool: RingPool,
    /// A lane per provider thread that wrote; a ring taken at creation waits for the first.
    lanes: Mutex<Vec<(ThreadId, Arc<Mutex<Lane>>)>>,
    spare: Mutex<Option<Arc<Ring>>>,
    /// The first failure; every later call reports it.
    failed: OnceLock<SinkError>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A lane left half-updated by a panic is not used again: its thread is gone, and drain
    // and drop only wait for what it submitted.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl BounceSink {
    /// A sink over a ring from `pool` (or a new one) for `device`; threads after the first
    /// to write take theirs when they start.
    pub fn new(device: Arc<dyn Device>, pool: RingPool) -> Result<Self, DeviceError> {
        let ring = take_ring(&device, &pool)?;
        Ok(Self {
            device,
            pool,
            lanes: Mutex::new(Vec::new()),
            spare: Mutex::new(Some(ring)),
            failed: OnceLock::new(),
        })
    }

    fn fail(&self, e: SinkError) -> SinkError {
        let _ = self.failed.set(e);
        self.failed
            .get()
            .cloned()
            .unwrap_or_else(|| SinkError::Flush {
                reason: "bounce sink failed".into(),
            })
    }

    fn check(&self) -> Result<(), SinkError> {
        match self.failed.get() {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// The calling thread's lane, made (with a ring) on its first call.
    fn lane(&self) -> Result<Arc<Mutex<Lane>>, SinkError> {
        let me = std::thread::current().id();
        if let Some((_, l)) = lock(&self.lanes).iter().find(|(t, _)| *t == me) {
            return Ok(Arc::clone(l));
        }
        // Only this thread makes its lane, so nobody else can add it meanwhile; the lock is
        // not held while a new ring is pinned (milliseconds on a GPU), so the other lanes
        // keep receiving.
        let ring = match lock(&self.spare).take() {
            Some(r) => r,
            None => take_ring(&self.device, &self.pool).map_err(|e| {
                self.fail(SinkError::Write {
                    dst: 0,
                    len: 0,
                    reason: format!("pinning another bounce ring: {e}"),
                })
            })?,
        };
        let lane = Arc::new(Mutex::new(Lane {
            ring: Some(ring),
            cur: 0,
            fill: 0,
            list: CopyList::default(),
            pending: VecDeque::new(),
            lent: None,
        }));
        lock(&self.lanes).push((me, Arc::clone(&lane)));
        Ok(lane)
    }
}

fn take_ring(device: &Arc<dyn Device>, pool: &RingPool) -> Result<Arc<Ring>, DeviceError> {
    let reused = pool
        .lock()
        .ok()
        .and_then(|mut p| p.get_mut(&device.ordinal()).and_then(Vec::pop));
    match reused {
        Some(r) => Ok(r),
        None => Ring::new(device.as_ref()).map(Arc::new),
    }
}

/// Waits for one batch. Provider threads may block; a thread inside an async runtime must
/// not park on the event's channel, so it polls instead (only teardown paths get there).
fn wait(ev: OwnedCopyEvent) -> Result<(), DeviceError> {
    if tokio::runtime::Handle::try_current().is_err() {
        return ev.wait_blocking().map(|_| ());
    }
    let mut ev = ev;
    loop {
        if let Some(r) = ev.try_complete() {
            return r.map(|_| ());
        }
        std::thread::yield_now();
    }
}

impl Lane {
    fn wait_oldest(&mut self, sink: &BounceSink) -> Result<(), SinkError> {
        if let Some((_, ev)) = self.pending.pop_front() {
            wait(ev).map_err(|e| {
                sink.fail(SinkError::Flush {
                    reason: e.to_string(),
                })
            })?;
        }
        Ok(())
    }

    /// Submits the filled part of the current slot and moves to the next free slot.
    fn submit(&mut self, sink: &BounceSink) -> Result<(), SinkError> {
        self.lent = None;
        if self.list.is_empty() {
            return Ok(());
        }
        let list = std::mem::take(&mut self.list);
        let (ops, bytes) = (list.len(), list.bytes());
        let refused = |reason: String| {
            sink.fail(SinkError::Write {
                dst: 0,
                len: bytes,
                reason,
            })
        };
        // Every source lies in the current slot, which is not written again until this
        // batch has resolved (the slot cycles back only after `wait_oldest`).
        let ring = Arc::clone(self.ring()?);
        let batch = HostSpan::new(ring, (self.cur * SLOT_BYTES) as u64, SLOT_BYTES as u64)
            .and_then(|slot| CopyBatch::from_list(CopyDirection::HostToDevice, list, &slot))
            .map_err(|e| refused(format!("copies of {ops} pieces: {e}")))?;
        // Detached: the receive thread goes back to its socket without planning the copies.
        let ev = batch
            .submit_detached(sink.device.as_ref())
            .map_err(|e| refused(format!("submitting {ops} copies: {e}")))?;
        self.pending.push_back((self.cur, ev));
        self.cur = (self.cur + 1) % SLOTS;
        self.fill = 0;
        if self.pending.len() == SLOTS {
            self.wait_oldest(sink)?;
        }
        Ok(())
    }

    fn ring(&self) -> Result<&Arc<Ring>, SinkError> {
        self.ring.as_ref().ok_or_else(|| SinkError::Flush {
            reason: "bounce ring gone".into(),
        })
    }
}

impl DeviceSink for BounceSink {
    fn write(&self, dst: u64, data: &[u8]) -> Result<(), SinkError> {
        self.check()?;
        let lane = self.lane()?;
        let mut st = lock(&lane);
        // Bytes copied in now would land where a provider is receiving.
        st.lent = None;
        let mut done = 0;
        while done < data.len() {
            let n = (data.len() - done).min(SLOT_BYTES - st.fill);
            let (cur, fill) = (st.cur, st.fill);
            let ring = st.ring()?;
            // The slot is not in flight: it is the one being filled.
            ring.mem
                .write_at(cur * SLOT_BYTES + fill, &data[done..done + n])
                .map_err(|e| SinkError::Write {
                    dst,
                    len: n as u64,
                    reason: e.to_string(),
                })?;
            let src = ring.addr(cur, fill);
            st.list.push(src, dst + done as u64, n as u64);
            st.fill += n;
            done += n;
            if st.fill == SLOT_BYTES {
                st.submit(self)?;
            }
        }
        Ok(())
    }

    /// Lends the free rest of the calling thread's current slot (a full slot goes to the
    /// device first).
    fn staging(&self, max: usize) -> Option<StagingArea> {
        if self.failed.get().is_some() {
            return None;
        }
        let lane = self.lane().ok()?;
        let mut st = lock(&lane);
        if st.fill == SLOT_BYTES && st.submit(self).is_err() {
            return None;
        }
        let (cur, fill) = (st.cur, st.fill);
        let len = max.min(SLOT_BYTES - fill);
        let ptr = st.ring.as_ref()?.addr(cur, fill) as usize as *mut u8;
        st.lent = Some(len);
        Some(StagingArea { ptr, len })
    }

    fn commit(&self, dst: u64, len: usize) -> Result<(), SinkError> {
        self.check()?;
        let lane = self.lane()?;
        let mut st = lock(&lane);
        let left = match st.lent {
            Some(left) if len <= left => left,
            _ => {
                return Err(self.fail(SinkError::Write {
                    dst,
                    len: len as u64,
                    reason: "committing bytes that were not lent".into(),
                }))
            }
        };
        let (cur, fill) = (st.cur, st.fill);
        let src = st.ring()?.addr(cur, fill);
        st.list.push(src, dst, len as u64);
        st.fill += len;
        st.lent = Some(left - len);
        if st.fill == SLOT_BYTES {
            st.submit(self)?;
        }
        Ok(())
    }

    /// The end of a read. Its bytes are in the ring, the sink's: a slot at least half full
    /// goes to the device now, without waiting (the receive goes on with the next read);
    /// a fuller batch is cheaper than one per read where reads are small, and
    /// [`BounceSink::drain`] sends what is left at the end.
    fn flush(&self) -> Result<(), SinkError> {
        self.check()?;
        let lane = self.lane()?;
        let mut st = lock(&lane);
        if st.fill >= SLOT_BYTES / 2 {
            st.submit(self)?;
        }
        self.check()
    }
}

impl BounceSink {
    /// Waits until every byte written has reached the device and is visible to work
    /// submitted afterwards. The link calls it once all reads of a load have completed,
    /// before it lets the destinations go; a copy that failed fails the load.
    pub fn drain(&self) -> Result<(), SinkError> {
        let lanes: Vec<Arc<Mutex<Lane>>> = lock(&self.lanes)
            .iter()
            .map(|(_, l)| Arc::clone(l))
            .collect();
        let mut submitted = Ok(());
        for lane in &lanes {
            let mut st = lock(lane);
            if self.failed.get().is_none() {
                if let Err(e) = st.submit(self) {
                    submitted = Err(e);
                }
            }
            // Every pending copy is waited for, failed or not: they write into the
            // destinations, which may be freed once this returns.
            while !st.pending.is_empty() {
                let _ = st.wait_oldest(self);
            }
        }
        submitted?;
        self.check()?;
        self.device
            .flush_direct_writes()
            .map_err(|e| SinkError::Flush {
                reason: e.to_string(),
            })
    }
}

impl Drop for BounceSink {
    fn drop(&mut self) {
        let spare = lock(&self.spare).take();
        let lanes = std::mem::take(&mut *lock(&self.lanes));
        let mut idle: Vec<Arc<Ring>> = spare.into_iter().collect();
        for (_, lane) in lanes {
            let mut st = lock(&lane);
            let Some(ring) = st.ring.take() else { continue };
            // A read that failed mid-way leaves copies from the ring running: their events,
            // dropped here, keep the ring (unregistered and freed only after them); it does
            // not go back to the pool.
            if st.pending.is_empty() {
                idle.push(ring);
            }
            st.pending.clear();
        }
        if let Ok(mut p) = self.pool.lock() {
            p.entry(self.device.ordinal()).or_default().extend(idle);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvferry_gpu::HostDevice;

    const CANARY: u8 = 0xA5;

    fn pattern(i: usize) -> u8 {
        (i.wrapping_mul(31) ^ (i >> 9)) as u8
    }

    #[test]
    fn pieces_across_every_slot_land_in_order_and_nothing_else_is_written() {
        let dev: Arc<dyn Device> = HostDevice::new(0);
        let pool = RingPool::default();
        // More than the whole ring, in 64 KiB pieces to every other 64 KiB of the buffer.
        let piece = 64 << 10;
        let pieces = 2 * SLOTS * SLOT_BYTES / piece + 3;
        let buf = dev.alloc((2 * pieces * piece) as u64).unwrap();
        dev.write(buf.ptr(), &vec![CANARY; buf.len() as usize])
            .unwrap();
        let src: Vec<u8> = (0..pieces * piece).map(pattern).collect();
        {
            let sink = BounceSink::new(Arc::clone(&dev), Arc::clone(&pool)).unwrap();
            for (i, chunk) in src.chunks(piece).enumerate() {
                sink.write(buf.ptr() + (2 * i * piece) as u64, chunk)
                    .unwrap();
            }
            sink.flush().unwrap();
            sink.drain().unwrap();
        }
        let mut back = vec![0u8; buf.len() as usize];
        dev.read(buf.ptr(), &mut back).unwrap();
        for i in 0..pieces {
            let at = 2 * i * piece;
            assert_eq!(
                &back[at..at + piece],
                &src[i * piece..(i + 1) * piece],
                "piece {i}"
            );
            assert!(back[at + piece..at + 2 * piece]
                .iter()
                .all(|&b| b == CANARY));
        }
        // The ring went back to the pool for the next load on this device.
        assert_eq!(pool.lock().unwrap().get(&0).map(Vec::len), Some(1));
        let again = BounceSink::new(Arc::clone(&dev), Arc::clone(&pool)).unwrap();
        assert_eq!(pool.lock().unwrap().get(&0).map(Vec::len), Some(0));
        drop(again);
    }

    #[test]
    fn a_refused_copy_fails_the_write_or_flush_and_every_later_call() {
        let dev: Arc<dyn Device> = HostDevice::new(0);
        let sink = BounceSink::new(Arc::clone(&dev), RingPool::default()).unwrap();
        let host = vec![0u8; 4096];
        // Host memory is not device memory: the batch holding it fails.
        sink.write(host.as_ptr() as u64, &[1u8; 4096]).unwrap();
        sink.flush().unwrap();
        let err = sink.drain().unwrap_err();
        assert!(
            err.to_string().contains("not inside one allocation"),
            "{err}"
        );
        assert!(sink.write(host.as_ptr() as u64, &[1u8; 16]).is_err());
        assert!(sink.flush().is_err());
        assert!(sink.drain().is_err());
        assert!(host.iter().all(|&b| b == 0), "a refused batch wrote");
    }

    #[test]
    fn threads_receiving_at_once_each_get_a_ring_and_their_bytes_land() {
        let dev: Arc<dyn Device> = HostDevice::new(0);
        let pool = RingPool::default();
        // Each thread receives 1.5 rings' worth into its own half of the buffer, in pieces
        // of 100 000 bytes, all through one sink at once.
        let per = 3 * SLOTS * SLOT_BYTES / 2;
        let buf = dev.alloc(2 * per as u64 + 4096).unwrap();
        dev.write(buf.ptr(), &vec![CANARY; buf.len() as usize])
            .unwrap();
        let src: Vec<u8> = (0..2 * per).map(pattern).collect();
        let sink = Arc::new(BounceSink::new(Arc::clone(&dev), Arc::clone(&pool)).unwrap());
        let start = Arc::new(std::sync::Barrier::new(2));
        std::thread::scope(|s| {
            for t in 0..2 {
                let (sink, start, src, base) =
                    (Arc::clone(&sink), Arc::clone(&start), &src, buf.ptr());
                s.spawn(move || {
                    start.wait();
                    let mut got = 0;
                    while got < per {
                        let area = sink.staging((per - got).min(100_000)).unwrap();
                        // SAFETY: the sink lent `area.len` writable bytes to this thread.
                        let lent = unsafe { std::slice::from_raw_parts_mut(area.ptr, area.len) };
                        let from = t * per + got;
                        lent.copy_from_slice(&src[from..from + area.len]);
                        sink.commit(base + from as u64, area.len).unwrap();
                        got += area.len;
                        sink.flush().unwrap();
                    }
                });
            }
        });
        sink.drain().unwrap();
        drop(sink);
        let mut back = vec![0u8; buf.len() as usize];
        dev.read(buf.ptr(), &mut back).unwrap();
        assert!(
            back[..2 * per] == src[..],
            "a thread's bytes were lost or mixed"
        );
        assert!(back[2 * per..].iter().all(|&b| b == CANARY));
        // One ring per receiving thread, both back in the pool.
        assert_eq!(pool.lock().unwrap().get(&0).map(Vec::len), Some(2));
    }

    #[test]
    fn staged_bytes_are_committed_in_order_and_only_by_the_borrower() {
        let dev: Arc<dyn Device> = HostDevice::new(0);
        let buf = dev.alloc(3 * SLOT_BYTES as u64).unwrap();
        dev.write(buf.ptr(), &vec![CANARY; buf.len() as usize])
            .unwrap();
        let sink = Arc::new(BounceSink::new(Arc::clone(&dev), RingPool::default()).unwrap());
        // Receive 2.5 slots "from a socket" into lent memory, committed in uneven pieces to
        // every other 1000 bytes of the destination.
        let total = 5 * SLOT_BYTES / 2;
        let src: Vec<u8> = (0..total).map(pattern).collect();
        let (mut got, mut dst) = (0usize, 0u64);
        while got < total {
            let area = sink.staging(total - got).unwrap();
            assert!(area.len > 0 && area.len <= SLOT_BYTES);
            // SAFETY: the sink lent `area.len` writable bytes at `area.ptr`.
            let lent = unsafe { std::slice::from_raw_parts_mut(area.ptr, area.len) };
            lent.copy_from_slice(&src[got..got + area.len]);
            let mut used = 0;
            while used < area.len {
                let take = (area.len - used).min(1000);
                sink.commit(buf.ptr() + dst, take).unwrap();
                used += take;
                dst += take as u64;
            }
            got += area.len;
        }
        sink.flush().unwrap();
        sink.drain().unwrap();
        let mut back = vec![0u8; buf.len() as usize];
        dev.read(buf.ptr(), &mut back).unwrap();
        assert_eq!(&back[..total], &src[..]);
        assert!(back[total..].iter().all(|&b| b == CANARY));
        // Another thread cannot commit what this one was lent.
        sink.staging(100).unwrap();
        let (other, at) = (Arc::clone(&sink), buf.ptr());
        let r = std::thread::spawn(move || other.commit(at, 10))
            .join()
            .unwrap();
        assert!(r.is_err());
        assert!(sink.drain().is_err(), "the sink failed for good");
    }
}
