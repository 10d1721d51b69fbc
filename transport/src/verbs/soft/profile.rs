//! Device profiles of the software verbs device: the limits `ibv_query_device` and
//! `ibv_query_port` report, which the device then enforces. `mlx5` carries the figures of a
//! ConnectX-6/7 (30 SGEs, read depth 16, 1 GiB messages, 32768 WRs per queue); `small` is a
//! deliberately tighter device for mixed-NIC tests (a peer with a shallower read depth, fewer
//! SGEs, a shorter queue and a smaller MTU than its partner).

use crate::verbs::gid::Mtu;
use crate::verbs::ops::{DeviceAttr, PortAttr};

/// What one software device model reports and enforces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SoftProfile {
    pub name: &'static str,
    pub attr: DeviceAttr,
    pub max_msg_sz: u64,
    pub mtu: Mtu,
}

impl SoftProfile {
    /// A ConnectX-class device.
    pub const MLX5: SoftProfile = SoftProfile {
        name: "mlx5",
        attr: DeviceAttr {
            max_qp: 131_072,
            max_qp_wr: 32_768,
            max_sge: 30,
            max_cq: 16_777_216,
            max_cqe: 4_194_303,
            max_mr: 16_777_216,
            max_mr_size: u64::MAX,
            max_qp_rd_atom: 16,
            max_qp_init_rd_atom: 16,
        },
        max_msg_sz: 1 << 30,
        mtu: Mtu::M4096,
    };

    /// A smaller device: read depth 4, 4 SGEs, 1024 WRs per queue, 4096 CQEs, MTU 1024,
    /// 16 MiB messages.
    pub const SMALL: SoftProfile = SoftProfile {
        name: "small",
        attr: DeviceAttr {
            max_qp: 1024,
            max_qp_wr: 1024,
            max_sge: 4,
            max_cq: 256,
            max_cqe: 4096,
            max_mr: 4096,
            max_mr_size: 1 << 40,
            max_qp_rd_atom: 4,
            max_qp_init_rd_atom: 4,
        },
        max_msg_sz: 16 << 20,
        mtu: Mtu::M1024,
    };

    /// The profile a device name asks for: `soft_<profile>_<n>`.
    pub fn for_name(name: &str) -> Option<SoftProfile> {
        let rest = name.strip_prefix("soft_")?;
        let (profile, index) = rest.rsplit_once('_')?;
        if index.is_empty() || !index.chars().all(|c| c.is_ascii_digit()) {
            return None;
        }
        match profile {
            "mlx5" => Some(Self::MLX5),
            "small" => Some(Self::SMALL),
            _ => None,
        }
    }

    pub fn port(&self, active: bool) -> PortAttr {
        PortAttr {
            active,
            lid: 0,
            active_mtu: self.mtu,
            max_msg_sz: self.max_msg_sz,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_pick_profiles() {
        assert_eq!(
            SoftProfile::for_name("soft_mlx5_0"),
            Some(SoftProfile::MLX5)
        );
        assert_eq!(
            SoftProfile::for_name("soft_small_12"),
            Some(SoftProfile::SMALL)
        );
        for bad in [
            "mlx5_0",
            "soft_mlx5",
            "soft_mlx5_",
            "soft_cx9_0",
            "soft_mlx5_x",
        ] {
            assert_eq!(SoftProfile::for_name(bad), None, "{bad}");
        }
        assert_eq!(SoftProfile::MLX5.max_msg_sz, 1 << 30);
        assert_eq!(SoftProfile::MLX5.attr.max_sge, 30);
    }
}
