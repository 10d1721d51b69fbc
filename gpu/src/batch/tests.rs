//! The safe copy layer on the host backend: spans refused outside their bounds, bytes that
//! land where they should and nowhere else, and guards that outlive their copies however the
//! event ends. A lane is stalled (a batch whose `Landed` hook blocks the lane's copy thread)
//! to make a copy complete late.

use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use super::*;
use crate::drain::THREAD_NAME;
use crate::{CopyStats, HostDevice};

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(f)
}

type Log = Arc<Mutex<Vec<String>>>;

/// Host memory owned through a raw pointer (as a mapped pool is), recording its drop and the
/// thread that dropped it.
struct Recorded {
    mem: *mut [u8],
    log: Log,
}

// SAFETY: the memory is owned by this value alone and only touched through raw pointers.
unsafe impl Send for Recorded {}
// SAFETY: as above; shared access only reads the pointer.
unsafe impl Sync for Recorded {}

// SAFETY: `mem` is a live heap allocation freed only in `Drop`, never borrowed as a slice
// while a batch may use it (`bytes` is called with none in flight).
unsafe impl HostMemory for Recorded {
    fn span(&self) -> (u64, u64) {
        (self.mem as *mut u8 as u64, self.mem.len() as u64)
    }
}

impl Recorded {
    fn new(fill: impl Fn(usize) -> u8, len: usize, log: &Log) -> Arc<Self> {
        let mem: Box<[u8]> = (0..len).map(fill).collect();
        Arc::new(Self {
            mem: Box::into_raw(mem),
            log: Arc::clone(log),
        })
    }

    /// A copy of the contents; only with no batch in flight.
    fn bytes(&self) -> Vec<u8> {
        // SAFETY: the allocation is live and no batch writes it now (the caller's word).
        unsafe { (*self.mem).to_vec() }
    }
}

impl Drop for Recorded {
    fn drop(&mut self) {
        let thread = std::thread::current().name().unwrap_or("?").to_owned();
        self.log
            .lock()
            .unwrap()
            .push(format!("dropped on {thread}"));
        // SAFETY: from `Box::into_raw` in `new`, freed once.
        drop(unsafe { Box::from_raw(self.mem) });
    }
}

fn guard(r: &Arc<Recorded>) -> Arc<dyn HostMemory> {
    Arc::clone(r) as Arc<dyn HostMemory>
}

fn note(log: &Log, what: &'static str) -> Option<Landed> {
    let log = Arc::clone(log);
    Some(Box::new(move |_: &Result<CopyStats, DeviceError>| {
        log.lock().unwrap().push(what.into())
    }))
}

/// Holds `dir`'s copy thread of `dev` until the returned sender is used or dropped: batches
/// submitted after it complete late.
fn stall(dev: &HostDevice, dir: CopyDirection) -> mpsc::Sender<()> {
    let (tx, rx) = mpsc::channel::<()>();
    let hold: Landed = Box::new(move |_| {
        let _ = rx.recv_timeout(Duration::from_secs(10));
    });
    let ev = CopyBatch::new(dir).submit(dev, Some(hold)).unwrap();
    // Nothing guarded; dropping it pending costs nothing.
    drop(ev);
    tx
}

