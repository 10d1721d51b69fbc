//! The verbs rules the software device enforces, call by call.

use super::*;
use crate::region::HostRegion;
use crate::verbs::config::VerbsConfig;
use crate::verbs::gid::PortAddress;
use crate::verbs::qp_attrs::{connect_transitions, QpEndpoint, ReadDepthLimits};
use crate::verbs::registration::Sge;

struct Side {
    ctx: Handle,
    pd: Handle,
    cq: Handle,
    qp: Handle,
    qpn: u32,
    addr: PortAddress,
    depth: ReadDepthLimits,
}

fn side(ops: &SoftOps, name: &str, cqe: u32, caps: QpCaps) -> Side {
    let ctx = ops.open_device(name).unwrap().unwrap();
    let attr = ops.query_device(ctx).unwrap();
    let port = ops.query_port(ctx, 1).unwrap();
    let gid = Gid(ops.query_gid(ctx, 1, 0).unwrap());
    let pd = ops.alloc_pd(ctx).unwrap();
    let cq = ops.create_cq(ctx, cqe).unwrap();
    let (qp, qpn) = ops.create_qp(pd, cq, caps).unwrap();
    Side {
        ctx,
        pd,
        cq,
        qp,
        qpn,
        addr: PortAddress {
            port: 1,
            gid_index: 0,
            gid,
            lid: 0,
            global: true,
            mtu: port.active_mtu,
        },
        depth: ReadDepthLimits {
            initiator: attr.max_qp_init_rd_atom,
            responder: attr.max_qp_rd_atom,
        },
    }
}

fn endpoint(s: &Side, depth: u8) -> QpEndpoint {
    QpEndpoint {
        qpn: s.qpn,
        psn: 7,
        lid: 0,
        gid: s.addr.gid,
        mtu: s.addr.mtu,
        responder_depth: depth,
    }
}

/// Brings `a` (requester, initiator depth `rd`) and `b` (responder) to RTS against each
/// other, `b` granting `b_access`.
fn connect(ops: &SoftOps, a: &Side, b: &Side, rd: u32, b_access: u32) {
    let cfg = VerbsConfig::default();
    let b_depth = b.depth.responder.min(255) as u8;
    for t in connect_transitions(&cfg, rd, a.depth, &a.addr, &endpoint(b, b_depth), 1, 0) {
        ops.modify_qp(a.qp, &t).unwrap();
    }
    for t in connect_transitions(&cfg, rd, b.depth, &b.addr, &endpoint(a, 16), 7, b_access) {
        ops.modify_qp(b.qp, &t).unwrap();
    }
}

const CAPS: QpCaps = QpCaps {
    max_send_wr: 64,
    max_send_sge: 4,
};

fn read(wr_id: u64, remote: u64, rkey: u32, sges: &[(u64, u32, u32)]) -> ReadWr {
    ReadWr {
        wr_id,
        remote_addr: remote,
        rkey,
        sges: sges
            .iter()
            .map(|&(addr, len, lkey)| Sge { addr, len, lkey })
            .collect(),
    }
}

fn drain(ops: &SoftOps, cq: Handle) -> Vec<Wc> {
    let mut out = Vec::new();
    let mut buf = [Wc::default(); 16];
    loop {
        let n = ops.poll_cq(cq, &mut buf).unwrap();
        if n == 0 {
            return out;
        }
        out.extend_from_slice(&buf[..n]);
    }
}

