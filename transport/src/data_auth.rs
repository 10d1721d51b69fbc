//! Who may read this node's pool over the tcp data plane, as plain state.
//!
//! A requester gets a **link grant** from the owner's Peer service (its `Handshake`, which
//! checks the cluster token): a random link id and a 32-byte secret, both from the OS CSPRNG.
//! The secret never crosses the data port. Each data connection proves it instead: the owner
//! opens with a fresh nonce, the requester answers with HMAC-SHA256(secret, nonce and the
//! connection's identity), and the owner answers with its own HMAC over both nonces, so each
//! side knows the other holds the link's secret and a recorded exchange is worth nothing on
//! another connection. A grant is bound to the requester's node id; issuing a new one for the
//! same requester revokes the old one (its connections stop being served), and a grant nobody
//! used for [`GRANT_IDLE_TTL`] expires.
//!
//! [`Grants`] is the table (`now` passed in); [`DataAuth`] shares it between the Peer service
//! that issues grants and the tcp owner that checks them. [`SourceGuard`] refuses a source
//! address that keeps failing, for a while; [`Rejections`] counts refusals by [`Reject`]
//! reason for the node's metrics.

use std::collections::HashMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use ring::hmac;
use thiserror::Error;

use crate::qp_key::NodeId;

/// Bytes of a link secret.
pub const SECRET_LEN: usize = 32;
/// Bytes of a nonce (owner's and requester's).
pub(crate) const NONCE_LEN: usize = 32;
/// Bytes of a proof (HMAC-SHA256).
pub(crate) const PROOF_LEN: usize = 32;
/// A grant with no live connection for this long expires.
pub const GRANT_IDLE_TTL: Duration = Duration::from_secs(30 * 60);
/// Grants kept at once; past it the one idle longest is dropped. One per requester node.
pub const MAX_GRANTS: usize = 4096;

const REQUESTER_LABEL: &[u8] = b"kvferry data link v2: requester";
const OWNER_LABEL: &[u8] = b"kvferry data link v2: owner";

#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DataAuthError {
    /// No grant can be issued without unguessable bytes; the handshake is refused.
    #[error("the OS random source failed, so no link secret can be drawn")]
    NoRandomness,
}

/// Fills `b` from the OS CSPRNG.
pub(crate) fn random(b: &mut [u8]) -> Result<(), DataAuthError> {
    getrandom::fill(b).map_err(|_| DataAuthError::NoRandomness)
}

/// A link's secret. Never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct LinkSecret([u8; SECRET_LEN]);

impl LinkSecret {
    /// A secret received in a Handshake answer; `None` unless exactly [`SECRET_LEN`] bytes.
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        b.try_into().ok().map(LinkSecret)
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    fn key(&self) -> hmac::Key {
        hmac::Key::new(hmac::HMAC_SHA256, &self.0)
    }
}

impl fmt::Debug for LinkSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LinkSecret(..)")
    }
}

/// What a requester needs to open data connections of one link.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkGrant {
    /// Random, nonzero; names the link in every data hello.
    pub link: u64,
    pub secret: LinkSecret,
}

/// What a data connection proves, besides holding the secret: the connection it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ProofContext {
    pub owner_nonce: [u8; NONCE_LEN],
    pub requester_nonce: [u8; NONCE_LEN],
    pub link: u64,
    pub requester: NodeId,
    pub owner: NodeId,
    pub qp: u32,
}

impl ProofContext {
    fn message(&self, label: &[u8]) -> Vec<u8> {
        let mut m = Vec::with_capacity(label.len() + 2 * NONCE_LEN + 28);
        m.extend_from_slice(label);
        m.extend_from_slice(&self.owner_nonce);
        m.extend_from_slice(&self.requester_nonce);
        m.extend_from_slice(&self.link.to_le_bytes());
        m.extend_from_slice(&self.requester.0.to_le_bytes());
        m.extend_from_slice(&self.owner.0.to_le_bytes());
        m.extend_from_slice(&self.qp.to_le_bytes());
        m
    }

