//! Processes the tests start: `redis-server`, `promtool`, a `kvferry node` (its `listening`
//! lines), and this test binary again as a child running one ignored test.

use std::time::Duration;

/// A loopback port nothing listened on a moment ago (a process the test starts binds it).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

/// Runs `promtool check metrics` on `text` (a scrape) and asserts it passes.
pub fn promtool_check(text: &str) {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let mut check = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool is not installed: run ./scripts/test, which installs it");
    check
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let res = check.wait_with_output().unwrap();
    assert!(
        res.status.success(),
        "promtool: {}{}\n{text}",
        String::from_utf8_lossy(&res.stdout),
        String::from_utf8_lossy(&res.stderr)
    );
}

/// A real `redis-server` on a free loopback port, killed on drop (continued first, if a
/// test hung it).
pub struct RedisServer {
    child: std::process::Child,
    pub addr: String,
    port: u16,
}

impl RedisServer {
    pub fn start() -> Self {
        for _ in 0..5 {
            if let Some(s) = Self::start_on(free_port()) {
                return s;
            }
        }
        panic!("redis-server did not come up");
    }

    /// With `args` added to its command line (`--requirepass pw`, `--user name on >pw …`).
    pub fn start_with(args: &[&str]) -> Self {
        for _ in 0..5 {
            if let Some(s) = Self::start_on_with(free_port(), args) {
                return s;
            }
        }
        panic!("redis-server did not come up");
    }

    /// On `port`; None when it exits at once (the port was taken meanwhile) or never accepts.
    pub fn start_on(port: u16) -> Option<Self> {
        Self::start_on_with(port, &[])
    }

    fn start_on_with(port: u16, args: &[&str]) -> Option<Self> {
        let child = std::process::Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(["--bind", "127.0.0.1"])
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("redis-server could not start ({e}): run ./scripts/test, which installs it")
            });
        let mut s = RedisServer {
            child,
            addr: format!("127.0.0.1:{port}"),
            port,
        };
        for _ in 0..500 {
            if matches!(s.child.try_wait(), Ok(Some(_))) {
                return None;
            }
            if std::net::TcpStream::connect(&s.addr).is_ok() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Signals the server while it runs (never a reaped pid, which may be reused).
    fn signal(&mut self, sig: libc::c_int) {
        if matches!(self.child.try_wait(), Ok(None)) {
            // SAFETY: kill(2) on our own child, not yet reaped; no memory is involved.
            let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, sig) };
            assert_eq!(rc, 0, "kill({}, {sig})", self.child.id());
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Hangs it (SIGSTOP): connections are still accepted, nothing is answered.
    pub fn hang(&mut self) {
        self.signal(libc::SIGSTOP);
    }

    pub fn resume(&mut self) {
        self.signal(libc::SIGCONT);
    }

    pub fn kill(&mut self) {
        self.resume();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Kills it and starts an empty one on the same port.
    pub fn restart(mut self) -> Self {
        self.kill();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(s) = Self::start_on(self.port) {
                return s;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "redis-server did not come back on port {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Waits until this process's stdin closes: how a parent ([`ChildTest::finish`]) tells a
/// child process that it may check itself and stop.
pub async fn stdin_closed() {
    let _ = tokio::task::spawn_blocking(|| {
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
    })
    .await;
}

/// Reads `out` (a `kvferry node`'s stdout) on a thread of its own and waits, at most
/// `within`, for a `listening <what>=ADDR` line of each of `whats`; their addresses in that
/// order, or (the error) what it had seen by then.
pub fn wait_listening(
    out: impl std::io::Read + Send + 'static,
    whats: &[&str],
    within: Duration,
) -> Result<Vec<String>, String> {
    use std::io::BufRead;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if let Some((what, addr)) = line
                .strip_prefix("listening ")
                .and_then(|l| l.split_once('='))
            {
                let _ = tx.send((what.to_owned(), addr.to_owned()));
            }
        }
    });
    let deadline = std::time::Instant::now() + within;
    let mut seen = std::collections::HashMap::new();
    while whats.iter().any(|w| !seen.contains_key(*w)) {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok((what, addr)) => {
                seen.insert(what, addr);
            }
            Err(_) => return Err(format!("{seen:?}")),
        }
    }
    Ok(whats.iter().map(|w| seen[*w].clone()).collect())
}

/// This test binary re-executed to run one ignored test as a child process (an owner or a
/// node of its own), with `env` set; its stdout is read line by line. The child serves until
/// its stdin closes ([`ChildTest::finish`]); it is killed if the test fails first.
pub struct ChildTest {
    child: Option<std::process::Child>,
    stdin: Option<std::process::ChildStdin>,
    lines: std::sync::mpsc::Receiver<String>,
}

impl ChildTest {
    /// `test` is the child test's `module_path!()`-qualified name (`integration::remote::
    /// child_owner_process`); libtest names it without the crate.
    pub fn spawn(test: &str, env: &[(&str, &str)]) -> Self {
        use std::io::{BufRead, BufReader};
        use std::process::{Command, Stdio};
        let test = test.split_once("::").map_or(test, |(_, t)| t);
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "--ignored",
            "--exact",
            test,
            "--nocapture",
            "--test-threads=1",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let stdin = child.stdin.take();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            child: Some(child),
            stdin,
            lines,
        }
    }

    /// Waits (at most a minute) for a line holding `prefix` and returns what follows it
    /// (libtest may print "test NAME ... " on the same line first).
    pub fn wait_for(&self, prefix: &str) -> String {
        loop {
            let line = self
                .lines
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("the child never printed {prefix}"));
            if let Some(at) = line.find(prefix) {
                return line[at + prefix.len()..].trim().to_owned();
            }
        }
    }

    /// Closes the child's stdin (its signal to check itself and stop), waits for
    /// `last_line` where given, and asserts a clean exit.
    pub fn finish(mut self, last_line: Option<&str>) {
        drop(self.stdin.take());
        if let Some(l) = last_line {
            self.wait_for(l);
        }
        let status = self.child.take().unwrap().wait().unwrap();
        assert!(status.success(), "the child exited with {status}");
    }
}

impl Drop for ChildTest {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
