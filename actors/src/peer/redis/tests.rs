//! Against real `redis-server` processes ([`super::test_server`]).

use std::future::Future;
use std::thread;
use std::time::{Duration, Instant};

use super::keys::block_key;
use super::test_server::{free_port, RedisServer};
use super::*;
use crate::model::{BlockHash, Namespace};
use crate::peer::breaker::BreakerState;
use crate::peer::directory::{Directory, EmbeddedDirectory, Segment};

/// Short deadlines; no periodic reconcile within a test, so that what a test sees
/// found again was re-announced (the periodic one has a test of its own).
fn quick() -> RedisOptions {
    RedisOptions {
        connect_timeout: Duration::from_millis(500),
        lookup_timeout: Duration::from_millis(200),
        write_timeout: Duration::from_millis(500),
        breaker_failures: 3,
        probe_interval: Duration::from_millis(100),
        reconcile_interval: Duration::from_secs(600),
    }
}

/// Within how long a directory back from an outage has re-announced everything: a
/// probe, then one round.
fn recovery(o: &RedisOptions) -> Duration {
    o.probe_interval * 2 + o.write_timeout * 2 + Duration::from_millis(500)
}

fn ns(fp: &str) -> Namespace {
    Namespace::new("m", "bf16", fp).unwrap()
}

fn hashes(n: u64) -> Vec<BlockHash> {
    (0..n).map(BlockHash::from_u64).collect()
}

fn seg(start: usize, len: usize, owners: &[&str]) -> Segment {
    Segment {
        start,
        len,
        owners: owners.iter().map(|o| o.to_string()).collect(),
    }
}

fn block_on<F: Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

/// Writes what is queued, then looks up.
fn lookup(d: &RedisDirectory, space: &Namespace, h: &[BlockHash], me: &str) -> Vec<Segment> {
    block_on(async {
        d.flush().await;
        d.lookup(space, h, me).await
    })
}

fn owners(d: &RedisDirectory, space: &Namespace, h: &[BlockHash], me: &str) -> Vec<Vec<String>> {
    block_on(async {
        d.flush().await;
        d.owners(space, h, me).await
    })
}

/// Polls `f` until it holds, for at most `within`; the time it took.
fn eventually(within: Duration, what: &str, mut f: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < within, "{what}: not within {within:?}");
        thread::sleep(Duration::from_millis(20));
    }
    t.elapsed()
}

#[test]
fn segments_across_three_nodes() {
    let server = RedisServer::start();
    let d = RedisDirectory::connect_with(&server.addr(), "kvf", quick()).unwrap();
    let h = hashes(12);
    d.publish("b", &ns("x"), &h[0..4]);
    d.publish("a", &ns("x"), &h[4..8]);
    d.publish("c", &ns("x"), &h[8..12]);
    assert_eq!(
        lookup(&d, &ns("x"), &h[4..], "b"),
        vec![seg(0, 4, &["a"]), seg(4, 4, &["c"])]
    );
    // Shared blocks list every holder, sorted, and keep the run with the common owner.
    d.publish("c", &ns("x"), &h[6..8]);
    d.publish("a", &ns("x"), &h[6..8]); // twice is once
    assert_eq!(
        owners(&d, &ns("x"), &h[5..9], "b"),
        vec![vec!["a"], vec!["a", "c"], vec!["a", "c"], vec!["c"]]
    );
    assert_eq!(
        lookup(&d, &ns("x"), &h[4..], "b"),
        vec![seg(0, 4, &["a"]), seg(4, 4, &["c"])]
    );
    // A node never lists itself.
    assert!(lookup(&d, &ns("x"), &h[0..4], "b").is_empty());
    assert_eq!(lookup(&d, &ns("x"), &h[0..4], "a"), vec![seg(0, 4, &["b"])]);
    assert_eq!(owners(&d, &ns("x"), &h[6..7], "a"), vec![vec!["c"]]);
    let s = d.stats();
    assert_eq!((s.publishes, s.entries), (16, 14));
    assert_eq!(server.entries("kvf"), 12);
    assert_eq!(d.errors(), 0, "{:?}", d.last_error());
    assert_eq!(d.breaker(), BreakerState::Closed);
}