    fn sign(&self, secret: &LinkSecret, label: &[u8]) -> [u8; PROOF_LEN] {
        let tag = hmac::sign(&secret.key(), &self.message(label));
        let mut out = [0u8; PROOF_LEN];
        out.copy_from_slice(tag.as_ref());
        out
    }

    fn verify(&self, secret: &LinkSecret, label: &[u8], proof: &[u8; PROOF_LEN]) -> bool {
        // Constant time: a wrong proof says nothing about how much of it was right.
        hmac::verify(&secret.key(), &self.message(label), proof).is_ok()
    }

    pub fn requester_proof(&self, secret: &LinkSecret) -> [u8; PROOF_LEN] {
        self.sign(secret, REQUESTER_LABEL)
    }

    pub fn check_requester(&self, secret: &LinkSecret, proof: &[u8; PROOF_LEN]) -> bool {
        self.verify(secret, REQUESTER_LABEL, proof)
    }

    pub fn owner_proof(&self, secret: &LinkSecret) -> [u8; PROOF_LEN] {
        self.sign(secret, OWNER_LABEL)
    }

    pub fn check_owner(&self, secret: &LinkSecret, proof: &[u8; PROOF_LEN]) -> bool {
        self.verify(secret, OWNER_LABEL, proof)
    }
}

/// Why a grant does not admit a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GrantRefusal {
    /// No such link (never issued, or forgotten long ago).
    Unknown,
    /// The link was revoked (a newer grant for its requester) or expired.
    Stale,
    /// The link was issued to another requester node.
    WrongPeer,
}

struct GrantEntry {
    peer: NodeId,
    secret: LinkSecret,
    /// Live connections of this link.
    conns: usize,
    /// When the last connection closed (or the grant was issued).
    idle_since: Instant,
    /// Set once the link is revoked or expired; connections check it before each read.
    revoked: Arc<AtomicBool>,
}

/// Grants that ended recently, remembered so a stale link is told from an unknown one.
const REMEMBERED_STALE: usize = 1024;

/// The grant table: plain state, `now` passed in.
pub struct Grants {
    live: HashMap<u64, GrantEntry>,
    by_peer: HashMap<NodeId, u64>,
    stale: Vec<u64>,
    idle_ttl: Duration,
    max: usize,
}

/// A connection admitted under a grant: what it must keep checking.
#[derive(Clone, Debug)]
pub(crate) struct Admitted {
    pub secret: LinkSecret,
    pub revoked: Arc<AtomicBool>,
}

impl Grants {
    pub fn new(idle_ttl: Duration, max: usize) -> Self {
        Self {
            live: HashMap::new(),
            by_peer: HashMap::new(),
            stale: Vec::new(),
            idle_ttl,
            max: max.max(1),
        }
    }

    fn end(&mut self, link: u64) {
        if let Some(e) = self.live.remove(&link) {
            e.revoked.store(true, Ordering::Release);
            if self.by_peer.get(&e.peer) == Some(&link) {
                self.by_peer.remove(&e.peer);
            }
            if self.stale.len() >= REMEMBERED_STALE {
                self.stale.remove(0);
            }
            self.stale.push(link);
        }
    }

    /// Issues a grant for `peer` with `link` and `secret` drawn by the caller, revoking the
    /// peer's previous one.
    pub fn issue_with(&mut self, peer: NodeId, link: u64, secret: LinkSecret, now: Instant) {
        self.sweep(now);
        if let Some(old) = self.by_peer.get(&peer).copied() {
            self.end(old);
        }
        if self.live.len() >= self.max {
            let idlest = self
                .live
                .iter()
                .filter(|(_, e)| e.conns == 0)
                .min_by_key(|(_, e)| e.idle_since)
                .or_else(|| self.live.iter().min_by_key(|(_, e)| e.idle_since))
                .map(|(l, _)| *l);
            if let Some(l) = idlest {
                self.end(l);
            }
        }
        self.live.insert(
            link,
            GrantEntry {
                peer,
                secret,
                conns: 0,
                idle_since: now,
                revoked: Arc::new(AtomicBool::new(false)),
            },
        );
        self.by_peer.insert(peer, link);
    }

