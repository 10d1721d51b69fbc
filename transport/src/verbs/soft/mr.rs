//! Memory regions: registration under the device's limits and access rules, host memory
//! (exported to other processes where a memfd holds it) and DMA-BUF stand-ins mapped here.

use std::io;

use super::state::{Obj, State};
use super::{
    einval, errno, fabric, SoftOps, ACCESS_REMOTE_ATOMIC, ACCESS_REMOTE_WRITE, KNOWN_ACCESS,
};
use crate::verbs::ops::Handle;
use crate::verbs::registration::{ACCESS_LOCAL_WRITE, ACCESS_REMOTE_READ};

pub(super) struct Mr {
    pub(super) ctx: usize,
    pub(super) pd: usize,
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) access: u32,
    pub(super) key: u32,
    /// Where the bytes of `addr` live in this process (differs from `addr` for DMA-BUF MRs,
    /// which are mapped here).
    pub(super) host: u64,
    /// Keeps a DMA-BUF stand-in mapped while the MR lives.
    pub(super) _map: Option<Mapping>,
    /// Where other processes find the bytes (remotely readable memfd-backed MRs).
    pub(super) export: Option<fabric::Export>,
}

/// A DMA-BUF stand-in mapped into this process (a memfd or any mappable fd).
pub(super) struct Mapping {
    ptr: *mut libc::c_void,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; it is only unmapped in `Drop`.
unsafe impl Send for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` came from a successful mmap and are unmapped once.
        unsafe { libc::munmap(self.ptr, self.len) };
    }
}

impl Mapping {
    /// Maps `len` bytes of `fd` at `offset`, shared, read-write.
    pub(super) fn map(fd: i32, offset: u64, len: u64) -> io::Result<Mapping> {
        let n = usize::try_from(len).map_err(|_| einval("ibv_reg_dmabuf_mr: length"))?;
        let off = libc::off_t::try_from(offset).map_err(|_| einval("ibv_reg_dmabuf_mr: offset"))?;
        // SAFETY: a new shared mapping of `fd`; nothing existing is affected. Failure is
        // checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                n,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                off,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping { ptr, len: n })
    }

    /// Where the mapping starts in this process.
    pub(super) fn host(&self) -> u64 {
        self.ptr as u64
    }
}

impl SoftOps {
    pub(super) fn register(
        &self,
        pd: Handle,
        addr: u64,
        len: u64,
        access: u32,
        host: u64,
        map: Option<Mapping>,
    ) -> io::Result<(Handle, u32, u32)> {
        let mut st = self.lock();
        let ctx = st.ctx_of_pd(pd)?;
        let attr = st.ctx(Handle(ctx))?.profile.attr;
        if len == 0 || addr.checked_add(len).is_none() || len > attr.max_mr_size {
            return Err(einval("ibv_reg_mr: empty, wrapping or too long"));
        }
        if access & !KNOWN_ACCESS != 0 {
            return Err(einval("ibv_reg_mr: unknown access flags"));
        }
        // IBA: remote write or atomic access needs local write.
        if access & (ACCESS_REMOTE_WRITE | ACCESS_REMOTE_ATOMIC) != 0
            && access & ACCESS_LOCAL_WRITE == 0
        {
            return Err(einval("ibv_reg_mr: remote write needs local write"));
        }
        let live = st
            .objs
            .values()
            .filter(|o| matches!(o, Obj::Mr(m) if m.ctx == ctx))
            .count();
        if live >= attr.max_mr as usize {
            return Err(errno(libc::ENOMEM, "ibv_reg_mr: max_mr reached"));
        }
        // Keys: an index in the high 24 bits and a varying low byte, as hardware keys look.
        st.next_key = st.next_key.wrapping_add(1);
        let key = (st.next_key << 8) | (st.next_key.wrapping_mul(37) & 0xff);
        // Remotely readable host memory is offered to other processes where a memfd holds it.
        let export = (access & ACCESS_REMOTE_READ != 0 && map.is_none())
            .then(|| fabric::export_of(addr, len))
            .flatten();
        let h = st.insert(Obj::Mr(Mr {
            ctx,
            pd: pd.0,
            addr,
            len,
            access,
            key,
            host,
            _map: map,
            export,
        }));
        if export.is_some() {
            if let Some(g) = st.gid_of_ctx(ctx) {
                st.publish(g);
            }
        }
        Ok((h, key, key))
    }
}

impl State {
    pub(super) fn dereg_mr(&mut self, mr: Handle) -> io::Result<()> {
        match self.objs.remove(&mr.0) {
            Some(Obj::Mr(m)) => {
                if m.export.is_some() {
                    if let Some(g) = self.gid_of_ctx(m.ctx) {
                        self.publish(g);
                    }
                }
                Ok(())
            }
            Some(other) => {
                self.objs.insert(mr.0, other);
                Err(einval("not a memory region"))
            }
            None => Err(einval("not a memory region")),
        }
    }

    /// Finds an MR of `ctx`/`pd` by key covering `addr..addr+len`.
    pub(super) fn mr_covering(
        &self,
        ctx: usize,
        pd: usize,
        key: u32,
        addr: u64,
        len: u64,
    ) -> Option<&Mr> {
        self.objs.values().find_map(|o| match o {
            Obj::Mr(m)
                if m.ctx == ctx
                    && m.pd == pd
                    && m.key == key
                    && addr >= m.addr
                    && addr
                        .checked_add(len)
                        .is_some_and(|e| e <= m.addr.saturating_add(m.len)) =>
            {
                Some(m)
            }
            _ => None,
        })
    }
}
