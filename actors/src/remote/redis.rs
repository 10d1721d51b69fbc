//! The Redis backend of the block directory, for nodes in different processes or hosts.
//!
//! [`RedisDirectory`] speaks RESP2 over one blocking `TcpStream` (a directory call is one
//! pipelined round trip, so an async client would buy nothing). Data model, under a key
//! prefix (`kvf` by default):
//!
//! - `{prefix}:blk:{namespace}:{hex hash}` — the set of node ids holding that block;
//! - `{prefix}:node:{node}` — the set of block keys the node published, so that
//!   [`Directory::withdraw_node`] can remove a departed node without scanning.
//!
//! The trait's methods cannot fail, so a Redis outage degrades to "nobody else holds
//! anything" (local hits only): failures are counted in [`RedisDirectory::errors`] and the
//! latest one kept in [`RedisDirectory::last_error`]; nothing panics.

use std::collections::HashSet;
use std::fmt;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use thiserror::Error;

use super::directory::{Directory, DirectoryStats};
use crate::model::{BlockHash, Namespace};

/// Redis's own default port, used when the address names none.
pub const DEFAULT_PORT: u16 = 6379;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RedisError {
    #[error("bad redis address {addr:?}: {reason}")]
    Address { addr: String, reason: &'static str },
    #[error("the redis key prefix must not be empty")]
    EmptyPrefix,
    #[error("cannot resolve redis address {addr:?}: {source}")]
    Resolve {
        addr: String,
        #[source]
        source: io::Error,
    },
    /// The server is unreachable (refused, timed out): back off and retry later.
    #[error("cannot connect to redis at {addr}: {source}")]
    Connect {
        addr: String,
        #[source]
        source: io::Error,
    },
    /// An established connection broke (reset, EOF, read/write timeout).
    #[error("redis at {addr}: connection lost: {source}")]
    Io {
        addr: String,
        #[source]
        source: io::Error,
    },
    /// The byte stream is not RESP2; the connection is dropped.
    #[error("redis at {addr}: malformed reply: {reason}")]
    Protocol { addr: String, reason: String },
    /// The server answered a command with an error reply (e.g. WRONGTYPE).
    #[error("redis at {addr} refused {command}: {message}")]
    Server {
        addr: String,
        command: &'static str,
        message: String,
    },
    #[error("redis at {addr} answered {command} with {reply}")]
    Unexpected {
        addr: String,
        command: &'static str,
        reply: String,
    },
    /// A connection attempt failed recently; calls fail fast until the back-off ends.
    #[error("redis at {addr} is down; next connection attempt in {retry_in:?}")]
    Backoff { addr: String, retry_in: Duration },
}

/// Timeouts of the client. Zero read/write timeout means none (block forever).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedisOptions {
    pub connect_timeout: Duration,
    pub io_timeout: Duration,
    /// After a failed connection attempt, calls fail without touching the network for this
    /// long, so an unreachable host costs each lookup nothing rather than a connect timeout.
    pub retry_backoff: Duration,
}

impl Default for RedisOptions {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(1),
            io_timeout: Duration::from_secs(1),
            retry_backoff: Duration::from_secs(1),
        }
    }
}

/// The block directory kept in a Redis server, shared by every node pointed at it.
pub struct RedisDirectory {
    addr: String,
    addrs: Vec<SocketAddr>,
    prefix: String,
    options: RedisOptions,
    state: Mutex<State>,
    last_error: Mutex<Option<String>>,
    publishes: AtomicU64,
    withdraws: AtomicU64,
    lookups: AtomicU64,
    errors: AtomicU64,
}

#[derive(Default)]
struct State {
    conn: Option<Conn>,
    retry_at: Option<Instant>,
}

impl fmt::Debug for RedisDirectory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisDirectory")
            .field("addr", &self.addr)
            .field("prefix", &self.prefix)
            .field("errors", &self.errors())
            .finish()
    }
}

impl RedisDirectory {
    /// Connects to `addr` (`host:port`, `host` or `redis://host:port[/0]`) and checks the
    /// server answers PING; fails with [`RedisError::Connect`] when it is unreachable.
    pub fn connect(addr: &str, prefix: &str) -> Result<Self, RedisError> {
        Self::connect_with(addr, prefix, RedisOptions::default())
    }

