//! A read's resolved destination: the local segments checked against the MR table, each pinning
//! its region until the read has completed and been reported.

use std::io;
use std::os::fd::RawFd;

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
    pub(crate) fn fill_from_fd(
        &self,
        fd: RawFd,
        bounce: &mut [u8],
        mut keep_waiting: impl FnMut() -> bool,
    ) -> Result<(), ScatterError> {
        let mut received = 0u64;
        let mut sink_err: Option<SinkError> = None;
        let mut recv = |ptr: *mut u8, n: usize, received: u64| -> Result<usize, ScatterError> {
            loop {
                // SAFETY: callers pass a pointer to at least `n` writable bytes (a checked
                // destination range or the bounce buffer).
                let r = unsafe { libc::recv(fd, ptr.cast(), n, 0) };
                if r > 0 {
                    return Ok(r as usize);
                }
                if r == 0 {
                    return Err(ScatterError::Eof {
                        received,
                        expected: self.len,
                    });
                }
                let e = io::Error::last_os_error();
                match e.kind() {
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
                }
            }
        };
        for p in &self.pieces {
            let total = p.len as usize;
            let mut done = 0usize;
            while done < total {
                match &p.target {
                    Target::Host { region, offset } => {
                        let n = recv(region.ptr_at(offset + done), total - done, received)?;
                        done += n;
                        received += n as u64;
                    }
                    Target::Device { sink, addr } => {
                        let want = (total - done).min(bounce.len());
                        let n = recv(bounce.as_mut_ptr(), want, received)?;
                        if sink_err.is_none() {
                            if let Err(e) = sink.write(addr + done as u64, &bounce[..n]) {
                                sink_err = Some(e);
                            }
                        }
                        done += n;
                        received += n as u64;
                    }
                }
            }
        }
        match sink_err {
            Some(source) => Err(ScatterError::Sink { source }),
            None => Ok(()),
        }
    }

    /// Makes device pieces visible; called once before a read is reported successful.
    pub(crate) fn finish(&self) -> Result<(), ScatterError> {
        for p in &self.pieces {
            if let Target::Device { sink, .. } = &p.target {
                sink.flush()
                    .map_err(|source| ScatterError::Sink { source })?;
            }
        }
        Ok(())
    }
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
}
