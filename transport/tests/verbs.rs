//! The verbs provider's logic against sysfs fixtures (no NIC needed), and, behind
//! `#[ignore = "needs an RDMA NIC"]`, the provider itself on real hardware.

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

#[cfg(feature = "verbs")]
mod nic {
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use kvferry_transport::verbs::device::{device_names, Registration};
    use kvferry_transport::verbs::provider::{EndpointExchange, VerbsConnector, VerbsNic};
    use kvferry_transport::verbs::registration::{KeyMap, NicKeys};
    use kvferry_transport::verbs::{QpEndpoint, Sysfs, VerbsConfig};
    use kvferry_transport::{
        Access, CompletionQueue, CompletionStatus, ConnectionError, Connector, HostRegion,
        LocalSegment, MrTable, NicConfig, NicId, NodeId, ProviderKind, Qp, QpGauges, QpKey, QpNum,
        ReadRequest, RemoteDescriptor,
    };

    /// Both ends live in this process: the "owner" QP answers the requester's endpoint.
    struct SelfExchange {
        owner: Arc<VerbsNic>,
        keys: KeyMap,
        owner_conn: Mutex<Vec<Box<dyn kvferry_transport::Connection>>>,
    }

    impl EndpointExchange for SelfExchange {
        fn exchange(
            &self,
            _qp: QpKey,
            local: QpEndpoint,
        ) -> Result<(QpEndpoint, KeyMap), ConnectionError> {
            // The owner side connects back with our endpoint as its remote.
            struct Fixed(QpEndpoint, Mutex<Option<QpEndpoint>>);
            impl EndpointExchange for Fixed {
                fn exchange(
                    &self,
                    _qp: QpKey,
                    mine: QpEndpoint,
                ) -> Result<(QpEndpoint, KeyMap), ConnectionError> {
                    *self.1.lock().unwrap() = Some(mine);
                    Ok((self.0, KeyMap::new()))
                }
            }
            let fixed = Arc::new(Fixed(local, Mutex::new(None)));
            let back = VerbsConnector::new(self.owner.clone(), NodeId(0), fixed.clone());
            let conn = back.connect(
                QpKey::new(NodeId(0), NicId(0), QpNum(0)),
                Arc::new(CompletionQueue::new(1)),
            )?;
            self.owner_conn.lock().unwrap().push(conn);
            let theirs = fixed.1.lock().unwrap().unwrap();
            Ok((theirs, self.keys.clone()))
        }
    }

    #[test]
    #[ignore = "needs an RDMA NIC"]
    fn rdma_read_over_one_nic() {
        let name = device_names().unwrap().remove(0);
        let sysfs = Sysfs::default();
        let nic_cfg = NicConfig {
            provider: ProviderKind::Verbs,
            ..NicConfig::default()
        };
        let nic =
            VerbsNic::open(&name, &sysfs, nic_cfg.clone(), VerbsConfig::default(), 4).unwrap();
        // Owner pool, registered for remote read.
        let pool = Arc::new(HostRegion::anonymous(1 << 20).unwrap());
        let pattern: Vec<u8> = (0..1 << 20).map(|i: u32| (i * 7 + 3) as u8).collect();
        pool.write_at(0, &pattern).unwrap();
        let reg: Registration = nic.register_host(&pool).unwrap();
        let mut keys = KeyMap::new();
        for (c, k) in reg.advertised() {
            keys.insert(
                c,
                NicKeys {
                    lkey: k.lkey,
                    rkey: k.rkey,
                },
            )
            .unwrap();
        }
        let exchange = Arc::new(SelfExchange {
            owner: nic.clone(),
            keys,
            owner_conn: Mutex::new(Vec::new()),
        });
        let connector = VerbsConnector::new(nic.clone(), NodeId(1), exchange);
        // Requester destination, checked by the MR table as for every provider.
        let local = MrTable::new();
        let dst = Arc::new(HostRegion::anonymous(8192).unwrap());
        let h = local
            .register_host(dst.clone(), Access::LOCAL_WRITE)
            .unwrap();
        // ... and on the NIC: the read's SGEs name the destination itself (no staging).
        let _dst_reg: Registration = nic.register_local(&dst).unwrap();
        let key = QpKey::new(NodeId(1), NicId(0), QpNum(1));
        let cq = Arc::new(CompletionQueue::new(64));
        let mut qp = Qp::new(
            key,
            nic_cfg.queue_limits(),
            local,
            Arc::new(QpGauges::default()),
        );
        qp.connect(&connector, cq.clone()).unwrap();
        let read = ReadRequest {
            wr_id: 1,
            remote: RemoteDescriptor {
                addr: pool.addr() + 4096,
                len: 6000,
                rkey: kvferry_transport::MrKey(0),
            },
            local: vec![
                LocalSegment {
                    lkey: h.key(),
                    addr: dst.addr() + 100,
                    len: 2000,
                },
                LocalSegment {
                    lkey: h.key(),
                    addr: dst.addr() + 4000,
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
        let got = dst.to_vec();
        assert_eq!(&got[100..2100], &pattern[4096..6096]);
        assert_eq!(&got[4000..8000], &pattern[6096..10096]);
        assert!(got[..100].iter().all(|&b| b == 0));
    }
}
