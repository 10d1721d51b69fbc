//! The verbs provider's logic against sysfs fixtures (no NIC needed); the provider itself on
//! the software verbs device (every build); and, behind `#[ignore = "needs an RDMA NIC"]`,
//! the same provider tests on real hardware.

use std::path::PathBuf;

use kvferry_transport::verbs::affinity::{choose_nics, stripe, AffinityError, Destination};
use kvferry_transport::verbs::capability::{probe, probe_devices, VerbsCapability};
use kvferry_transport::verbs::gid::{choose_address, GidError, LinkLayer};
use kvferry_transport::verbs::sysfs::{Sysfs, SysfsError};

fn fixture(name: &str) -> Sysfs {
    Sysfs::new(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name),
    )
}

#[test]
fn reads_devices_ports_and_gids() {
    let sys = fixture("sysfs-two-socket");
    let nics = sys.nics().unwrap();
    let names: Vec<_> = nics.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_10"]);
    let m0 = &nics[0];
    assert_eq!(m0.pci.bdf(), "0000:1a:00.0");
    assert_eq!(m0.pci.numa, Some(0));
    assert_eq!(m0.ports[0].link_layer, LinkLayer::Ethernet);
    // The all-zero entry is skipped.
    assert_eq!(m0.ports[0].gids.len(), 4);
    let a = choose_address(&m0.ports[0]).unwrap();
    assert_eq!(a.gid_index, 3);
    assert_eq!(a.gid.to_string(), "0000:0000:0000:0000:0000:ffff:0a00:0002");
    let ib = choose_address(&nics[2].ports[0]).unwrap();
    assert_eq!((ib.lid, ib.global), (5, false));
    assert_eq!(
        choose_address(&nics[1].ports[0]),
        Err(GidError::NoRoceV2Gid { port: 1 })
    );
    assert_eq!(
        choose_address(&nics[4].ports[0]),
        Err(GidError::PortDown { port: 1 })
    );
    assert_eq!(nics[4].pci.numa, None);
}

#[test]
fn nic_choice_by_gpu_and_numa() {
    let sys = fixture("sysfs-two-socket");
    let nics = sys.nics().unwrap();
    let gpu0 = Destination::Gpu(sys.pci_device("0000:19:00.0").unwrap());
    let gpu1 = Destination::Gpu(sys.pci_device("0000:9A:00.0").unwrap());
    // mlx5_1 shares gpu0's root complex but has no routable RoCE v2 GID.
    assert_eq!(choose_nics(&nics, &gpu0, &[]).unwrap(), ["mlx5_0"]);
    assert_eq!(
        choose_nics(&nics, &gpu1, &[]).unwrap(),
        ["mlx5_2", "mlx5_3"]
    );
    assert_eq!(
        choose_nics(&nics, &Destination::Host { numa: Some(1) }, &[]).unwrap(),
        ["mlx5_2", "mlx5_3"]
    );
    // Override wins, but must name a usable device.
    assert_eq!(
        choose_nics(&nics, &gpu0, &["mlx5_3".into()]).unwrap(),
        ["mlx5_3"]
    );
    assert!(matches!(
        choose_nics(&nics, &gpu0, &["mlx5_9".into()]),
        Err(AffinityError::UnknownOverride { .. })
    ));
    assert!(matches!(
        choose_nics(&nics, &gpu0, &["mlx5_10".into()]),
        Err(AffinityError::UnusableOverride { .. })
    ));
    assert!(matches!(
        sys.pci_device("0000:01:00.0"),
        Err(SysfsError::UnknownPciDevice { .. })
    ));
    // A large plan to gpu1 is striped over both nearby NICs.
    let near = choose_nics(&nics, &gpu1, &[]).unwrap();
    let lens = [1 << 20; 8];
    let a = stripe(&lens, near.len(), 4 << 20);
    assert_eq!(a.iter().filter(|&&i| i == 0).count(), 4);
    assert_eq!(a.iter().filter(|&&i| i == 1).count(), 4);
}

