//! The rdma-core calls, each behind a thin wrapper that turns its return convention (NULL,
//! -1/errno, positive errno) into a `Result`. Nothing here owns anything; [`super::device`]
//! wraps the handles in owning types.

use std::ffi::CStr;
use std::io;
use std::ptr;

use ibverbs_sys as ffi;

use super::qp_attrs::Transition;
use super::work::ReadWr;

pub(crate) use ffi::{ibv_context, ibv_cq, ibv_mr, ibv_pd, ibv_qp, ibv_wc};

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

/// Names of the RDMA devices rdma-core sees (empty when there are none).
pub(crate) fn device_names() -> io::Result<Vec<String>> {
    let mut n = 0i32;
    // SAFETY: `n` is a valid out-pointer; a NULL return is handled below.
    let list = unsafe { ffi::ibv_get_device_list(&mut n) };
    if list.is_null() {
        let e = io::Error::last_os_error();
        // ENOSYS: no kernel support (no RDMA stack at all); that is "no device".
        return if e.raw_os_error() == Some(libc::ENOSYS) {
            Ok(Vec::new())
        } else {
            Err(e)
        };
    }
    let mut names = Vec::with_capacity(n.max(0) as usize);
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds `n` valid device pointers until it is freed below.
        let dev = unsafe { *list.add(i) };
        // SAFETY: `dev` is valid; the name is a NUL-terminated string owned by the device.
        let name = unsafe { ffi::ibv_get_device_name(dev) };
        if !name.is_null() {
            // SAFETY: non-NULL, NUL-terminated, alive until the list is freed.
            names.push(
                unsafe { CStr::from_ptr(name) }
                    .to_string_lossy()
                    .into_owned(),
            );
        }
    }
    // SAFETY: `list` came from ibv_get_device_list and is freed once.
    unsafe { ffi::ibv_free_device_list(list) };
    Ok(names)
}

/// Opens the device called `name`; `Ok(None)` when it does not exist.
pub(crate) fn open_device(name: &str) -> io::Result<Option<*mut ibv_context>> {
    let mut n = 0i32;
    // SAFETY: as in `device_names`.
    let list = unsafe { ffi::ibv_get_device_list(&mut n) };
    if list.is_null() {
        return Ok(None);
    }
    let mut out = Ok(None);
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds `n` valid device pointers until it is freed below.
        let dev = unsafe { *list.add(i) };
        // SAFETY: `dev` is valid; the name is owned by the device.
        let dn = unsafe { ffi::ibv_get_device_name(dev) };
        // SAFETY: checked non-NULL, NUL-terminated.
        if dn.is_null() || unsafe { CStr::from_ptr(dn) }.to_bytes() != name.as_bytes() {
            continue;
        }
        // SAFETY: `dev` is valid while the list lives; the context outlives the list.
        let ctx = unsafe { ffi::ibv_open_device(dev) };
        out = if ctx.is_null() {
            Err(null_err())
        } else {
            Ok(Some(ctx))
        };
        break;
    }
    // SAFETY: freed once; contexts opened from it stay valid.
    unsafe { ffi::ibv_free_device_list(list) };
    out
}

/// # Safety
/// `ctx` must be an open context with nothing created on it still alive.
pub(crate) unsafe fn close_device(ctx: *mut ibv_context) -> io::Result<()> {
    // SAFETY: the caller guarantees `ctx` is open and unused.
    rc_err(unsafe { ffi::ibv_close_device(ctx) })
}

/// # Safety
/// `ctx` must be an open context.
pub(crate) unsafe fn query_device(ctx: *mut ibv_context) -> io::Result<ffi::ibv_device_attr> {
    let mut attr = ffi::ibv_device_attr::default();
    // SAFETY: `ctx` is open (caller) and `attr` is a valid out-pointer.
    rc_err(unsafe { ffi::ibv_query_device(ctx, &mut attr) })?;
    Ok(attr)
}

