//! The real [`VerbsOps`] table: each rdma-core call behind a thin wrapper that turns its
//! return convention (NULL, -1/errno, positive errno) into a `Result`. Handles are the
//! rdma-core pointers; the owning types in [`super::device`] and [`super::provider`] keep
//! each object alive while its handle is used and destroy it once.

use std::ffi::CStr;
use std::io;
use std::ptr;

use ibverbs_sys as ffi;

use super::gid::{Mtu, PortInfo};
use super::ops::{AsyncEvent, DeviceAttr, Handle, PortAttr, QpCaps, VerbsOps, Wc};
use super::qp_attrs::Transition;
use super::sysfs::{Sysfs, SysfsError};
use super::work::ReadWr;

fn null_err() -> io::Error {
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(0) {
        io::Error::other("rdma-core returned NULL without errno")
    } else {
        e
    }
}

fn rc_err(rc: i32) -> io::Result<()> {
    match rc {
        0 => Ok(()),
        // Most verbs return the errno; a few return -1 and set errno.
        r if r < 0 => Err(io::Error::last_os_error()),
        r => Err(io::Error::from_raw_os_error(r)),
    }
}

fn h<T>(p: *mut T) -> Handle {
    Handle(p as usize)
}

fn ptr_of<T>(h: Handle) -> *mut T {
    h.0 as *mut T
}

/// rdma-core, linked through ibverbs-sys.
#[derive(Debug)]
pub(crate) struct RealOps;

impl RealOps {
    fn with_list<R>(f: impl FnOnce(&[*mut ffi::ibv_device]) -> R) -> io::Result<Option<R>> {
        let mut n = 0i32;
        // SAFETY: `n` is a valid out-pointer; a NULL return is handled below.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            let e = io::Error::last_os_error();
            // ENOSYS: no kernel support (no RDMA stack at all); that is "no device".
            return if e.raw_os_error() == Some(libc::ENOSYS) {
                Ok(None)
            } else {
                Err(e)
            };
        }
        // SAFETY: the list holds `n` valid device pointers until it is freed below.
        let devs = unsafe { std::slice::from_raw_parts(list, n.max(0) as usize) };
        let r = f(devs);
        // SAFETY: `list` came from ibv_get_device_list and is freed once; contexts opened
        // from it stay valid.
        unsafe { ffi::ibv_free_device_list(list) };
        Ok(Some(r))
    }

    fn name_of(dev: *mut ffi::ibv_device) -> Option<String> {
        // SAFETY: `dev` is valid while its list lives; the name is owned by the device.
        let name = unsafe { ffi::ibv_get_device_name(dev) };
        (!name.is_null()).then(|| {
            // SAFETY: checked non-NULL, NUL-terminated, alive until the list is freed.
            unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned()
        })
    }
}

