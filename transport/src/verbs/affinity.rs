//! Which NICs serve a destination: the ones nearest the GPU (or NUMA node) in the PCIe tree,
//! and how a plan's reads are striped across them.

use thiserror::Error;

use super::gid::choose_address;
use super::sysfs::{NicInfo, PciLocation};

/// How close a NIC is to a destination, best first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Affinity {
    /// Below the same PCIe switch or root port (peer-to-peer traffic stays off the host bridge).
    SameSwitch,
    /// Same root complex.
    SameHostBridge,
    /// Same NUMA node, different root complex.
    SameNuma,
    /// Across the inter-socket link.
    Remote,
}

/// Where the data lands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Destination {
    /// A GPU at this PCI location.
    Gpu(PciLocation),
    /// Host memory on this NUMA node (staging, host pool); `None`: anywhere.
    Host { numa: Option<u32> },
}

#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AffinityError {
    #[error("configured nic {name:?} does not exist")]
    UnknownOverride { name: String },
    #[error("configured nic {name:?} is not usable: {reason}")]
    UnusableOverride { name: String, reason: String },
    #[error("no usable RDMA NIC: {reason}")]
    NoUsableNic { reason: String },
}

/// How close `nic` is to `dest`.
pub fn affinity(nic: &PciLocation, dest: &Destination) -> Affinity {
    match dest {
        Destination::Gpu(gpu) => {
            // Shared ancestors, not counting the devices themselves.
            let n = nic.path.len().saturating_sub(1);
            let g = gpu.path.len().saturating_sub(1);
            let common = nic.path[..n]
                .iter()
                .zip(&gpu.path[..g])
                .take_while(|(a, b)| a == b)
                .count();
            if common >= 2 {
                Affinity::SameSwitch
            } else if common == 1 {
                Affinity::SameHostBridge
            } else if nic.numa.is_some() && nic.numa == gpu.numa {
                Affinity::SameNuma
            } else {
                Affinity::Remote
            }
        }
        Destination::Host { numa } => match (numa, nic.numa) {
            (None, _) => Affinity::SameNuma,
            (Some(a), Some(b)) if *a == b => Affinity::SameNuma,
            _ => Affinity::Remote,
        },
    }
}

/// Why a NIC cannot carry reads, or `None` when one of its ports can.
pub fn unusable_reason(nic: &NicInfo) -> Option<String> {
    if nic.ports.is_empty() {
        return Some(format!("{} has no ports", nic.name));
    }
    let mut reasons = Vec::new();
    for p in &nic.ports {
        match choose_address(p) {
            Ok(_) => return None,
            Err(e) => reasons.push(e.to_string()),
        }
    }
    Some(format!("{}: {}", nic.name, reasons.join("; ")))
}

/// The NICs that serve `dest`, by name: the override if one is configured (each must exist and
/// be usable), else every usable NIC in the best affinity tier, in name order.
pub fn choose_nics(
    nics: &[NicInfo],
    dest: &Destination,
    overrides: &[String],
) -> Result<Vec<String>, AffinityError> {
    if !overrides.is_empty() {
        return overrides
            .iter()
            .map(|name| {
                let nic = nics
                    .iter()
                    .find(|n| &n.name == name)
                    .ok_or_else(|| AffinityError::UnknownOverride { name: name.clone() })?;
                match unusable_reason(nic) {
                    Some(reason) => Err(AffinityError::UnusableOverride {
                        name: name.clone(),
                        reason,
                    }),
                    None => Ok(name.clone()),
                }
            })
            .collect();
    }
    let mut reasons = Vec::new();
    let mut usable: Vec<(Affinity, &NicInfo)> = Vec::new();
    for n in nics {
        match unusable_reason(n) {
            Some(r) => reasons.push(r),
            None => usable.push((affinity(&n.pci, dest), n)),
        }
    }
    let Some(best) = usable.iter().map(|(a, _)| *a).min() else {
        let reason = if reasons.is_empty() {
            "no RDMA device".to_string()
        } else {
            reasons.join("; ")
        };
        return Err(AffinityError::NoUsableNic { reason });
    };
    Ok(usable
        .into_iter()
        .filter(|(a, _)| *a == best)
        .map(|(_, n)| n.name.clone())
        .collect())
}

/// Assigns each read (by length, in plan order) to one of `nics` NICs. Plans shorter than
/// `min_bytes` stay on the first NIC (one QP keeps small loads in order and cheap); longer ones
/// go to the least-loaded NIC read by read, ties to the lowest index, so bytes even out and
/// the assignment is deterministic.
pub fn stripe(read_lens: &[u64], nics: usize, min_bytes: u64) -> Vec<usize> {
    let total: u64 = read_lens.iter().sum();
    if nics <= 1 || total < min_bytes {
        return vec![0; read_lens.len()];
    }
    let mut load = vec![0u64; nics];
    read_lens
        .iter()
        .map(|len| {
            let (i, _) = load
                .iter()
                .enumerate()
                .min_by_key(|(i, l)| (**l, *i))
                .unwrap_or((0, &0));
            load[i] += len;
            i
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(path: &str, numa: Option<u32>) -> PciLocation {
        PciLocation {
            path: path.split('/').map(str::to_string).collect(),
            numa,
        }
    }

    #[test]
    fn tiers() {
        let gpu = Destination::Gpu(loc(
            "pci0000:17/0000:17:00.0/0000:18:00.0/0000:19:00.0",
            Some(0),
        ));
        let sw = loc("pci0000:17/0000:17:00.0/0000:18:01.0/0000:1a:00.0", Some(0));
        let hb = loc("pci0000:17/0000:17:02.0/0000:1b:00.0", Some(0));
        let numa = loc("pci0000:3a/0000:3a:00.0/0000:3b:00.0", Some(0));
        let far = loc("pci0000:97/0000:97:00.0/0000:98:00.0", Some(1));
        assert_eq!(affinity(&sw, &gpu), Affinity::SameSwitch);
        assert_eq!(affinity(&hb, &gpu), Affinity::SameHostBridge);
        assert_eq!(affinity(&numa, &gpu), Affinity::SameNuma);
        assert_eq!(affinity(&far, &gpu), Affinity::Remote);
        let host = Destination::Host { numa: Some(1) };
        assert_eq!(affinity(&far, &host), Affinity::SameNuma);
        assert_eq!(affinity(&sw, &host), Affinity::Remote);
    }

    #[test]
    fn striping() {
        assert_eq!(stripe(&[10, 10, 10], 2, 100), vec![0, 0, 0]);
        assert_eq!(stripe(&[10, 10, 10], 1, 0), vec![0, 0, 0]);
        assert_eq!(stripe(&[40, 10, 10, 10, 40], 2, 0), vec![0, 1, 1, 1, 1]);
        assert_eq!(stripe(&[8, 8, 8, 8], 2, 16), vec![0, 1, 0, 1]);
        assert!(stripe(&[], 2, 0).is_empty());
    }
}
