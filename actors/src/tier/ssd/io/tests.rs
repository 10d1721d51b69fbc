use super::*;

#[test]
fn a_filesystem_refusing_o_direct_gets_buffered_io_and_a_reason() {
    let path = std::env::temp_dir().join(format!("kvferry-odirect-{}", std::process::id()));
    let open = |flags: i32| {
        if flags & libc::O_DIRECT != 0 {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
    };
    let (_, mode) = open_with(&path, true, open).unwrap();
    let why = mode.unwrap_err();
    assert!(why.contains("refuses O_DIRECT"), "{why}");
    // Other errors are not papered over.
    let denied = |_: i32| Err(std::io::Error::from_raw_os_error(libc::EACCES));
    assert!(matches!(
        open_with(&path, true, denied),
        Err(SsdError::Open { .. })
    ));
    let _ = std::fs::remove_file(&path);
}

/// A file header write (its used mark tells a restart how far to scan) runs alone: the
/// block writes queued before it are done when it starts, those after it wait for it,
/// so no block past the mark is on disk before the mark.
#[test]
fn a_file_header_write_is_a_fence() {
    let path = std::env::temp_dir().join(format!("kvferry-fence-{}", std::process::id()));
    let (file, direct) = open_file(&path, true).unwrap();
    file.set_len(1 << 20).unwrap();
    let (mut io, uring) = DirIo::new(path.clone(), file, direct.is_ok(), 8);
    assert!(uring.is_ok(), "{uring:?}");
    let company = Arc::new(AtomicU64::new(0));
    io.fence_company = Some(Arc::clone(&company));
    let (tx, rx) = mpsc::channel();
    let t = std::thread::spawn(move || io.run(rx));
    let write = |offset: u64| {
        let (reply, done) = oneshot::channel();
        tx.send(Op::Write {
            offset,
            buf: AlignedBuf::new(8192),
            reply,
            charge: None,
        })
        .unwrap();
        done
    };
    let mut done: Vec<_> = (1..=6).map(|i| write(i * 16384)).collect();
    done.push(write(0));
    done.extend((7..=12).map(|i| write(i * 16384)));
    for d in done {
        d.blocking_recv().unwrap().unwrap();
    }
    assert_eq!(
        company.load(Relaxed),
        1,
        "the header write ran beside others"
    );
    drop(tx);
    t.join().unwrap();
    let _ = std::fs::remove_file(&path);
}

/// A block read queued behind a write of its slot sees the written bytes, on every
/// round, on io_uring.
#[test]
fn block_reads_wait_behind_a_write_of_their_slot() {
    reads_after_writes(true);
}

/// The same without io_uring: the pread/pwrite fallback (what a kernel or seccomp
/// profile without io_uring gets).
#[test]
fn the_pread_pwrite_fallback_reads_and_writes_the_same() {
    reads_after_writes(false);
}

fn reads_after_writes(uring: bool) {
    use crate::model::{BlockHash, Namespace};
    let path = std::env::temp_dir().join(format!("kvferry-order-{uring}-{}", std::process::id()));
    let (file, direct) = open_file(&path, true).unwrap();
    file.set_len(1 << 20).unwrap();
    let (mut io, _) = DirIo::new(path.clone(), file, direct.is_ok(), 8);
    if !uring {
        io.ring = None;
    }
    let (tx, rx) = mpsc::channel();
    let t = std::thread::spawn(move || io.run(rx));
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let key = BlockKey {
        namespace: Namespace::new("m", "d", "f").unwrap(),
        hash: BlockHash::from_u64(1),
    };
    let dest = Arc::new(AlignedBuf::new(8192));
    for round in 0..50u8 {
        let mut buf = AlignedBuf::new(2 * 4096);
        let data = vec![round; 4096];
        let (head, body) = buf.as_mut_slice().split_at_mut(4096);
        body.copy_from_slice(&data);
        BlockHeader::new(key.clone(), 1, &data, round as u64).encode(head);
        let (wr, wrx) = oneshot::channel();
        tx.send(Op::Write {
            offset: 8192,
            buf,
            reply: wr,
            charge: None,
        })
        .unwrap();
        let (rr, rrx) = oneshot::channel();
        let into = ReadInto {
            addr: dest.as_slice().as_ptr() as u64,
            cap: 8192,
            keep: Arc::clone(&dest) as Arc<dyn Send + Sync>,
        };
        tx.send(Op::Read {
            offset: 8192,
            key: key.clone(),
            len: 4096,
            into,
            reply: rr,
        })
        .unwrap();
        rt.block_on(async {
            wrx.await.unwrap().unwrap();
            assert!(
                matches!(rrx.await.unwrap(), ReadOutcome::Ok),
                "round {round}"
            );
        });
        assert!(dest.as_slice()[..4096].iter().all(|b| *b == round));
    }
    let (br, brx) = oneshot::channel();
    tx.send(Op::Barrier { reply: br }).unwrap();
    rt.block_on(brx).unwrap();
    drop(tx);
    t.join().unwrap();
    let _ = std::fs::remove_file(&path);
}