#[test]
fn capability_gate_says_why() {
    let none = fixture("sysfs-no-rdma");
    assert!(matches!(none.nics(), Err(SysfsError::NoDevice { .. })));
    let cap = probe_devices(&none);
    assert!(!cap.is_usable());
    assert!(cap.refusal().unwrap().contains("no RDMA device"), "{cap:?}");
    let some = fixture("sysfs-two-socket");
    assert_eq!(
        probe_devices(&some),
        VerbsCapability::Usable {
            nics: vec!["mlx5_0".into(), "mlx5_2".into(), "mlx5_3".into()]
        }
    );
    // Without the feature the gate refuses and names it, whatever the devices.
    assert_eq!(probe(&some).is_usable(), cfg!(feature = "verbs"));
    if !cfg!(feature = "verbs") {
        assert!(probe(&some).refusal().unwrap().contains("`verbs` feature"));
    }
    // No NIC at all in the choice.
    assert!(matches!(
        choose_nics(&[], &Destination::Host { numa: None }, &[]),
        Err(AffinityError::NoUsableNic { .. })
    ));
}

/// Runs everywhere the feature is on: without a device, discovery answers with a typed error.
#[cfg(feature = "verbs")]
#[test]
fn discovery_without_device_is_an_error_not_a_panic() {
    use kvferry_transport::verbs::device::{device_names, DeviceError};
    match device_names() {
        Ok(names) => assert!(!names.is_empty()),
        Err(DeviceError::NoDevice) | Err(DeviceError::List { .. }) => {}
        Err(e) => panic!("unexpected error {e}"),
    }
}

mod nic {
    use std::any::Any;
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use kvferry_transport::verbs::device::Registration;
    use kvferry_transport::verbs::provider::{EndpointExchange, VerbsConnector, VerbsNic};
    use kvferry_transport::verbs::registration::{KeyMap, NicKeys};
    use kvferry_transport::verbs::work::wc;
    use kvferry_transport::verbs::{QpEndpoint, RdmaNic, SoftFault, SoftOps, Sysfs, VerbsConfig};
    use kvferry_transport::{
        Access, CompletionQueue, CompletionStatus, ConnectionError, HostRegion, LocalSegment,
        MrTable, NicConfig, NicId, NodeId, ProviderKind, Qp, QpGauges, QpKey, QpNum, ReadRequest,
        RemoteDescriptor, WorkCompletion,
    };

    /// The owner's side in this process: each exchange makes an owner QP (the NIC's
    /// `accept`, as the Peer service does) and answers the pool's keys.
    struct Owner {
        nic: Arc<VerbsNic>,
        keys: KeyMap,
        held: Mutex<Vec<Box<dyn Any + Send + Sync>>>,
    }

    impl EndpointExchange for Owner {
        fn exchange(
            &self,
            _qp: QpKey,
            local: QpEndpoint,
        ) -> Result<(QpEndpoint, KeyMap), ConnectionError> {
            let (theirs, guard) =
                Arc::clone(&self.nic)
                    .accept(local)
                    .map_err(|e| ConnectionError::Handshake {
                        peer: NodeId(0),
                        reason: e.to_string(),
                    })?;
            self.held.lock().unwrap().push(guard);
            Ok((theirs, self.keys.clone()))
        }
    }

    fn nic_cfg(name: &str) -> NicConfig {
        NicConfig {
            name: name.into(),
            provider: ProviderKind::Verbs,
            ..NicConfig::default()
        }
    }

    fn open(name: &str, cfg: NicConfig, verbs: VerbsConfig, qps: u32) -> Arc<VerbsNic> {
        VerbsNic::open(name, &Sysfs::default(), cfg, verbs, qps).unwrap()
    }

    fn pattern(len: usize, seed: u32) -> Vec<u8> {
        (0..len as u32)
            .map(|i| (i.wrapping_mul(31) ^ seed.wrapping_mul(0x9e37)) as u8)
            .collect()
    }

    /// An owner NIC with a pool of `len` bytes (a pattern) registered in `chunk`-byte MRs.
    struct Pool {
        region: Arc<HostRegion>,
        bytes: Vec<u8>,
        _reg: Registration,
        exchange: Arc<Owner>,
    }

    fn pool(owner: &Arc<VerbsNic>, len: usize) -> Pool {
        let region = Arc::new(HostRegion::anonymous(len).unwrap());
        let bytes = pattern(len, 7);
        region.write_at(0, &bytes).unwrap();
        let reg = owner.register_host(&region).unwrap();
        let mut keys = KeyMap::new();
        for (c, k) in reg.advertised() {
            keys.insert(
                c,
                NicKeys {
                    lkey: 0,
                    rkey: k.rkey,
                },
            )
            .unwrap();
        }
        Pool {
            region,
            bytes,
            _reg: reg,
            exchange: Arc::new(Owner {
                nic: owner.clone(),
                keys,
                held: Mutex::new(Vec::new()),
            }),
        }
    }

