//! A real `redis-server` child process for the directory's tests.

use std::collections::HashSet;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// A real `redis-server` on a loopback port, killed on drop (and continued first, if a
/// test stopped it).
pub(super) struct RedisServer {
    child: Child,
    port: u16,
    /// Where it saves and loads its data; None: in memory only.
    dir: Option<PathBuf>,
}

impl RedisServer {
    pub(super) fn start() -> Self {
        Self::start_with(None)
    }

    pub(super) fn start_with(dir: Option<PathBuf>) -> Self {
        for _ in 0..5 {
            if let Some(s) = Self::start_on(free_port(), dir.clone()) {
                return s;
            }
        }
        panic!("redis-server did not come up on any of 5 free ports");
    }

    /// None when the server exits early (its port was taken meanwhile).
    pub(super) fn start_on(port: u16, dir: Option<PathBuf>) -> Option<Self> {
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--appendonly", "no", "--save", ""]);
        if let Some(d) = &dir {
            cmd.arg("--dir").arg(d).args(["--dbfilename", "dir.rdb"]);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let child = match child {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                "redis-server is not installed (needed by the Redis directory tests): \
                 run ./scripts/test, which installs it, or apt-get install redis-server"
            ),
            Err(e) => panic!("cannot start redis-server: {e}"),
        };
        let mut s = Self { child, port, dir };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if matches!(s.child.try_wait(), Ok(Some(_))) {
                return None;
            }
            if s.pong() {
                return Some(s);
            }
            thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-server on port {port} did not answer PING within 10 s");
    }

    pub(super) fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn pong(&self) -> bool {
        redis::Client::open(format!("redis://{}/", self.addr()))
            .and_then(|c| c.get_connection_with_timeout(Duration::from_millis(500)))
            .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
            .is_ok()
    }

    /// A plain blocking connection of the test's own, to look at the server.
    pub(super) fn conn(&self) -> redis::Connection {
        let c = redis::Client::open(format!("redis://{}/", self.addr())).unwrap();
        let conn = c
            .get_connection_with_timeout(Duration::from_secs(2))
            .unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        conn
    }

    /// Block keys under `prefix`, counted with SCAN.
    pub(super) fn entries(&self, prefix: &str) -> usize {
        let mut c = self.conn();
        let it = redis::cmd("SCAN")
            .cursor_arg(0)
            .arg("MATCH")
            .arg(format!("{prefix}:blk:*"))
            .clone()
            .iter::<String>(&mut c)
            .unwrap();
        it.filter_map(Result::ok).collect::<HashSet<String>>().len()
    }

    /// Signals the server while it runs (never a pid that was reaped and may be reused).
    fn signal(&mut self, sig: libc::c_int) {
        if !matches!(self.child.try_wait(), Ok(None)) {
            return;
        }
        // SAFETY: kill(2) on our own child, not yet reaped; no memory is involved.
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, sig) };
        assert_eq!(rc, 0, "kill({}, {sig})", self.child.id());
    }

    /// Hangs the server: its socket still accepts, nothing answers.
    pub(super) fn stop(&mut self) {
        self.signal(libc::SIGSTOP);
    }

    pub(super) fn cont(&mut self) {
        self.signal(libc::SIGCONT);
    }

    /// Kills it and starts another on the same port (with the same data directory).
    pub(super) fn restart(mut self) -> Self {
        self.kill();
        let dir = self.dir.take();
        let port = self.port;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(s) = Self::start_on(port, dir.clone()) {
                return s;
            }
            assert!(Instant::now() < deadline, "no restart on port {port}");
            thread::sleep(Duration::from_millis(50));
        }
    }

    pub(super) fn kill(&mut self) {
        self.cont();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

pub(super) fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local addr").port()
}