    pub fn connect_with(
        addr: &str,
        prefix: &str,
        options: RedisOptions,
    ) -> Result<Self, RedisError> {
        if prefix.is_empty() {
            return Err(RedisError::EmptyPrefix);
        }
        let host_port = parse_addr(addr)?;
        let addrs: Vec<SocketAddr> = host_port
            .to_socket_addrs()
            .map_err(|source| RedisError::Resolve {
                addr: host_port.clone(),
                source,
            })?
            .collect();
        let dir = Self {
            addr: host_port,
            addrs,
            prefix: prefix.to_owned(),
            options,
            state: Mutex::new(State::default()),
            last_error: Mutex::new(None),
            publishes: AtomicU64::new(0),
            withdraws: AtomicU64::new(0),
            lookups: AtomicU64::new(0),
            errors: AtomicU64::new(0),
        };
        dir.ping()?;
        Ok(dir)
    }

    /// One PING round trip (reconnecting if needed).
    pub fn ping(&self) -> Result<(), RedisError> {
        let mut p = Pipeline::default();
        p.push("PING", &[]);
        match self.exec(&p)?.pop() {
            Some(Reply::Status(s)) if s == "PONG" => Ok(()),
            other => Err(self.unexpected("PING", other)),
        }
    }

    /// Failed directory operations since start (each failed call counts once).
    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }

    /// The most recent failure, for operators.
    pub fn last_error(&self) -> Option<String> {
        lock(&self.last_error).clone()
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn block_key(&self, ns: &Namespace, h: &BlockHash) -> String {
        let mut k = format!("{}:blk:{}:", self.prefix, ns.as_str());
        for b in h.as_bytes() {
            k.push_str(&format!("{b:02x}"));
        }
        k
    }

    fn node_key(&self, node: &str) -> String {
        format!("{}:node:{node}", self.prefix)
    }

    /// Sends the pipeline and reads all its replies. A broken reused connection is
    /// reconnected once and the pipeline resent (every command here is idempotent).
    fn exec(&self, p: &Pipeline) -> Result<Vec<Reply>, RedisError> {
        let mut st = lock(&self.state);
        let mut may_retry = st.conn.is_some();
        loop {
            let conn = match st.conn.as_mut() {
                Some(c) => c,
                None => {
                    if let Some(at) = st.retry_at {
                        let now = Instant::now();
                        if now < at {
                            return Err(RedisError::Backoff {
                                addr: self.addr.clone(),
                                retry_in: at - now,
                            });
                        }
                    }
                    match Conn::open(&self.addr, &self.addrs, &self.options) {
                        Ok(c) => {
                            st.retry_at = None;
                            st.conn.insert(c)
                        }
                        Err(e) => {
                            st.retry_at = Some(Instant::now() + self.options.retry_backoff);
                            return Err(e);
                        }
                    }
                }
            };
            match conn.round_trip(p) {
                Ok(replies) => return Ok(replies),
                Err(e) => {
                    // Whatever broke, the stream may be mid-reply: never reuse it.
                    st.conn = None;
                    if may_retry && matches!(e, RedisError::Io { .. }) {
                        may_retry = false;
                        continue;
                    }
                    return Err(e);
                }
            }
        }
    }

    /// Counts a failed operation and keeps its message.
    fn record<T>(&self, r: Result<T, RedisError>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                self.errors.fetch_add(1, Ordering::Relaxed);
                *lock(&self.last_error) = Some(e.to_string());
                None
            }
        }
    }

    fn unexpected(&self, command: &'static str, reply: Option<Reply>) -> RedisError {
        match reply {
            Some(Reply::Error(message)) => RedisError::Server {
                addr: self.addr.clone(),
                command,
                message,
            },
            other => RedisError::Unexpected {
                addr: self.addr.clone(),
                command,
                reply: format!("{other:?}"),
            },
        }
    }

    /// Every reply of a write pipeline must be an integer (SADD/SREM/DEL counts).
    fn expect_ints(&self, p: &Pipeline, replies: Vec<Reply>) -> Result<(), RedisError> {
        for (command, reply) in p.names.iter().zip(replies) {
            if !matches!(reply, Reply::Int(_)) {
                return Err(self.unexpected(command, Some(reply)));
            }
        }
        Ok(())
    }

    fn members(&self, command: &'static str, reply: Reply) -> Result<Vec<String>, RedisError> {
        match reply {
            Reply::Array(Some(items)) => items
                .into_iter()
                .map(|item| match item {
                    Reply::Bulk(Some(b)) => Ok(String::from_utf8_lossy(&b).into_owned()),
                    other => Err(self.unexpected(command, Some(other))),
                })
                .collect(),
            other => Err(self.unexpected(command, Some(other))),
        }
    }

    /// Adds `node` to each block's set, or removes it, and mirrors that in the node's set.
    fn try_update(
        &self,
        op: &'static str,
        node: &str,
        ns: &Namespace,
        hashes: &[BlockHash],
    ) -> Result<(), RedisError> {
        let keys: Vec<String> = hashes.iter().map(|h| self.block_key(ns, h)).collect();
        let node_key = self.node_key(node);
        let mut p = Pipeline::default();
        for k in &keys {
            p.push(op, &[k.as_bytes(), node.as_bytes()]);
        }
        let mut args: Vec<&[u8]> = Vec::with_capacity(keys.len() + 1);
        args.push(node_key.as_bytes());
        args.extend(keys.iter().map(|k| k.as_bytes()));
        p.push(op, &args);
        let replies = self.exec(&p)?;
        self.expect_ints(&p, replies)
    }

    fn try_owners(
        &self,
        ns: &Namespace,
        hashes: &[BlockHash],
        exclude: &str,
    ) -> Result<Vec<Vec<String>>, RedisError> {
        let keys: Vec<String> = hashes.iter().map(|h| self.block_key(ns, h)).collect();
        let mut p = Pipeline::default();
        for k in &keys {
            p.push("SMEMBERS", &[k.as_bytes()]);
        }
        self.exec(&p)?
            .into_iter()
            .map(|reply| {
                let mut owners = self.members("SMEMBERS", reply)?;
                owners.retain(|o| o != exclude);
                // Sets are unordered; sorted owners keep lookups stable across calls.
                owners.sort_unstable();
                Ok(owners)
            })
            .collect()
    }

    fn try_withdraw_node(&self, node: &str) -> Result<(), RedisError> {
        let node_key = self.node_key(node);
        let mut p = Pipeline::default();
        p.push("SMEMBERS", &[node_key.as_bytes()]);
        let reply = self.exec(&p)?.pop();
        let keys = match reply {
            Some(r) => self.members("SMEMBERS", r)?,
            None => return Err(self.unexpected("SMEMBERS", None)),
        };
        let mut p = Pipeline::default();
        for k in &keys {
            p.push("SREM", &[k.as_bytes(), node.as_bytes()]);
        }
        p.push("DEL", &[node_key.as_bytes()]);
        let replies = self.exec(&p)?;
        self.expect_ints(&p, replies)
    }

    /// Counts block keys with SCAN: O(keys) round trips of 1000, meant for operators.
    fn try_entries(&self) -> Result<usize, RedisError> {
        let pattern = format!("{}:blk:*", glob_escape(&self.prefix));
        let mut seen: HashSet<Vec<u8>> = HashSet::new();
        let mut cursor = b"0".to_vec();
        loop {
            let mut p = Pipeline::default();
            p.push(
                "SCAN",
                &[&cursor, b"MATCH", pattern.as_bytes(), b"COUNT", b"1000"],
            );
            let reply = self.exec(&p)?.pop();
            let (next, keys) = match reply {
                Some(Reply::Array(Some(mut parts))) if parts.len() == 2 => {
                    match (parts.remove(0), parts.remove(0)) {
                        (Reply::Bulk(Some(next)), Reply::Array(Some(keys))) => (next, keys),
                        (a, b) => {
                            return Err(
                                self.unexpected("SCAN", Some(Reply::Array(Some(vec![a, b]))))
                            )
                        }
                    }
                }
                other => return Err(self.unexpected("SCAN", other)),
            };
            for k in keys {
                if let Reply::Bulk(Some(k)) = k {
                    seen.insert(k);
                }
            }
            if next == b"0" {
                return Ok(seen.len());
            }
            cursor = next;
        }
    }
}

