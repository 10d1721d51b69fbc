//! The software device across processes, through shared memory.
//!
//! Every process publishes the state a remote requester must check — per GID: its QPs
//! (state, access, peer, read depth) and its remotely readable MRs (key, range, access, and
//! where the bytes live: a memfd of the process and the offset in it) — as a small text file
//! in the fabric directory, rewritten (write, then rename) whenever that state changes. A
//! requester whose QP names a GID of another process reads that file, applies the same
//! checks as for a local responder, maps the owner's memfd read-only through
//! `/proc/<pid>/fd/<n>` (the owner's memory itself, shared; no copy on the owner's side) and
//! copies from it. Host pools are memfds, so the pool is readable this way; an MR that is not
//! backed by a memfd is not exported, and remote reads of it fail with a remote access error.
//!
//! The directory is `$KVFERRY_SOFT_VERBS_DIR`, else `/dev/shm/kvferry-soft-verbs-<uid>`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use crate::verbs::gid::Gid;

/// Where the fabric's files are.
pub(super) fn dir() -> PathBuf {
    if let Some(d) = std::env::var_os("KVFERRY_SOFT_VERBS_DIR") {
        return PathBuf::from(d);
    }
    // SAFETY: getuid has no preconditions and cannot fail.
    let uid = unsafe { libc::getuid() };
    PathBuf::from(format!("/dev/shm/kvferry-soft-verbs-{uid}"))
}

fn hex(g: &Gid) -> String {
    g.0.iter().fold(String::with_capacity(32), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn unhex(s: &str) -> Option<Gid> {
    if s.len() != 32 {
        return None;
    }
    let mut g = [0u8; 16];
    for (i, b) in g.iter_mut().enumerate() {
        *b = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(Gid(g))
}

/// Where an MR's bytes live for other processes: the memfd's descriptor in the owner, its
/// inode, and the offset of the MR's first byte in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Export {
    pub fd: i32,
    pub ino: u64,
    pub offset: u64,
}

/// Finds the memfd behind `addr..addr+len` of this process, if one is open here.
pub(super) fn export_of(addr: u64, len: u64) -> Option<Export> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let end = addr.checked_add(len)?;
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (range, _perms, off, _dev, ino) =
            (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?);
        let path: String = f.collect::<Vec<_>>().join(" ");
        let (s, e) = range.split_once('-')?;
        let (s, e) = (
            u64::from_str_radix(s, 16).ok()?,
            u64::from_str_radix(e, 16).ok()?,
        );
        if !(s <= addr && end <= e) {
            continue;
        }
        if !path.starts_with("/memfd:") {
            return None;
        }
        let ino: u64 = ino.parse().ok()?;
        let file_off = u64::from_str_radix(off, 16).ok()? + (addr - s);
        for entry in std::fs::read_dir("/proc/self/fd").ok()?.flatten() {
            let Ok(target) = std::fs::read_link(entry.path()) else {
                continue;
            };
            if target.to_string_lossy() != path {
                continue;
            }
            let Ok(meta) = std::fs::metadata(entry.path()) else {
                continue;
            };
            if meta.ino() == ino {
                let fd: i32 = entry.file_name().to_str()?.parse().ok()?;
                return Some(Export {
                    fd,
                    ino,
                    offset: file_off,
                });
            }
        }
        return None;
    }
    None
}

/// One QP of a remote process, as published.
#[derive(Clone, Copy, Debug)]
pub(super) struct RemoteQp {
    pub qpn: u32,
    pub ready: bool,
    pub access: u32,
    pub dest_qpn: u32,
    pub dest_gid: Gid,
    pub depth: u8,
    pub pd: usize,
}

/// One exported MR of a remote process, as published.
#[derive(Clone, Copy, Debug)]
pub(super) struct RemoteMr {
    pub key: u32,
    pub pd: usize,
    pub addr: u64,
    pub len: u64,
    pub access: u32,
    pub export: Export,
}

/// What a process published for one GID.
#[derive(Debug, Default)]
pub(super) struct Published {
    pub pid: u32,
    pub up: bool,
    pub qps: Vec<RemoteQp>,
    pub mrs: Vec<RemoteMr>,
}

impl Published {
    pub fn render(&self) -> String {
        let mut s = format!("pid {}\nport {}\n", self.pid, u8::from(self.up));
        for q in &self.qps {
            let _ = writeln!(
                s,
                "qp {} {} {} {} {} {} {}",
                q.qpn,
                u8::from(q.ready),
                q.access,
                q.dest_qpn,
                hex(&q.dest_gid),
                q.depth,
                q.pd
            );
        }
        for m in &self.mrs {
            let _ = writeln!(
                s,
                "mr {} {} {} {} {} {} {} {}",
                m.key, m.pd, m.addr, m.len, m.access, m.export.fd, m.export.ino, m.export.offset
            );
        }
        s
    }

    pub fn parse(text: &str) -> Option<Published> {
        let mut p = Published::default();
        for line in text.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            match f.as_slice() {
                ["pid", pid] => p.pid = pid.parse().ok()?,
                ["port", up] => p.up = *up == "1",
                ["qp", qpn, ready, access, dq, dg, depth, pd] => p.qps.push(RemoteQp {
                    qpn: qpn.parse().ok()?,
                    ready: *ready == "1",
                    access: access.parse().ok()?,
                    dest_qpn: dq.parse().ok()?,
                    dest_gid: unhex(dg)?,
                    depth: depth.parse().ok()?,
                    pd: pd.parse().ok()?,
                }),
                ["mr", key, pd, addr, len, access, fd, ino, off] => p.mrs.push(RemoteMr {
                    key: key.parse().ok()?,
                    pd: pd.parse().ok()?,
                    addr: addr.parse().ok()?,
                    len: len.parse().ok()?,
                    access: access.parse().ok()?,
                    export: Export {
                        fd: fd.parse().ok()?,
                        ino: ino.parse().ok()?,
                        offset: off.parse().ok()?,
                    },
                }),
                _ => return None,
            }
        }
        Some(p)
    }
}

