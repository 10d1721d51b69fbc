//! Which verbs NIC carries each read of a remote plan: the NICs nearest the destination GPU in
//! the PCIe tree (or the configured override), with large plans striped across them by
//! bytes. [`stripe_plan`] is the plain decision; [`NicRouting`] holds what a node knows
//! (its configured verbs NICs as sysfs describes them, each GPU's PCI location) and is what
//! the load path asks.

use kvferry_transport::verbs::affinity::{choose_nics, stripe, Destination};
use kvferry_transport::verbs::sysfs::PciLocation;
use kvferry_transport::verbs::{
    is_soft_name, AffinityError, NicInfo, SoftOps, Sysfs, SysfsError, VerbsConfig, VerbsOps,
};
use thiserror::Error;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RoutingError {
    #[error("verbs nic {nic} is not described by sysfs")]
    Sysfs {
        nic: String,
        #[source]
        source: SysfsError,
    },
    #[error("gpu {ordinal}: PCI address {bdf:?} is not described by sysfs")]
    Gpu {
        ordinal: usize,
        bdf: String,
        #[source]
        source: SysfsError,
    },
}

/// The NIC of every read of a plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StripePlan {
    /// The NICs used, nearest first (name order within a tier).
    pub nics: Vec<String>,
    /// Index into `nics`, per read, in plan order.
    pub per_read: Vec<usize>,
}

impl StripePlan {
    /// Bytes each NIC carries.
    pub fn bytes_per_nic(&self, read_lens: &[u64]) -> Vec<u64> {
        let mut out = vec![0; self.nics.len()];
        for (i, len) in self.per_read.iter().zip(read_lens) {
            out[*i] += len;
        }
        out
    }
}

/// One segment's reads, each with the NIC it goes through: what a link gets from the load
/// path (ops of a copy list are matched to reads by source address, since a list coalesces
/// adjacent ops).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadRoute {
    pub nics: Vec<String>,
    /// `(source start, length, index into nics)` per read.
    pub reads: Vec<(u64, u64, usize)>,
}

impl ReadRoute {
    /// The NIC name of the read whose source range holds `src`.
    pub fn nic_of(&self, src: u64) -> Option<&str> {
        self.reads
            .iter()
            .find(|(start, len, _)| src >= *start && src - start < *len)
            .and_then(|(_, _, n)| self.nics.get(*n))
            .map(String::as_str)
    }
}

/// Assigns the reads of a plan (`read_lens`, in plan order) to the usable NICs of `nics`
/// nearest `dest`, or to `cfg.nic_override` when set; plans of at least
/// `cfg.stripe_min_bytes` are striped across all of them, smaller ones stay on the first.
pub fn stripe_plan(
    read_lens: &[u64],
    nics: &[NicInfo],
    dest: &Destination,
    cfg: &VerbsConfig,
) -> Result<StripePlan, AffinityError> {
    let chosen = choose_nics(nics, dest, &cfg.nic_override)?;
    let per_read = stripe(read_lens, chosen.len(), cfg.stripe_min_bytes);
    Ok(StripePlan {
        nics: chosen,
        per_read,
    })
}

/// What a node knows for routing: its configured verbs NICs as sysfs describes them and each
/// GPU ordinal's PCI location.
#[derive(Clone, Debug)]
pub struct NicRouting {
    nics: Vec<NicInfo>,
    gpus: Vec<PciLocation>,
    cfg: VerbsConfig,
}