impl Directory for RedisDirectory {
    fn publish(&self, node: &str, ns: &Namespace, hashes: &[BlockHash]) {
        self.publishes
            .fetch_add(hashes.len() as u64, Ordering::Relaxed);
        if !hashes.is_empty() {
            let r = self.try_update("SADD", node, ns, hashes);
            self.record(r);
        }
    }

    fn withdraw(&self, node: &str, ns: &Namespace, hashes: &[BlockHash]) {
        self.withdraws
            .fetch_add(hashes.len() as u64, Ordering::Relaxed);
        if !hashes.is_empty() {
            let r = self.try_update("SREM", node, ns, hashes);
            self.record(r);
        }
    }

    fn owners(&self, ns: &Namespace, hashes: &[BlockHash], exclude: &str) -> Vec<Vec<String>> {
        self.lookups.fetch_add(1, Ordering::Relaxed);
        if hashes.is_empty() {
            return Vec::new();
        }
        let r = self.try_owners(ns, hashes, exclude);
        self.record(r)
            .unwrap_or_else(|| vec![Vec::new(); hashes.len()])
    }

    fn withdraw_node(&self, node: &str) {
        let r = self.try_withdraw_node(node);
        self.record(r);
    }

    /// `entries` scans the server (see [`RedisDirectory`]); it reads 0 when Redis is down.
    fn stats(&self) -> DirectoryStats {
        let r = self.try_entries();
        DirectoryStats {
            publishes: self.publishes.load(Ordering::Relaxed),
            withdraws: self.withdraws.load(Ordering::Relaxed),
            lookups: self.lookups.load(Ordering::Relaxed),
            entries: self.record(r).unwrap_or(0),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// `host:port`, `host` (default port) or `redis://host[:port][/0]` → `host:port`.
fn parse_addr(addr: &str) -> Result<String, RedisError> {
    let bad = |reason| RedisError::Address {
        addr: addr.to_owned(),
        reason,
    };
    let rest = match addr.split_once("://") {
        Some(("redis", rest)) => rest,
        Some(_) => return Err(bad("only redis:// URLs are supported (no TLS)")),
        None => addr,
    };
    let rest = rest
        .strip_suffix("/0")
        .or_else(|| rest.strip_suffix('/'))
        .unwrap_or(rest);
    if rest.contains('@') {
        return Err(bad("credentials (AUTH) are not supported"));
    }
    if rest.contains('/') {
        return Err(bad("only database 0 is supported"));
    }
    if rest.is_empty() {
        return Err(bad("no host"));
    }
    // A bare host or IPv4 has no ':'; an IPv6 address must be bracketed with its port.
    if rest.contains(':') {
        Ok(rest.to_owned())
    } else {
        Ok(format!("{rest}:{DEFAULT_PORT}"))
    }
}

/// Escapes a literal for a SCAN MATCH glob.
fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Commands encoded back to back, sent with one write.
#[derive(Default)]
struct Pipeline {
    buf: Vec<u8>,
    names: Vec<&'static str>,
}

impl Pipeline {
    fn push(&mut self, name: &'static str, args: &[&[u8]]) {
        self.buf
            .extend_from_slice(format!("*{}\r\n", args.len() + 1).as_bytes());
        for a in std::iter::once(name.as_bytes()).chain(args.iter().copied()) {
            self.buf
                .extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            self.buf.extend_from_slice(a);
            self.buf.extend_from_slice(b"\r\n");
        }
        self.names.push(name);
    }
}

/// A RESP2 reply.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Reply {
    Status(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Reply>>),
}

enum ReadFault {
    Io(io::Error),
    Protocol(String),
}

impl From<io::Error> for ReadFault {
    fn from(e: io::Error) -> Self {
        ReadFault::Io(e)
    }
}

// Bounds on what a reply may claim, so a corrupt stream cannot make us allocate wildly.
const MAX_LINE: u64 = 64 * 1024;
const MAX_BULK: usize = 512 * 1024 * 1024;
const MAX_DEPTH: u8 = 8;

fn read_line(r: &mut impl BufRead) -> Result<String, ReadFault> {
    let mut line = Vec::new();
    let n = r.by_ref().take(MAX_LINE).read_until(b'\n', &mut line)?;
    if n == 0 {
        return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
    }
    if !line.ends_with(b"\r\n") {
        return Err(if n as u64 == MAX_LINE {
            ReadFault::Protocol("line too long".into())
        } else {
            io::Error::from(io::ErrorKind::UnexpectedEof).into()
        });
    }
    line.truncate(line.len() - 2);
    String::from_utf8(line).map_err(|_| ReadFault::Protocol("line is not UTF-8".into()))
}

fn parse_len(s: &str) -> Result<i64, ReadFault> {
    s.parse()
        .map_err(|_| ReadFault::Protocol(format!("bad length {s:?}")))
}

fn read_reply(r: &mut impl BufRead, depth: u8) -> Result<Reply, ReadFault> {
    if depth > MAX_DEPTH {
        return Err(ReadFault::Protocol("arrays nested too deep".into()));
    }
    let line = read_line(r)?;
    let (kind, rest) = match line.char_indices().nth(1) {
        Some((i, _)) => line.split_at(i),
        None => (line.as_str(), ""),
    };
    match kind {
        "+" => Ok(Reply::Status(rest.to_owned())),
        "-" => Ok(Reply::Error(rest.to_owned())),
        ":" => Ok(Reply::Int(parse_len(rest)?)),
        "$" => {
            let len = parse_len(rest)?;
            if len == -1 {
                return Ok(Reply::Bulk(None));
            }
            let len = usize::try_from(len)
                .ok()
                .filter(|&l| l <= MAX_BULK)
                .ok_or_else(|| ReadFault::Protocol(format!("bad bulk length {len}")))?;
            let mut buf = vec![0u8; len + 2];
            r.read_exact(&mut buf)?;
            if !buf.ends_with(b"\r\n") {
                return Err(ReadFault::Protocol("bulk string not ended by CRLF".into()));
            }
            buf.truncate(len);
            Ok(Reply::Bulk(Some(buf)))
        }
        "*" => {
            let len = parse_len(rest)?;
            if len == -1 {
                return Ok(Reply::Array(None));
            }
            let len = usize::try_from(len)
                .map_err(|_| ReadFault::Protocol(format!("bad array length {len}")))?;
            let mut items = Vec::with_capacity(len.min(1024));
            for _ in 0..len {
                items.push(read_reply(r, depth + 1)?);
            }
            Ok(Reply::Array(Some(items)))
        }
        _ => Err(ReadFault::Protocol(format!("unknown reply type {line:?}"))),
    }
}

/// One connection: the stream behind a read buffer (writes go straight to the stream).
struct Conn {
    addr: String,
    reader: BufReader<TcpStream>,
}

impl Conn {
    fn open(addr: &str, addrs: &[SocketAddr], o: &RedisOptions) -> Result<Self, RedisError> {
        let connect_err = |source| RedisError::Connect {
            addr: addr.to_owned(),
            source,
        };
        let mut last = None;
        for a in addrs {
            let r = if o.connect_timeout.is_zero() {
                TcpStream::connect(a)
            } else {
                TcpStream::connect_timeout(a, o.connect_timeout)
            };
            match r {
                Ok(s) => {
                    let timeout = Some(o.io_timeout).filter(|t| !t.is_zero());
                    s.set_read_timeout(timeout).map_err(connect_err)?;
                    s.set_write_timeout(timeout).map_err(connect_err)?;
                    // Pipelines are written whole; don't let Nagle hold the tail back.
                    s.set_nodelay(true).map_err(connect_err)?;
                    return Ok(Self {
                        addr: addr.to_owned(),
                        reader: BufReader::new(s),
                    });
                }
                Err(e) => last = Some(e),
            }
        }
        Err(connect_err(last.unwrap_or_else(|| {
            io::Error::new(io::ErrorKind::NotFound, "the address resolved to nothing")
        })))
    }

    fn round_trip(&mut self, p: &Pipeline) -> Result<Vec<Reply>, RedisError> {
        let io_err = |source| RedisError::Io {
            addr: self.addr.clone(),
            source,
        };
        let s = self.reader.get_mut();
        s.write_all(&p.buf).map_err(io_err)?;
        s.flush().map_err(io_err)?;
        let mut replies = Vec::with_capacity(p.names.len());
        for _ in 0..p.names.len() {
            match read_reply(&mut self.reader, 0) {
                Ok(r) => replies.push(r),
                Err(ReadFault::Io(e)) => return Err(io_err(e)),
                Err(ReadFault::Protocol(reason)) => {
                    return Err(RedisError::Protocol {
                        addr: self.addr.clone(),
                        reason,
                    })
                }
            }
        }
        Ok(replies)
    }
}

#[cfg(test)]
mod tests {
    use std::io::Cursor;
    use std::net::TcpListener;
    use std::process::{Child, Command, Stdio};
    use std::thread;

    use super::*;
    use crate::remote::directory::Segment;

    /// A real `redis-server` on a loopback port, killed on drop.
    struct RedisServer {
        child: Child,
        port: u16,
    }

    impl RedisServer {
        fn start() -> Self {
            for _ in 0..5 {
                if let Some(s) = Self::start_on(free_port()) {
                    return s;
                }
            }
            panic!("redis-server did not come up on any of 5 free ports");
        }

        /// None when the server exits early (its port was taken meanwhile).
        fn start_on(port: u16) -> Option<Self> {
            let child = Command::new("redis-server")
                .args(["--port", &port.to_string()])
                .args(["--save", "", "--appendonly", "no", "--bind", "127.0.0.1"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn();
            let child = match child {
                Ok(c) => c,
                Err(e) if e.kind() == io::ErrorKind::NotFound => panic!(
                    "redis-server is not installed (needed by the Redis directory tests): \
                     run ./scripts/test, which installs it, or apt-get install redis-server"
                ),
                Err(e) => panic!("cannot start redis-server: {e}"),
            };
            let mut s = Self { child, port };
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if matches!(s.child.try_wait(), Ok(Some(_))) {
                    return None;
                }
                if pong(port) {
                    return Some(s);
                }
                thread::sleep(Duration::from_millis(20));
            }
            panic!("redis-server on port {port} did not answer PING within 10 s");
        }

        fn addr(&self) -> String {
            format!("127.0.0.1:{}", self.port)
        }
    }

    impl Drop for RedisServer {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    fn free_port() -> u16 {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        l.local_addr().expect("local addr").port()
    }

    fn pong(port: u16) -> bool {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
        let mut buf = [0u8; 7];
        s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
    }

    fn quick() -> RedisOptions {
        RedisOptions {
            connect_timeout: Duration::from_millis(500),
            io_timeout: Duration::from_millis(500),
            retry_backoff: Duration::ZERO,
        }
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

    #[test]
    fn segments_across_three_nodes() {
        let server = RedisServer::start();
        let d = RedisDirectory::connect_with(&server.addr(), "kvf", quick()).unwrap();
        let h = hashes(12);
        d.publish("b", &ns("x"), &h[0..4]);
        d.publish("a", &ns("x"), &h[4..8]);
        d.publish("c", &ns("x"), &h[8..12]);
        assert_eq!(
            d.lookup(&ns("x"), &h[4..], "b"),
            vec![seg(0, 4, &["a"]), seg(4, 4, &["c"])]
        );
        // Shared blocks list every holder, sorted, and keep the run with the common owner.
        d.publish("c", &ns("x"), &h[6..8]);
        d.publish("a", &ns("x"), &h[6..8]); // twice is once
        assert_eq!(
            d.owners(&ns("x"), &h[5..9], "b"),
            vec![vec!["a"], vec!["a", "c"], vec!["a", "c"], vec!["c"]]
        );
        assert_eq!(
            d.lookup(&ns("x"), &h[4..], "b"),
            vec![seg(0, 4, &["a"]), seg(4, 4, &["c"])]
        );
        // A node never lists itself.
        assert!(d.lookup(&ns("x"), &h[0..4], "b").is_empty());
        assert_eq!(d.lookup(&ns("x"), &h[0..4], "a"), vec![seg(0, 4, &["b"])]);
        assert_eq!(d.owners(&ns("x"), &h[6..7], "a"), vec![vec!["c"]]);
        let s = d.stats();
        assert_eq!((s.publishes, s.entries), (16, 12));
        assert_eq!(d.errors(), 0, "{:?}", d.last_error());
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
        assert_eq!(d.lookup(&ns("x"), &h[4..], "b"), vec![seg(0, 1, &["a"])]);
        assert_eq!(d.stats().entries, 11);
        // Withdrawing what a node does not hold changes nothing.
        d.withdraw("b", &ns("x"), &h[8..12]);
        assert_eq!(d.owners(&ns("x"), &h[8..9], ""), vec![vec!["c"]]);

        d.withdraw_node("c");
        assert_eq!(d.stats().entries, 7, "as the embedded directory");
        assert_eq!(
            d.owners(&ns("x"), &h[6..10], "b"),
            vec![vec!["a"], vec!["a"], vec![], vec![]]
        );
        // The node's own index is gone too, and a second withdraw_node is a no-op.
        let mut p = Pipeline::default();
        p.push("EXISTS", &[b"kvf:node:c"]);
        assert_eq!(d.exec(&p).unwrap(), vec![Reply::Int(0)]);
        d.withdraw_node("c");
        d.withdraw_node("never-seen");
        // A node that rejoins publishes afresh.
        d.publish("c", &ns("x"), &h[8..9]);
        assert_eq!(d.owners(&ns("x"), &h[8..9], "b"), vec![vec!["c"]]);
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
        assert_eq!(d.lookup(&ns("x"), &h, "z"), vec![seg(0, 4, &["a"])]);
        assert_eq!(d.lookup(&ns("y"), &h, "z"), vec![seg(0, 2, &["b"])]);
        assert!(d.lookup(&ns("w"), &h, "z").is_empty());
        assert!(other.lookup(&ns("x"), &h, "z").is_empty());
        assert_eq!(other.stats().entries, 0);
        d.withdraw_node("a");
        assert!(d.lookup(&ns("x"), &h, "z").is_empty());
        assert_eq!(d.lookup(&ns("y"), &h, "z"), vec![seg(0, 2, &["b"])]);
        // Hashes of different lengths are different blocks.
        let short = BlockHash::new(&[0, 0, 0, 0, 0, 0, 0]).unwrap();
        assert_eq!(
            d.owners(&ns("y"), &[short], "z"),
            vec![Vec::<String>::new()]
        );
    }

    #[test]
    fn an_outage_degrades_to_misses_and_a_fresh_server_is_picked_up() {
        let server = RedisServer::start();
        let port = server.port;
        let d = RedisDirectory::connect_with(&server.addr(), "kvf", quick()).unwrap();
        let h = hashes(4);
        d.publish("a", &ns("x"), &h);
        assert_eq!(d.lookup(&ns("x"), &h, "b"), vec![seg(0, 4, &["a"])]);
        drop(server);

        assert_eq!(d.owners(&ns("x"), &h, "b"), vec![Vec::<String>::new(); 4]);
        assert!(d.lookup(&ns("x"), &h, "b").is_empty());
        assert!(d.errors() > 0);
        let before = d.errors();
        d.publish("a", &ns("x"), &h);
        d.withdraw("a", &ns("x"), &h);
        d.withdraw_node("a");
        assert_eq!(d.stats().entries, 0);
        assert_eq!(d.errors(), before + 4);
        assert!(d.ping().is_err());
        let msg = d.last_error().unwrap();
        assert!(msg.contains(&format!("127.0.0.1:{port}")), "{msg}");

        // The directory was in memory only: a fresh server starts empty and is used again.
        let _fresh = RedisServer::start_on(port).expect("restart on the same port");
        d.ping().unwrap();
        assert!(d.lookup(&ns("x"), &h, "b").is_empty());
        let errors = d.errors();
        d.publish("a", &ns("x"), &h);
        assert_eq!(d.lookup(&ns("x"), &h, "b"), vec![seg(0, 4, &["a"])]);
        assert_eq!(d.errors(), errors);
    }

    #[test]
    fn a_failed_connection_backs_off() {
        let port = free_port();
        let addr = format!("127.0.0.1:{port}");
        let d = RedisDirectory {
            addr: addr.clone(),
            addrs: vec![addr.parse().unwrap()],
            prefix: "kvf".into(),
            options: RedisOptions {
                retry_backoff: Duration::from_secs(60),
                ..quick()
            },
            state: Mutex::new(State::default()),
            last_error: Mutex::new(None),
            publishes: AtomicU64::new(0),
            withdraws: AtomicU64::new(0),
            lookups: AtomicU64::new(0),
            errors: AtomicU64::new(0),
        };
        assert!(matches!(d.ping(), Err(RedisError::Connect { .. })));
        // Even once a server is up, the back-off holds until it ends.
        let _server = RedisServer::start_on(port).expect("start");
        assert!(matches!(d.ping(), Err(RedisError::Backoff { .. })));
        assert_eq!(
            d.owners(&ns("x"), &hashes(2), "b"),
            vec![Vec::<String>::new(); 2]
        );
        assert_eq!(d.errors(), 1);
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

    #[test]
    fn addresses() {
        let ok = |a: &str| parse_addr(a).unwrap();
        assert_eq!(ok("127.0.0.1:6379"), "127.0.0.1:6379");
        assert_eq!(ok("redis://127.0.0.1:7000"), "127.0.0.1:7000");
        assert_eq!(ok("redis://127.0.0.1:7000/"), "127.0.0.1:7000");
        assert_eq!(ok("redis://127.0.0.1:7000/0"), "127.0.0.1:7000");
        assert_eq!(ok("localhost"), "localhost:6379");
        assert_eq!(ok("redis://[::1]:7000"), "[::1]:7000");
        for bad in [
            "",
            "redis://",
            "rediss://h:1",
            "redis://u:p@h:1",
            "redis://h:1/3",
        ] {
            assert!(
                matches!(parse_addr(bad), Err(RedisError::Address { .. })),
                "{bad:?}"
            );
        }
        assert_eq!(glob_escape("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
    }

    #[test]
    fn resp_encoding_and_parsing() {
        let mut p = Pipeline::default();
        p.push("SADD", &[b"k", b"n 1"]);
        p.push("PING", &[]);
        assert_eq!(
            p.buf,
            b"*3\r\n$4\r\nSADD\r\n$1\r\nk\r\n$3\r\nn 1\r\n*1\r\n$4\r\nPING\r\n".to_vec()
        );
        let mut r = Cursor::new(
            b"+OK\r\n-ERR x\r\n:42\r\n$-1\r\n$5\r\na\r\nbc\r\n*2\r\n$1\r\nx\r\n:1\r\n*-1\r\n*0\r\n"
                .to_vec(),
        );
        let mut next = || match read_reply(&mut r, 0) {
            Ok(v) => v,
            Err(_) => panic!("parse failed"),
        };
        assert_eq!(next(), Reply::Status("OK".into()));
        assert_eq!(next(), Reply::Error("ERR x".into()));
        assert_eq!(next(), Reply::Int(42));
        assert_eq!(next(), Reply::Bulk(None));
        assert_eq!(next(), Reply::Bulk(Some(b"a\r\nbc".to_vec())));
        assert_eq!(
            next(),
            Reply::Array(Some(vec![Reply::Bulk(Some(b"x".to_vec())), Reply::Int(1)]))
        );
        assert_eq!(next(), Reply::Array(None));
        assert_eq!(next(), Reply::Array(Some(vec![])));
        assert!(matches!(read_reply(&mut r, 0), Err(ReadFault::Io(_))));
        for bad in [
            &b"?x\r\n"[..],
            b"$abc\r\n",
            b"$-5\r\n",
            b"$3\r\nabcd\r\n",
            b":1\n",
        ] {
            let r = read_reply(&mut Cursor::new(bad.to_vec()), 0);
            let is_fault = matches!(r, Err(ReadFault::Protocol(_)) | Err(ReadFault::Io(_)));
            assert!(is_fault, "{bad:?}");
        }
        // A truncated stream is a broken connection, not a protocol error.
        let r = read_reply(&mut Cursor::new(b"$5\r\nab".to_vec()), 0);
        assert!(matches!(r, Err(ReadFault::Io(_))));
        let deep = b"*1\r\n".repeat(20);
        let r = read_reply(&mut Cursor::new(deep), 0);
        assert!(matches!(r, Err(ReadFault::Protocol(_))));
    }

    #[test]
    fn matches_the_embedded_directory() {
        use crate::remote::directory::EmbeddedDirectory;
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
            let mut want = e.owners(&space, &h, me);
            want.iter_mut().for_each(|o| o.sort());
            assert_eq!(d.owners(&space, &h, me), want);
        }
        assert_eq!(d.stats().entries, e.stats().entries);
        assert_eq!(d.errors(), 0, "{:?}", d.last_error());
    }
}