#[test]
fn the_state_machine_takes_only_legal_transitions_with_their_masks() {
    let ops = SoftOps::default();
    let a = side(&ops, "soft_mlx5_0", 64, CAPS);
    let b = side(&ops, "soft_mlx5_1", 64, CAPS);
    let cfg = VerbsConfig::default();
    let [init, rtr, rts] = connect_transitions(&cfg, 16, a.depth, &a.addr, &endpoint(&b, 16), 1, 0);
    // Reset → RTR skips init.
    let e = ops.modify_qp(a.qp, &rtr).unwrap_err();
    assert!(e.to_string().contains("not a transition"), "{e}");
    // A required bit missing, then a bit the transition does not allow.
    let mut t = init;
    t.mask &= !mask::ACCESS_FLAGS;
    let e = ops.modify_qp(a.qp, &t).unwrap_err();
    assert!(e.to_string().contains("lacks required"), "{e}");
    let mut t = init;
    t.mask |= mask::SQ_PSN;
    let e = ops.modify_qp(a.qp, &t).unwrap_err();
    assert!(e.to_string().contains("not allowed"), "{e}");
    ops.modify_qp(a.qp, &init).unwrap();
    // Posting needs RTS.
    let e = ops.post_read(a.qp, &read(1, 0, 0, &[])).unwrap_err();
    assert!(e.to_string().contains("sends need RTS"), "{e}");
    // Values the device cannot take: a path MTU above the port's, a read depth above the
    // device's, a zero destination QPN.
    let mut t = rtr;
    t.max_dest_rd_atomic = 17;
    assert!(ops.modify_qp(a.qp, &t).is_err());
    let mut t = rtr;
    t.dest_qpn = 0;
    assert!(ops.modify_qp(a.qp, &t).is_err());
    ops.modify_qp(a.qp, &rtr).unwrap();
    let mut t = rts;
    t.max_rd_atomic = 17;
    let e = ops.modify_qp(a.qp, &t).unwrap_err();
    assert!(e.to_string().contains("max_qp_init_rd_atom"), "{e}");
    ops.modify_qp(a.qp, &rts).unwrap();
    // Error and reset are reachable from anywhere; reset → RTS is not.
    ops.modify_qp(a.qp, &Transition::error()).unwrap();
    ops.modify_qp(a.qp, &Transition::reset()).unwrap();
    assert!(ops.modify_qp(a.qp, &rts).is_err());
    // The small profile's MTU is 1024: a 4096 path is refused there.
    let s = side(&ops, "soft_small_0", 64, CAPS);
    let [init, mut rtr, _] =
        connect_transitions(&cfg, 4, s.depth, &s.addr, &endpoint(&b, 16), 1, 0);
    ops.modify_qp(s.qp, &init).unwrap();
    rtr.path_mtu = crate::verbs::gid::Mtu::M4096;
    let e = ops.modify_qp(s.qp, &rtr).unwrap_err();
    assert!(e.to_string().contains("path MTU"), "{e}");
}

#[test]
fn creation_is_held_to_the_profile() {
    let ops = SoftOps::default();
    let ctx = ops.open_device("soft_mlx5_0").unwrap().unwrap();
    assert!(ops.open_device("mlx5_0").unwrap().is_none());
    let pd = ops.alloc_pd(ctx).unwrap();
    assert!(ops.create_cq(ctx, 4_194_304).is_err());
    let cq = ops.create_cq(ctx, 128).unwrap();
    let caps = |w, s| QpCaps {
        max_send_wr: w,
        max_send_sge: s,
    };
    // mlx5: 32768 WRs, 30 SGEs.
    let e = ops.create_qp(pd, cq, caps(32_769, 4)).unwrap_err();
    assert!(e.to_string().contains("max_qp_wr"), "{e}");
    let e = ops.create_qp(pd, cq, caps(128, 31)).unwrap_err();
    assert!(e.to_string().contains("max_sge"), "{e}");
    let (qp, qpn) = ops.create_qp(pd, cq, caps(32_768, 30)).unwrap();
    assert!(qpn > 0 && qpn <= MASK_24);
    // Objects in use cannot go.
    assert!(ops.destroy_cq(cq).is_err());
    assert!(ops.dealloc_pd(pd).is_err());
    assert!(ops.close_device(ctx).is_err());
    // Remote write without local write is refused (IBA).
    assert!(ops.reg_mr(pd, 0x1000, 4096, ACCESS_REMOTE_WRITE).is_err());
    ops.destroy_qp(qp).unwrap();
    ops.destroy_cq(cq).unwrap();
    ops.dealloc_pd(pd).unwrap();
    ops.close_device(ctx).unwrap();
    // The small device: 4 SGEs, 1024 WRs.
    let ctx = ops.open_device("soft_small_0").unwrap().unwrap();
    let pd = ops.alloc_pd(ctx).unwrap();
    let cq = ops.create_cq(ctx, 128).unwrap();
    assert!(ops.create_qp(pd, cq, caps(128, 5)).is_err());
    assert!(ops.create_qp(pd, cq, caps(1025, 4)).is_err());
    let p = ops.query_port(ctx, 1).unwrap();
    assert_eq!(p.max_msg_sz, 16 << 20);
    assert!(ops.query_port(ctx, 2).is_err());
}