impl NicRouting {
    /// Reads the configured verbs NICs (`names`) and GPUs (`gpu_pci`, by ordinal) from
    /// `sysfs`.
    pub fn discover(
        sysfs: &Sysfs,
        names: &[String],
        gpu_pci: &[String],
        cfg: VerbsConfig,
    ) -> Result<Self, RoutingError> {
        let nics = names
            .iter()
            .map(|n| {
                let info = if is_soft_name(n) {
                    // The software device is in no sysfs tree: its ports come from its
                    // profile, and it sits nowhere on PCIe (as near as any NIC to host memory).
                    SoftOps::global().ports(n, sysfs).map(|ports| NicInfo {
                        name: n.clone(),
                        pci: PciLocation {
                            path: Vec::new(),
                            numa: None,
                        },
                        ports,
                    })
                } else {
                    sysfs.nic(n)
                };
                info.map_err(|source| RoutingError::Sysfs {
                    nic: n.clone(),
                    source,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let gpus = gpu_pci
            .iter()
            .enumerate()
            .map(|(ordinal, bdf)| {
                sysfs.pci_device(bdf).map_err(|source| RoutingError::Gpu {
                    ordinal,
                    bdf: bdf.clone(),
                    source,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(NicRouting { nics, gpus, cfg })
    }

    /// Where a load into GPU `ordinal` lands: its PCI location when configured, else host
    /// memory anywhere (every usable NIC is as near as any other).
    pub fn destination(&self, ordinal: u32) -> Destination {
        match self.gpus.get(ordinal as usize) {
            Some(loc) => Destination::Gpu(loc.clone()),
            None => Destination::Host { numa: None },
        }
    }

    /// The NIC of every read of a plan into GPU `ordinal`.
    pub fn route(&self, read_lens: &[u64], ordinal: u32) -> Result<StripePlan, AffinityError> {
        stripe_plan(read_lens, &self.nics, &self.destination(ordinal), &self.cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> Sysfs {
        Sysfs::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../transport/tests/fixtures/sysfs-two-socket"
        ))
    }

    fn names(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn large_plans_stripe_across_the_nics_nearest_the_gpu() {
        let sys = fixture();
        let all = names(&["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]);
        let r = NicRouting::discover(
            &sys,
            &all,
            &names(&["0000:19:00.0", "0000:9a:00.0"]),
            VerbsConfig::default(),
        )
        .unwrap();
        // GPU 1 sits under the second socket, next to mlx5_2 and mlx5_3: 16 MiB in 1 MiB
        // reads is striped evenly over both.
        let lens = vec![1u64 << 20; 16];
        let p = r.route(&lens, 1).unwrap();
        assert_eq!(p.nics, names(&["mlx5_2", "mlx5_3"]));
        assert_eq!(p.per_read.len(), 16);
        assert_eq!(p.bytes_per_nic(&lens), vec![8 << 20, 8 << 20]);
        // A small plan stays on one NIC (one QP keeps it in order).
        let small = r.route(&[64 << 10; 4], 1).unwrap();
        assert_eq!(small.per_read, vec![0; 4]);
        // GPU 0's nearest usable NIC is mlx5_0 alone.
        let p = r.route(&lens, 0).unwrap();
        assert_eq!(p.nics, names(&["mlx5_0"]));
        assert!(p.per_read.iter().all(|&i| i == 0));
        // A GPU without a configured PCI address: host memory anywhere, every usable NIC.
        assert_eq!(r.destination(5), Destination::Host { numa: None });
        let p = r.route(&lens, 5).unwrap();
        assert_eq!(p.nics, names(&["mlx5_0", "mlx5_2", "mlx5_3"]));
    }

    #[test]
    fn software_devices_route_without_sysfs() {
        let r = NicRouting::discover(
            &Sysfs::new("/nonexistent"),
            &names(&["soft_mlx5_0", "soft_mlx5_1"]),
            &[],
            VerbsConfig::default(),
        )
        .unwrap();
        let p = r.route(&[8 << 20, 8 << 20], 0).unwrap();
        assert_eq!(p.nics, names(&["soft_mlx5_0", "soft_mlx5_1"]));
        assert_eq!(p.bytes_per_nic(&[8 << 20, 8 << 20]), vec![8 << 20, 8 << 20]);
    }

    #[test]
    fn the_override_wins_and_must_be_usable() {
        let sys = fixture();
        let nics = sys.nics().unwrap();
        let gpu1 = Destination::Gpu(sys.pci_device("0000:9a:00.0").unwrap());
        let cfg = VerbsConfig {
            nic_override: names(&["mlx5_0"]),
            ..VerbsConfig::default()
        };
        let lens = vec![1u64 << 20; 8];
        let p = stripe_plan(&lens, &nics, &gpu1, &cfg).unwrap();
        assert_eq!(p.nics, names(&["mlx5_0"]));
        let cfg = VerbsConfig {
            nic_override: names(&["mlx5_10"]),
            ..VerbsConfig::default()
        };
        assert!(matches!(
            stripe_plan(&lens, &nics, &gpu1, &cfg),
            Err(AffinityError::UnusableOverride { .. })
        ));
        // Only the configured NICs are candidates; none usable is an error, not a guess.
        let only_down: Vec<NicInfo> = nics.into_iter().filter(|n| n.name == "mlx5_10").collect();
        assert!(matches!(
            stripe_plan(&lens, &only_down, &gpu1, &VerbsConfig::default()),
            Err(AffinityError::NoUsableNic { .. })
        ));
        assert!(matches!(
            NicRouting::discover(&sys, &names(&["mlx5_9"]), &[], VerbsConfig::default()),
            Err(RoutingError::Sysfs { .. })
        ));
        assert!(matches!(
            NicRouting::discover(
                &sys,
                &names(&["mlx5_0"]),
                &names(&["0000:01:00.0"]),
                VerbsConfig::default()
            ),
            Err(RoutingError::Gpu { ordinal: 0, .. })
        ));
    }
}