    /// A requester destination: in the MR table (as every provider checks) and on the NIC.
    struct Dst {
        table: MrTable,
        region: Arc<HostRegion>,
        key: kvferry_transport::MrKey,
        _h: kvferry_transport::MrHandle,
        _nic: Arc<Registration>,
    }

    fn dst(nic: &Arc<VerbsNic>, len: usize) -> Dst {
        let table = MrTable::new();
        let region = Arc::new(HostRegion::anonymous(len).unwrap());
        region.fill(0xee).unwrap();
        let h = table
            .register_host(region.clone(), Access::LOCAL_WRITE)
            .unwrap();
        let reg = nic.register_local(&region).unwrap();
        Dst {
            key: h.key(),
            table,
            region,
            _h: h,
            _nic: reg,
        }
    }

    fn read(d: &Dst, wr_id: u64, remote: u64, pieces: &[(u64, u64)]) -> ReadRequest {
        ReadRequest {
            wr_id,
            remote: RemoteDescriptor {
                addr: remote,
                len: pieces.iter().map(|p| p.1).sum(),
                rkey: kvferry_transport::MrKey(0),
            },
            local: pieces
                .iter()
                .map(|&(off, len)| LocalSegment {
                    lkey: d.key,
                    addr: d.region.addr() + off,
                    len,
                })
                .collect(),
        }
    }

    /// One RC queue over the provider, driven as the NIC worker drives it.
    struct Driver {
        qp: Qp,
        cq: Arc<CompletionQueue>,
    }

    impl Driver {
        fn new(nic: &Arc<VerbsNic>, owner: &Pool, d: &Dst, qpn: u32) -> Self {
            Self::with_limits(nic, owner, d, qpn, nic_cfg(nic.device().name()))
        }

        fn with_limits(
            nic: &Arc<VerbsNic>,
            owner: &Pool,
            d: &Dst,
            qpn: u32,
            cfg: NicConfig,
        ) -> Self {
            let key = QpKey::new(NodeId(1), NicId(0), QpNum(qpn));
            let cq = Arc::new(CompletionQueue::new(256));
            let mut qp = Qp::new(
                key,
                cfg.queue_limits(),
                d.table.clone(),
                Arc::new(QpGauges::default()),
            );
            let connector = VerbsConnector::new(nic.clone(), NodeId(1), owner.exchange.clone());
            qp.connect(&connector, cq.clone()).unwrap();
            Driver { qp, cq }
        }

        fn post(&mut self, reads: &[ReadRequest]) {
            self.qp.post(reads, Instant::now()).unwrap();
        }

        /// Drives completions until `n` requests were reported (in order).
        fn run(&mut self, n: usize) -> Vec<WorkCompletion> {
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut out = Vec::new();
            while out.len() < n && Instant::now() < deadline {
                let mut raw = Vec::new();
                self.cq.wait(&mut raw, 64, Duration::from_millis(5));
                for wc in raw {
                    let _ = self.qp.handle_completion(&wc, Instant::now());
                }
                let _ = self.qp.pump(Instant::now());
                self.qp.poll_completions(&mut out);
            }
            out
        }
    }

