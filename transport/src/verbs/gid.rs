//! Addressing a port: which GID (and, on InfiniBand, which LID) a QP uses, and the path MTU
//! two ports agree on. Plain data, filled from `ibv_query_port`/`ibv_query_gid` or from sysfs.

use std::fmt;

use thiserror::Error;

/// The port's link layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LinkLayer {
    InfiniBand,
    Ethernet,
}

/// What a GID table entry is for (sysfs `gid_attrs/types/N`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GidType {
    /// Native InfiniBand GID (also reported as "IB/RoCE v1").
    Ib,
    RoceV1,
    RoceV2,
}

impl GidType {
    /// Parses the sysfs spelling (`IB/RoCE v1`, `RoCE v2`).
    pub fn parse(s: &str) -> Option<GidType> {
        match s.trim() {
            "IB/RoCE v1" | "IB" => Some(GidType::Ib),
            "RoCE v1" => Some(GidType::RoceV1),
            "RoCE v2" => Some(GidType::RoceV2),
            _ => None,
        }
    }
}

/// A 128-bit GID.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }

    /// fe80::/10: valid only on one link, so useless for routed RoCE v2.
    pub fn is_link_local(&self) -> bool {
        self.0[0] == 0xfe && self.0[1] & 0xc0 == 0x80
    }

    /// Parses the sysfs form `fe80:0000:0000:0000:0202:c9ff:fe00:0001`.
    pub fn parse(s: &str) -> Option<Gid> {
        let mut out = [0u8; 16];
        let groups: Vec<&str> = s.trim().split(':').collect();
        if groups.len() != 8 {
            return None;
        }
        for (i, g) in groups.iter().enumerate() {
            let v = u16::from_str_radix(g, 16).ok()?;
            out[2 * i..2 * i + 2].copy_from_slice(&v.to_be_bytes());
        }
        Some(Gid(out))
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, pair) in self.0.chunks(2).enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{:02x}{:02x}", pair[0], pair[1])?;
        }
        Ok(())
    }
}

/// One GID table entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GidEntry {
    pub index: u8,
    pub gid: Gid,
    pub kind: GidType,
}

/// Path MTU, with the verbs enum values (`IBV_MTU_256` = 1 … `IBV_MTU_4096` = 5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mtu {
    M256 = 1,
    M512 = 2,
    M1024 = 3,
    M2048 = 4,
    M4096 = 5,
}

impl Mtu {
    pub fn from_code(code: u32) -> Option<Mtu> {
        Some(match code {
            1 => Mtu::M256,
            2 => Mtu::M512,
            3 => Mtu::M1024,
            4 => Mtu::M2048,
            5 => Mtu::M4096,
            _ => return None,
        })
    }

    /// From the byte count sysfs and `ibv_devinfo` print.
    pub fn from_bytes(bytes: u32) -> Option<Mtu> {
        Some(match bytes {
            256 => Mtu::M256,
            512 => Mtu::M512,
            1024 => Mtu::M1024,
            2048 => Mtu::M2048,
            4096 => Mtu::M4096,
            _ => return None,
        })
    }

    pub fn code(self) -> u32 {
        self as u32
    }

    pub fn bytes(self) -> u32 {
        128 << (self as u32)
    }
}

/// What the provider needs to know about one port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortInfo {
    pub port: u8,
    pub link_layer: LinkLayer,
    /// `IBV_PORT_ACTIVE` (4) or not.
    pub active: bool,
    pub lid: u16,
    pub active_mtu: Mtu,
    pub gids: Vec<GidEntry>,
}

/// How a QP on this port is addressed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortAddress {
    pub port: u8,
    pub gid_index: u8,
    pub gid: Gid,
    /// Non-zero on InfiniBand; 0 on RoCE, where routing is by GID.
    pub lid: u16,
    /// RoCE: the address handle must carry a global route header.
    pub global: bool,
    pub mtu: Mtu,
}

#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum GidError {
    #[error("port {port} is not active")]
    PortDown { port: u8 },
    #[error("port {port} is Ethernet but has no RoCE v2 GID with a routable address")]
    NoRoceV2Gid { port: u8 },
    #[error("port {port} is InfiniBand but has no LID assigned (is the subnet manager running?)")]
    NoLid { port: u8 },
    #[error("port {port} has no usable GID")]
    NoGid { port: u8 },
}