/// # Safety
/// `ctx` must be an open context.
pub(crate) unsafe fn query_port(ctx: *mut ibv_context, port: u8) -> io::Result<ffi::ibv_port_attr> {
    let mut attr = ffi::ibv_port_attr::default();
    // SAFETY: `ctx` is open (caller); `attr` is a valid out-pointer of the compiled-in size
    // (the exported symbol is the compat entry point that accepts the old layout too).
    rc_err(unsafe { ffi::ibv_query_port(ctx, port, &mut attr as *mut _ as *mut _) })?;
    Ok(attr)
}

/// # Safety
/// `ctx` must be an open context.
pub(crate) unsafe fn query_gid(
    ctx: *mut ibv_context,
    port: u8,
    index: i32,
) -> io::Result<[u8; 16]> {
    let mut gid = ffi::ibv_gid { raw: [0; 16] };
    // SAFETY: `ctx` is open (caller) and `gid` is a valid out-pointer.
    rc_err(unsafe { ffi::ibv_query_gid(ctx, port, index, &mut gid) })?;
    // SAFETY: every bit pattern of the union is a valid `raw` array.
    Ok(unsafe { gid.raw })
}

/// # Safety
/// `ctx` must be an open context.
pub(crate) unsafe fn alloc_pd(ctx: *mut ibv_context) -> io::Result<*mut ibv_pd> {
    // SAFETY: `ctx` is open (caller).
    let pd = unsafe { ffi::ibv_alloc_pd(ctx) };
    if pd.is_null() {
        Err(null_err())
    } else {
        Ok(pd)
    }
}

/// # Safety
/// `pd` must be allocated and no longer used by any MR or QP.
pub(crate) unsafe fn dealloc_pd(pd: *mut ibv_pd) -> io::Result<()> {
    // SAFETY: guaranteed by the caller.
    rc_err(unsafe { ffi::ibv_dealloc_pd(pd) })
}

/// # Safety
/// `ctx` must be an open context.
pub(crate) unsafe fn create_cq(ctx: *mut ibv_context, cqe: i32) -> io::Result<*mut ibv_cq> {
    // SAFETY: `ctx` is open; no completion channel or context pointer is attached.
    let cq = unsafe { ffi::ibv_create_cq(ctx, cqe, ptr::null_mut(), ptr::null_mut(), 0) };
    if cq.is_null() {
        Err(null_err())
    } else {
        Ok(cq)
    }
}

/// # Safety
/// `cq` must exist and no QP may still use it.
pub(crate) unsafe fn destroy_cq(cq: *mut ibv_cq) -> io::Result<()> {
    // SAFETY: guaranteed by the caller.
    rc_err(unsafe { ffi::ibv_destroy_cq(cq) })
}