#[test]
fn withdraw_and_withdraw_node() {
    let server = RedisServer::start();
    let d = RedisDirectory::connect_with(&server.addr(), "kvf", quick()).unwrap();
    let h = hashes(12);
    d.publish("b", &ns("x"), &h[0..4]);
    d.publish("a", &ns("x"), &h[4..8]);
    d.publish("c", &ns("x"), &h[8..12]);
    d.publish("c", &ns("x"), &h[6..8]);
    // A hole ends the lookup.
    d.withdraw("a", &ns("x"), &h[5..6]);
    assert_eq!(lookup(&d, &ns("x"), &h[4..], "b"), vec![seg(0, 1, &["a"])]);
    assert_eq!(server.entries("kvf"), 11);
    // Withdrawing what a node does not hold changes nothing.
    d.withdraw("b", &ns("x"), &h[8..12]);
    assert_eq!(owners(&d, &ns("x"), &h[8..9], ""), vec![vec!["c"]]);

    d.withdraw_node("c");
    block_on(d.flush());
    assert_eq!(server.entries("kvf"), 7, "as the embedded directory");
    assert_eq!(
        owners(&d, &ns("x"), &h[6..10], "b"),
        vec![vec!["a"], vec!["a"], vec![], vec![]]
    );
    // The node's own index is gone too, and a second withdraw_node is a no-op.
    let exists: i64 = redis::cmd("EXISTS")
        .arg("kvf:node:c")
        .query(&mut server.conn())
        .unwrap();
    assert_eq!(exists, 0);
    d.withdraw_node("c");
    d.withdraw_node("never-seen");
    // A node that rejoins publishes afresh.
    d.publish("c", &ns("x"), &h[8..9]);
    assert_eq!(owners(&d, &ns("x"), &h[8..9], "b"), vec![vec!["c"]]);
    assert_eq!(d.errors(), 0, "{:?}", d.last_error());
}

#[test]
fn namespaces_and_prefixes_do_not_mix() {
    let server = RedisServer::start();
    let d = RedisDirectory::connect_with(&server.addr(), "kvf", quick()).unwrap();
    let other = RedisDirectory::connect_with(&server.addr(), "kvf2", quick()).unwrap();
    let h = hashes(4);
    d.publish("a", &ns("x"), &h);
    d.publish("b", &ns("y"), &h[..2]);
    assert_eq!(lookup(&d, &ns("x"), &h, "z"), vec![seg(0, 4, &["a"])]);
    assert_eq!(lookup(&d, &ns("y"), &h, "z"), vec![seg(0, 2, &["b"])]);
    assert!(lookup(&d, &ns("w"), &h, "z").is_empty());
    assert!(lookup(&other, &ns("x"), &h, "z").is_empty());
    assert_eq!(server.entries("kvf2"), 0);
    d.withdraw_node("a");
    assert!(lookup(&d, &ns("x"), &h, "z").is_empty());
    assert_eq!(lookup(&d, &ns("y"), &h, "z"), vec![seg(0, 2, &["b"])]);
    // Hashes of different lengths are different blocks.
    let short = BlockHash::new(&[0, 0, 0, 0, 0, 0, 0]).unwrap();
    assert_eq!(
        owners(&d, &ns("y"), &[short], "z"),
        vec![Vec::<String>::new()]
    );
}