    /// Revokes `link` (its connections stop being served); unknown links are ignored.
    pub fn revoke(&mut self, link: u64) {
        self.end(link);
    }

    /// Expires grants idle longer than the TTL.
    pub fn sweep(&mut self, now: Instant) {
        let ttl = self.idle_ttl;
        let expired: Vec<u64> = self
            .live
            .iter()
            .filter(|(_, e)| e.conns == 0 && now.saturating_duration_since(e.idle_since) >= ttl)
            .map(|(l, _)| *l)
            .collect();
        for l in expired {
            self.end(l);
        }
    }

    /// The secret a connection claiming `link` for `peer` must prove.
    pub(crate) fn lookup(
        &mut self,
        link: u64,
        peer: NodeId,
        now: Instant,
    ) -> Result<Admitted, GrantRefusal> {
        self.sweep(now);
        match self.live.get(&link) {
            Some(e) if e.peer != peer => Err(GrantRefusal::WrongPeer),
            Some(e) => Ok(Admitted {
                secret: e.secret.clone(),
                revoked: e.revoked.clone(),
            }),
            None if self.stale.contains(&link) => Err(GrantRefusal::Stale),
            None => Err(GrantRefusal::Unknown),
        }
    }

    /// A connection of `link` proved itself and is being served.
    pub(crate) fn attach(&mut self, link: u64) {
        if let Some(e) = self.live.get_mut(&link) {
            e.conns += 1;
        }
    }

    /// A connection of `link` ended.
    pub(crate) fn detach(&mut self, link: u64, now: Instant) {
        if let Some(e) = self.live.get_mut(&link) {
            e.conns = e.conns.saturating_sub(1);
            if e.conns == 0 {
                e.idle_since = now;
            }
        }
    }

    /// Live grants.
    pub fn len(&self) -> usize {
        self.live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }
}

/// The grant table shared by the Peer service (which issues) and the tcp owner (which
/// checks). Cheap to clone.
#[derive(Clone)]
pub struct DataAuth {
    grants: Arc<Mutex<Grants>>,
}

impl fmt::Debug for DataAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DataAuth")
            .field("grants", &self.lock().len())
            .finish()
    }
}

impl PartialEq for DataAuth {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.grants, &other.grants)
    }
}

impl Eq for DataAuth {}

impl Default for DataAuth {
    fn default() -> Self {
        Self::new()
    }
}

impl DataAuth {
    pub fn new() -> Self {
        Self::with_limits(GRANT_IDLE_TTL, MAX_GRANTS)
    }

