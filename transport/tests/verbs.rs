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
