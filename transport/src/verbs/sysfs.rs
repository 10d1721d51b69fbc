//! Reads RDMA devices, their ports and GID tables, and PCI placement of NICs and GPUs from
//! sysfs. The root is a parameter so tests run against a fixture tree.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use thiserror::Error;

use super::gid::{Gid, GidEntry, GidType, LinkLayer, Mtu, PortInfo};

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SysfsError {
    #[error("no RDMA device under {path}")]
    NoDevice { path: PathBuf },
    #[error("reading {path} failed")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} holds {value:?}, which is not {expected}")]
    Parse {
        path: PathBuf,
        value: String,
        expected: &'static str,
    },
    #[error("PCI device {bdf} is not under {path}")]
    UnknownPciDevice { bdf: String, path: PathBuf },
}

/// Where a PCI device sits: its path from the root complex down, and its NUMA node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PciLocation {
    /// Path components below `devices/`: `["pci0000:17", "0000:17:00.0", …, bdf]`.
    pub path: Vec<String>,
    /// `None` where the platform reports -1 (no NUMA information).
    pub numa: Option<u32>,
}

impl PciLocation {
    pub fn bdf(&self) -> &str {
        self.path.last().map(String::as_str).unwrap_or("")
    }
}

/// One RDMA device as sysfs describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NicInfo {
    /// The verbs device name (`mlx5_0`).
    pub name: String,
    pub pci: PciLocation,
    pub ports: Vec<PortInfo>,
}

/// A sysfs tree (`/sys` on a real host).
#[derive(Clone, Debug)]
pub struct Sysfs {
    root: PathBuf,
}

impl Default for Sysfs {
    fn default() -> Self {
        Sysfs::new("/sys")
    }
}

fn read(path: &Path) -> Result<String, SysfsError> {
    fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .map_err(|source| SysfsError::Read {
            path: path.to_path_buf(),
            source,
        })
}

fn parse_err(path: &Path, value: &str, expected: &'static str) -> SysfsError {
    SysfsError::Parse {
        path: path.to_path_buf(),
        value: value.to_string(),
        expected,
    }
}

/// Sorted names in a directory (empty if it does not exist).
fn entries(dir: &Path) -> Result<Vec<String>, SysfsError> {
    let rd = match fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(SysfsError::Read {
                path: dir.to_path_buf(),
                source,
            })
        }
    };
    let mut names: Vec<String> = rd
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    names.sort_by_key(|a| natural_key(a));
    Ok(names)
}

/// Sorts `mlx5_10` after `mlx5_9` and GID index `10` after `9`.
fn natural_key(s: &str) -> (String, u64) {
    let digits = s.len() - s.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    let (head, tail) = s.split_at(s.len() - digits);
    (head.to_string(), tail.parse().unwrap_or(0))
}

impl Sysfs {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Sysfs { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Every RDMA device with its ports; `NoDevice` when there is none.
    pub fn nics(&self) -> Result<Vec<NicInfo>, SysfsError> {
        let class = self.root.join("class/infiniband");
        let names = entries(&class)?;
        if names.is_empty() {
            return Err(SysfsError::NoDevice { path: class });
        }
        names.into_iter().map(|n| self.nic(&n)).collect()
    }

    /// One RDMA device by name.
    pub fn nic(&self, name: &str) -> Result<NicInfo, SysfsError> {
        let dir = self.root.join("class/infiniband").join(name);
        let pci = self.location(&dir.join("device"))?;
        let mut ports = Vec::new();
        for p in entries(&dir.join("ports"))? {
            let num: u8 = p
                .parse()
                .map_err(|_| parse_err(&dir.join("ports"), &p, "a port number"))?;
            ports.push(self.port(&dir.join("ports").join(&p), num)?);
        }
        Ok(NicInfo {
            name: name.to_string(),
            pci,
            ports,
        })
    }

    /// A PCI device (a GPU) by bus address, e.g. `0000:19:00.0`.
    pub fn pci_device(&self, bdf: &str) -> Result<PciLocation, SysfsError> {
        let link = self
            .root
            .join("bus/pci/devices")
            .join(bdf.to_ascii_lowercase());
        if fs::symlink_metadata(&link).is_err() {
            return Err(SysfsError::UnknownPciDevice {
                bdf: bdf.to_string(),
                path: link,
            });
        }
        self.location(&link)
    }

    fn location(&self, dev: &Path) -> Result<PciLocation, SysfsError> {
        let real = fs::canonicalize(dev).map_err(|source| SysfsError::Read {
            path: dev.to_path_buf(),
            source,
        })?;
        let devices = fs::canonicalize(self.root.join("devices")).unwrap_or_default();
        let rel = real.strip_prefix(&devices).unwrap_or(&real);
        let path: Vec<String> = rel
            .components()
            .filter_map(|c| c.as_os_str().to_str().map(str::to_string))
            .filter(|c| c != "/")
            .collect();
        let numa_path = real.join("numa_node");
        let numa = match fs::read_to_string(&numa_path) {
            Ok(s) => {
                let v: i64 = s
                    .trim()
                    .parse()
                    .map_err(|_| parse_err(&numa_path, s.trim(), "a NUMA node"))?;
                u32::try_from(v).ok()
            }
            Err(_) => None,
        };
        Ok(PciLocation { path, numa })
    }

    fn port(&self, dir: &Path, num: u8) -> Result<PortInfo, SysfsError> {
        let state_path = dir.join("state");
        let state = read(&state_path)?;
        // "4: ACTIVE"
        let active = state.split(':').next().map(str::trim) == Some("4");
        let ll_path = dir.join("link_layer");
        let ll = read(&ll_path)?;
        let link_layer = match ll.as_str() {
            "InfiniBand" => LinkLayer::InfiniBand,
            "Ethernet" => LinkLayer::Ethernet,
            _ => return Err(parse_err(&ll_path, &ll, "InfiniBand or Ethernet")),
        };
        let lid_path = dir.join("lid");
        let lid = match fs::read_to_string(&lid_path) {
            Ok(s) => {
                let s = s.trim();
                u16::from_str_radix(s.trim_start_matches("0x"), 16)
                    .map_err(|_| parse_err(&lid_path, s, "a hexadecimal LID"))?
            }
            Err(_) => 0,
        };
        let mut gids = Vec::new();
        for i in entries(&dir.join("gids"))? {
            let Ok(index) = i.parse::<u8>() else { continue };
            let gid_path = dir.join("gids").join(&i);
            let text = read(&gid_path)?;
            let gid = Gid::parse(&text).ok_or_else(|| parse_err(&gid_path, &text, "a GID"))?;
            if gid.is_zero() {
                continue;
            }
            // Reading the type of an unpopulated entry fails with EINVAL on real hosts.
            let kind = fs::read_to_string(dir.join("gid_attrs/types").join(&i))
                .ok()
                .and_then(|t| GidType::parse(&t))
                .unwrap_or(match link_layer {
                    LinkLayer::InfiniBand => GidType::Ib,
                    LinkLayer::Ethernet => GidType::RoceV1,
                });
            gids.push(GidEntry { index, gid, kind });
        }
        Ok(PortInfo {
            port: num,
            link_layer,
            active,
            lid,
            // sysfs has no active MTU; the device query replaces this with the real one.
            active_mtu: Mtu::M4096,
            gids,
        })
    }
}
