//! A read's resolved destination: the local segments checked against the MR table, each pinning
//! its region until the read has completed and been reported.

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

use thiserror::Error;

use crate::descriptor::LocalSegment;
use crate::mr_table::{LocalTarget, MrError, MrTable, Target};
use crate::sink::SinkError;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ScatterError {
    #[error("read delivers {got} bytes but its segments hold {expected}")]
    LengthMismatch { expected: u64, got: u64 },
    #[error("device destination refused the bytes")]
    Sink {
        #[source]
        source: SinkError,
    },
    #[error("connection closed after {received} of {expected} bytes")]
    Eof { received: u64, expected: u64 },
    #[error("receiving into the destination failed after {received} bytes")]
    Io {
        received: u64,
        #[source]
        source: io::Error,
    },
    #[error("receive abandoned after {received} bytes")]
    Abandoned { received: u64 },
}

/// The checked destination of one read.
pub struct Scatter {
    pieces: Vec<LocalTarget>,
    len: u64,
}

impl Scatter {
    /// Checks every segment (key, bounds, local-write access) and pins the regions.
    pub(crate) fn resolve(table: &MrTable, segs: &[LocalSegment]) -> Result<Self, MrError> {
        let mut pieces = Vec::with_capacity(segs.len());
        let mut len = 0u64;
        for s in segs {
            pieces.push(table.acquire_local_write(s.lkey, s.addr, s.len)?);
            len = len.saturating_add(s.len);
        }
        Ok(Scatter { pieces, len })
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn segments(&self) -> usize {
        self.pieces.len()
    }

    /// The checked destination as raw `(addr, len)` ranges, in order: host virtual addresses
    /// for host pieces, device addresses for device pieces. For providers whose hardware
    /// writes the destination itself (verbs SGEs): the ranges stay valid, and their regions
    /// registered, for as long as this scatter lives.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))] // only the verbs provider posts raw
    pub(crate) fn ranges(&self) -> Vec<(u64, u64)> {
        self.pieces
            .iter()
            .map(|p| match &p.target {
                Target::Host { region, offset } => (region.addr() + *offset as u64, p.len),
                Target::Device { addr, .. } => (*addr, p.len),
            })
            .collect()
    }

    /// Scatters a contiguous source of exactly `self.len()` bytes.
    ///
    /// # Safety
    /// `src..src+len` must be readable for the duration of the call.
    pub(crate) unsafe fn write_from_ptr(
        &self,
        src: *const u8,
        len: u64,
    ) -> Result<(), ScatterError> {
        if len != self.len {
            return Err(ScatterError::LengthMismatch {
                expected: self.len,
                got: len,
            });
        }
        let mut done = 0usize;
        for p in &self.pieces {
            let n = p.len as usize;
            let from = src.wrapping_add(done);
            match &p.target {
                Target::Host { region, offset } => {
                    // SAFETY: the MR table checked offset+n against the region when the target
                    // was acquired and the region is writable (local-write registration); the
                    // caller guarantees the source range; `copy_in` allows overlap.
                    unsafe { region.copy_in(*offset, from, n) };
                }
                Target::Device { sink, addr } => {
                    // SAFETY: the caller guarantees `src..src+len` is readable and
                    // done+n <= len.
                    let data = unsafe { std::slice::from_raw_parts(from, n) };
                    sink.write(*addr, data)
                        .map_err(|source| ScatterError::Sink { source })?;
                }
            }
            done += n;
        }
        Ok(())
    }

    /// Receives exactly `self.len()` bytes from a stream socket straight into the destination
    /// (device pieces go through `bounce`). `keep_waiting` is asked whenever the socket has no
    /// data within its timeout; returning false abandons the receive.
    ///
    /// A device-sink failure does not stop the receive (the stream must stay framed); it is
    /// returned after all bytes were consumed.
    pub(crate) fn fill_from(
        &self,
        src: &mut impl ByteSource,
        bounce: &mut [u8],
        mut keep_waiting: impl FnMut() -> bool,
    ) -> Result<(), ScatterError> {
        let mut received = 0u64;
        let mut sink_err: Option<SinkError> = None;
        let mut recv = |ptr: *mut u8, n: usize, received: u64| -> Result<usize, ScatterError> {
            loop {
                // SAFETY: callers pass a pointer to at least `n` writable bytes (a checked
                // destination range, the bounce buffer, or a sink's staging area).
                match unsafe { src.recv_raw(ptr, n) } {
                    Ok(0) => {
                        return Err(ScatterError::Eof {
                            received,
                            expected: self.len,
                        })
                    }
                    Ok(r) => return Ok(r),
                    Err(e) => match e.kind() {
                        io::ErrorKind::Interrupted => continue,
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                            if !keep_waiting() {
                                return Err(ScatterError::Abandoned { received });
                            }
                        }
                        _ => {
                            return Err(ScatterError::Io {
                                received,
                                source: e,
                            })
                        }
                    },
                }
            }
        };
        let mut i = 0;
        while i < self.pieces.len() {
            let p = &self.pieces[i];
            if let Target::Host { region, offset } = &p.target {
                let total = p.len as usize;
                let mut done = 0usize;
                while done < total {
                    let n = recv(region.ptr_at(offset + done), total - done, received)?;
                    done += n;
                    received += n as u64;
                }
                i += 1;
                continue;
            }
            // A run of device pieces arrives back to back: receive it in bounce-sized
            // chunks whatever the piece boundaries (a block's rank part is one piece per
            // layer and K/V, often smaller than the bounce buffer), then hand each piece its
            // part. One receive per piece would cost a system call per 64 KiB segment.
            let end = self.pieces[i..]
                .iter()
                .position(|p| !matches!(p.target, Target::Device { .. }))
                .map_or(self.pieces.len(), |k| i + k);
            let run: usize = self.pieces[i..end].iter().map(|p| p.len as usize).sum();
            // A run into one sink is received straight into the sink's own staging memory
            // where it lends some (no copy out of `bounce`).
            let one_sink = match &self.pieces[i].target {
                Target::Device { sink, .. } => self.pieces[i..end].iter().all(
                    |p| matches!(&p.target, Target::Device { sink: s, .. } if Arc::ptr_eq(s, sink)),
                ).then(|| Arc::clone(sink)),
                Target::Host { .. } => None,
            };
            // Where the next received byte goes: piece `at`, `into` bytes into it.
            let (mut at, mut into) = (i, 0usize);
            let mut got = 0usize;
            while got < run {
                let want = run - got;
                let staged = match (&one_sink, &sink_err) {
                    (Some(sink), None) => sink.staging(want).filter(|a| a.len > 0),
                    _ => None,
                };
                let (ptr, cap) = match staged {
                    Some(a) => (a.ptr, a.len),
                    None => (bounce.as_mut_ptr(), bounce.len()),
                };
                let n = recv(ptr, want.min(cap), received)?;
                received += n as u64;
                got += n;
                let mut used = 0usize;
                while used < n {
                    let piece = &self.pieces[at];
                    let take = (piece.len as usize - into).min(n - used);
                    if let (None, Target::Device { sink, addr }) = (&sink_err, &piece.target) {
                        let dst = addr + into as u64;
                        let r = if staged.is_some() {
                            sink.commit(dst, take)
                        } else {
                            sink.write(dst, &bounce[used..used + take])
                        };
                        if let Err(e) = r {
                            sink_err = Some(e);
                        }
                    }
                    used += take;
                    into += take;
                    if into == piece.len as usize {
                        at += 1;
                        into = 0;
                    }
                }
            }
            i = end;
        }
        match sink_err {
            Some(source) => Err(ScatterError::Sink { source }),
            None => Ok(()),
        }
    }