/// Writes what this process publishes for `gid` (`None`: nothing any more).
pub(super) fn publish(gid: &Gid, what: Option<&Published>) {
    let d = dir();
    let path = d.join(hex(gid));
    let Some(p) = what else {
        let _ = std::fs::remove_file(&path);
        return;
    };
    static SWEPT: std::sync::Once = std::sync::Once::new();
    SWEPT.call_once(|| sweep(&d));
    let write = || -> std::io::Result<()> {
        std::fs::create_dir_all(&d)?;
        let tmp = d.join(format!(".{}.{}", hex(gid), std::process::id()));
        std::fs::write(&tmp, p.render())?;
        std::fs::rename(&tmp, &path)
    };
    if let Err(e) = write() {
        tracing::warn!(dir = %d.display(), error = %e, "soft verbs: publishing to the fabric failed");
    }
}

/// Removes what processes that have exited left behind (they publish until they close their
/// devices, and a process that is killed never does).
fn sweep(d: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(d) else {
        return;
    };
    for e in entries.flatten() {
        // Files being written (`.<gid>.<pid>`) are another process's, mid-rename.
        if e.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let path = e.path();
        let dead = std::fs::read_to_string(&path)
            .ok()
            .and_then(|t| Published::parse(&t))
            .is_none_or(|p| !std::path::Path::new(&format!("/proc/{}", p.pid)).exists());
        if dead {
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// What another process published for `gid`, if it is alive.
pub(super) fn lookup(gid: &Gid) -> Option<Published> {
    let text = std::fs::read_to_string(dir().join(hex(gid))).ok()?;
    let p = Published::parse(&text)?;
    (p.pid != std::process::id() && std::path::Path::new(&format!("/proc/{}", p.pid)).exists())
        .then_some(p)
}

/// A remote process's memfd mapped read-only here.
pub(super) struct RemoteMap {
    ptr: *mut libc::c_void,
    len: u64,
}

// SAFETY: a read-only shared mapping; only unmapped in `Drop`.
unsafe impl Send for RemoteMap {}

impl Drop for RemoteMap {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` came from a successful mmap and are unmapped once.
        unsafe { libc::munmap(self.ptr, self.len as usize) };
    }
}

impl RemoteMap {
    /// Maps `pid`'s descriptor `fd` (checked to be inode `ino`) read-only.
    pub fn open(pid: u32, e: &Export) -> Option<RemoteMap> {
        let f = std::fs::File::open(format!("/proc/{pid}/fd/{}", e.fd)).ok()?;
        let meta = f.metadata().ok()?;
        if meta.ino() != e.ino || meta.len() == 0 {
            return None;
        }
        let len = meta.len();
        // SAFETY: a new read-only shared mapping of an open file; checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                usize::try_from(len).ok()?,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        (ptr != libc::MAP_FAILED).then_some(RemoteMap { ptr, len })
    }

    /// The address of `len` bytes at `offset`, if inside the mapping.
    pub fn at(&self, offset: u64, len: u64) -> Option<u64> {
        (offset.checked_add(len)? <= self.len).then(|| self.ptr as u64 + offset)
    }
}

/// Mappings of other processes' memfds, by (pid, fd, inode).
#[derive(Default)]
pub(super) struct Maps(HashMap<(u32, i32, u64), RemoteMap>);

impl Maps {
    pub fn get(&mut self, pid: u32, e: &Export) -> Option<&RemoteMap> {
        match self.0.entry((pid, e.fd, e.ino)) {
            std::collections::hash_map::Entry::Occupied(o) => Some(o.into_mut()),
            std::collections::hash_map::Entry::Vacant(v) => {
                Some(v.insert(RemoteMap::open(pid, e)?))
            }
        }
        .map(|m| &*m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::HostRegion;

    #[test]
    fn a_memfd_region_is_found_and_round_trips() {
        let r = HostRegion::memfd("soft-fabric-test", 3 * 4096).unwrap();
        let e = export_of(r.addr() + 4096, 100).expect("memfd-backed");
        assert_eq!(e.offset, 4096);
        assert!(export_of(HostRegion::anonymous(4096).unwrap().addr(), 8).is_none());
        let p = Published {
            pid: 7,
            up: true,
            qps: vec![RemoteQp {
                qpn: 0x123,
                ready: true,
                access: 4,
                dest_qpn: 0x456,
                dest_gid: Gid([0xfd; 16]),
                depth: 16,
                pd: 9,
            }],
            mrs: vec![RemoteMr {
                key: 0x1234,
                pd: 9,
                addr: r.addr(),
                len: 4096,
                access: 5,
                export: e,
            }],
        };
        let back = Published::parse(&p.render()).unwrap();
        assert_eq!(back.render(), p.render());
        // Mapped "from another process" (this one, through procfs): the same bytes.
        r.write_at(4096, b"shared").unwrap();
        let mut maps = Maps::default();
        let m = maps.get(std::process::id(), &e).unwrap();
        let at = m.at(e.offset, 6).unwrap();
        // SAFETY: `at` is inside the read-only mapping just made.
        let got = unsafe { std::slice::from_raw_parts(at as *const u8, 6) };
        assert_eq!(got, b"shared");
        assert!(m.at(e.offset, 1 << 40).is_none());
    }
}
