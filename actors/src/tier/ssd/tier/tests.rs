use super::*;
use crate::config::ByteSize;
use crate::model::{BlockHash, Namespace};
use crate::tier::ssd::config::SsdDir;
use crate::tier::ssd::format::Damage;
use std::path::Path;
use std::time::Duration;

const SLOT: u64 = 64 << 10;

fn key(i: u64) -> BlockKey {
    BlockKey {
        namespace: Namespace::new("m", "bf16", "t").unwrap(),
        hash: BlockHash::from_u64(i),
    }
}

fn data(i: u64, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i as usize * 31 + j * 7) as u8).collect()
}

/// A fresh directory under `base` (removed first if a failed run left it).
fn fresh(base: &str, name: &str) -> PathBuf {
    let p = Path::new(base).join(format!("kvferry-ssd-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    p
}

fn cfg(dirs: &[&Path], blocks: u64) -> SsdConfig {
    SsdConfig {
        dir: dirs
            .iter()
            .map(|p| SsdDir {
                path: p.to_path_buf(),
                capacity: ByteSize(HEADER + blocks * format::slot_stride(SLOT)),
            })
            .collect(),
        queue_depth: 4,
        ..Default::default()
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

async fn put(t: &mut SsdTier, i: u64, len: usize) -> (bool, Option<BlockKey>) {
    let d = data(i, len);
    let Ok((w, rx, evicted)) = t.write(&key(i), 2, len as u64, |dst| dst.copy_from_slice(&d))
    else {
        return (false, None);
    };
    let out = rx.await.unwrap();
    (t.write_done(&w, out).is_ok(), evicted)
}

/// Reads block `i` into a fresh buffer: the outcome and the bytes.
async fn get(t: &mut SsdTier, i: u64) -> (bool, Vec<u8>) {
    let buf = Arc::new(AlignedBuf::new(SLOT as usize));
    let into = ReadInto {
        addr: buf.as_slice().as_ptr() as u64,
        cap: SLOT,
        keep: Arc::clone(&buf) as Arc<dyn Send + Sync>,
    };
    let Some((r, rx)) = t.read(&key(i), into) else {
        return (false, Vec::new());
    };
    let out = rx.await.ok();
    let (ok, _) = t.read_done(&r, out.as_ref());
    (ok, buf.as_slice()[..r.len as usize].to_vec())
}

/// Both I/O paths: O_DIRECT where /tmp allows it, and the buffered fallback on tmpfs.
fn round_trip_and_restart(base: &str, expect_direct: bool) {
    let dir = fresh(base, "rt");
    rt().block_on(async {
        let mut t = SsdTier::open(&cfg(&[&dir], 8), SLOT).unwrap();
        assert_eq!(
            t.modes()[0].direct.is_ok(),
            expect_direct,
            "{:?}",
            t.modes()
        );
        for i in 0..5u64 {
            // Odd lengths: padding is not part of the block.
            assert!(put(&mut t, i, 1000 + i as usize * 4099).await.0);
        }
        for i in 0..5u64 {
            let (ok, bytes) = get(&mut t, i).await;
            assert!(ok);
            assert_eq!(bytes, data(i, 1000 + i as usize * 4099), "block {i}");
        }
        assert_eq!(t.stats().writes, 5);
        drop(t);
        // Restart on the same directory: every block is found by the scan.
        let mut t = SsdTier::open(&cfg(&[&dir], 8), SLOT).unwrap();
        assert_eq!(t.recovered(), 5);
        for i in 0..5u64 {
            let (ok, bytes) = get(&mut t, i).await;
            assert!(
                ok && bytes == data(i, 1000 + i as usize * 4099),
                "block {i}"
            );
        }
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn o_direct_round_trip_and_restart_on_tmp() {
    // /tmp is a disk filesystem here (ext4); where it is tmpfs this asserts the fallback.
    let direct = !is_tmpfs("/tmp");
    round_trip_and_restart("/tmp", direct);
}

/// tmpfs: O_DIRECT where the kernel allows it on tmpfs (6.6 and later), else the
/// buffered fallback; either way the same bytes come back.
#[test]
fn tmpfs_round_trip_and_restart() {
    assert!(
        is_tmpfs("/dev/shm"),
        "/dev/shm is tmpfs on every supported host"
    );
    let probe = fresh("/dev/shm", "probe");
    let direct = super::super::io::open_file(&probe, true)
        .map(|(_, d)| d.is_ok())
        .unwrap();
    let _ = std::fs::remove_file(&probe);
    round_trip_and_restart("/dev/shm", direct);
}

/// The fallback path end to end: buffered I/O (what a filesystem without O_DIRECT gets).
#[test]
fn buffered_io_round_trip_and_restart() {
    let dir = fresh("/tmp", "buffered");
    rt().block_on(async {
        let mut c = cfg(&[&dir], 4);
        c.direct_io = false;
        let mut t = SsdTier::open(&c, SLOT).unwrap();
        assert!(t.modes()[0].direct.is_err());
        assert!(put(&mut t, 7, 12345).await.0);
        drop(t);
        let mut t = SsdTier::open(&c, SLOT).unwrap();
        let (ok, bytes) = get(&mut t, 7).await;
        assert!(ok && bytes == data(7, 12345));
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

fn is_tmpfs(path: &str) -> bool {
    let c = std::ffi::CString::new(path).unwrap();
    // SAFETY: a zeroed statfs is a valid out-parameter; the path is NUL-terminated.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut s) };
    rc == 0 && s.f_type == libc::TMPFS_MAGIC
}

#[test]
fn a_flipped_byte_is_a_miss_counted_and_dropped() {
    let dir = fresh("/tmp", "corrupt");
    rt().block_on(async {
        let mut t = SsdTier::open(&cfg(&[&dir], 4), SLOT).unwrap();
        assert!(put(&mut t, 1, 5000).await.0);
        assert!(put(&mut t, 2, 5000).await.0);
        let loc = t.entry(&key(1)).unwrap().loc;
        drop(t);
        // Flip one byte of block 1's bytes on disk, behind the tier's back.
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(dir.join(format::FILE_NAME))
            .unwrap();
        use std::os::unix::fs::FileExt;
        let at = format::slot_offset(loc.slot, format::slot_stride(SLOT)) + HEADER + 1234;
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, at).unwrap();
        f.write_all_at(&[b[0] ^ 0x40], at).unwrap();
        f.sync_all().unwrap();
        let mut t = SsdTier::open(&cfg(&[&dir], 4), SLOT).unwrap();
        assert_eq!(t.recovered(), 2, "the header is intact: found by the scan");
        let (ok, _) = get(&mut t, 1).await;
        assert!(!ok, "corrupt bytes are never served");
        assert_eq!(t.stats().damaged, [0, 0, 1]);
        assert!(!t.contains(&key(1)), "dropped from the tier");
        let (ok, bytes) = get(&mut t, 2).await;
        assert!(ok && bytes == data(2, 5000));
        // Its slot is reused.
        assert!(put(&mut t, 3, 5000).await.0);
    });
    std::fs::remove_dir_all(&dir).unwrap();
    let _ = Damage::Checksum;
}

#[test]
fn capacity_evicts_the_least_recently_used() {
    let (a, b) = (fresh("/tmp", "lru-a"), fresh("/dev/shm", "lru-b"));
    rt().block_on(async {
        let mut t = SsdTier::open(&cfg(&[&a, &b], 2), SLOT).unwrap();
        for i in 0..4 {
            assert_eq!(put(&mut t, i, 3000).await, (true, None));
        }
        assert!(get(&mut t, 0).await.0, "block 0 is now the youngest");
        assert_eq!(put(&mut t, 4, 3000).await, (true, Some(key(1))));
        assert_eq!(put(&mut t, 5, 3000).await, (true, Some(key(2))));
        let s = t.stats();
        assert_eq!((s.blocks, s.capacity_blocks, s.evictions), (4, 4, 2));
        for i in [0, 3, 4, 5] {
            let (ok, bytes) = get(&mut t, i).await;
            assert!(ok && bytes == data(i, 3000), "block {i}");
        }
        assert!(!get(&mut t, 1).await.0);
    });
    std::fs::remove_dir_all(&a).unwrap();
    std::fs::remove_dir_all(&b).unwrap();
}

/// 1 TiB configured (15.8 M slots of this size): opening, writing past the first used
/// mark and restarting cost what is used, not what is configured.
#[test]
fn a_huge_directory_costs_only_what_it_uses() {
    let dir = fresh("/tmp", "huge");
    rt().block_on(async {
        let mut c = cfg(&[&dir], 1);
        c.dir[0].capacity = ByteSize(1 << 40);
        let t0 = std::time::Instant::now();
        let mut t = SsdTier::open(&c, SLOT).unwrap();
        assert!(t.stats().capacity_blocks > 15_000_000);
        for i in 0..300 {
            assert!(put(&mut t, i, 100).await.0, "block {i}");
        }
        drop(t);
        let mut t = SsdTier::open(&c, SLOT).unwrap();
        assert_eq!(
            t.recovered(),
            300,
            "the used mark moved past the first 256 slots"
        );
        let (ok, bytes) = get(&mut t, 299).await;
        assert!(ok && bytes == data(299, 100));
        assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A slow disk (20 ms a write) and a backlog of two copies: a third write is refused
/// before it takes a disk slot (nothing on disk is evicted for it), and the room comes
/// back as soon as a write answers.
#[test]
fn the_write_backlog_is_bounded_and_given_back() {
    let dir = fresh("/tmp", "backlog");
    rt().block_on(async {
        let mut c = cfg(&[&dir], 8);
        c.test_write_delay = Some(Duration::from_millis(20));
        const LEN: usize = SLOT as usize;
        let copy = HEADER + format::round_up(LEN as u64);
        let mut t = SsdTier::open(&c, SLOT)
            .unwrap()
            .with_write_backlog(2 * copy);
        let mut queued = Vec::new();
        for i in 0..2 {
            let d = data(i, LEN);
            let w = t.write(&key(i), 1, LEN as u64, |dst| dst.copy_from_slice(&d));
            queued.push(w.unwrap());
        }
        assert_eq!(t.backlog_bytes(), 2 * copy);
        let d = data(2, LEN);
        let refused = t.write(&key(2), 1, LEN as u64, |dst| dst.copy_from_slice(&d));
        assert_eq!(refused.err(), Some(WriteSkip::Backlog));
        assert!(!t.contains(&key(2)), "no disk slot taken for it");
        assert!(!t.has_room(LEN as u64));
        let (w, rx, _) = queued.remove(0);
        let out = rx.await.unwrap();
        // Given back by the I/O thread before the answer.
        assert!(t.backlog_bytes() <= copy, "{}", t.backlog_bytes());
        t.write_done(&w, out).unwrap();
        assert!(t.has_room(LEN as u64));
        assert!(put(&mut t, 2, LEN).await.0);
        let (w, rx, _) = queued.remove(0);
        t.write_done(&w, rx.await.unwrap()).unwrap();
        let s = t.stats();
        assert_eq!(
            (
                s.write_backlog_bytes,
                s.write_backlog_peak_bytes,
                s.write_backlog_limit_bytes
            ),
            (0, 2 * copy, 2 * copy)
        );
        for i in 0..3 {
            let (ok, bytes) = get(&mut t, i).await;
            assert!(ok && bytes == data(i, LEN), "block {i}");
        }
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_directory_serves_one_node_at_a_time() {
    let dir = fresh("/tmp", "lock");
    let t = SsdTier::open(&cfg(&[&dir], 2), SLOT).unwrap();
    let e = SsdTier::open(&cfg(&[&dir], 2), SLOT).unwrap_err();
    assert!(e.to_string().contains(&dir.display().to_string()), "{e}");
    assert!(
        matches!(&e, SsdError::Open { op, .. } if op.contains("another node")),
        "{e:?}"
    );
    drop(t);
    SsdTier::open(&cfg(&[&dir], 2), SLOT).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn another_slot_size_starts_the_file_afresh() {
    let dir = fresh("/tmp", "geometry");
    rt().block_on(async {
        let mut t = SsdTier::open(&cfg(&[&dir], 4), SLOT).unwrap();
        assert!(put(&mut t, 1, 5000).await.0);
        drop(t);
        let mut c = cfg(&[&dir], 4);
        c.dir[0].capacity = ByteSize(HEADER + 4 * format::slot_stride(2 * SLOT));
        let t = SsdTier::open(&c, 2 * SLOT).unwrap();
        assert_eq!(t.recovered(), 0);
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A directory on a 1 MiB tmpfs configured for far more: writes fail with DiskFull,
/// what was written stays readable, and the directory reuses its written slots.
#[test]
fn disk_full_is_typed_and_the_tier_keeps_working() {
    let dir = fresh("/tmp", "full");
    std::fs::create_dir_all(&dir).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs"])
        .arg(&dir)
        .status()
        .is_ok_and(|s| s.success());
    if !mounted {
        eprintln!("cannot mount a tmpfs here (not root?): disk full is not exercised");
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    let out = std::panic::catch_unwind(|| {
        rt().block_on(async {
            let mut t = SsdTier::open(&cfg(&[&dir], 64), SLOT).unwrap();
            let mut written = 0;
            let mut full = 0;
            for i in 0..64 {
                match put(&mut t, i, SLOT as usize).await.0 {
                    true => written += 1,
                    false => full += 1,
                }
            }
            let s = t.stats();
            // One write met the full disk; every later one reused a written slot.
            assert_eq!((full, s.disk_full, s.write_errors), (1, 1, 1), "{s:?}");
            assert_eq!(written, 63);
            assert!(s.blocks >= 8 && s.blocks < 64, "{s:?}");
            assert_eq!(s.capacity_blocks, s.blocks, "a full directory only reuses");
            assert_eq!(s.evictions, 63 - s.blocks as u64);
            // The newest written blocks are readable.
            let last = (0..64).rev().find(|i| t.contains(&key(*i))).unwrap();
            let (ok, bytes) = get(&mut t, last).await;
            assert!(ok && bytes == data(last, SLOT as usize));
            // And it keeps taking blocks by evicting, in place.
            let (ok, evicted) = put(&mut t, 100, SLOT as usize).await;
            assert!(ok && evicted.is_some());
        })
    });
    let _ = std::process::Command::new("umount").arg(&dir).status();
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(p) = out {
        std::panic::resume_unwind(p);
    }
}