#[test]
fn reads_move_bytes_and_check_keys_bounds_and_access() {
    let ops = SoftOps::default();
    let a = side(&ops, "soft_mlx5_0", 64, CAPS);
    let b = side(&ops, "soft_mlx5_1", 64, CAPS);
    connect(&ops, &a, &b, 16, ACCESS_REMOTE_READ);
    let src = HostRegion::anonymous(8192).unwrap();
    let pattern: Vec<u8> = (0..8192u32).map(|i| (i * 7 + 1) as u8).collect();
    src.write_at(0, &pattern).unwrap();
    let dst = HostRegion::anonymous(8192).unwrap();
    dst.fill(0xee).unwrap();
    let (_, _, rkey) = ops
        .reg_mr(
            b.pd,
            src.addr(),
            4096,
            ACCESS_LOCAL_WRITE | ACCESS_REMOTE_READ,
        )
        .unwrap();
    let (_, lkey, _) = ops
        .reg_mr(a.pd, dst.addr(), 8192, ACCESS_LOCAL_WRITE)
        .unwrap();
    let (_, ro_key, _) = ops.reg_mr(a.pd, dst.addr(), 8192, 0).unwrap();
    // Scattered into two pieces, canaries around them.
    ops.post_read(
        a.qp,
        &read(
            1,
            src.addr() + 100,
            rkey,
            &[(dst.addr() + 10, 50, lkey), (dst.addr() + 1000, 200, lkey)],
        ),
    )
    .unwrap();
    let wcs = drain(&ops, a.cq);
    assert_eq!(wcs.len(), 1);
    assert_eq!(
        (wcs[0].wr_id, wcs[0].status, wcs[0].byte_len),
        (1, wc::SUCCESS, 250)
    );
    let got = dst.to_vec();
    assert_eq!(&got[10..60], &pattern[100..150]);
    assert_eq!(&got[1000..1200], &pattern[150..350]);
    assert!(got[..10]
        .iter()
        .chain(&got[60..1000])
        .chain(&got[1200..])
        .all(|&x| x == 0xee));
    // Past the end of the remote MR: remote access error, the QP goes to error and what
    // was queued behind flushes.
    ops.post_read(
        a.qp,
        &read(2, src.addr() + 4000, rkey, &[(dst.addr(), 200, lkey)]),
    )
    .unwrap();
    ops.post_read(a.qp, &read(3, src.addr(), rkey, &[(dst.addr(), 8, lkey)]))
        .unwrap();
    let wcs = drain(&ops, a.cq);
    let st: Vec<_> = wcs.iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(st, vec![(2, wc::REM_ACCESS_ERR), (3, wc::WR_FLUSH_ERR)]);
    // In error, posts are accepted and flush.
    ops.post_read(a.qp, &read(4, src.addr(), rkey, &[(dst.addr(), 8, lkey)]))
        .unwrap();
    assert_eq!(drain(&ops, a.cq)[0].status, wc::WR_FLUSH_ERR);

    // A fresh pair: a local MR without local write is a protection error; an unknown rkey
    // and a responder QP that does not grant remote read are remote access errors.
    for (case, access, local, want) in [
        ("lkey", ACCESS_REMOTE_READ, ro_key, wc::LOC_PROT_ERR),
        ("rkey", ACCESS_REMOTE_READ, lkey, wc::REM_ACCESS_ERR),
        ("qp access", 0, lkey, wc::REM_ACCESS_ERR),
    ] {
        let a = side(&ops, "soft_mlx5_0", 64, CAPS);
        let b2 = side(&ops, "soft_mlx5_1", 64, CAPS);
        connect(&ops, &a, &b2, 16, access);
        let (_, _, rk) = ops
            .reg_mr(
                b2.pd,
                src.addr(),
                4096,
                ACCESS_LOCAL_WRITE | ACCESS_REMOTE_READ,
            )
            .unwrap();
        let (_, lk, _) = ops
            .reg_mr(a.pd, dst.addr() + 4096, 4096, ACCESS_LOCAL_WRITE)
            .unwrap();
        let local = if local == lkey { lk } else { local };
        let rk = if case == "rkey" { rk ^ 0xffff_0000 } else { rk };
        ops.post_read(
            a.qp,
            &read(9, src.addr(), rk, &[(dst.addr() + 4096, 16, local)]),
        )
        .unwrap();
        let wcs = drain(&ops, a.cq);
        assert_eq!(wcs[0].status, want, "{case}");
    }
}