    pub fn with_limits(idle_ttl: Duration, max: usize) -> Self {
        Self {
            grants: Arc::new(Mutex::new(Grants::new(idle_ttl, max))),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Grants> {
        // Every update leaves the maps consistent, so a poisoned lock is still usable.
        self.grants.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A fresh grant for requester `peer`, revoking its previous one.
    pub fn issue(&self, peer: NodeId) -> Result<LinkGrant, DataAuthError> {
        let mut b = [0u8; 8 + SECRET_LEN];
        let link = loop {
            random(&mut b)?;
            let mut l = [0u8; 8];
            l.copy_from_slice(&b[..8]);
            let l = u64::from_le_bytes(l);
            if l != 0 && !self.lock().live.contains_key(&l) {
                break l;
            }
        };
        let mut s = [0u8; SECRET_LEN];
        s.copy_from_slice(&b[8..]);
        let secret = LinkSecret(s);
        self.lock()
            .issue_with(peer, link, secret.clone(), Instant::now());
        Ok(LinkGrant { link, secret })
    }

    /// Revokes `link`: new connections are refused and live ones are closed at their next
    /// read.
    pub fn revoke(&self, link: u64) {
        self.lock().revoke(link);
    }

    /// Live grants.
    pub fn grants(&self) -> usize {
        self.lock().len()
    }

    pub(crate) fn lookup(&self, link: u64, peer: NodeId) -> Result<Admitted, GrantRefusal> {
        self.lock().lookup(link, peer, Instant::now())
    }

    pub(crate) fn attach(&self, link: u64) {
        self.lock().attach(link);
    }

    pub(crate) fn detach(&self, link: u64) {
        self.lock().detach(link, Instant::now());
    }
}

/// Why the owner refused or closed a data connection: the `reason` label of
/// `kvferry_data_rejected_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Reject {
    /// Not a kvferry data hello (magic, version, kind), or bytes that do not frame.
    BadHello,
    /// The hello did not arrive in full before its deadline (silent, slow or truncated).
    HelloTimeout,
    /// A hello for another owner node.
    WrongPeer,
    /// A link id this owner never issued (or to another requester).
    UnknownLink,
    /// A link that was revoked or expired.
    StaleLink,
    /// The proof does not match the link's secret.
    BadProof,
    /// After the hello: a read naming a key, address or length the owner does not serve.
    BadRead,
    /// The source address failed too often and is refused for a while.
    Banned,
    /// Too many connections still in their hello; refused at once.
    Busy,
    /// The TLS handshake or a TLS record failed.
    Tls,
    /// The TLS handshake did not finish before the hello deadline (silent, slow or
    /// truncated, or a plaintext client against a TLS port).
    TlsTimeout,
}

impl Reject {
    pub const ALL: [Reject; 11] = [
        Reject::BadHello,
        Reject::HelloTimeout,
        Reject::WrongPeer,
        Reject::UnknownLink,
        Reject::StaleLink,
        Reject::BadProof,
        Reject::BadRead,
        Reject::Banned,
        Reject::Busy,
        Reject::Tls,
        Reject::TlsTimeout,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reject::BadHello => "bad_hello",
            Reject::HelloTimeout => "hello_timeout",
            Reject::WrongPeer => "wrong_peer",
            Reject::UnknownLink => "unknown_link",
            Reject::StaleLink => "stale_link",
            Reject::BadProof => "bad_proof",
            Reject::BadRead => "bad_read",
            Reject::Banned => "banned",
            Reject::Busy => "busy",
            Reject::Tls => "tls",
            Reject::TlsTimeout => "tls_timeout",
        }
    }

    fn index(self) -> usize {
        Reject::ALL.iter().position(|r| *r == self).unwrap_or(0)
    }

    /// Whether this refusal counts against the source ([`SourceGuard`]): refusals the owner
    /// made for its own reasons (busy, already banned) do not.
    pub fn counts_against_source(self) -> bool {
        !matches!(self, Reject::Banned | Reject::Busy)
    }

    /// Whether this refusal is a failed TLS handshake (counted with the TLS listeners').
    pub fn is_tls(self) -> bool {
        matches!(self, Reject::Tls | Reject::TlsTimeout)
    }
}

/// Refusals by reason, counted by the owner's threads.
#[derive(Debug, Default)]
pub struct Rejections {
    counts: [AtomicU64; Reject::ALL.len()],
}

impl Rejections {
    pub(crate) fn count(&self, r: Reject) {
        self.counts[r.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub fn get(&self, r: Reject) -> u64 {
        self.counts[r.index()].load(Ordering::Relaxed)
    }

    /// Every reason with its count (zeros included, so every series exists from the start).
    pub fn labelled(&self) -> Vec<(&'static str, u64)> {
        Reject::ALL
            .iter()
            .map(|r| (r.as_str(), self.get(*r)))
            .collect()
    }

    pub fn total(&self) -> u64 {
        Reject::ALL.iter().map(|r| self.get(*r)).sum()
    }
}

/// Failures within [`SourceGuard`]'s window that get a source refused.
pub const SOURCE_MAX_FAILURES: u32 = 8;
/// The window failures are counted in.
pub const SOURCE_WINDOW: Duration = Duration::from_secs(60);
/// How long a source that reached the limit is refused.
pub const SOURCE_BAN: Duration = Duration::from_secs(60);
/// Sources remembered at once; past it the one seen longest ago is forgotten.
pub const SOURCE_MAX_TRACKED: usize = 4096;

struct SourceEntry {
    window_start: Instant,
    failures: u32,
    banned_until: Option<Instant>,
    last: Instant,
}

/// Source addresses that keep failing: plain state, `now` passed in. After `max_failures`
/// failures within `window`, a source is refused for `ban`; a successful hello clears it.
/// A source with an authorised connection open is never refused: another client on its
/// host (or behind its NAT), or its own failed attempts while it rotates certificates,
/// cannot shut an authorised peer out; its failed connections are still closed and counted.
pub struct SourceGuard {
    sources: HashMap<IpAddr, SourceEntry>,
    /// Authorised connections open per source (at most the owner's connection limit).
    live: HashMap<IpAddr, u32>,
    max_failures: u32,
    window: Duration,
    ban: Duration,
    max_tracked: usize,
}

impl Default for SourceGuard {
    fn default() -> Self {
        Self::new(
            SOURCE_MAX_FAILURES,
            SOURCE_WINDOW,
            SOURCE_BAN,
            SOURCE_MAX_TRACKED,
        )
    }
}

impl SourceGuard {
    pub fn new(max_failures: u32, window: Duration, ban: Duration, max_tracked: usize) -> Self {
        Self {
            sources: HashMap::new(),
            live: HashMap::new(),
            max_failures: max_failures.max(1),
            window,
            ban,
            max_tracked: max_tracked.max(1),
        }
    }

    /// Whether `ip` is refused now.
    pub fn is_refused(&self, ip: IpAddr, now: Instant) -> bool {
        !self.live.contains_key(&ip)
            && self
                .sources
                .get(&ip)
                .and_then(|e| e.banned_until)
                .is_some_and(|until| now < until)
    }

    /// One failure from `ip`; true when it gets the source refused from now.
    pub fn failed(&mut self, ip: IpAddr, now: Instant) -> bool {
        if self.live.contains_key(&ip) {
            return false;
        }
        if !self.sources.contains_key(&ip) && self.sources.len() >= self.max_tracked {
            self.forget_one(now);
        }
        let (window, ban, max) = (self.window, self.ban, self.max_failures);
        let e = self.sources.entry(ip).or_insert(SourceEntry {
            window_start: now,
            failures: 0,
            banned_until: None,
            last: now,
        });
        e.last = now;
        if e.banned_until.is_some_and(|u| now >= u) {
            e.banned_until = None;
            e.failures = 0;
            e.window_start = now;
        }
        if now.saturating_duration_since(e.window_start) >= window {
            e.window_start = now;
            e.failures = 0;
        }
        e.failures = e.failures.saturating_add(1);
        if e.failures >= max && e.banned_until.is_none() {
            e.banned_until = Some(now + ban);
            return true;
        }
        false
    }

    /// A hello from `ip` succeeded: its failures are forgotten, and it is not refused while
    /// the connection is open (until the matching [`SourceGuard::closed`]).
    pub fn succeeded(&mut self, ip: IpAddr) {
        self.sources.remove(&ip);
        *self.live.entry(ip).or_insert(0) += 1;
    }

    /// An authorised connection from `ip` (one [`SourceGuard::succeeded`]) closed.
    pub fn closed(&mut self, ip: IpAddr) {
        if let Some(n) = self.live.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                self.live.remove(&ip);
            }
        }
    }

    fn forget_one(&mut self, now: Instant) {
        // Entries neither banned nor in a live window go first, then the one seen longest ago.
        let (window, ban) = (self.window, self.ban);
        let done = self
            .sources
            .iter()
            .find(|(_, e)| {
                now.saturating_duration_since(e.last) >= window.max(ban)
                    && e.banned_until.is_none_or(|u| now >= u)
            })
            .map(|(ip, _)| *ip)
            .or_else(|| {
                self.sources
                    .iter()
                    .min_by_key(|(_, e)| e.last)
                    .map(|(ip, _)| *ip)
            });
        if let Some(ip) = done {
            self.sources.remove(&ip);
        }
    }

    /// Sources remembered.
    pub fn tracked(&self) -> usize {
        self.sources.len()
    }
}

#[cfg(test)]
mod tests;