/// Creates an RC QP whose send completions go to `cq`; every request is signaled.
///
/// # Safety
/// `pd` and `cq` must be alive and from the same context.
pub(crate) unsafe fn create_rc_qp(
    pd: *mut ibv_pd,
    cq: *mut ibv_cq,
    max_send_wr: u32,
    max_sge: u32,
) -> io::Result<*mut ibv_qp> {
    let mut attr = ffi::ibv_qp_init_attr {
        qp_context: ptr::null_mut(),
        send_cq: cq,
        recv_cq: cq,
        srq: ptr::null_mut(),
        cap: ffi::ibv_qp_cap {
            max_send_wr,
            max_recv_wr: 1,
            max_send_sge: max_sge,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
        sq_sig_all: 1,
    };
    // SAFETY: `pd`/`cq` are alive (caller); `attr` is fully initialised.
    let qp = unsafe { ffi::ibv_create_qp(pd, &mut attr) };
    if qp.is_null() {
        Err(null_err())
    } else {
        Ok(qp)
    }
}

/// The QP number of `qp`.
///
/// # Safety
/// `qp` must be alive.
pub(crate) unsafe fn qp_num(qp: *mut ibv_qp) -> u32 {
    // SAFETY: `qp` is alive (caller); `qp_num` is immutable after creation.
    unsafe { (*qp).qp_num }
}

/// # Safety
/// `qp` must be alive.
pub(crate) unsafe fn modify_qp(qp: *mut ibv_qp, t: &Transition) -> io::Result<()> {
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
    // SAFETY: `qp` is alive (caller); only the fields named by the mask are read.
    rc_err(unsafe { ffi::ibv_modify_qp(qp, &mut attr, t.mask as i32) })
}

/// # Safety
/// `qp` must be alive, with nothing outstanding that could still complete onto freed state.
pub(crate) unsafe fn destroy_qp(qp: *mut ibv_qp) -> io::Result<()> {
    // SAFETY: guaranteed by the caller.
    rc_err(unsafe { ffi::ibv_destroy_qp(qp) })
}

/// # Safety
/// `pd` must be alive and `addr..addr+len` mapped for as long as the MR exists.
pub(crate) unsafe fn reg_mr(
    pd: *mut ibv_pd,
    addr: u64,
    len: u64,
    access: u32,
) -> io::Result<*mut ibv_mr> {
    // SAFETY: guaranteed by the caller; the kernel pins the pages.
    let mr = unsafe { ffi::ibv_reg_mr(pd, addr as *mut _, len as usize, access as i32) };
    if mr.is_null() {
        Err(null_err())
    } else {
        Ok(mr)
    }
}

/// Registers `len` bytes at `offset` of a DMA-BUF, addressed by the NIC as `iova`.
///
/// # Safety
/// `pd` must be alive and `fd` a DMA-BUF exported for at least `offset + len` bytes.
pub(crate) unsafe fn reg_dmabuf_mr(
    pd: *mut ibv_pd,
    offset: u64,
    len: u64,
    iova: u64,
    fd: i32,
    access: u32,
) -> io::Result<*mut ibv_mr> {
    // SAFETY: guaranteed by the caller; the kernel takes its own reference on the buffer.
    let mr = unsafe { ffi::ibv_reg_dmabuf_mr(pd, offset, len as usize, iova, fd, access as i32) };
    if mr.is_null() {
        Err(null_err())
    } else {
        Ok(mr)
    }
}

/// (lkey, rkey) of a registration.
///
/// # Safety
/// `mr` must be alive.
pub(crate) unsafe fn mr_keys(mr: *mut ibv_mr) -> (u32, u32) {
    // SAFETY: `mr` is alive (caller); keys are immutable.
    unsafe { ((*mr).lkey, (*mr).rkey) }
}

/// # Safety
/// `mr` must be alive and no posted request may still use it.
pub(crate) unsafe fn dereg_mr(mr: *mut ibv_mr) -> io::Result<()> {
    // SAFETY: guaranteed by the caller.
    rc_err(unsafe { ffi::ibv_dereg_mr(mr) })
}

/// Posts one signaled RDMA READ.
///
/// # Safety
/// `qp` must be alive; every SGE must name memory registered under its lkey that stays valid
/// until the request completes.
pub(crate) unsafe fn post_read(qp: *mut ibv_qp, wr: &ReadWr) -> io::Result<()> {
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
    // SAFETY: `qp` is alive (caller), so its context and ops table are valid.
    let post = unsafe { (*(*qp).context).ops.post_send };
    let Some(post) = post else {
        return Err(io::Error::from_raw_os_error(libc::ENOSYS));
    };
    // SAFETY: `swr` and `sges` live across the call (the provider copies them into the send
    // queue); `bad` is a valid out-pointer.
    rc_err(unsafe { post(qp, &mut swr, &mut bad) })
}

/// Polls up to `out.len()` completions; returns how many were written.
///
/// # Safety
/// `cq` must be alive and polled by one thread at a time.
pub(crate) unsafe fn poll_cq(cq: *mut ibv_cq, out: &mut [ibv_wc]) -> io::Result<usize> {
    // SAFETY: `cq` is alive (caller), so its context and ops table are valid.
    let poll = unsafe { (*(*cq).context).ops.poll_cq };
    let Some(poll) = poll else {
        return Err(io::Error::from_raw_os_error(libc::ENOSYS));
    };
    // SAFETY: `out` has room for `out.len()` entries of the layout rdma-core writes.
    let n = unsafe { poll(cq, out.len() as i32, out.as_mut_ptr()) };
    if n < 0 {
        Err(io::Error::other("ibv_poll_cq failed"))
    } else {
        Ok(n as usize)
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
