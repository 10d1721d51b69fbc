//! A real `kvferry node` process against what a client or an operator can get wrong: a client
//! that shrinks the memory it shared (SIGBUS, if the node let it), file and directory modes
//! under any umask, a restart right after SIGKILL, and secrets in what the node prints.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvferry_actors::service::{board, Code};
use kvferry_actors::{BlockHash, LoadRequest, PutBlocks};
use kvferry_client::EngineClient;
use kvferry_client::KvFd;
use kvferry_client::{LoadOptions, Registration};
use kvferry_gpu::KvShape;
use kvferry_harness::{id, wait_listening, RedisServer};
use kvferry_proto::shm::mailbox::{self, Mailbox, Op};
use kvferry_testkit::{rank_part, MemfdKv};

/// A node process, killed if the test fails before it stops it; its stderr goes to a file.
struct NodeChild {
    child: Child,
    stderr: PathBuf,
}

impl Drop for NodeChild {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl NodeChild {
    /// `kvferry node --config cfg`, under `umask` when given (set in a shell that then
    /// becomes the node: the test process's own umask is shared by every test thread).
    fn spawn(cfg: &Path, umask: Option<&str>, env: &[(&str, &str)], stderr: &Path) -> Self {
        let bin = env!("CARGO_BIN_EXE_kvferry");
        let mut cmd = match umask {
            Some(m) => {
                let mut c = Command::new("sh");
                c.arg("-c")
                    .arg(format!("umask {m} && exec \"$0\" node --config \"$1\""))
                    .arg(bin)
                    .arg(cfg);
                c
            }
            None => {
                let mut c = Command::new(bin);
                c.args(["node", "--config"]).arg(cfg);
                c
            }
        };
        let err = std::fs::File::create(stderr).unwrap();
        let child = cmd
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(err)
            .spawn()
            .unwrap();
        NodeChild {
            child,
            stderr: stderr.to_path_buf(),
        }
    }

    /// Spawns it and waits for a `listening` line of each of `whats`.
    fn start(
        cfg: &Path,
        umask: Option<&str>,
        whats: &[&str],
        stderr: &Path,
    ) -> (Self, Vec<String>) {
        Self::start_with_env(cfg, umask, &[], whats, stderr)
    }

    fn start_with_env(
        cfg: &Path,
        umask: Option<&str>,
        env: &[(&str, &str)],
        whats: &[&str],
        stderr: &Path,
    ) -> (Self, Vec<String>) {
        let mut node = Self::spawn(cfg, umask, env, stderr);
        let out = node.child.stdout.take().unwrap();
        let addrs = wait_listening(out, whats, Duration::from_secs(30)).unwrap_or_else(|seen| {
            panic!(
                "the node did not start serving {whats:?}: {seen}\n{}",
                node.stderr_text()
            )
        });
        (node, addrs)
    }

