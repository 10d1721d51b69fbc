//! The `kvferry` binary as an operator runs it: a node from a config file serves its Peer
//! service and stops cleanly on SIGTERM; bad configs are refused with the key named.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use kvferry_harness::{free_port, promtool_check, wait_listening, RedisServer};

fn kvferry() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvferry"))
}

/// A node process that is killed if the test fails before it stops it.
struct NodeChild(std::process::Child);

impl NodeChild {
    fn id(&self) -> u32 {
        self.0.id()
    }

    fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        self.0.wait()
    }
}

impl Drop for NodeChild {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Starts `kvferry node --config cfg` and waits for its `listening <what>=ADDR` line.
fn start_node(cfg: &std::path::Path, what: &str) -> (NodeChild, String) {
    let (child, mut addrs) = start_node_serving(cfg, &[what]);
    (child, addrs.remove(0))
}

/// Starts `kvferry node --config cfg` and waits for a `listening <what>=ADDR` line of each
/// of `whats`; their addresses in that order.
fn start_node_serving(cfg: &std::path::Path, whats: &[&str]) -> (NodeChild, Vec<String>) {
    let mut child = NodeChild(
        kvferry()
            .args(["node", "--config", cfg.to_str().unwrap()])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let out = child.0.stdout.take().unwrap();
    let addrs = wait_listening(out, whats, Duration::from_secs(30))
        .unwrap_or_else(|seen| panic!("the node did not start serving all of {whats:?}: {seen}"));
    (child, addrs)
}

#[test]
fn node_with_a_cluster_serves_peers_and_stops_on_sigterm() {
    let dir = std::env::temp_dir().join(format!("kvferry-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("node.toml");
    std::fs::write(
        &cfg,
        format!(
            "node-id = \"a\"\n[pool]\nsize = \"8MiB\"\nslot-bytes = \"1MiB\"\n[device]\nkind = \"host\"\n\
             [cluster]\nprovider = \"shm\"\npeer-listen = \"127.0.0.1:0\"\nshm-dir = \"{}\"\ntoken = \"t\"\n",
            dir.display()
        ),
    )
    .unwrap();
    let (mut child, addr) = start_node(&cfg, "peer");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        use kvferry_actors::peer::client::PeerInfo;
        use kvferry_actors::peer::PeerClient;
        let client = PeerClient::connect(addr.clone(), "t").await.unwrap();
        let info = client
            .hello(PeerInfo::local("probe", &[], &[]))
            .await
            .unwrap();
        assert_eq!(info.node_id, "a");
        assert!(info.providers.iter().any(|p| p == "shm"), "{info:?}");
        let bad = PeerClient::connect(addr, "wrong").await.unwrap();
        assert!(bad.hello(PeerInfo::local("probe", &[], &[])).await.is_err());
    });
    // SIGTERM: the node stops accepting, shuts down and exits 0; its socket is gone.
    // SAFETY: signalling our own child process by its pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert!(!dir.join("a.sock").exists(), "shm socket left behind");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn node_with_an_engine_section_serves_engines_and_stops_on_sigterm() {
    let dir = std::env::temp_dir().join(format!("kvferry-cli-engine-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("node.toml");
    std::fs::write(
        &cfg,
        format!(
            "node-id = \"e\"\n[pool]\nsize = \"8MiB\"\nslot-bytes = \"1MiB\"\n[device]\nkind = \"host\"\n\
             [engine]\nlisten = \"127.0.0.1:0\"\nfd-dir = \"{}\"\ntoken = \"t\"\n",
            dir.display()
        ),
    )
    .unwrap();
    let (mut child, addr) = start_node(&cfg, "engine");
    let sock = dir.join("e.engine.sock");
    {
        use std::os::unix::fs::{FileTypeExt, PermissionsExt};
        let meta = std::fs::metadata(&sock).unwrap();
        assert!(meta.file_type().is_socket());
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        use kvferry_actors::service::Code;
        use kvferry_client::EngineClient;
        let client = EngineClient::connect(addr.clone(), Some(sock.clone()), "t")
            .await
            .unwrap();
        let caps = client.capabilities().await.unwrap();
        assert_eq!(caps.node_id, "e");
        assert_eq!(caps.fd_socket, sock.display().to_string());
        assert_eq!(client.stats().await.unwrap().instances, 0);
        let bad = EngineClient::connect(addr, None, "wrong").await.unwrap();
        assert_eq!(
            bad.health().await.unwrap_err().code(),
            Some(Code::Unauthenticated)
        );
    });
    // The client process's connections go away with its runtime.
    drop(rt);
    // SAFETY: signalling our own child process by its pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert!(!sock.exists(), "engine fd socket left behind");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_configs_are_refused_naming_the_key() {
    let dir = std::env::temp_dir().join(format!("kvferry-cli-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (text, needle) in [
        ("node-id = \"a\"\n[pool]\nslots = 3\n", "line 3"),
        ("[cluster]\nprovider = \"verbs\"\n", "cluster.provider"),
        ("[lease]\nttl-secs = 0\n", "lease.ttl-secs"),
        ("[engine]\nlisten = \"x\"\n", "engine.listen"),
        // Issue 15: what used to pass and then panicked or failed at start.
        ("[lease]\nttl-secs = 9223372036854775807\n", "lease.ttl-secs"),
        (
            "[lease]\npeer-pin-ttl-secs = 9223372036854775807\n",
            "lease.peer-pin-ttl-secs",
        ),
        (
            "[engine]\nhandle-ttl-secs = 9223372036854775807\n",
            "engine.handle-ttl-secs",
        ),
        ("[pool]\nsize = 9223372036854775807\n", "pool.size"),
        ("[pool]\nsize = \"1048576TiB\"\n", "pool.size"),
        ("[cluster]\ndirectory = \"redis://\"\n", "cluster.directory"),
        ("[cluster]\ntoken = \"two words\"\n", "cluster.token"),
        (
            "[engine]\nfd-dir = \"/tmp/0123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890123456789\"\n",
            "engine.fd-dir",
        ),
        (
            "[cluster]\npeer-listen = \"127.0.0.1:7100\"\n[[cluster.peers]]\nnode-id = \"b\"\naddress = \"127.0.0.1:7100\"\n",
            "own cluster.peer-listen",
        ),
        (
            "[cluster]\n[[cluster.peers]]\nnode-id = \"b\"\naddress = \"127.0.0.1:7101\"\n\
             [[cluster.peers]]\nnode-id = \"c\"\naddress = \"127.0.0.1:7101\"\n",
            "b and c have one address",
        ),
        (
            "[[nic]]\nname = \"n0\"\nprovider = \"udp\"\n",
            "expected loopback, tcp, shm or verbs",
        ),
        ("node-id = \"a/b\"\n", "node-id"),
        (
            "[engine]\nlisten = \"127.0.0.1:7200\"\n[cluster]\npeer-listen = \"0.0.0.0:7200\"\n",
            "cluster.peer-listen",
        ),
        ("[pool]\nsize = true\n", "expected a size like \"64MiB\" or a number of bytes"),
        // Issue 29: reachable from other hosts with nothing authenticating the callers.
        ("[engine]\nlisten = \"0.0.0.0:7200\"\n", "config key engine.listen:"),
        ("[cluster]\npeer-listen = \"0.0.0.0:7100\"\n", "config key cluster.peer-listen:"),
        ("[tls]\ncert = \"/nonexistent/a.pem\"\nkey = \"/k\"\nca = \"/c\"\n", "config key tls.cert:"),
    ] {
        let cfg = dir.join("bad.toml");
        std::fs::write(&cfg, text).unwrap();
        let out = kvferry()
            .args(["node", "--config", cfg.to_str().unwrap(), "--check-config"])
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{needle}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sample_configs_pass_check_config() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../config");
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let out = kvferry()
                .args(["node", "--config", path.to_str().unwrap(), "--check-config"])
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

/// GETs `path` from an HTTP/1.1 server; returns the status line and the body.
fn http_get(addr: &str, path: &str) -> (String, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_owned(), body.to_owned())
}

#[test]
fn metrics_and_health_are_served_and_pass_promtool() {
    let dir = std::env::temp_dir().join(format!("kvferry-cli-metrics-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("node.toml");
    std::fs::write(
        &cfg,
        format!(
            "node-id = \"m\"\n[pool]\nsize = \"8MiB\"\nslot-bytes = \"1MiB\"\n[device]\n\
             kind = \"host\"\n[metrics]\nlisten = \"127.0.0.1:0\"\n[engine]\n\
             listen = \"127.0.0.1:0\"\nfd-dir = \"{}\"\n",
            dir.display()
        ),
    )
    .unwrap();
    let (mut child, addr) = start_node(&cfg, "metrics");
    let (status, body) = http_get(&addr, "/health");
    assert!(status.contains("200"), "{status}");
    assert_eq!(body, "ok\n");
    let (status, body) = http_get(&addr, "/metrics");
    assert!(status.contains("200"), "{status}");
    for name in [
        "kvferry_leases_live 0",
        "kvferry_transfers_in_flight 0",
        "kvferry_pinned_blocks 0",
        "kvferry_pool_slots 8",
        "kvferry_engine_sessions 0",
        "kvferry_engine_memory_handles 0",
        "kvferry_engine_completions_dropped_total 0",
    ] {
        assert!(body.lines().any(|l| l == name), "{name} missing:\n{body}");
    }
    let (status, _) = http_get(&addr, "/nope");
    assert!(status.contains("404"), "{status}");
    promtool_check(&body);
    // SAFETY: signalling our own child process by its pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    let _ = std::fs::remove_dir_all(&dir);
}

/// GETs `path` over TLS from a server whose certificate `ca_pem` signed for `name`.
fn https_get(addr: &str, ca_pem: &Path, name: &str, path: &str) -> std::io::Result<String> {
    use rustls::pki_types::pem::PemObject;
    use std::io::{Read, Write};
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::CertificateDer::pem_file_iter(ca_pem).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let conn = rustls::ClientConnection::new(
        std::sync::Arc::new(config),
        name.to_owned().try_into().unwrap(),
    )
    .unwrap();
    let mut tls = rustls::StreamOwned::new(conn, std::net::TcpStream::connect(addr)?);
    write!(
        tls,
        "GET {path} HTTP/1.1\r\nHost: {name}\r\nConnection: close\r\n\r\n"
    )?;
    let mut text = String::new();
    match tls.read_to_string(&mut text) {
        Ok(_) => Ok(text),
        // The server closed without close_notify after a complete answer: take it.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !text.is_empty() => Ok(text),
        Err(e) => Err(e),
    }
}

/// `[tls]` with "metrics": /metrics over TLS (the lab certificate of `config/tls-lab`); a
/// plaintext GET gets no answer and is counted as a failed handshake on that listener.
#[test]
fn metrics_over_tls() {
    let dir = std::env::temp_dir().join(format!("kvferry-cli-metrics-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let lab = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../config/tls-lab"));
    let cfg = dir.join("node.toml");
    std::fs::write(
        &cfg,
        format!(
            "node-id = \"a\"\n[pool]\nsize = \"8MiB\"\nslot-bytes = \"1MiB\"\n[device]\n\
             kind = \"host\"\n[metrics]\nlisten = \"127.0.0.1:0\"\n\
             [tls]\ncert = \"{l}/a.pem\"\nkey = \"{l}/a.key\"\nca = \"{l}/ca.pem\"\n\
             listeners = [\"metrics\"]\n",
            l = lab.display()
        ),
    )
    .unwrap();
    let (mut child, addr) = start_node(&cfg, "metrics");
    let ca = lab.join("ca.pem");
    let health = https_get(&addr, &ca, "a", "/health").unwrap();
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    // Plaintext: the server reads no TLS record and closes the connection.
    {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n")
            .unwrap();
        let mut back = Vec::new();
        let _ = s.read_to_end(&mut back);
        assert!(!String::from_utf8_lossy(&back).contains("HTTP/1.1 200"));
    }
    let mut seen = String::new();
    for _ in 0..100 {
        seen = https_get(&addr, &ca, "a", "/metrics").unwrap();
        if seen.contains("kvferry_tls_handshake_failures_total{listener=\"metrics\"} 1") {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(
        seen.contains("kvferry_tls_handshake_failures_total{listener=\"metrics\"} 1"),
        "{seen}"
    );
    assert!(
        seen.contains("kvferry_tls_reloads_total{result=\"failed\"} 0"),
        "{seen}"
    );
    // SAFETY: signalling our own child process by its pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A SIGTERM that arrives as soon as the node announces itself stops it cleanly: the signal
/// handlers are in place before the first `listening` line (they were installed later, and
/// the default action then ended the process with status 15, about two times in three).
#[test]
fn sigterm_right_after_the_first_listening_line_stops_cleanly() {
    let dir = std::env::temp_dir().join(format!("kvferry-cli-term-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("node.toml");
    std::fs::write(
        &cfg,
        format!(
            "node-id = \"t\"\n[pool]\nsize = \"8MiB\"\nslot-bytes = \"1MiB\"\n[device]\n\
             kind = \"host\"\n[metrics]\nlisten = \"127.0.0.1:0\"\n[engine]\n\
             listen = \"127.0.0.1:0\"\nfd-dir = \"{}\"\n",
            dir.display()
        ),
    )
    .unwrap();
    for round in 0..10 {
        // "engine" is the first line the node prints.
        let (mut child, _) = start_node(&cfg, "engine");
        // SAFETY: signalling our own child process by its pid.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let status = child.wait().unwrap();
        assert!(status.success(), "round {round}: {status}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A cluster node (shm, no peers) over the Redis directory on `port`, with short directory
/// deadlines, metrics and an engine service.
fn redis_node_config(dir: &std::path::Path, id: &str, port: u16) -> std::path::PathBuf {
    let cfg = dir.join(format!("{id}.toml"));
    std::fs::write(
        &cfg,
        format!(
            "node-id = \"{id}\"\n[pool]\nsize = \"8MiB\"\nslot-bytes = \"1MiB\"\n[device]\n\
             kind = \"host\"\n[metrics]\nlisten = \"127.0.0.1:0\"\n[engine]\n\
             listen = \"127.0.0.1:0\"\nfd-dir = \"{d}\"\n[cluster]\nprovider = \"shm\"\n\
             peer-listen = \"127.0.0.1:0\"\nshm-dir = \"{d}/shm\"\n\
             directory = \"redis://127.0.0.1:{port}\"\n[directory]\nlookup-timeout-ms = 200\n\
             write-timeout-ms = 300\nprobe-interval-ms = 100\n",
            d = dir.display()
        ),
    )
    .unwrap();
    cfg
}

/// Scrapes `/metrics` until `line` is in it, each scrape answering within a second; the
/// last scrape.
fn scrape_until(addr: &str, line: &str, within: Duration) -> String {
    let t = std::time::Instant::now();
    loop {
        let s = std::time::Instant::now();
        let (status, body) = http_get(addr, "/metrics");
        assert!(
            s.elapsed() < Duration::from_secs(1),
            "a scrape took {:?}",
            s.elapsed()
        );
        assert!(status.contains("200"), "{status}");
        if body.lines().any(|l| l == line) {
            return body;
        }
        assert!(
            t.elapsed() < within,
            "no {line:?} within {within:?}:\n{body}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Redis hung with SIGSTOP under a running node process: Health and scrapes answer at
/// once, the scrape shows the breaker open (and passes promtool), and the breaker closes
/// once Redis answers again; SIGTERM still stops the node promptly.
#[test]
fn a_hung_redis_directory_does_not_stall_a_node_process() {
    let dir = std::env::temp_dir().join(format!("kvferry-cli-redis-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut redis = RedisServer::start();
    let cfg = redis_node_config(&dir, "r", redis.port());
    let (mut child, addrs) = start_node_serving(&cfg, &["metrics", "engine", "peer"]);
    let (metrics, engine) = (&addrs[0], &addrs[1]);
    let body = scrape_until(
        metrics,
        "kvferry_directory_breaker_open 0",
        Duration::from_secs(5),
    );
    promtool_check(&body);

    redis.hang();
    let body = scrape_until(
        metrics,
        "kvferry_directory_breaker_open 1",
        Duration::from_secs(5),
    );
    promtool_check(&body);
    assert!(
        body.lines().any(
            |l| l.starts_with("kvferry_directory_failures_total{op=\"probe\"} ")
                && !l.ends_with(" 0")
        ),
        "{body}"
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let client = kvferry_client::EngineClient::connect(engine.clone(), None, "")
            .await
            .unwrap();
        for _ in 0..5 {
            let t = std::time::Instant::now();
            assert_eq!(client.health().await.unwrap().node_id, "r");
            client.stats().await.unwrap();
            assert!(
                t.elapsed() < Duration::from_millis(500),
                "{:?}",
                t.elapsed()
            );
        }
    });
    drop(rt);
    let (status, _) = http_get(metrics, "/health");
    assert!(status.contains("200"), "{status}");

    redis.resume();
    scrape_until(
        metrics,
        "kvferry_directory_breaker_open 0",
        Duration::from_secs(5),
    );
    let t = std::time::Instant::now();
    // SAFETY: signalling our own child process by its pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Redis may come up after the nodes: a node starts without it and uses it once it
/// answers.
#[test]
fn a_node_starts_while_its_redis_directory_is_down() {
    let dir = std::env::temp_dir().join(format!("kvferry-cli-redis-down-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let port = free_port();
    let cfg = redis_node_config(&dir, "d", port);
    let (mut child, addrs) = start_node_serving(&cfg, &["metrics", "peer"]);
    scrape_until(
        &addrs[0],
        "kvferry_directory_breaker_open 1",
        Duration::from_secs(5),
    );
    let _redis = RedisServer::start_on(port).expect("redis-server on the node's port");
    scrape_until(
        &addrs[0],
        "kvferry_directory_breaker_open 0",
        Duration::from_secs(5),
    );
    // SAFETY: signalling our own child process by its pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Starts a node whose stderr is read line by line; its lines come on the receiver.
fn start_node_reading_stderr(
    cfg: &std::path::Path,
    env: &[(&str, &str)],
) -> (NodeChild, std::sync::mpsc::Receiver<String>) {
    let mut child = NodeChild(
        kvferry()
            .args(["node", "--config", cfg.to_str().unwrap()])
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let err = child.0.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    (child, rx)
}

/// Waits for a line containing `needle`; every line read so far.
fn wait_for_line(rx: &std::sync::mpsc::Receiver<String>, needle: &str, seen: &mut Vec<String>) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !seen.iter().any(|l| l.contains(needle)) {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => seen.push(line),
            Err(_) => panic!("no line with {needle:?}: {seen:#?}"),
        }
    }
}

fn standalone_config(dir: &std::path::Path, id: &str, cluster: bool) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let cfg = dir.join("node.toml");
    let mut text = format!(
        "node-id = \"{id}\"\n[pool]\nsize = \"8MiB\"\nslot-bytes = \"1MiB\"\n[device]\n\
         kind = \"host\"\n[engine]\nlisten = \"127.0.0.1:0\"\nfd-dir = \"{}\"\n",
        dir.display()
    );
    if cluster {
        text.push_str("[cluster]\nprovider = \"tcp\"\npeer-listen = \"127.0.0.1:0\"\n");
    }
    std::fs::write(&cfg, text).unwrap();
    cfg
}

/// What a supervisor and an operator grep for: one `started` line once the node serves, one
/// `stopped` line as the last word of a clean stop (status 0), for a node on its own and
/// one in a cluster.
#[test]
fn start_up_and_shutdown_lines_are_greppable() {
    for cluster in [false, true] {
        let dir = std::env::temp_dir().join(format!(
            "kvferry-cli-lines-{}-{cluster}",
            std::process::id()
        ));
        let cfg = standalone_config(&dir, "g", cluster);
        let (mut child, rx) = start_node_reading_stderr(&cfg, &[]);
        let mut seen = Vec::new();
        wait_for_line(&rx, "kvferry node g: started", &mut seen);
        let started = seen
            .iter()
            .find(|l| l.starts_with("kvferry node g: started (pid "))
            .unwrap();
        assert!(
            started.contains(&format!("pid {}", child.id())),
            "{started}"
        );
        // SAFETY: signalling our own child process by its pid.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let status = child.wait().unwrap();
        seen.extend(rx.iter());
        assert!(status.success(), "{status:?}: {seen:#?}");
        assert!(
            seen.iter()
                .any(|l| l == "kvferry node g: stopping on SIGTERM"),
            "{seen:#?}"
        );
        assert_eq!(
            seen.last().map(String::as_str),
            Some("kvferry node g: stopped"),
            "{seen:#?}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Crash-only (issue 15): a panic on the actor thread used to leave a process that answered
/// UNAVAILABLE forever; it now prints the panic and exits with status 101 at once, for a
/// node on its own and one in a cluster.
#[test]
fn a_panicking_actor_ends_the_node_process_with_status_101() {
    for cluster in [false, true] {
        let dir = std::env::temp_dir().join(format!(
            "kvferry-cli-panic-{}-{cluster}",
            std::process::id()
        ));
        let cfg = standalone_config(&dir, "p", cluster);
        let (mut child, rx) =
            start_node_reading_stderr(&cfg, &[("KVFERRY_TEST_CRASH", "actor-panic")]);
        let t0 = std::time::Instant::now();
        let status = loop {
            if let Some(s) = child.0.try_wait().unwrap() {
                break s;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "still running: a zombie"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let lines: Vec<String> = rx.iter().collect();
        assert_eq!(status.code(), Some(101), "{status:?}: {lines:#?}");
        assert!(
            lines.iter().any(|l| l.contains("kvferry node p: started")),
            "{lines:#?}"
        );
        assert!(
            lines
                .iter()
                .any(|l| l.contains("KVFERRY_TEST_CRASH=actor-panic")),
            "the panic message is printed: {lines:#?}"
        );
        assert!(!lines.iter().any(|l| l.contains(": stopped")), "{lines:#?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// `[log] format = "json"`: every stderr line is one JSON object, the lifecycle lines among
/// them with their usual text as the message (and written whatever the level); the start-up
/// summary carries the effective config; `RUST_LOG` takes the place of `[log] level`.
#[test]
fn json_logs_keep_the_lifecycle_lines_and_rust_log_sets_the_level() {
    for rust_log in [None, Some("warn")] {
        let dir = std::env::temp_dir().join(format!(
            "kvferry-cli-json-{}-{}",
            std::process::id(),
            rust_log.is_some()
        ));
        let cfg = standalone_config(&dir, "j", true);
        let mut text = std::fs::read_to_string(&cfg).unwrap();
        text.push_str("[log]\nlevel = \"info\"\nformat = \"json\"\n");
        std::fs::write(&cfg, text).unwrap();
        let env: Vec<(&str, &str)> = rust_log.iter().map(|l| ("RUST_LOG", *l)).collect();
        let (mut child, rx) = start_node_reading_stderr(&cfg, &env);
        let mut seen = Vec::new();
        wait_for_line(&rx, "kvferry node j: started (pid ", &mut seen);
        // SAFETY: signalling our own child process by its pid.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let status = child.wait().unwrap();
        seen.extend(rx.iter());
        assert!(status.success(), "{status:?}: {seen:#?}");
        let events: Vec<serde_json::Value> = seen
            .iter()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
            .collect();
        let message = |e: &serde_json::Value| e["message"].as_str().unwrap_or("").to_owned();
        assert_eq!(
            events.last().map(message).as_deref(),
            Some("kvferry node j: stopped"),
            "{seen:#?}"
        );
        assert!(
            events
                .iter()
                .any(|e| message(e) == "kvferry node j: stopping on SIGTERM"),
            "{seen:#?}"
        );
        let summary = events
            .iter()
            .find(|e| message(e) == "starting with this config");
        match rust_log {
            None => {
                let s = summary.unwrap_or_else(|| panic!("no summary: {seen:#?}"));
                assert_eq!(s["node"], "j", "{s}");
                assert_eq!(s["provider"], "tcp", "{s}");
                assert_eq!(s["log_format"], "json", "{s}");
            }
            Some(_) => assert!(summary.is_none(), "RUST_LOG=warn hides info: {seen:#?}"),
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A `[log] level` that is not a level is refused by `--check-config`, naming the key; a
/// bad `RUST_LOG` stops the node at start with status 1.
#[test]
fn bad_log_levels_are_refused() {
    let dir = std::env::temp_dir().join(format!("kvferry-cli-loglevel-{}", std::process::id()));
    let cfg = standalone_config(&dir, "l", false);
    let good = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, format!("{good}[log]\nlevel = \"wran\"\n")).unwrap();
    let out = kvferry()
        .args(["node", "--config", cfg.to_str().unwrap(), "--check-config"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("log.level") && err.contains("wran"), "{err}");
    std::fs::write(&cfg, good).unwrap();
    let out = kvferry()
        .args(["node", "--config", cfg.to_str().unwrap()])
        .env("RUST_LOG", "kvferry=loud")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("RUST_LOG"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A peer that is down fails every query that names it (a static directory names every
/// peer): the node writes one `peer link failed` warning, not one per query, and counts the
/// rest in the next one's `held_back`.
#[test]
fn a_peer_that_is_down_is_logged_once_not_once_per_query() {
    let dir = std::env::temp_dir().join(format!("kvferry-cli-gone-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (engine, gone) = (free_port(), free_port());
    let cfg = dir.join("node.toml");
    std::fs::write(
        &cfg,
        format!(
            "node-id = \"w\"\n[pool]\nsize = \"8MiB\"\nslot-bytes = \"1MiB\"\n[device]\n\
             kind = \"host\"\n[engine]\nlisten = \"127.0.0.1:{engine}\"\nfd-dir = \"{}\"\n\
             [cluster]\nprovider = \"tcp\"\npeer-listen = \"127.0.0.1:0\"\n\
             peers = [{{ node-id = \"gone\", address = \"127.0.0.1:{gone}\" }}]\n",
            dir.display()
        ),
    )
    .unwrap();
    let (mut child, rx) = start_node_reading_stderr(&cfg, &[]);
    let mut seen = Vec::new();
    wait_for_line(&rx, "kvferry node w: started", &mut seen);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let shape = kvferry_gpu::KvShape::new(2, 1, 2, 4 << 10).unwrap();
        let e = kvferry_testkit::Attached::connect(
            &format!("127.0.0.1:{engine}"),
            "",
            shape,
            8,
            "eng",
            "m",
        )
        .await
        .unwrap();
        for i in 0..5 {
            let hashes = [kvferry_actors::BlockHash::from_u64(i)];
            // Answered from local blocks (none) or refused: either way it asked for `gone`.
            let _ = e.client.query(&e.instance, &hashes, false).await;
        }
    });
    drop(rt);
    // SAFETY: signalling our own child process by its pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    seen.extend(rx.iter());
    let failed: Vec<&String> = seen
        .iter()
        .filter(|l| l.contains("peer link failed"))
        .collect();
    assert_eq!(failed.len(), 1, "{seen:#?}");
    assert!(
        failed[0].contains("WARN") && failed[0].contains("peer=\"gone\""),
        "{seen:#?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `kvferry bench engine` end to end on the host device with a small KV: the node in its own
/// process, every figure present, the bytes checked, one progress line per size; a copy path
/// the node does not know ends the run with the key named.
#[test]
fn bench_engine_measures_verifies_and_reports_progress() {
    let out = kvferry()
        .args(["bench", "engine", "--device", "host", "--blocks", "1,4"])
        .args([
            "--iters",
            "1",
            "--layers",
            "2",
            "--segment-kib",
            "4",
            "--json",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["verified"], true, "{v}");
    assert_eq!(v["copy_path"], "auto", "{v}");
    let sweep = v["sweep"].as_array().unwrap();
    assert_eq!(sweep.len(), 2, "{v}");
    for (row, n) in sweep.iter().zip([1, 4]) {
        assert_eq!(row["blocks"], n, "{row}");
        assert_eq!(row["bytes"], n * 2 * 2 * 4096, "{row}");
        for key in [
            "query_ms",
            "load_ms",
            "load_node_ms",
            "save_ms",
            "raw_ms",
            "duplex_ms",
        ] {
            assert!(row[key].as_f64().is_some_and(|x| x > 0.0), "{key}: {row}");
        }
        // The node's own time is part of what the client waited for.
        assert!(
            row["load_node_ms"].as_f64() <= row["load_ms"].as_f64(),
            "{row}"
        );
        assert!(row["load_stages_ms"]["h2d"].as_f64().is_some(), "{row}");
        assert_eq!(row["verified"], true, "{row}");
    }
    for n in [1, 4] {
        let line = format!("kvferry bench engine: {n} blocks: query ");
        assert!(
            err.contains(&line),
            "no progress line for {n} blocks: {err}"
        );
    }

    let out = kvferry()
        .args(["bench", "engine", "--device", "host", "--blocks", "1"])
        .args(["--iters", "1", "--layers", "2", "--segment-kib", "4"])
        .args(["--copy-path", "dma"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("device.copy-path") && err.contains("\"dma\""),
        "{err}"
    );
}

/// `kvferry bench remote --provider tcp --tls`: a pair of nodes in clear and a pair over
/// mutual TLS measured in the same run, both paths on each, every byte checked, and the
/// ratio TLS/plain reported; `--tls` where it cannot apply is refused, naming it.
#[test]
fn bench_remote_over_tcp_in_clear_and_over_tls_in_one_run() {
    let out = kvferry()
        .args([
            "bench",
            "remote",
            "--device",
            "host",
            "--provider",
            "tcp",
            "--tls",
        ])
        .args(["--blocks", "2", "--iters", "1", "--json"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["verified"], true, "{v}");
    for side in ["plain", "tls"] {
        assert_eq!(v[side]["verified"], true, "{side}: {v}");
        for path in ["direct", "staged"] {
            let gbps = v[side][path]["gbps"].as_f64();
            assert!(gbps.is_some_and(|g| g > 0.0), "{side} {path}: {v}");
        }
    }
    // The plain figures are the run's main ones, as without --tls.
    assert_eq!(v["direct"], v["plain"]["direct"], "{v}");
    for path in ["direct", "staged"] {
        let r = v["tls_vs_plain"][path].as_f64().unwrap();
        let want =
            v["tls"][path]["gbps"].as_f64().unwrap() / v["plain"][path]["gbps"].as_f64().unwrap();
        assert!(
            r > 0.0 && (r - want).abs() < 1e-9 * want.max(1.0),
            "{path}: {v}"
        );
    }
    let row = &v["sweep"][0];
    assert_eq!(row["blocks"], 2, "{v}");
    assert!(
        row["tls_direct_gbps"].as_f64().is_some_and(|g| g > 0.0),
        "{v}"
    );

    for refused in [
        &["--provider", "shm"][..],
        &["--provider", "tcp", "--owner-process"],
    ] {
        let out = kvferry()
            .args(["bench", "remote", "--device", "host", "--tls"])
            .args(refused)
            .args(["--blocks", "2", "--iters", "1"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{refused:?}: {err}");
        assert!(err.contains("--tls"), "{refused:?}: {err}");
    }
}