#[test]
fn max_sge_send_queue_depth_and_message_size() {
    let ops = SoftOps::default();
    let caps = QpCaps {
        max_send_wr: 2,
        max_send_sge: 2,
    };
    let a = side(&ops, "soft_small_0", 64, caps);
    let b = side(&ops, "soft_small_1", 64, caps);
    connect(&ops, &a, &b, 4, ACCESS_REMOTE_READ);
    let big = HostRegion::anonymous((16 << 20) + 4096).unwrap();
    let dst = HostRegion::anonymous((16 << 20) + 4096).unwrap();
    let (_, _, rkey) = ops
        .reg_mr(
            b.pd,
            big.addr(),
            big.len() as u64,
            ACCESS_LOCAL_WRITE | ACCESS_REMOTE_READ,
        )
        .unwrap();
    let (_, lkey, _) = ops
        .reg_mr(a.pd, dst.addr(), dst.len() as u64, ACCESS_LOCAL_WRITE)
        .unwrap();
    let three = [
        (dst.addr(), 1, lkey),
        (dst.addr() + 1, 1, lkey),
        (dst.addr() + 2, 1, lkey),
    ];
    let e = ops
        .post_read(a.qp, &read(1, big.addr(), rkey, &three))
        .unwrap_err();
    assert!(e.to_string().contains("SGEs"), "{e}");
    let one = read(1, big.addr(), rkey, &[(dst.addr(), 8, lkey)]);
    ops.post_read(a.qp, &one).unwrap();
    ops.post_read(a.qp, &one).unwrap();
    let e = ops.post_read(a.qp, &one).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::OutOfMemory, "{e}");
    assert_eq!(drain(&ops, a.cq).len(), 2);
    // One byte over the port's max_msg_sz (16 MiB on this profile).
    let over = (16u32 << 20) + 1;
    ops.post_read(
        a.qp,
        &read(5, big.addr(), rkey, &[(dst.addr(), over, lkey)]),
    )
    .unwrap();
    assert_eq!(drain(&ops, a.cq)[0].status, wc::LOC_LEN_ERR);
}

/// IBA: an initiator must not have more reads outstanding than the responder accepts. A
/// requester at depth 16 against a responder at 4 gets a remote invalid request at the 5th.
#[test]
fn more_reads_than_the_responder_accepts_is_an_invalid_request() {
    let ops = SoftOps::default();
    let a = side(&ops, "soft_mlx5_0", 64, CAPS);
    let b = side(&ops, "soft_small_0", 64, CAPS);
    // The responder's depth is honoured by connect_transitions (min of both); force the
    // requester past it as a config above the peer's advertised depth would.
    let cfg = VerbsConfig::default();
    for t in connect_transitions(&cfg, 16, a.depth, &a.addr, &endpoint(&b, 16), 1, 0) {
        ops.modify_qp(a.qp, &t).unwrap();
    }
    let mut bt = connect_transitions(
        &cfg,
        4,
        b.depth,
        &b.addr,
        &endpoint(&a, 16),
        7,
        ACCESS_REMOTE_READ,
    );
    bt[1].path_mtu = crate::verbs::gid::Mtu::M1024;
    for t in bt {
        ops.modify_qp(b.qp, &t).unwrap();
    }
    let src = HostRegion::anonymous(4096).unwrap();
    let dst = HostRegion::anonymous(4096).unwrap();
    let (_, _, rkey) = ops
        .reg_mr(
            b.pd,
            src.addr(),
            4096,
            ACCESS_LOCAL_WRITE | ACCESS_REMOTE_READ,
        )
        .unwrap();
    let (_, lkey, _) = ops
        .reg_mr(a.pd, dst.addr(), 4096, ACCESS_LOCAL_WRITE)
        .unwrap();
    for i in 0..8 {
        ops.post_read(a.qp, &read(i, src.addr(), rkey, &[(dst.addr(), 8, lkey)]))
            .unwrap();
    }
    let st: Vec<u32> = drain(&ops, a.cq).iter().map(|w| w.status).collect();
    assert_eq!(&st[..4], &[wc::SUCCESS; 4]);
    assert_eq!(st[4], wc::REM_INV_REQ_ERR);
    assert!(st[5..].iter().all(|s| *s == wc::WR_FLUSH_ERR));
}