/// Chooses the address for a port: on Ethernet the first RoCE v2 GID that is not link-local
/// (IPv4-mapped or global IPv6, so routed fabrics work), on InfiniBand the port's LID with its
/// first non-zero GID (index 0 in practice) for global routes.
pub fn choose_address(port: &PortInfo) -> Result<PortAddress, GidError> {
    if !port.active {
        return Err(GidError::PortDown { port: port.port });
    }
    match port.link_layer {
        LinkLayer::Ethernet => {
            let e = port
                .gids
                .iter()
                .filter(|e| e.kind == GidType::RoceV2 && !e.gid.is_zero())
                .find(|e| !e.gid.is_link_local())
                .ok_or(GidError::NoRoceV2Gid { port: port.port })?;
            Ok(PortAddress {
                port: port.port,
                gid_index: e.index,
                gid: e.gid,
                lid: 0,
                global: true,
                mtu: port.active_mtu,
            })
        }
        LinkLayer::InfiniBand => {
            if port.lid == 0 {
                return Err(GidError::NoLid { port: port.port });
            }
            let e = port
                .gids
                .iter()
                .find(|e| !e.gid.is_zero())
                .ok_or(GidError::NoGid { port: port.port })?;
            Ok(PortAddress {
                port: port.port,
                gid_index: e.index,
                gid: e.gid,
                lid: port.lid,
                global: false,
                mtu: port.active_mtu,
            })
        }
    }
}

/// The MTU both ends of a path can carry.
pub fn path_mtu(local: Mtu, remote: Mtu) -> Mtu {
    local.min(remote)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(index: u8, gid: &str, kind: GidType) -> GidEntry {
        GidEntry {
            index,
            gid: Gid::parse(gid).unwrap(),
            kind,
        }
    }

    fn port(link_layer: LinkLayer, lid: u16, gids: Vec<GidEntry>) -> PortInfo {
        PortInfo {
            port: 1,
            link_layer,
            active: true,
            lid,
            active_mtu: Mtu::M4096,
            gids,
        }
    }

    const LL: &str = "fe80:0000:0000:0000:0202:c9ff:fe00:0001";
    const V4: &str = "0000:0000:0000:0000:0000:ffff:0a00:0002";

    #[test]
    fn roce_prefers_v2_routable() {
        let p = port(
            LinkLayer::Ethernet,
            0,
            vec![
                entry(0, LL, GidType::RoceV1),
                entry(1, LL, GidType::RoceV2),
                entry(2, V4, GidType::RoceV1),
                entry(3, V4, GidType::RoceV2),
            ],
        );
        let a = choose_address(&p).unwrap();
        assert_eq!((a.gid_index, a.global, a.lid), (3, true, 0));
        assert_eq!(a.gid.to_string(), V4);
        let only_ll = port(LinkLayer::Ethernet, 0, vec![entry(1, LL, GidType::RoceV2)]);
        assert_eq!(
            choose_address(&only_ll),
            Err(GidError::NoRoceV2Gid { port: 1 })
        );
    }

    #[test]
    fn infiniband_uses_lid() {
        let p = port(LinkLayer::InfiniBand, 7, vec![entry(0, LL, GidType::Ib)]);
        let a = choose_address(&p).unwrap();
        assert_eq!((a.gid_index, a.lid, a.global), (0, 7, false));
        let p = port(LinkLayer::InfiniBand, 0, vec![entry(0, LL, GidType::Ib)]);
        assert_eq!(choose_address(&p), Err(GidError::NoLid { port: 1 }));
        let mut p = port(LinkLayer::InfiniBand, 7, vec![]);
        assert_eq!(choose_address(&p), Err(GidError::NoGid { port: 1 }));
        p.active = false;
        assert_eq!(choose_address(&p), Err(GidError::PortDown { port: 1 }));
    }

    #[test]
    fn mtu_and_gid_forms() {
        assert_eq!(path_mtu(Mtu::M4096, Mtu::M1024), Mtu::M1024);
        assert_eq!(Mtu::from_code(5).unwrap().bytes(), 4096);
        assert_eq!(Mtu::from_bytes(2048), Some(Mtu::M2048));
        assert_eq!(Mtu::from_code(0), None);
        assert!(Gid::parse(LL).unwrap().is_link_local());
        assert!(!Gid::parse(V4).unwrap().is_link_local());
        assert_eq!(Gid::parse("1:2"), None);
        assert_eq!(GidType::parse("RoCE v2\n"), Some(GidType::RoceV2));
    }
}