    /// Makes device pieces visible; called once before a read is reported successful. Each
    /// sink is flushed once per read, however many of the read's pieces it took (a block's
    /// rank part is one piece per layer and K/V, all into one sink).
    pub(crate) fn finish(&self) -> Result<(), ScatterError> {
        let mut flushed: Vec<*const ()> = Vec::new();
        for p in &self.pieces {
            if let Target::Device { sink, .. } = &p.target {
                let id = Arc::as_ptr(sink).cast::<()>();
                if flushed.contains(&id) {
                    continue;
                }
                flushed.push(id);
                sink.flush()
                    .map_err(|source| ScatterError::Sink { source })?;
            }
        }
        Ok(())
    }
}

/// Where received bytes come from: a socket, or the plaintext of a TLS connection.
pub(crate) trait ByteSource {
    /// Receives up to `n` bytes into `ptr`: `Ok(0)` at the end of the stream, `WouldBlock` or
    /// `TimedOut` when nothing came within the source's poll interval.
    ///
    /// # Safety
    /// `ptr..ptr+n` must be writable.
    unsafe fn recv_raw(&mut self, ptr: *mut u8, n: usize) -> io::Result<usize>;
}

/// A stream socket read with `recv(2)`.
pub(crate) struct FdSource(pub(crate) RawFd);