// SAFETY (for every method below that dereferences a handle): handles are only made by this
// table from live rdma-core objects, and the owning types destroy each object once, after
// its last use; so every pointer passed to rdma-core here is alive.
impl VerbsOps for RealOps {
    fn kind(&self) -> &'static str {
        "rdma-core"
    }

    fn device_names(&self) -> io::Result<Vec<String>> {
        Ok(
            Self::with_list(|devs| devs.iter().filter_map(|d| Self::name_of(*d)).collect())?
                .unwrap_or_default(),
        )
    }

    fn open_device(&self, name: &str) -> io::Result<Option<Handle>> {
        let r = Self::with_list(|devs| {
            let dev = devs
                .iter()
                .find(|d| Self::name_of(**d).as_deref() == Some(name))?;
            // SAFETY: `dev` is valid while the list lives; the context outlives the list.
            let ctx = unsafe { ffi::ibv_open_device(*dev) };
            Some(if ctx.is_null() {
                Err(null_err())
            } else {
                // Async events are read without blocking (the poller thread checks them
                // between CQ polls).
                // SAFETY: `ctx` is open; `async_fd` is its event descriptor.
                let fd = unsafe { (*ctx).async_fd };
                // SAFETY: fcntl on a descriptor the context owns.
                unsafe {
                    let fl = libc::fcntl(fd, libc::F_GETFL);
                    libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
                }
                Ok(h(ctx))
            })
        })?;
        r.flatten().transpose()
    }

    fn close_device(&self, ctx: Handle) -> io::Result<()> {
        // SAFETY: see the impl comment; nothing created on the context is alive.
        rc_err(unsafe { ffi::ibv_close_device(ptr_of(ctx)) })
    }

    fn query_device(&self, ctx: Handle) -> io::Result<DeviceAttr> {
        let mut a = ffi::ibv_device_attr::default();
        // SAFETY: `ctx` is open and `a` is a valid out-pointer.
        rc_err(unsafe { ffi::ibv_query_device(ptr_of(ctx), &mut a) })?;
        let u = |v: i32| u32::try_from(v).unwrap_or(0);
        Ok(DeviceAttr {
            max_qp: u(a.max_qp),
            max_qp_wr: u(a.max_qp_wr),
            max_sge: u(a.max_sge),
            max_cq: u(a.max_cq),
            max_cqe: u(a.max_cqe),
            max_mr: u(a.max_mr),
            max_mr_size: a.max_mr_size,
            max_qp_rd_atom: u(a.max_qp_rd_atom),
            max_qp_init_rd_atom: u(a.max_qp_init_rd_atom),
        })
    }

    fn query_port(&self, ctx: Handle, port: u8) -> io::Result<PortAttr> {
        let mut a = ffi::ibv_port_attr::default();
        // SAFETY: `ctx` is open; `a` is a valid out-pointer of the compiled-in size (the
        // exported symbol is the compat entry point that accepts the old layout too).
        rc_err(unsafe { ffi::ibv_query_port(ptr_of(ctx), port, &mut a as *mut _ as *mut _) })?;
        Ok(PortAttr {
            active: a.state == 4,
            lid: a.lid,
            active_mtu: Mtu::from_code(a.active_mtu).unwrap_or(Mtu::M1024),
            max_msg_sz: u64::from(a.max_msg_sz),
        })
    }

    fn query_gid(&self, ctx: Handle, port: u8, index: u8) -> io::Result<[u8; 16]> {
        let mut gid = ffi::ibv_gid { raw: [0; 16] };
        // SAFETY: `ctx` is open and `gid` is a valid out-pointer.
        rc_err(unsafe { ffi::ibv_query_gid(ptr_of(ctx), port, index.into(), &mut gid) })?;
        // SAFETY: every bit pattern of the union is a valid `raw` array.
        Ok(unsafe { gid.raw })
    }

    fn ports(&self, name: &str, sysfs: &Sysfs) -> Result<Vec<PortInfo>, SysfsError> {
        sysfs.nic(name).map(|n| n.ports)
    }

    fn alloc_pd(&self, ctx: Handle) -> io::Result<Handle> {
        // SAFETY: `ctx` is open.
        let pd = unsafe { ffi::ibv_alloc_pd(ptr_of(ctx)) };
        if pd.is_null() {
            Err(null_err())
        } else {
            Ok(h(pd))
        }
    }

    fn dealloc_pd(&self, pd: Handle) -> io::Result<()> {
        // SAFETY: no MR or QP uses the PD any more.
        rc_err(unsafe { ffi::ibv_dealloc_pd(ptr_of(pd)) })
    }

    fn create_cq(&self, ctx: Handle, cqe: u32) -> io::Result<Handle> {
        let cqe = i32::try_from(cqe).unwrap_or(i32::MAX);
        // SAFETY: `ctx` is open; no completion channel or context pointer is attached.
        let cq =
            unsafe { ffi::ibv_create_cq(ptr_of(ctx), cqe, ptr::null_mut(), ptr::null_mut(), 0) };
        if cq.is_null() {
            Err(null_err())
        } else {
            Ok(h(cq))
        }
    }

    fn destroy_cq(&self, cq: Handle) -> io::Result<()> {
        // SAFETY: no QP uses the CQ any more.
        rc_err(unsafe { ffi::ibv_destroy_cq(ptr_of(cq)) })
    }

    fn create_qp(&self, pd: Handle, cq: Handle, caps: QpCaps) -> io::Result<(Handle, u32)> {
        let cq: *mut ffi::ibv_cq = ptr_of(cq);
        let mut attr = ffi::ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: cq,
            recv_cq: cq,
            srq: ptr::null_mut(),
            cap: ffi::ibv_qp_cap {
                max_send_wr: caps.max_send_wr,
                max_recv_wr: 1,
                max_send_sge: caps.max_send_sge,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 1,
        };
        // SAFETY: `pd`/`cq` are alive and of one context; `attr` is fully initialised.
        let qp = unsafe { ffi::ibv_create_qp(ptr_of(pd), &mut attr) };
        if qp.is_null() {
            return Err(null_err());
        }
        // SAFETY: `qp` was just created; `qp_num` is immutable after creation.
        let qpn = unsafe { (*qp).qp_num };
        Ok((h(qp), qpn))
    }

    fn modify_qp(&self, qp: Handle, t: &Transition) -> io::Result<()> {
        let mut attr = ffi::ibv_qp_attr {
            qp_state: t.state as u32,
            path_mtu: t.path_mtu.code(),
            rq_psn: t.rq_psn,
            sq_psn: t.sq_psn,
            dest_qp_num: t.dest_qpn,
            qp_access_flags: t.access_flags,
            pkey_index: t.pkey_index,
            max_rd_atomic: t.max_rd_atomic,
            max_dest_rd_atomic: t.max_dest_rd_atomic,
            min_rnr_timer: t.min_rnr_timer,
            port_num: t.port,
            timeout: t.timeout,
            retry_cnt: t.retry_cnt,
            rnr_retry: t.rnr_retry,
            ..Default::default()
        };
        attr.ah_attr.dlid = t.av.dlid;
        attr.ah_attr.sl = t.av.sl;
        attr.ah_attr.port_num = t.av.port;
        attr.ah_attr.is_global = u8::from(t.av.is_global);
        attr.ah_attr.grh.dgid = ffi::ibv_gid { raw: t.av.dgid.0 };
        attr.ah_attr.grh.sgid_index = t.av.sgid_index;
        attr.ah_attr.grh.hop_limit = t.av.hop_limit;
        attr.ah_attr.grh.traffic_class = t.av.traffic_class;
        // SAFETY: `qp` is alive; only the fields named by the mask are read.
        rc_err(unsafe { ffi::ibv_modify_qp(ptr_of(qp), &mut attr, t.mask as i32) })
    }

    fn destroy_qp(&self, qp: Handle) -> io::Result<()> {
        // SAFETY: the QP is drained and no longer polled for.
        rc_err(unsafe { ffi::ibv_destroy_qp(ptr_of(qp)) })
    }

    fn reg_mr(
        &self,
        pd: Handle,
        addr: u64,
        len: u64,
        access: u32,
    ) -> io::Result<(Handle, u32, u32)> {
        // SAFETY: `pd` is alive and the caller keeps the range mapped while the MR exists;
        // the kernel pins the pages.
        let mr =
            unsafe { ffi::ibv_reg_mr(ptr_of(pd), addr as *mut _, len as usize, access as i32) };
        if mr.is_null() {
            return Err(null_err());
        }
        // SAFETY: `mr` was just registered; keys are immutable.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok((h(mr), lkey, rkey))
    }

    fn reg_dmabuf_mr(
        &self,
        pd: Handle,
        offset: u64,
        len: u64,
        iova: u64,
        fd: i32,
        access: u32,
    ) -> io::Result<(Handle, u32, u32)> {
        // SAFETY: `pd` is alive and `fd` a DMA-BUF of at least `offset + len` bytes (the
        // caller); the kernel takes its own reference on the buffer.
        let mr = unsafe {
            ffi::ibv_reg_dmabuf_mr(ptr_of(pd), offset, len as usize, iova, fd, access as i32)
        };
        if mr.is_null() {
            return Err(null_err());
        }
        // SAFETY: `mr` was just registered; keys are immutable.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok((h(mr), lkey, rkey))
    }

    fn dereg_mr(&self, mr: Handle) -> io::Result<()> {
        // SAFETY: no posted request still uses the MR.
        rc_err(unsafe { ffi::ibv_dereg_mr(ptr_of(mr)) })
    }

    fn post_read(&self, qp: Handle, wr: &ReadWr) -> io::Result<()> {
        let qp: *mut ffi::ibv_qp = ptr_of(qp);
        let mut sges: Vec<ffi::ibv_sge> = wr
            .sges
            .iter()
            .map(|s| ffi::ibv_sge {
                addr: s.addr,
                length: s.len,
                lkey: s.lkey,
            })
            .collect();
        // SAFETY: all-zero is a valid `ibv_send_wr` (null pointers, zero counts).
        let mut swr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        swr.wr_id = wr.wr_id;
        swr.sg_list = sges.as_mut_ptr();
        swr.num_sge = sges.len() as i32;
        swr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_READ;
        swr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        swr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
            remote_addr: wr.remote_addr,
            rkey: wr.rkey,
        };
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        // SAFETY: `qp` is alive, so its context and ops table are valid.
        let post = unsafe { (*(*qp).context).ops.post_send };
        let Some(post) = post else {
            return Err(io::Error::from_raw_os_error(libc::ENOSYS));
        };
        // SAFETY: `swr` and `sges` live across the call (the provider copies them into the
        // send queue); `bad` is a valid out-pointer.
        rc_err(unsafe { post(qp, &mut swr, &mut bad) })
    }

    fn poll_cq(&self, cq: Handle, out: &mut [Wc]) -> io::Result<usize> {
        let cq: *mut ffi::ibv_cq = ptr_of(cq);
        // SAFETY: `ibv_wc` is plain integers; all-zero is a valid value.
        let mut raw: Vec<ffi::ibv_wc> = vec![unsafe { std::mem::zeroed() }; out.len()];
        // SAFETY: `cq` is alive, so its context and ops table are valid.
        let poll = unsafe { (*(*cq).context).ops.poll_cq };
        let Some(poll) = poll else {
            return Err(io::Error::from_raw_os_error(libc::ENOSYS));
        };
        // SAFETY: `raw` has room for `raw.len()` entries of the layout rdma-core writes; one
        // thread polls a CQ.
        let n = unsafe { poll(cq, raw.len() as i32, raw.as_mut_ptr()) };
        if n < 0 {
            return Err(io::Error::other("ibv_poll_cq failed (CQ overrun?)"));
        }
        let n = n as usize;
        for (o, w) in out.iter_mut().zip(&raw[..n]) {
            *o = Wc {
                wr_id: w.wr_id(),
                status: w.error().map(|(s, _)| s).unwrap_or(0),
                qp_num: w.qp_num,
                byte_len: w.len() as u32,
            };
        }
        Ok(n)
    }

    fn next_async_event(&self, ctx: Handle) -> io::Result<Option<AsyncEvent>> {
        let ctx: *mut ffi::ibv_context = ptr_of(ctx);
        // SAFETY: all-zero is a valid event (a union of pointers and an int).
        let mut ev: ffi::ibv_async_event = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` is open with a non-blocking async fd (set at open).
        let rc = unsafe { ffi::ibv_get_async_event(ctx, &mut ev) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EAGAIN) => Ok(None),
                _ => Err(e),
            };
        }
        let code = ev.event_type;
        let (qpn, port) = match code {
            // QP events carry the QP; port events the port number.
            1..=7 => {
                // SAFETY: QP events name a live QP of this context.
                let qp = unsafe { ev.element.qp };
                let qpn = if qp.is_null() {
                    0
                } else {
                    // SAFETY: as above; `qp_num` is immutable after creation.
                    unsafe { (*qp).qp_num }
                };
                (qpn, 0)
            }
            // SAFETY: port events carry the port number.
            9 | 10 => (0, unsafe { ev.element.port_num } as u8),
            _ => (0, 0),
        };
        // SAFETY: every event got is acknowledged once (destroy calls wait for it).
        unsafe { ffi::ibv_ack_async_event(&mut ev) };
        Ok(Some(AsyncEvent::from_code(code, qpn, port)))
    }
}

#[cfg(test)]
mod tests {
    use super::ffi;
    use crate::verbs::gid::Mtu;
    use crate::verbs::qp_attrs::{mask, VerbsQpState};
    use crate::verbs::registration::{
        ACCESS_LOCAL_WRITE, ACCESS_RELAXED_ORDERING, ACCESS_REMOTE_READ,
    };
    use crate::verbs::work::wc;

    /// The plain layers use their own copies of the ABI constants so they build without
    /// rdma-core; this pins them to the real headers.
    #[test]
    fn constants_match_rdma_core() {
        use ffi::ibv_access_flags as A;
        assert_eq!(ACCESS_LOCAL_WRITE, A::IBV_ACCESS_LOCAL_WRITE.0);
        assert_eq!(ACCESS_REMOTE_READ, A::IBV_ACCESS_REMOTE_READ.0);
        assert_eq!(ACCESS_RELAXED_ORDERING, A::IBV_ACCESS_RELAXED_ORDERING.0);
        use ffi::ibv_qp_attr_mask as M;
        for (ours, theirs) in [
            (mask::STATE, M::IBV_QP_STATE),
            (mask::ACCESS_FLAGS, M::IBV_QP_ACCESS_FLAGS),
            (mask::PKEY_INDEX, M::IBV_QP_PKEY_INDEX),
            (mask::PORT, M::IBV_QP_PORT),
            (mask::AV, M::IBV_QP_AV),
            (mask::PATH_MTU, M::IBV_QP_PATH_MTU),
            (mask::TIMEOUT, M::IBV_QP_TIMEOUT),
            (mask::RETRY_CNT, M::IBV_QP_RETRY_CNT),
            (mask::RNR_RETRY, M::IBV_QP_RNR_RETRY),
            (mask::RQ_PSN, M::IBV_QP_RQ_PSN),
            (mask::MAX_QP_RD_ATOMIC, M::IBV_QP_MAX_QP_RD_ATOMIC),
            (mask::MIN_RNR_TIMER, M::IBV_QP_MIN_RNR_TIMER),
            (mask::SQ_PSN, M::IBV_QP_SQ_PSN),
            (mask::MAX_DEST_RD_ATOMIC, M::IBV_QP_MAX_DEST_RD_ATOMIC),
            (mask::DEST_QPN, M::IBV_QP_DEST_QPN),
        ] {
            assert_eq!(ours, theirs.0);
        }
        use ffi::ibv_qp_state as S;
        assert_eq!(VerbsQpState::Reset as u32, S::IBV_QPS_RESET);
        assert_eq!(VerbsQpState::Init as u32, S::IBV_QPS_INIT);
        assert_eq!(VerbsQpState::ReadyToReceive as u32, S::IBV_QPS_RTR);
        assert_eq!(VerbsQpState::ReadyToSend as u32, S::IBV_QPS_RTS);
        assert_eq!(VerbsQpState::Error as u32, S::IBV_QPS_ERR);
        use ffi::ibv_wc_status as W;
        assert_eq!(wc::SUCCESS, W::IBV_WC_SUCCESS);
        assert_eq!(wc::WR_FLUSH_ERR, W::IBV_WC_WR_FLUSH_ERR);
        assert_eq!(wc::REM_ACCESS_ERR, W::IBV_WC_REM_ACCESS_ERR);
        assert_eq!(wc::LOC_PROT_ERR, W::IBV_WC_LOC_PROT_ERR);
        assert_eq!(wc::RETRY_EXC_ERR, W::IBV_WC_RETRY_EXC_ERR);
        assert_eq!(wc::RNR_RETRY_EXC_ERR, W::IBV_WC_RNR_RETRY_EXC_ERR);
        assert_eq!(Mtu::M4096.code(), ffi::IBV_MTU_4096);
        assert_eq!(Mtu::M256.code(), ffi::IBV_MTU_256);
    }
}