    fn stderr_text(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGTERM, and the clean exit it must lead to.
    fn stop(mut self) {
        // SAFETY: signalling our own child process by its pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let status = self.child.wait().unwrap();
        assert!(status.success(), "{status:?}\n{}", self.stderr_text());
    }
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvferry-hard-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .permissions()
        .mode()
        & 0o7777
}

fn shape() -> KvShape {
    KvShape::new(3, 1, 2, 1024).unwrap()
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// An engine node on a host device with its fd socket in `dir`.
fn engine_config(dir: &Path, extra: &str) -> PathBuf {
    let cfg = dir.join("node.toml");
    std::fs::write(
        &cfg,
        format!(
            "node-id = \"h\"\n[pool]\nsize = \"4MiB\"\nslot-bytes = \"64KiB\"\n\
             [device]\nkind = \"host\"\n\
             [engine]\nlisten = \"127.0.0.1:0\"\nfd-dir = \"{d}/fd\"\n{extra}",
            d = dir.display()
        ),
    )
    .unwrap();
    cfg
}

/// A memfd of `len` bytes holding `words` (offset, little-endian u32), created with `flags`
/// and not sealed: what a client that does not seal its memory sends.
fn raw_memfd(flags: libc::c_uint, len: u64, words: &[(u64, u32)]) -> OwnedFd {
    // SAFETY: a NUL-terminated name; the descriptor is checked and owned below.
    let fd = unsafe { libc::memfd_create(c"kvferry-test".as_ptr(), flags) };
    assert!(fd >= 0, "{}", std::io::Error::last_os_error());
    // SAFETY: a fresh descriptor nobody else owns.
    let f = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    f.set_len(len).unwrap();
    for (off, w) in words {
        f.write_at(&w.to_le_bytes(), *off).unwrap();
    }
    f.into()
}

fn board_memfd(flags: libc::c_uint, slots: u32) -> (OwnedFd, u64) {
    let len = board::board_bytes(slots);
    let words = [(0, board::MAGIC), (4, board::VERSION), (8, slots)];
    (raw_memfd(flags, len, &words), len)
}

fn mailbox_memfd(flags: libc::c_uint) -> (OwnedFd, u64) {
    let (slots, bytes) = (2, mailbox::MIN_SLOT_BYTES);
    let len = mailbox::mailbox_bytes(slots, bytes);
    let words = [
        (0, mailbox::MAGIC),
        (4, mailbox::VERSION),
        (8, slots),
        (12, bytes),
    ];
    (raw_memfd(flags, len, &words), len)
}

/// `ftruncate(fd, 0)`.
fn shrink(fd: &OwnedFd) -> std::io::Result<()> {
    std::fs::File::from(fd.try_clone().unwrap()).set_len(0)
}

/// One fd socket request by hand (`board …`, `mailbox …`) with `fd`; the answer line.
fn send_raw(sock: &Path, line: &str, fd: BorrowedFd<'_>) -> String {
    let s = std::os::unix::net::UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    kvferry_transport::fd_passing::send_with_fds(s.as_raw_fd(), line.as_bytes(), &[fd]).unwrap();
    let mut answer = String::new();
    BufReader::new(&s).read_line(&mut answer).unwrap();
    answer.trim_end().to_owned()
}

fn handle_of(answer: &str) -> u64 {
    answer
        .strip_prefix("ok ")
        .and_then(|h| h.parse().ok())
        .unwrap_or_else(|| panic!("not ok: {answer}"))
}

/// Puts blocks `hashes` for `instance`, queries them and loads them into `dest`; checks the
/// bytes.
async fn put_and_load(
    c: &EngineClient,
    kv: &MemfdKv,
    instance: &str,
    hashes: &[u64],
    slot: Option<(u32, u32)>,
) {
    let blocks = hashes
        .iter()
        .map(|&h| (BlockHash::from_u64(h), rank_part(&shape(), h, 0)))
        .collect();
    c.put_blocks(&PutBlocks {
        instance: id(instance),
        rank: 0,
        blocks,
    })
    .await
    .unwrap();
    let hs: Vec<BlockHash> = hashes.iter().map(|&h| BlockHash::from_u64(h)).collect();
    let q = c.query(&id(instance), &hs, false).await.unwrap();
    assert_eq!(q.local_blocks as usize, hashes.len(), "{q:?}");
    let dest: Vec<u32> = (0..hashes.len() as u32).map(|i| 15 - i).collect();
    let req = LoadRequest {
        lease: q.lease.unwrap(),
        instance: id(instance),
        rank: 0,
        dest_blocks: dest.clone(),
        per_layer: false,
    };
    let load = match slot {
        Some(s) => c.load(&req, LoadOptions::board(Some(s))).await.unwrap(),
        None => c.load(&req, LoadOptions::default()).await.unwrap(),
    };
    let done = c.wait_load(load, Duration::from_secs(10)).await.unwrap();
    assert_eq!(done.blocks as usize, hashes.len(), "{done:?}");
    let want: Vec<(u32, u64)> = dest.iter().copied().zip(hashes.iter().copied()).collect();
    kv.verify(&want, 0).unwrap();
}

/// Issue 28: a client that maps its board and mailbox and then truncates them killed the
/// node with SIGBUS. Now every board and mailbox is sealed against shrinking at intake: the
/// truncation fails (EPERM) and the node keeps serving that client and the others; a memfd
/// that cannot be sealed is refused for that client alone, naming what it was for.
#[test]
fn a_client_cannot_shrink_its_board_or_mailbox_under_the_node() {
    let dir = scratch("shrink");
    let cfg = engine_config(&dir, "");
    let sock = dir.join("fd/h.engine.sock");
    let (mut node, addrs) = NodeChild::start(&cfg, None, &["engine"], &dir.join("stderr"));
    let rt = rt();
    rt.block_on(async {
        let connect = || EngineClient::connect(addrs[0].clone(), Some(sock.clone()), "");
        // Client a: a board and a mailbox it did not seal (as an older or foreign client).
        let a = connect().await.unwrap();
        let kv_a = MemfdKv::create(shape(), 16, 0).unwrap();
        let kv_handle = a
            .send_kv(&id("a"), 0, 0, kv_a.fd(), KvFd::Memfd { len: kv_a.len() })
            .await
            .unwrap();
        let (board_fd, board_len) = board_memfd(libc::MFD_ALLOW_SEALING, 4);
        let b = handle_of(&send_raw(
            &sock,
            &format!("board a 0 0 {board_len}\n"),
            board_fd.as_fd(),
        ));
        a.register(
            Registration::in_handle(&kv_a.register_request(&id("a"), "m", 0), kv_handle)
                .with_board(b),
        )
        .await
        .unwrap();
        let (mb_fd, mb_len) = mailbox_memfd(libc::MFD_ALLOW_SEALING);
        let m = handle_of(&send_raw(
            &sock,
            &format!("mailbox a 0 0 {mb_len}\n"),
            mb_fd.as_fd(),
        ));
        let mut session = a.open_session(&[]).await.unwrap();
        session.attach(m).await.unwrap();

        // The node sealed both: truncating them fails, and nothing reaches the node.
        for fd in [&board_fd, &mb_fd] {
            let e = shrink(fd).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
        }
        // The node's mailbox thread polls the doorbell: a truncated mailbox faulted it within
        // ~200 ms.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(node.alive(), "{}", node.stderr_text());
        // Client a is still served: a load on its board, a request in its mailbox.
        put_and_load(&a, &kv_a, "a", &[100, 101, 102], Some((1, 7))).await;
        let own = std::sync::Arc::new(Mailbox::open(mb_fd.try_clone().unwrap(), mb_len).unwrap());
        let answer = own
            .post(Op::Query, &[0xff; 64])
            .unwrap()
            .wait(Duration::from_millis(1), Duration::from_secs(10))
            .unwrap();
        assert_eq!(answer.code, Code::InvalidArgument as u32, "{answer:?}");

        // Client c sends memfds that cannot be sealed: refused, naming what each was for,
        // while client b loads.
        let b_client = connect().await.unwrap();
        let kv_b = MemfdKv::create(shape(), 16, 0).unwrap();
        kv_b.register_with(&b_client, &id("b"), "m", 0)
            .await
            .unwrap();
        let (fd, len) = board_memfd(0, 4);
        let r = send_raw(&sock, &format!("board c 0 0 {len}\n"), fd.as_fd());
        assert!(r.starts_with("err invalid-argument"), "{r}");
        assert!(
            r.contains("completion board") && r.contains("shrinking"),
            "{r}"
        );
        let (fd, len) = mailbox_memfd(libc::MFD_ALLOW_SEALING);
        // SAFETY: fcntl on a descriptor we own with an integer argument.
        let rc = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SEAL) };
        assert_eq!(rc, 0);
        let r = send_raw(&sock, &format!("mailbox c 0 0 {len}\n"), fd.as_fd());
        assert!(r.starts_with("err invalid-argument"), "{r}");
        assert!(
            r.contains("request mailbox") && r.contains("shrinking"),
            "{r}"
        );
        put_and_load(&b_client, &kv_b, "b", &[0, 1, 2, 3], None).await;

        // Everything given back: nothing left on the node.
        drop(own);
        drop(session);
        a.unregister(&id("a")).await.unwrap();
        b_client.unregister(&id("b")).await.unwrap();
        let t0 = Instant::now();
        loop {
            let s = b_client.stats().await.unwrap();
            let idle = (
                s.leases_live,
                s.pinned_blocks,
                s.loads_pending,
                s.transfers_in_flight,
                s.memory_handles,
                s.instances,
            );
            if idle == (0, 0, 0, 0, 0, 0) {
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(5), "not idle: {s:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    drop(rt);
    assert!(node.alive());
    node.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 28: SSD block files were 0644 (0666 under umask 000), the shm directory 0777 under
/// umask 000. Whatever the umask, every directory the node creates is 0700 and every file and
/// socket 0600; a block file that was there is set to 0600; a directory that group or others
/// may write is refused, naming it and its mode.
#[test]
fn every_directory_and_file_the_node_creates_is_private_whatever_the_umask() {
    for umask in ["000", "022"] {
        let dir = scratch(&format!("umask{umask}"));
        let d = dir.display();
        let cfg = engine_config(
            &dir,
            &format!(
                "[cluster]\nprovider = \"shm\"\npeer-listen = \"127.0.0.1:0\"\n\
                 shm-dir = \"{d}/shm\"\n\
                 [ssd]\nqueue-depth = 8\n[[ssd.dir]]\npath = \"{d}/disk\"\ncapacity = \"8MiB\"\n"
            ),
        );
        let log = dir.join("stderr");
        let (node, _) = NodeChild::start(&cfg, Some(umask), &["engine", "peer"], &log);
        let want = [
            ("fd", 0o700),
            ("fd/h.engine.sock", 0o600),
            ("shm", 0o700),
            ("shm/h.sock", 0o600),
            ("disk", 0o700),
            ("disk/kvferry-blocks.dat", 0o600),
        ];
        for (p, m) in want {
            let got = mode(&dir.join(p));
            assert_eq!(
                format!("{got:04o}"),
                format!("{m:04o}"),
                "umask {umask}: {p}"
            );
        }
        node.stop();

        // A block file someone opened up is closed again at the next start.
        let file = dir.join("disk/kvferry-blocks.dat");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o666)).unwrap();
        let (node, _) = NodeChild::start(&cfg, Some(umask), &["engine", "peer"], &log);
        assert_eq!(format!("{:04o}", mode(&file)), "0600", "umask {umask}");
        node.stop();

        // A directory others may write is refused at start, naming it and its mode.
        for (sub, m) in [("disk", 0o777), ("shm", 0o775), ("fd", 0o1777)] {
            let p = dir.join(sub);
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(m)).unwrap();
            let mut node = NodeChild::spawn(&cfg, Some(umask), &[], &log);
            let status = node.child.wait().unwrap();
            let err = node.stderr_text();
            assert!(!status.success(), "umask {umask}: {sub} {m:o} was accepted");
            assert!(
                err.contains(&p.display().to_string()) && err.contains(&format!("{m:04o}")),
                "umask {umask}: {sub}: {err}"
            );
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o700)).unwrap();
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Issue 28: a supervisor restarting a node at once after SIGKILL was refused in about one of
/// three restarts ("another node uses this directory"): the dead process's io_uring holds the
/// block file's lock for a few milliseconds after it is reaped. The start now waits for it.
#[test]
fn a_restart_right_after_sigkill_gets_its_ssd_directory_20_times_in_a_row() {
    let dir = scratch("sigkill");
    // Write-through: the node is killed with block writes in flight on its io_uring.
    let cfg = engine_config(
        &dir,
        &format!(
            "[ssd]\nqueue-depth = 8\nwrite-through = true\n[[ssd.dir]]\npath = \"{}/disk\"\n\
             capacity = \"8MiB\"\n",
            dir.display()
        ),
    );
    let log = dir.join("stderr");
    let sock = dir.join("fd/h.engine.sock");
    let rt = rt();
    let kv = MemfdKv::create(shape(), 16, 0).unwrap();
    let (mut node, mut addrs) = NodeChild::start(&cfg, None, &["engine"], &log);
    let mut waited = 0;
    for i in 0..20u64 {
        rt.block_on(async {
            let c = EngineClient::connect(addrs[0].clone(), Some(sock.clone()), "")
                .await
                .unwrap();
            kv.register_with(&c, &id("k"), "m", 0).await.unwrap();
            let blocks = (0..8)
                .map(|b| (BlockHash::from_u64(i * 8 + b), rank_part(&shape(), b, 0)))
                .collect();
            c.put_blocks(&PutBlocks {
                instance: id("k"),
                rank: 0,
                blocks,
            })
            .await
            .unwrap();
        });
        node.child.kill().unwrap();
        node.child.wait().unwrap();
        let mut next = NodeChild::spawn(&cfg, None, &[], &log);
        let out = next.child.stdout.take().unwrap();
        match wait_listening(out, &["engine"], Duration::from_secs(30)) {
            Ok(a) => addrs = a,
            Err(seen) => panic!("restart {i} refused: {seen}\n{}", next.stderr_text()),
        }
        if next
            .stderr_text()
            .contains("waited for the block file's lock")
        {
            waited += 1;
        }
        node = next;
    }
    eprintln!("{waited} of 20 restarts waited for the lock");
    node.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// GETs `/metrics`; the body.
fn scrape(addr: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text
}

/// Issue 28: the Redis password was printed in clear on a refusal line. Nodes with a
/// password-bearing directory URL and engine and cluster tokens, started, used with wrong
/// and right tokens, failing and succeeding: no secret in their logs (at debug level), their
/// errors or their metrics.
#[test]
fn no_secret_shows_in_logs_errors_or_metrics() {
    const SECRETS: [&str; 5] = [
        "redis-pw-0451",
        "engine-tok-0452",
        "cluster-tok-0453",
        "wrong-pw-0454",
        "tls-pw-0455",
    ];
    let check = |what: &str, text: &str| {
        for s in SECRETS {
            assert!(!text.contains(s), "{what} shows {s}:\n{text}");
        }
    };
    let redis = RedisServer::start_with(&[
        "--user",
        "kvuser",
        "on",
        ">redis-pw-0451",
        "~*",
        "&*",
        "+@all",
        "--user",
        "default",
        "off",
    ]);
    let dir = scratch("secrets");
    let config = |name: &str, url: &str| {
        let cfg = dir.join(format!("{name}.toml"));
        std::fs::write(
            &cfg,
            format!(
                "node-id = \"{name}\"\n[pool]\nsize = \"4MiB\"\nslot-bytes = \"64KiB\"\n\
                 [device]\nkind = \"host\"\n[metrics]\nlisten = \"127.0.0.1:0\"\n\
                 [engine]\nlisten = \"127.0.0.1:0\"\nfd-dir = \"{d}/fd\"\ntoken = \"engine-tok-0452\"\n\
                 [cluster]\nprovider = \"tcp\"\npeer-listen = \"127.0.0.1:0\"\n\
                 token = \"cluster-tok-0453\"\ndirectory = \"{url}\"\n\
                 [directory]\nconnect-timeout-ms = 300\nprobe-interval-ms = 100\n",
                d = dir.display()
            ),
        )
        .unwrap();
        cfg
    };
    let debug = [("RUST_LOG", "debug")];
    let port = redis.port();

    // Succeeding: the right password, a database index; clients with wrong and right tokens.
    let cfg = config(
        "good",
        &format!("redis://kvuser:redis-pw-0451@127.0.0.1:{port}/2"),
    );
    let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(["node", "--check-config", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    check("--check-config", &String::from_utf8_lossy(&out.stderr));
    check("--check-config", &String::from_utf8_lossy(&out.stdout));
    let log = dir.join("good.log");
    let (node, addrs) = NodeChild::start_with_env(&cfg, None, &debug, &["engine", "metrics"], &log);
    let rt = rt();
    rt.block_on(async {
        let sock = dir.join("fd/good.engine.sock");
        let wrong = EngineClient::connect(addrs[0].clone(), Some(sock.clone()), "not-it")
            .await
            .unwrap();
        let e = wrong.stats().await.unwrap_err();
        assert_eq!(e.code(), Some(Code::Unauthenticated), "{e}");
        check("an error", &format!("{e} {e:?}"));
        let kv = MemfdKv::create(shape(), 16, 0).unwrap();
        let e = kv
            .register_with(&wrong, &id("w"), "m", 0)
            .await
            .unwrap_err();
        check("an error", &format!("{e} {e:?}"));
        let c = EngineClient::connect(addrs[0].clone(), Some(sock), "engine-tok-0452")
            .await
            .unwrap();
        kv.register_with(&c, &id("e"), "m", 0).await.unwrap();
        put_and_load(&c, &kv, "e", &[5, 6], None).await;
    });
    let metrics = scrape(&addrs[1]);
    assert!(metrics.contains("kvferry_"), "{metrics}");
    check("/metrics", &metrics);
    node.stop();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("DEBUG") || text.contains("debug"), "{text}");
    check("a node's log", &text);

    // Failing: a wrong password (the node starts without its directory, saying why), and
    // a TLS URL, refused by the check and at start.
    let cfg = config(
        "wrong",
        &format!("redis://kvuser:wrong-pw-0454@127.0.0.1:{port}/2"),
    );
    let log = dir.join("wrong.log");
    let (node, _) = NodeChild::start_with_env(&cfg, None, &debug, &["engine"], &log);
    let t0 = Instant::now();
    while !node.stderr_text().contains("does not answer") {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{}",
            node.stderr_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    node.stop();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("kvuser:***@127.0.0.1"), "{text}");
    check("a node's log", &text);

    let cfg = config("tls", "rediss://kvuser:tls-pw-0455@127.0.0.1:1/2");
    for args in [
        &["node", "--check-config", "--config"][..],
        &["node", "--config"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
            .args(args)
            .arg(&cfg)
            .envs(debug)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{err}");
        assert!(
            err.contains("TLS") && err.contains("cluster.directory"),
            "{err}"
        );
        check("a refusal", &err);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