impl ByteSource for FdSource {
    unsafe fn recv_raw(&mut self, ptr: *mut u8, n: usize) -> io::Result<usize> {
        // SAFETY: the caller guarantees `ptr..ptr+n` is writable.
        let r = unsafe { libc::recv(self.0, ptr.cast(), n, 0) };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r as usize)
        }
    }
}

/// Receives exactly `buf.len()` bytes from `src`; `keep_waiting` decides on each timeout.
pub(crate) fn recv_exact_from(
    src: &mut impl ByteSource,
    buf: &mut [u8],
    mut keep_waiting: impl FnMut() -> bool,
) -> Result<(), crate::wire::RecvError> {
    use crate::wire::RecvError;
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: `rest` is a valid writable buffer of `rest.len()` bytes.
        match unsafe { src.recv_raw(rest.as_mut_ptr(), rest.len()) } {
            Ok(0) => return Err(RecvError::Eof),
            Ok(r) => done += r,
            Err(e) => match e.kind() {
                io::ErrorKind::Interrupted => {}
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                    if !keep_waiting() {
                        return Err(RecvError::Abandoned);
                    }
                }
                _ => return Err(RecvError::Io(e)),
            },
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::mr_table::Access;
    use crate::region::HostRegion;
    use crate::sink::DeviceSink;

    struct NullSink;
    impl DeviceSink for NullSink {
        fn write(&self, _: u64, _: &[u8]) -> Result<(), SinkError> {
            Ok(())
        }
        fn flush(&self) -> Result<(), SinkError> {
            Ok(())
        }
    }

    #[test]
    fn ranges_are_the_checked_destination() {
        let t = MrTable::new();
        let host = Arc::new(HostRegion::anonymous(8192).unwrap());
        let h = t.register_host(host.clone(), Access::LOCAL_WRITE).unwrap();
        let d = t
            .register_device(0x7f00_0000, 1 << 20, Arc::new(NullSink))
            .unwrap();
        let segs = [
            LocalSegment {
                lkey: h.key(),
                addr: host.addr() + 100,
                len: 50,
            },
            LocalSegment {
                lkey: d.key(),
                addr: 0x7f00_1000,
                len: 4096,
            },
            LocalSegment {
                lkey: h.key(),
                addr: host.addr() + 4096,
                len: 10,
            },
        ];
        let s = Scatter::resolve(&t, &segs).unwrap();
        assert_eq!(
            s.ranges(),
            vec![
                (host.addr() + 100, 50),
                (0x7f00_1000, 4096),
                (host.addr() + 4096, 10)
            ]
        );
        assert_eq!(s.len(), 4156);
        // Out of bounds never resolves, so no raw range outside a registration exists.
        assert!(Scatter::resolve(
            &t,
            &[LocalSegment {
                lkey: h.key(),
                addr: host.addr() + 8190,
                len: 4
            }]
        )
        .is_err());
    }

    #[test]
    fn a_read_flushes_each_device_sink_once() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        #[derive(Default)]
        struct Counting {
            writes: AtomicUsize,
            flushes: AtomicUsize,
        }
        impl DeviceSink for Counting {
            fn write(&self, _: u64, _: &[u8]) -> Result<(), SinkError> {
                self.writes.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            fn flush(&self) -> Result<(), SinkError> {
                self.flushes.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
        }
        let t = MrTable::new();
        let (a, b) = (Arc::new(Counting::default()), Arc::new(Counting::default()));
        let da = t.register_device(0x7f00_0000, 1 << 20, a.clone()).unwrap();
        let db = t.register_device(0x7e00_0000, 1 << 20, b.clone()).unwrap();
        // A block's rank part: many pieces into one sink, one into another.
        let mut segs: Vec<LocalSegment> = (0..8)
            .map(|i| LocalSegment {
                lkey: da.key(),
                addr: 0x7f00_0000 + i * 8192,
                len: 64,
            })
            .collect();
        segs.push(LocalSegment {
            lkey: db.key(),
            addr: 0x7e00_0000,
            len: 64,
        });
        let s = Scatter::resolve(&t, &segs).unwrap();
        let src = vec![7u8; s.len() as usize];
        // SAFETY: `src` holds exactly `s.len()` readable bytes.
        unsafe { s.write_from_ptr(src.as_ptr(), s.len()) }.unwrap();
        s.finish().unwrap();
        assert_eq!(a.writes.load(Ordering::Relaxed), 8);
        assert_eq!(a.flushes.load(Ordering::Relaxed), 1);
        assert_eq!(b.flushes.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn runs_of_device_pieces_are_received_across_piece_boundaries() {
        use std::collections::BTreeMap;
        use std::os::fd::AsRawFd;
        use std::sync::Mutex;
        #[derive(Default)]
        struct Recording(Mutex<BTreeMap<u64, u8>>);
        impl DeviceSink for Recording {
            fn write(&self, dst: u64, data: &[u8]) -> Result<(), SinkError> {
                let mut m = self.0.lock().unwrap();
                for (i, b) in data.iter().enumerate() {
                    assert!(m.insert(dst + i as u64, *b).is_none(), "byte written twice");
                }
                Ok(())
            }
            fn flush(&self) -> Result<(), SinkError> {
                Ok(())
            }
        }
        let t = MrTable::new();
        let host = Arc::new(HostRegion::anonymous(8192).unwrap());
        let h = t.register_host(host.clone(), Access::LOCAL_WRITE).unwrap();
        let rec = Arc::new(Recording::default());
        let d = t.register_device(0x10_0000, 1 << 20, rec.clone()).unwrap();
        let dev = |addr, len| LocalSegment {
            lkey: d.key(),
            addr,
            len,
        };
        // Device run, host piece, device run; odd sizes so chunks straddle every boundary.
        let segs = [
            dev(0x10_0000, 300),
            dev(0x10_8000, 17),
            dev(0x10_4000, 999),
            LocalSegment {
                lkey: h.key(),
                addr: host.addr() + 10,
                len: 123,
            },
            dev(0x11_0000, 64),
        ];
        let s = Scatter::resolve(&t, &segs).unwrap();
        let src: Vec<u8> = (0..s.len()).map(|i| (i * 7 + 3) as u8).collect();
        let (tx, rx) = std::os::unix::net::UnixStream::pair().unwrap();
        let writer = {
            let src = src.clone();
            std::thread::spawn(move || {
                use std::io::Write;
                let mut tx = tx;
                // Dribble it in small writes, as a socket may deliver it.
                for c in src.chunks(77) {
                    tx.write_all(c).unwrap();
                }
            })
        };
        let mut bounce = vec![0u8; 100];
        s.fill_from(&mut FdSource(rx.as_raw_fd()), &mut bounce, || true)
            .unwrap();
        writer.join().unwrap();
        let mut at = 0usize;
        let m = rec.0.lock().unwrap();
        for seg in &segs {
            let want = &src[at..at + seg.len as usize];
            if seg.lkey == h.key() {
                // SAFETY: inside the registered host region, written by the receive above.
                let got = unsafe {
                    std::slice::from_raw_parts(seg.addr as usize as *const u8, seg.len as usize)
                };
                assert_eq!(got, want);
            } else {
                let got: Vec<u8> = (0..seg.len).map(|k| m[&(seg.addr + k)]).collect();
                assert_eq!(&got[..], want, "device piece at {:#x}", seg.addr);
            }
            at += seg.len as usize;
        }
        assert_eq!(m.len(), 300 + 17 + 999 + 64, "no byte went anywhere else");
    }
}