fn wait_for(log: &Log, entries: usize) -> Vec<String> {
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let seen = log.lock().unwrap().clone();
        if seen.len() >= entries || Instant::now() > until {
            return seen;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn spans_outside_their_bounds_are_refused_with_typed_errors() {
    let dev = HostDevice::new(2);
    let buf = dev.alloc(4096).unwrap();
    let log = Log::default();
    let mem = Recorded::new(|_| 0, 4096, &log);
    let base = mem.span().0;

    let err = HostSpan::new(guard(&mem), 4000, 200).unwrap_err();
    assert_eq!(
        err,
        SpanError::OutsideGuard {
            base,
            size: 4096,
            offset: 4000,
            len: 200
        }
    );
    assert!(
        matches!(
            HostSpan::new(guard(&mem), u64::MAX, 2),
            Err(SpanError::OutsideGuard { .. })
        ),
        "an overflowing offset"
    );
    let whole = HostSpan::new(guard(&mem), 0, 4096).unwrap();
    assert!(matches!(
        whole.sub(4095, 2),
        Err(SpanError::OutsideSpan { side: "host", .. })
    ));
    assert_eq!(whole.sub(96, 4000).unwrap().addr(), base + 96);

    let err = DeviceSpan::new(&*dev, buf.ptr() + 4000, 200).unwrap_err();
    assert!(
        matches!(
            &err,
            SpanError::NotDeviceRange {
                ordinal: 2,
                source: DeviceError::NotDeviceMemory { ordinal: 2, .. },
                ..
            }
        ),
        "{err}"
    );
    assert!(DeviceSpan::new(&*dev, base, 16).is_err(), "host memory");
    let dspan = DeviceSpan::new(&*dev, buf.ptr(), 4096).unwrap();
    assert!(matches!(
        dspan.sub(1, 4096),
        Err(SpanError::OutsideSpan { side: "device", .. })
    ));

    let mut batch = CopyBatch::new(CopyDirection::HostToDevice);
    let err = batch
        .push(whole.sub(0, 100).unwrap(), dspan.sub(0, 99).unwrap())
        .unwrap_err();
    assert_eq!(
        err,
        SpanError::LengthMismatch {
            host: 100,
            device: 99
        }
    );
    assert!(batch.is_empty());
    drop((whole, batch));
    assert_eq!(Arc::strong_count(&mem), 1, "refused spans keep no guard");
}

#[test]
fn bytes_land_and_canaries_around_destinations_hold() {
    let dev = HostDevice::new(0);
    let buf = dev.alloc(4096).unwrap();
    dev.write(buf.ptr(), &[0xa5; 4096]).unwrap();
    let log = Log::default();
    let src = Recorded::new(|i| (i % 251) as u8, 2048, &log);
    let dspan = DeviceSpan::new(&*dev, buf.ptr(), 4096).unwrap();
    let hspan = HostSpan::new(guard(&src), 0, 2048).unwrap();

    // Two spans adjacent on both sides: one copy, one guard.
    let mut batch = CopyBatch::new(CopyDirection::HostToDevice);
    batch
        .push(hspan.sub(100, 500).unwrap(), dspan.sub(1000, 500).unwrap())
        .unwrap();
    batch
        .push(hspan.sub(600, 500).unwrap(), dspan.sub(1500, 500).unwrap())
        .unwrap();
    assert_eq!((batch.len(), batch.bytes()), (1, 1000));
    let mut ev = batch.submit(&*dev, None).unwrap();
    assert_eq!(ev.guards_held(), 1);
    assert_eq!(block_on(&mut ev).unwrap().bytes, 1000);
    assert_eq!(ev.guards_held(), 0, "released with the result");
    let mut back = vec![0u8; 4096];
    dev.read(buf.ptr(), &mut back).unwrap();
    assert!(back[..1000].iter().all(|b| *b == 0xa5), "canary before");
    assert_eq!(&back[1000..2000], &src.bytes()[100..1100]);
    assert!(back[2000..].iter().all(|b| *b == 0xa5), "canary after");

    let dst = Recorded::new(|_| 0x5a, 2048, &log);
    let mut batch = CopyBatch::with_capacity(CopyDirection::DeviceToHost, 1);
    batch
        .push(
            HostSpan::new(guard(&dst), 300, 1000).unwrap(),
            dspan.sub(1000, 1000).unwrap(),
        )
        .unwrap();
    batch.submit(&*dev, None).unwrap().wait_blocking().unwrap();
    let got = dst.bytes();
    assert!(got[..300].iter().all(|b| *b == 0x5a), "canary before");
    assert_eq!(&got[300..1300], &src.bytes()[100..1100]);
    assert!(got[1300..].iter().all(|b| *b == 0x5a), "canary after");
    assert_eq!(Arc::strong_count(&dst), 1, "the batch kept no guard");
}

#[test]
fn guards_are_held_while_the_copy_runs_and_dropped_once_it_resolved() {
    let dev = HostDevice::new(0);
    let buf = dev.alloc(4096).unwrap();
    let log = Log::default();
    let src = Recorded::new(|_| 7, 4096, &log);
    let mut batch = CopyBatch::new(CopyDirection::HostToDevice);
    batch
        .push(
            HostSpan::new(guard(&src), 0, 4096).unwrap(),
            DeviceSpan::new(&*dev, buf.ptr(), 4096).unwrap(),
        )
        .unwrap();
    // The batch holds the last reference from here on.
    drop(src);
    let go = stall(&dev, CopyDirection::HostToDevice);
    let mut ev = batch.submit(&*dev, note(&log, "landed")).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert!(ev.try_complete().is_none(), "the lane is stalled");
    assert_eq!(ev.guards_held(), 1);
    assert!(
        log.lock().unwrap().is_empty(),
        "nothing dropped or landed yet"
    );
    go.send(()).unwrap();
    block_on(&mut ev).unwrap();
    let this = std::thread::current().name().unwrap_or("?").to_owned();
    assert_eq!(
        *log.lock().unwrap(),
        ["landed".to_owned(), format!("dropped on {this}")],
        "dropped by the event's owner when it resolved, after the copy"
    );
    drop(ev);
    assert_eq!(log.lock().unwrap().len(), 2);
    let mut back = vec![0u8; 4096];
    dev.read(buf.ptr(), &mut back).unwrap();
    assert!(back.iter().all(|b| *b == 7));
}

#[test]
fn a_pending_event_dropped_hands_its_guards_to_the_drain_thread() {
    let dev = HostDevice::new(0);
    let buf = dev.alloc(8192).unwrap();
    dev.write(buf.ptr(), &[3; 8192]).unwrap();
    let log = Log::default();
    let dst = Recorded::new(|_| 0, 8192, &log);
    let mut batch = CopyBatch::new(CopyDirection::DeviceToHost);
    batch
        .push(
            HostSpan::new(guard(&dst), 0, 8192).unwrap(),
            DeviceSpan::new(&*dev, buf.ptr(), 8192).unwrap(),
        )
        .unwrap();
    drop(dst);
    let go = stall(&dev, CopyDirection::DeviceToHost);
    let ev = batch.submit(&*dev, note(&log, "landed")).unwrap();
    drop(ev);
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        log.lock().unwrap().is_empty(),
        "the guard outlives the dropped event while the copy has not run"
    );
    go.send(()).unwrap();
    let seen = wait_for(&log, 2);
    assert_eq!(
        seen,
        ["landed".to_owned(), format!("dropped on {THREAD_NAME}")],
        "dropped by the drain thread, after the copy landed"
    );
}

#[test]
fn a_refused_batch_copies_nothing_and_releases_its_guards() {
    let dev = HostDevice::new(1);
    let buf = dev.alloc(4096).unwrap();
    let log = Log::default();
    let src = Recorded::new(|_| 9, 4096, &log);
    let mut batch = CopyBatch::new(CopyDirection::HostToDevice);
    batch
        .push(
            HostSpan::new(guard(&src), 0, 4096).unwrap(),
            DeviceSpan::new(&*dev, buf.ptr(), 4096).unwrap(),
        )
        .unwrap();
    // The device memory goes after the span was checked: the backend's own check refuses.
    drop(buf);
    let err = block_on(batch.submit(&*dev, None).unwrap()).unwrap_err();
    assert!(
        matches!(err, DeviceError::NotDeviceMemory { ordinal: 1, .. }),
        "{err}"
    );
    assert_eq!(Arc::strong_count(&src), 1);
}

#[test]
fn pushes_within_a_span_and_lists_built_elsewhere_are_checked_against_it() {
    let dev = HostDevice::new(0);
    let buf = dev.alloc(4096).unwrap();
    dev.write(buf.ptr(), &[0xa5; 4096]).unwrap();
    let log = Log::default();
    let src = Recorded::new(|i| (i % 253) as u8, 2048, &log);
    let base = src.span().0;
    let host = HostSpan::new(guard(&src), 1024, 1024).unwrap();
    let dspan = DeviceSpan::new(&*dev, buf.ptr(), 4096).unwrap();

    let mut batch = CopyBatch::new(CopyDirection::HostToDevice);
    let err = batch
        .push_within(&host, 1000, dspan.sub(0, 25).unwrap())
        .unwrap_err();
    assert!(matches!(
        err,
        SpanError::OutsideSpan {
            side: "host",
            offset: 1000,
            len: 25,
            ..
        }
    ));
    assert!(batch.is_empty());
    batch
        .push_within(&host, 0, dspan.sub(0, 100).unwrap())
        .unwrap();
    batch
        .push_within(&host, 200, dspan.sub(300, 100).unwrap())
        .unwrap();
    assert_eq!((batch.len(), batch.bytes()), (2, 200));
    assert_eq!(Arc::strong_count(&src), 3, "one guard for both copies");
    batch.submit(&*dev, None).unwrap().wait_blocking().unwrap();
    let mut back = vec![0u8; 4096];
    dev.read(buf.ptr(), &mut back).unwrap();
    let want = src.bytes();
    assert_eq!(&back[..100], &want[1024..1124]);
    assert!(back[100..300].iter().all(|b| *b == 0xa5), "canary between");
    assert_eq!(&back[300..400], &want[1224..1324]);
    assert!(back[400..].iter().all(|b| *b == 0xa5), "canary after");

    // A list whose host side leaves the span (below it, past it) is refused whole.
    for (addr, len) in [
        (base + 1000, 100),
        (base + 2000, 100),
        (base + 1024, 0x1_0000),
    ] {
        let mut list = CopyList::default();
        list.push(base + 1024, buf.ptr(), 16);
        list.push(addr, buf.ptr() + 512, len);
        let err = CopyBatch::from_list(CopyDirection::HostToDevice, list, &host).unwrap_err();
        assert!(
            matches!(err, SpanError::OutsideSpan { side: "host", .. }),
            "{err}"
        );
    }
    // The host side is the destination of a device-to-host list.
    let mut list = CopyList::default();
    list.push(buf.ptr(), base + 1024 + 512, 256);
    assert!(CopyBatch::from_list(CopyDirection::HostToDevice, list.clone(), &host).is_err());
    let batch = CopyBatch::from_list(CopyDirection::DeviceToHost, list, &host).unwrap();
    assert_eq!((batch.len(), batch.bytes()), (1, 256));
    batch.submit(&*dev, None).unwrap().wait_blocking().unwrap();
    let got = src.bytes();
    assert_eq!(&got[1536..1792], &back[..256]);
    assert_eq!(&got[1792..], &want[1792..], "nothing past the copy written");
    drop(host);
    assert_eq!(Arc::strong_count(&src), 1, "every guard released");
}

#[test]
fn host_copies_land_between_canaries_and_refuse_unequal_lengths() {
    let log = Log::default();
    let src = Recorded::new(|i| i as u8, 256, &log);
    let dst = Recorded::new(|_| 0xEE, 256, &log);
    let from = HostSpan::new(guard(&src), 16, 64).unwrap();
    let into = HostSpan::new(guard(&dst), 100, 64).unwrap();
    crate::copy_host(&from, &into).unwrap();
    let after = dst.bytes();
    let want: Vec<u8> = (16..80).map(|i| i as u8).collect();
    assert_eq!(&after[100..164], &want[..]);
    // Canaries on both sides of the destination are untouched.
    assert!(after[..100].iter().all(|&b| b == 0xEE));
    assert!(after[164..].iter().all(|&b| b == 0xEE));

    let short = HostSpan::new(guard(&dst), 0, 63).unwrap();
    let e = crate::copy_host(&from, &short).unwrap_err();
    assert_eq!(e, SpanError::HostLengthMismatch { src: 64, dst: 63 });
    assert!(
        dst.bytes()[..63].iter().all(|&b| b == 0xEE),
        "nothing copied"
    );
}