#[test]
fn matches_the_embedded_directory() {
    let server = RedisServer::start();
    let d = RedisDirectory::connect_with(&server.addr(), "kvf", quick()).unwrap();
    let e = EmbeddedDirectory::new();
    let nodes = ["a", "b", "c", "d"];
    let h = hashes(16);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..200 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let node = nodes[(x % 4) as usize];
        let lo = ((x >> 8) % 16) as usize;
        let hi = lo + ((x >> 16) % (17 - lo as u64)) as usize;
        let space = ns(if (x >> 24).is_multiple_of(3) {
            "y"
        } else {
            "x"
        });
        match (x >> 32) % 10 {
            0..=5 => {
                d.publish(node, &space, &h[lo..hi]);
                e.publish(node, &space, &h[lo..hi]);
            }
            6..=8 => {
                d.withdraw(node, &space, &h[lo..hi]);
                e.withdraw(node, &space, &h[lo..hi]);
            }
            _ => {
                d.withdraw_node(node);
                e.withdraw_node(node);
            }
        }
        let me = nodes[((x >> 40) % 4) as usize];
        let mut want = block_on(e.owners(&space, &h, me));
        want.iter_mut().for_each(|o| o.sort());
        assert_eq!(owners(&d, &space, &h, me), want);
    }
    assert_eq!(server.entries("kvf"), e.stats().entries);
    assert_eq!(d.errors(), 0, "{:?}", d.last_error());
}