#[test]
fn a_cq_overrun_fails_the_cq_and_raises_an_async_event() {
    let ops = SoftOps::default();
    let a = side(&ops, "soft_mlx5_0", 2, CAPS);
    let b = side(&ops, "soft_mlx5_1", 64, CAPS);
    connect(&ops, &a, &b, 16, ACCESS_REMOTE_READ);
    let src = HostRegion::anonymous(4096).unwrap();
    let (_, rkey, _) = ops
        .reg_mr(
            b.pd,
            src.addr(),
            4096,
            ACCESS_LOCAL_WRITE | ACCESS_REMOTE_READ,
        )
        .unwrap();
    let (_, lkey, _) = ops
        .reg_mr(a.pd, src.addr(), 4096, ACCESS_LOCAL_WRITE)
        .unwrap();
    for i in 0..3 {
        ops.post_read(
            a.qp,
            &read(i, src.addr(), rkey, &[(src.addr() + 64, 8, lkey)]),
        )
        .unwrap();
    }
    // The progress engine runs on poll: three completions into two entries.
    let mut buf = [Wc::default(); 1];
    let e = ops.poll_cq(a.cq, &mut buf).unwrap_err();
    assert!(e.to_string().contains("overran"), "{e}");
    assert_eq!(
        ops.next_async_event(a.ctx).unwrap(),
        Some(AsyncEvent::CqError)
    );
    assert_eq!(ops.next_async_event(a.ctx).unwrap(), None);
    // Its QP is in error: nothing posted on it executes.
    ops.post_read(
        a.qp,
        &read(9, src.addr(), rkey, &[(src.addr() + 64, 8, lkey)]),
    )
    .unwrap();
    assert!(ops.poll_cq(a.cq, &mut buf).is_err());
}

#[test]
fn injected_faults_complete_with_errors_and_events() {
    let ops = SoftOps::default();
    let src = HostRegion::anonymous(4096).unwrap();
    let setup = |ops: &SoftOps| {
        let a = side(ops, "soft_mlx5_0", 64, CAPS);
        let b = side(ops, "soft_mlx5_1", 64, CAPS);
        connect(ops, &a, &b, 16, ACCESS_REMOTE_READ);
        let (_, _, rkey) = ops
            .reg_mr(
                b.pd,
                src.addr(),
                2048,
                ACCESS_LOCAL_WRITE | ACCESS_REMOTE_READ,
            )
            .unwrap();
        let (_, lkey, _) = ops
            .reg_mr(a.pd, src.addr() + 2048, 2048, ACCESS_LOCAL_WRITE)
            .unwrap();
        (
            a,
            read(1, src.addr(), rkey, &[(src.addr() + 2048, 64, lkey)]),
        )
    };
    // The second read completes with a transport error.
    let (a, wr) = setup(&ops);
    ops.inject(
        "soft_mlx5_0",
        SoftFault::CompletionError {
            nth: 1,
            status: wc::RETRY_EXC_ERR,
        },
    );
    for _ in 0..3 {
        ops.post_read(a.qp, &wr).unwrap();
    }
    let st: Vec<u32> = drain(&ops, a.cq).iter().map(|w| w.status).collect();
    assert_eq!(st, vec![wc::SUCCESS, wc::RETRY_EXC_ERR, wc::WR_FLUSH_ERR]);
    // The peer vanishes: retry exceeded.
    let (a, wr) = setup(&ops);
    ops.inject("soft_mlx5_1", SoftFault::Vanish);
    ops.post_read(a.qp, &wr).unwrap();
    assert_eq!(drain(&ops, a.cq)[0].status, wc::RETRY_EXC_ERR);
    ops.heal("soft_mlx5_1");
    // The local port goes down: event, QP in error, posts flush; back up: event.
    let (a, wr) = setup(&ops);
    ops.inject("soft_mlx5_0", SoftFault::PortDown);
    assert!(!ops.query_port(a.ctx, 1).unwrap().active);
    assert_eq!(
        ops.next_async_event(a.ctx).unwrap(),
        Some(AsyncEvent::PortError { port: 1 })
    );
    ops.post_read(a.qp, &wr).unwrap();
    assert_eq!(drain(&ops, a.cq)[0].status, wc::WR_FLUSH_ERR);
    ops.heal("soft_mlx5_0");
    assert_eq!(
        ops.next_async_event(a.ctx).unwrap(),
        Some(AsyncEvent::PortActive { port: 1 })
    );
    let (a, wr) = setup(&ops);
    ops.post_read(a.qp, &wr).unwrap();
    assert_eq!(drain(&ops, a.cq)[0].status, wc::SUCCESS);
}