    /// One read scattered into two pieces through the RC queue (`Qp`), byte for byte with
    /// canaries, between two devices.
    fn rdma_read_over_one_nic(owner_name: &str, requester_name: &str) {
        let owner = open(owner_name, nic_cfg(owner_name), VerbsConfig::default(), 4);
        let requester = open(
            requester_name,
            nic_cfg(requester_name),
            VerbsConfig::default(),
            4,
        );
        let p = pool(&owner, 1 << 20);
        let connector = VerbsConnector::new(requester.clone(), NodeId(1), p.exchange.clone());
        let d = dst(&requester, 8192);
        let key = QpKey::new(NodeId(1), NicId(0), QpNum(1));
        let cq = Arc::new(CompletionQueue::new(64));
        let mut qp = Qp::new(
            key,
            nic_cfg(requester_name).queue_limits(),
            d.table.clone(),
            Arc::new(QpGauges::default()),
        );
        qp.connect(&connector, cq.clone()).unwrap();
        let read = ReadRequest {
            wr_id: 1,
            remote: RemoteDescriptor {
                addr: p.region.addr() + 4096,
                len: 6000,
                rkey: kvferry_transport::MrKey(0),
            },
            local: vec![
                LocalSegment {
                    lkey: d.key,
                    addr: d.region.addr() + 100,
                    len: 2000,
                },
                LocalSegment {
                    lkey: d.key,
                    addr: d.region.addr() + 4000,
                    len: 4000,
                },
            ],
        };
        qp.post(&[read], Instant::now()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut out = Vec::new();
        while out.is_empty() && Instant::now() < deadline {
            let mut raw = Vec::new();
            cq.wait(&mut raw, 16, Duration::from_millis(10));
            for wc in raw {
                qp.handle_completion(&wc, Instant::now()).unwrap();
            }
            qp.poll_completions(&mut out);
        }
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].status, CompletionStatus::Success);
        let got = d.region.to_vec();
        assert_eq!(&got[100..2100], &p.bytes[4096..6096]);
        assert_eq!(&got[4000..8000], &p.bytes[6096..10096]);
        assert!(got[..100].iter().all(|&b| b == 0xee));
        assert!(got[2100..4000].iter().all(|&b| b == 0xee));
        assert!(got[8000..].iter().all(|&b| b == 0xee));
    }

    #[test]
    fn rdma_read_over_the_software_device() {
        rdma_read_over_one_nic("soft_mlx5_10", "soft_mlx5_11");
    }

    #[test]
    #[ignore = "needs an RDMA NIC"]
    fn rdma_read_over_one_nic_on_hardware() {
        let name = kvferry_transport::verbs::device::device_names()
            .unwrap()
            .remove(0);
        rdma_read_over_one_nic(&name, &name);
    }

    /// Defect 1: the owner's pool is registered in `registration-chunk` pieces and one READ
    /// names one rkey; a read across a piece boundary is cut into one READ per piece (it
    /// was refused at post before, tearing the QP down).
    #[test]
    fn reads_across_the_owners_registration_chunks_are_split() {
        let small_chunks = VerbsConfig {
            registration_chunk: 16 << 10,
            ..VerbsConfig::default()
        };
        let owner = open("soft_mlx5_20", nic_cfg("soft_mlx5_20"), small_chunks, 4);
        let req = open(
            "soft_mlx5_21",
            nic_cfg("soft_mlx5_21"),
            VerbsConfig::default(),
            4,
        );
        let p = pool(&owner, 64 << 10);
        let d = dst(&req, 64 << 10);
        let mut drv = Driver::new(&req, &p, &d, 1);
        let before = SoftOps::global().reads("soft_mlx5_21");
        // 10000..30000 crosses the boundary at 16 KiB; scattered over two pieces.
        drv.post(&[read(
            &d,
            1,
            p.region.addr() + 10_000,
            &[(100, 7_000), (20_000, 13_000)],
        )]);
        let out = drv.run(1);
        assert_eq!(out[0].status, CompletionStatus::Success, "{out:?}");
        assert_eq!(out[0].bytes, 20_000);
        assert_eq!(SoftOps::global().reads("soft_mlx5_21") - before, 2);
        let got = d.region.to_vec();
        assert_eq!(&got[100..7_100], &p.bytes[10_000..17_000]);
        assert_eq!(&got[20_000..33_000], &p.bytes[17_000..30_000]);
        assert!(got[..100].iter().all(|&b| b == 0xee));
        assert!(got[7_100..20_000].iter().all(|&b| b == 0xee));
        assert!(got[33_000..].iter().all(|&b| b == 0xee));
    }

    /// Defect 8: one READ carries at most the port's `max_msg_sz` (16 MiB on the small
    /// profile, 1 GiB on mlx5, not 2 GiB): a longer read is cut there.
    #[test]
    fn reads_longer_than_the_ports_max_msg_sz_are_split() {
        let owner = open(
            "soft_mlx5_22",
            nic_cfg("soft_mlx5_22"),
            VerbsConfig::default(),
            4,
        );
        let req = open(
            "soft_small_22",
            nic_cfg("soft_small_22"),
            VerbsConfig::default(),
            4,
        );
        assert_eq!(req.device().max_msg_sz(), 16 << 20);
        let len = (40 << 20) - 4096;
        let p = pool(&owner, 40 << 20);
        let d = dst(&req, 40 << 20);
        let mut drv = Driver::new(&req, &p, &d, 1);
        let before = SoftOps::global().reads("soft_small_22");
        drv.post(&[read(&d, 1, p.region.addr() + 4096, &[(0, len as u64)])]);
        let out = drv.run(1);
        assert_eq!(out[0].status, CompletionStatus::Success, "{out:?}");
        assert_eq!(SoftOps::global().reads("soft_small_22") - before, 3);
        assert!(d.region.to_vec()[..len] == p.bytes[4096..]);
    }

    /// Defect 7: `max-sge` 64 and `max-send-wr` 4096 pass config validation; the small
    /// device takes 4 SGEs and 1024 WRs. The QP is created within the device's limits
    /// (`ibv_create_qp` refused it on every connect before).
    #[test]
    fn qp_capacities_are_clamped_to_the_device() {
        let owner = open(
            "soft_mlx5_23",
            nic_cfg("soft_mlx5_23"),
            VerbsConfig::default(),
            4,
        );
        let big = NicConfig {
            max_sge: 64,
            max_send_wr: 4096,
            ..nic_cfg("soft_small_23")
        };
        big.validate().unwrap();
        let req = open("soft_small_23", big.clone(), VerbsConfig::default(), 4);
        let p = pool(&owner, 64 << 10);
        let d = dst(&req, 64 << 10);
        let mut drv = Driver::with_limits(&req, &p, &d, 1, big);
        drv.post(&[read(&d, 1, p.region.addr(), &[(0, 4096), (8192, 4096)])]);
        assert_eq!(drv.run(1)[0].status, CompletionStatus::Success);
        // A CQ bigger than the device's max_cqe is clamped too, and the NIC says so.
        assert_eq!(req.device().cqe(), 4096);
        let limits = RdmaNic::limits(req.as_ref()).unwrap();
        assert_eq!(
            (limits.cq_entries, limits.max_sge, limits.max_qp_wr),
            (4096, 4, 1024)
        );
        assert_eq!(limits.max_msg_sz, 16 << 20);
    }

    /// Defect 2: two loads registering the same destination on one NIC share one
    /// registration; the second no longer fails on the overlap (and its cleanup no longer
    /// removes the first one's keys).
    #[test]
    fn registrations_of_one_range_are_shared() {
        let owner = open(
            "soft_mlx5_24",
            nic_cfg("soft_mlx5_24"),
            VerbsConfig::default(),
            4,
        );
        let req = open(
            "soft_mlx5_25",
            nic_cfg("soft_mlx5_25"),
            VerbsConfig::default(),
            4,
        );
        let p = pool(&owner, 64 << 10);
        let d = dst(&req, 16 << 10);
        let second = req.register_local(&d.region).unwrap();
        let third = req.register_local(&d.region).unwrap();
        assert!(Arc::ptr_eq(&second, &third));
        drop(second);
        drop(third);
        let mut drv = Driver::new(&req, &p, &d, 1);
        drv.post(&[read(&d, 1, p.region.addr(), &[(0, 4096)])]);
        assert_eq!(drv.run(1)[0].status, CompletionStatus::Success);
        assert_eq!(&d.region.to_vec()[..4096], &p.bytes[..4096]);
    }

    /// Defect 3 (the NIC side): a CQ that overruns fails the requests of its QPs as
    /// transport errors (not a hang), the async event is read, and new QPs get a fresh CQ:
    /// the NIC works on without a restart.
    #[test]
    fn a_cq_overrun_fails_its_requests_and_the_nic_recovers() {
        let name = "soft_mlx5_26";
        let owner = open(
            "soft_mlx5_27",
            nic_cfg("soft_mlx5_27"),
            VerbsConfig::default(),
            4,
        );
        let small = NicConfig {
            max_send_wr: 4,
            max_rd_atomic: 4,
            ..nic_cfg(name)
        };
        // A CQ for one QP's window; two QPs share it.
        let req = open(name, small.clone(), VerbsConfig::default(), 1);
        assert_eq!(req.device().cqe(), 4);
        let p = pool(&owner, 64 << 10);
        let d = dst(&req, 64 << 10);
        let mut a = Driver::with_limits(&req, &p, &d, 1, small.clone());
        let mut b = Driver::with_limits(&req, &p, &d, 2, small.clone());
        SoftOps::global().inject(name, SoftFault::Stall);
        let reads: Vec<_> = (0..4)
            .map(|i| read(&d, i + 1, p.region.addr(), &[(i * 64, 64)]))
            .collect();
        a.post(&reads);
        b.post(&reads);
        SoftOps::global().inject(name, SoftFault::Resume);
        let (oa, ob) = (a.run(4), b.run(4));
        assert_eq!(oa.len() + ob.len(), 8, "{oa:?} {ob:?}");
        assert!(
            oa.iter().chain(&ob).all(|w| !w.status.is_success()),
            "{oa:?} {ob:?}"
        );
        let deadline = Instant::now() + Duration::from_secs(5);
        // The overrun may be counted from the CQ's poll before the event that reports it is
        // read: wait for both.
        while (req.async_events().0 == 0 || req.async_events().1 == 0) && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(req.async_events().1, 1);
        assert!(req.async_events().0 >= 1);
        drop((a, b));
        let mut c = Driver::with_limits(&req, &p, &d, 3, small);
        c.post(&[read(&d, 9, p.region.addr(), &[(0, 64)])]);
        assert_eq!(c.run(1)[0].status, CompletionStatus::Success);
    }

    /// Faults through the whole provider: a completion error, the owner vanishing, the port
    /// going down. Each is a typed failure; once healed, a new QP reads again, and no QP is
    /// left on the requester's device.
    #[test]
    fn fault_matrix_over_the_software_device() {
        let (oname, rname) = ("soft_mlx5_28", "soft_mlx5_29");
        let ops = SoftOps::global();
        let owner = open(oname, nic_cfg(oname), VerbsConfig::default(), 4);
        let req = open(rname, nic_cfg(rname), VerbsConfig::default(), 4);
        let p = pool(&owner, 64 << 10);
        let d = dst(&req, 64 << 10);
        let faults: [(&str, SoftFault, CompletionStatus); 3] = [
            (
                rname,
                SoftFault::CompletionError {
                    nth: 1,
                    status: wc::REM_ACCESS_ERR,
                },
                CompletionStatus::RemoteAccessError,
            ),
            (oname, SoftFault::Vanish, CompletionStatus::TransportError),
            (rname, SoftFault::PortDown, CompletionStatus::Flushed),
        ];
        for (i, (dev, fault, want)) in faults.into_iter().enumerate() {
            let mut drv = Driver::new(&req, &p, &d, 10 + i as u32);
            ops.inject(dev, SoftFault::Stall);
            ops.inject(rname, SoftFault::Stall);
            let reads: Vec<_> = (0..3)
                .map(|k| read(&d, k + 1, p.region.addr() + k * 64, &[(k * 64, 64)]))
                .collect();
            drv.post(&reads);
            ops.inject(dev, fault);
            ops.inject(dev, SoftFault::Resume);
            ops.inject(rname, SoftFault::Resume);
            let out = drv.run(3);
            assert_eq!(out.len(), 3, "{fault:?}: {out:?}");
            assert!(out.iter().any(|w| w.status == want), "{fault:?}: {out:?}");
            assert!(
                out.iter()
                    .skip_while(|w| w.status.is_success())
                    .all(|w| !w.status.is_success()),
                "{fault:?}: {out:?}"
            );
            drop(drv);
            ops.heal(dev);
            let mut again = Driver::new(&req, &p, &d, 20 + i as u32);
            again.post(&[read(&d, 7, p.region.addr(), &[(0, 4096)])]);
            assert_eq!(
                again.run(1)[0].status,
                CompletionStatus::Success,
                "{fault:?}"
            );
        }
        assert_eq!(req.connections(), 0);
        assert_eq!(ops.live(rname).0, 0, "no QP left on the requester");
        assert_eq!(&d.region.to_vec()[..4096], &p.bytes[..4096]);
    }

    /// A read naming memory outside every region the owner advertised is refused before
    /// anything is posted (one READ names one advertised rkey): nothing lands anywhere.
    #[test]
    fn reads_outside_the_advertised_regions_are_refused_before_posting() {
        let owner = open(
            "soft_mlx5_30",
            nic_cfg("soft_mlx5_30"),
            VerbsConfig::default(),
            4,
        );
        let req = open(
            "soft_mlx5_31",
            nic_cfg("soft_mlx5_31"),
            VerbsConfig::default(),
            4,
        );
        let p = pool(&owner, 64 << 10);
        let d = dst(&req, 64 << 10);
        let mut drv = Driver::new(&req, &p, &d, 1);
        let before = SoftOps::global().reads("soft_mlx5_31");
        let past_end = p.region.addr() + (64 << 10) - 100;
        let r = drv
            .qp
            .post(&[read(&d, 1, past_end, &[(0, 200)])], Instant::now());
        let reported = if r.is_ok() { drv.run(1) } else { Vec::new() };
        assert!(
            r.is_err() || reported.first().is_some_and(|w| !w.status.is_success()),
            "{r:?} {reported:?}"
        );
        assert_eq!(
            SoftOps::global().reads("soft_mlx5_31"),
            before,
            "nothing posted"
        );
        assert!(
            d.region.to_vec().iter().all(|&b| b == 0xee),
            "nothing written"
        );
    }
}