#[test]
fn connect_fails_clearly_when_unreachable() {
    let port = free_port();
    let err = RedisDirectory::connect(&format!("redis://127.0.0.1:{port}"), "kvf").unwrap_err();
    assert!(matches!(err, RedisError::Connect { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains(&format!("cannot connect to redis at 127.0.0.1:{port}")),
        "{msg}"
    );
    assert!(matches!(
        RedisDirectory::connect("127.0.0.1:1", ""),
        Err(RedisError::EmptyPrefix)
    ));
}

/// `requirepass`, an ACL user and a database index, against a real server: each URL form
/// connects, AUTHs, SELECTs its database and finds what it published there; a missing or
/// wrong password fails at connect; no error and no address shown carries a password.
#[test]
fn a_password_an_acl_user_and_a_database_index_really_connect() {
    let server = RedisServer::start();
    let mut admin = server.conn();
    redis::cmd("ACL")
        .arg(&[
            "SETUSER",
            "kvuser",
            "on",
            ">user-secret",
            "~*",
            "&*",
            "+@all",
        ])
        .query::<()>(&mut admin)
        .unwrap();
    // The admin connection stays authenticated as the default user.
    redis::cmd("CONFIG")
        .arg(&["SET", "requirepass", "default-secret"])
        .query::<()>(&mut admin)
        .unwrap();
    let addr = server.addr();
    for (url, db) in [
        (format!("redis://:default-secret@{addr}/3"), 3),
        (format!("redis://kvuser:user-secret@{addr}/5"), 5),
        (format!("redis://default:default-secret@{addr}"), 0),
    ] {
        let d = RedisDirectory::connect_with(&url, "kvf", quick())
            .unwrap_or_else(|e| panic!("{}: {e}", redact_url(&url)));
        assert!(!d.addr().contains("secret"), "{}", d.addr());
        assert!(!format!("{d:?}").contains("secret"));
        let h = hashes(4);
        d.publish("a", &ns("x"), &h);
        assert_eq!(lookup(&d, &ns("x"), &h, "b"), vec![seg(0, 4, &["a"])]);
        assert_eq!(d.errors(), 0, "{:?}", d.last_error());
        // In its own database, and there only.
        redis::cmd("SELECT")
            .arg(db)
            .query::<()>(&mut admin)
            .unwrap();
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("kvf:blk:*")
            .query(&mut admin)
            .unwrap();
        assert_eq!(keys.len(), 4, "db {db}: {keys:?}");
        redis::cmd("FLUSHDB").query::<()>(&mut admin).unwrap();
    }
    for url in [
        addr.clone(),
        format!("redis://:wrong-secret@{addr}"),
        format!("redis://kvuser:wrong-secret@{addr}/5"),
    ] {
        let e = RedisDirectory::connect_with(&url, "kvf", quick()).unwrap_err();
        assert!(matches!(e, RedisError::Connect { .. }), "{e:?}");
        let (shown, debug) = (e.to_string(), format!("{e:?}"));
        assert!(shown.contains(&addr), "{shown}");
        assert!(
            !shown.contains("secret") && !debug.contains("secret"),
            "{debug}"
        );
    }
}

/// The config check and the node take the same URLs: every form either passes both or
/// fails both, with the same reason. (A bare `host[:port]`, which the library takes, is
/// refused by the check: a directory in a config is `static` or a URL.)
#[test]
fn the_config_check_and_the_node_agree_on_every_address() {
    for addr in ["h", "h:1", "[::1]:7000", "etcd"] {
        let text = format!("[cluster]\ndirectory = \"{addr}\"\n");
        let cfg: crate::NodeConfig = toml::from_str(&text).unwrap();
        let e = cfg.validate().unwrap_err().to_string();
        assert!(e.contains("is not static or redis://"), "{e}");
    }
    for addr in [
        "redis://h",
        "redis://[::1]:7000",
        "redis://h:1/0",
        "redis://h/3",
        "redis://:pw@h",
        "redis://u:pw@h:1/2",
        "redis://u@h",
        "rediss://u:pw@h",
        "unix:///tmp/r.sock",
        "redis://",
        "redis://h:1/x",
        "redis://h:1/-2",
        "redis://0.0.0.0:1",
    ] {
        let text = format!("[cluster]\ndirectory = \"{addr}\"\n");
        let cfg: crate::NodeConfig = toml::from_str(&text).unwrap();
        let check = cfg.validate().map_err(|e| e.to_string());
        let node = RedisDirectory::start(addr, "kvf", quick()).map_err(|e| e.to_string());
        match (&check, &node) {
            (Ok(()), Ok(_)) => {}
            (Err(c), Err(n)) => assert!(c.contains(n.as_str()), "{addr}: {c} / {n}"),
            _ => panic!(
                "{addr}: the check says {check:?}, the node {:?}",
                node.map(|_| ())
            ),
        }
        if let Err(e) = &check {
            assert!(!e.contains("pw@"), "{e}");
        }
    }
}

/// A hung server (SIGSTOP): lookups answer empty within the bound, then at once (the
/// breaker opened); publishes never wait; once it answers again, the breaker closes
/// and what was sealed meanwhile is found.
#[test]
fn a_hung_server_costs_a_lookup_at_most_the_bound() {
    let mut server = RedisServer::start();
    let o = quick();
    let d = RedisDirectory::connect_with(&server.addr(), "kvf", o.clone()).unwrap();
    let h = hashes(8);
    d.publish("a", &ns("x"), &h[..4]);
    assert_eq!(lookup(&d, &ns("x"), &h, "b"), vec![seg(0, 4, &["a"])]);

    server.stop();
    let slack = Duration::from_millis(150);
    let mut slowest = Duration::ZERO;
    for _ in 0..20 {
        let t = Instant::now();
        let owners = block_on(d.owners(&ns("x"), &h, "b"));
        slowest = slowest.max(t.elapsed());
        assert_eq!(owners, vec![Vec::<String>::new(); 8]);
        // Sealing and evicting never waits on the directory.
        let t = Instant::now();
        d.publish("a", &ns("x"), &h[4..8]);
        d.withdraw("a", &ns("x"), &h[..1]);
        d.publish("a", &ns("x"), &h[..1]);
        assert!(t.elapsed() < Duration::from_millis(20), "{:?}", t.elapsed());
    }
    assert!(
        slowest <= o.lookup_timeout + slack,
        "a lookup took {slowest:?}"
    );
    assert_eq!(d.breaker(), BreakerState::Open);
    let health = d.stats().health.unwrap();
    assert!(health.lookups_skipped >= 15, "{health:?}");
    assert!(
        health.trips >= 1
            && health.lookup_failures + health.write_failures + health.probe_failures >= 1
    );
    assert!(d.last_error().unwrap().contains(&server.addr()));
    // The flush of a hung directory is bounded too.
    let t = Instant::now();
    block_on(d.flush());
    assert!(t.elapsed() < o.write_timeout * 4 + o.lookup_timeout + slack);

    server.cont();
    let took = eventually(Duration::from_secs(5), "the breaker closes", || {
        d.breaker() == BreakerState::Closed
    });
    assert!(
        took <= o.probe_interval + o.write_timeout * 2 + slack * 4,
        "{took:?}"
    );
    // The blocks sealed during the hang are re-announced.
    eventually(recovery(&o), "blocks sealed while hung are found", || {
        block_on(d.lookup(&ns("x"), &h, "b")) == vec![seg(0, 8, &["a"])]
    });
    assert!(d.stats().health.unwrap().reannounces >= 1);
}

/// A server killed and restarted empty: every block is found again within the
/// reconcile interval, with what was sealed and evicted while it was down.
#[test]
fn a_server_restarted_empty_is_told_everything_again() {
    let mut server = RedisServer::start();
    let o = quick();
    let d = RedisDirectory::connect_with(&server.addr(), "kvf", o.clone()).unwrap();
    let h = hashes(12);
    d.publish("a", &ns("x"), &h[..4]);
    d.publish("c", &ns("x"), &h[4..8]);
    assert_eq!(
        lookup(&d, &ns("x"), &h, "b"),
        vec![seg(0, 4, &["a"]), seg(4, 4, &["c"])]
    );
    server.kill();
    // Down: lookups answer empty at once or within the bound, writes are queued.
    for _ in 0..5 {
        let t = Instant::now();
        assert!(block_on(d.lookup(&ns("x"), &h, "b")).is_empty());
        assert!(t.elapsed() <= o.lookup_timeout + Duration::from_millis(150));
    }
    d.publish("c", &ns("x"), &h[8..12]); // sealed during the outage
    d.withdraw("a", &ns("x"), &h[3..4]); // evicted during the outage
    eventually(Duration::from_secs(5), "the breaker opens", || {
        d.breaker() == BreakerState::Open
    });
    let server = server.restart();
    let took = eventually(recovery(&o), "all found again", || {
        block_on(d.lookup(&ns("x"), &h, "b")) == vec![seg(0, 3, &["a"])]
            && block_on(d.owners(&ns("x"), &h[3..12], "b"))
                == [
                    vec![],
                    vec!["c".to_string()],
                    vec!["c".into()],
                    vec!["c".into()],
                    vec!["c".into()],
                    vec!["c".into()],
                    vec!["c".into()],
                    vec!["c".into()],
                    vec!["c".into()],
                ]
    });
    assert_eq!(server.entries("kvf"), 11, "found again after {took:?}");
    assert_eq!(d.breaker(), BreakerState::Closed);
}

/// A restart between two heartbeats fails no call and opens no breaker; the new
/// `run_id` alone triggers the re-announce.
#[test]
fn a_quick_restart_is_noticed_by_its_run_id() {
    let o = quick();
    let server = RedisServer::start();
    let d = RedisDirectory::connect_with(&server.addr(), "kvf", o.clone()).unwrap();
    let h = hashes(4);
    d.publish("a", &ns("x"), &h);
    assert_eq!(lookup(&d, &ns("x"), &h, "b"), vec![seg(0, 4, &["a"])]);
    let server = server.restart();
    eventually(recovery(&o), "re-announced after a restart", || {
        block_on(d.lookup(&ns("x"), &h, "b")) == vec![seg(0, 4, &["a"])]
    });
    assert_eq!(server.entries("kvf"), 4);
    assert!(d.stats().health.unwrap().reannounces >= 1);
}

/// A server restarted with an older snapshot of its data: what was withdrawn since is
/// removed, what was published since is added.
#[test]
fn a_server_restarted_with_old_data_is_reconciled() {
    let dir = std::env::temp_dir().join(format!(
        "kvferry-redis-{}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let server = RedisServer::start_with(Some(dir.clone()));
    let o = quick();
    let d = RedisDirectory::connect_with(&server.addr(), "kvf", o.clone()).unwrap();
    let h = hashes(8);
    d.publish("a", &ns("x"), &h[..4]);
    block_on(d.flush());
    let _: String = redis::cmd("SAVE").query(&mut server.conn()).unwrap();
    d.withdraw("a", &ns("x"), &h[2..4]);
    d.publish("a", &ns("x"), &h[4..6]);
    assert_eq!(
        owners(&d, &ns("x"), &h[..6], "b")
            .iter()
            .filter(|o| !o.is_empty())
            .count(),
        4
    );
    let server = server.restart();
    eventually(recovery(&o), "reconciled after a restart with data", || {
        let got = block_on(d.owners(&ns("x"), &h, "b"));
        let holds: Vec<bool> = got.iter().map(|o| !o.is_empty()).collect();
        holds == [true, true, false, false, true, true, false, false]
    });
    assert_eq!(server.entries("kvf"), 4);
    let members: Vec<String> = redis::cmd("SMEMBERS")
        .arg("kvf:node:a")
        .query(&mut server.conn())
        .unwrap();
    assert_eq!(members.len(), 4, "{members:?}");
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Entries that a lost write left behind (here: written behind the directory's back)
/// are repaired by the periodic reconcile.
#[test]
fn the_periodic_reconcile_repairs_lost_writes() {
    let server = RedisServer::start();
    let o = RedisOptions {
        reconcile_interval: Duration::from_millis(500),
        ..quick()
    };
    let d = RedisDirectory::connect_with(&server.addr(), "kvf", o.clone()).unwrap();
    let h = hashes(4);
    d.publish("a", &ns("x"), &h[..2]);
    block_on(d.flush());
    let mut c = server.conn();
    // A lost publish and a lost withdraw.
    let k1 = block_key("kvf", &ns("x"), &h[1]);
    let k3 = block_key("kvf", &ns("x"), &h[3]);
    let _: () = redis::pipe()
        .cmd("SREM")
        .arg(&k1)
        .arg("a")
        .ignore()
        .cmd("SREM")
        .arg("kvf:node:a")
        .arg(&k1)
        .ignore()
        .cmd("SADD")
        .arg(&k3)
        .arg("a")
        .ignore()
        .cmd("SADD")
        .arg("kvf:node:a")
        .arg(&k3)
        .ignore()
        .query(&mut c)
        .unwrap();
    let took = eventually(o.reconcile_interval * 4, "reconciled", || {
        let holds: Vec<bool> = block_on(d.owners(&ns("x"), &h, "b"))
            .iter()
            .map(|o| !o.is_empty())
            .collect();
        holds == [true, true, false, false]
    });
    assert!(took <= o.reconcile_interval * 2, "{took:?}");
    assert_eq!(
        d.stats().health.unwrap().reannounces,
        0,
        "a diff, not a re-announce"
    );
}

#[test]
fn a_directory_started_while_the_server_is_down_catches_up() {
    let port = free_port();
    let o = quick();
    let d = RedisDirectory::start(&format!("127.0.0.1:{port}"), "kvf", o.clone()).unwrap();
    let h = hashes(4);
    d.publish("a", &ns("x"), &h);
    eventually(Duration::from_secs(5), "the breaker opens", || {
        d.breaker() == BreakerState::Open
    });
    assert!(block_on(d.lookup(&ns("x"), &h, "b")).is_empty());
    let _server = RedisServer::start_on(port, None).expect("a server on the port");
    eventually(
        recovery(&o) + o.connect_timeout,
        "found once the server is up",
        || block_on(d.lookup(&ns("x"), &h, "b")) == vec![seg(0, 4, &["a"])],
    );
}
