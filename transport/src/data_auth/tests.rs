use std::net::{IpAddr, Ipv4Addr};

use super::*;

fn secret(b: u8) -> LinkSecret {
    LinkSecret([b; SECRET_LEN])
}

fn ctx() -> ProofContext {
    ProofContext {
        owner_nonce: [1; NONCE_LEN],
        requester_nonce: [2; NONCE_LEN],
        link: 77,
        requester: NodeId(5),
        owner: NodeId(9),
        qp: 3,
    }
}

#[test]
fn proofs_bind_secret_nonces_and_identity() {
    let s = secret(7);
    let c = ctx();
    let p = c.requester_proof(&s);
    assert!(c.check_requester(&s, &p));
    assert!(!c.check_requester(&secret(8), &p), "another secret");
    // A proof replayed on a connection with another owner nonce, link, qp or identity fails.
    for other in [
        ProofContext {
            owner_nonce: [3; NONCE_LEN],
            ..c
        },
        ProofContext {
            requester_nonce: [4; NONCE_LEN],
            ..c
        },
        ProofContext { link: 78, ..c },
        ProofContext { qp: 4, ..c },
        ProofContext {
            requester: NodeId(6),
            ..c
        },
        ProofContext {
            owner: NodeId(10),
            ..c
        },
    ] {
        assert!(!other.check_requester(&s, &p), "{other:?}");
    }
    // The two directions never verify as each other.
    let o = c.owner_proof(&s);
    assert_ne!(o, p);
    assert!(c.check_owner(&s, &o));
    assert!(!c.check_owner(&s, &p));
    assert!(!c.check_requester(&s, &o));
    let mut flipped = p;
    flipped[31] ^= 1;
    assert!(!c.check_requester(&s, &flipped));
}

#[test]
fn grants_are_bound_to_their_requester_and_replaced() {
    let t0 = Instant::now();
    let mut g = Grants::new(Duration::from_secs(60), 16);
    g.issue_with(NodeId(1), 10, secret(1), t0);
    assert_eq!(g.lookup(10, NodeId(1), t0).unwrap().secret, secret(1));
    assert_eq!(
        g.lookup(10, NodeId(2), t0).unwrap_err(),
        GrantRefusal::WrongPeer
    );
    assert_eq!(
        g.lookup(11, NodeId(1), t0).unwrap_err(),
        GrantRefusal::Unknown
    );
    // A new grant for the same requester revokes the old one, and its connections see it.
    let old = g.lookup(10, NodeId(1), t0).unwrap();
    g.attach(10);
    g.issue_with(NodeId(1), 20, secret(2), t0);
    assert!(old.revoked.load(Ordering::Acquire));
    assert_eq!(
        g.lookup(10, NodeId(1), t0).unwrap_err(),
        GrantRefusal::Stale
    );
    assert!(g.lookup(20, NodeId(1), t0).is_ok());
    assert_eq!(g.len(), 1);
    g.revoke(20);
    assert_eq!(
        g.lookup(20, NodeId(1), t0).unwrap_err(),
        GrantRefusal::Stale
    );
    assert!(g.is_empty());
}

#[test]
fn idle_grants_expire_but_used_ones_do_not() {
    let t0 = Instant::now();
    let ttl = Duration::from_secs(60);
    let mut g = Grants::new(ttl, 16);
    g.issue_with(NodeId(1), 10, secret(1), t0);
    g.issue_with(NodeId(2), 20, secret(2), t0);
    g.attach(20);
    let later = t0 + ttl + Duration::from_secs(1);
    assert_eq!(
        g.lookup(10, NodeId(1), later).unwrap_err(),
        GrantRefusal::Stale
    );
    // A link with a live connection stays; once it closes, the TTL starts from then.
    assert!(g.lookup(20, NodeId(2), later).is_ok());
    g.detach(20, later);
    assert!(g
        .lookup(20, NodeId(2), later + ttl - Duration::from_secs(1))
        .is_ok());
    assert_eq!(
        g.lookup(20, NodeId(2), later + ttl).unwrap_err(),
        GrantRefusal::Stale
    );
}

#[test]
fn the_table_is_bounded() {
    let t0 = Instant::now();
    let mut g = Grants::new(Duration::from_secs(600), 4);
    for i in 1..=4u64 {
        g.issue_with(NodeId(i), i, secret(i as u8), t0 + Duration::from_secs(i));
    }
    g.attach(1);
    g.issue_with(NodeId(5), 5, secret(5), t0 + Duration::from_secs(5));
    assert_eq!(g.len(), 4);
    // The one idle longest goes, not the one in use.
    assert!(g.lookup(1, NodeId(1), t0 + Duration::from_secs(5)).is_ok());
    assert_eq!(
        g.lookup(2, NodeId(2), t0 + Duration::from_secs(5))
            .unwrap_err(),
        GrantRefusal::Stale
    );
}

#[test]
fn issued_grants_are_random() {
    let auth = DataAuth::new();
    let a = auth.issue(NodeId(1)).unwrap();
    let b = auth.issue(NodeId(2)).unwrap();
    assert_ne!(a.link, b.link);
    assert_ne!(a.secret, b.secret);
    assert_ne!(a.link, 0);
    assert_eq!(auth.grants(), 2);
    assert_eq!(format!("{:?}", a.secret), "LinkSecret(..)");
    assert!(LinkSecret::from_bytes(&[0; 31]).is_none());
    assert_eq!(
        LinkSecret::from_bytes(a.secret.as_bytes()).as_ref(),
        Some(&a.secret)
    );
}

#[test]
fn a_source_that_keeps_failing_is_refused_for_a_while() {
    let t0 = Instant::now();
    let (window, ban) = (Duration::from_secs(60), Duration::from_secs(30));
    let mut g = SourceGuard::new(3, window, ban, 16);
    let bad = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
    let good = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2));
    assert!(!g.failed(bad, t0));
    assert!(!g.failed(bad, t0 + Duration::from_secs(1)));
    assert!(!g.is_refused(bad, t0 + Duration::from_secs(1)));
    assert!(g.failed(bad, t0 + Duration::from_secs(2)));
    assert!(g.is_refused(bad, t0 + Duration::from_secs(2)));
    assert!(!g.is_refused(good, t0 + Duration::from_secs(2)));
    assert!(g.is_refused(bad, t0 + Duration::from_secs(31)));
    // The ban ends; the count starts over.
    let after = t0 + Duration::from_secs(32);
    assert!(!g.is_refused(bad, after));
    assert!(!g.failed(bad, after));
    assert!(!g.is_refused(bad, after));
    // Failures spread wider than the window never add up.
    let mut t = after + window;
    for _ in 0..10 {
        assert!(!g.failed(good, t));
        t += window;
    }
    // A success forgets the failures.
    assert!(!g.failed(good, t));
    assert!(!g.failed(good, t));
    g.succeeded(good);
    assert!(!g.failed(good, t));
    assert!(!g.is_refused(good, t));
}

#[test]
fn a_source_with_an_authorised_connection_open_is_never_refused() {
    let t0 = Instant::now();
    let mut g = SourceGuard::new(2, Duration::from_secs(60), Duration::from_secs(60), 16);
    let peer = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 7));
    g.succeeded(peer);
    g.succeeded(peer);
    // Another client on the peer's host fails again and again: the peer's next connections
    // are still admitted.
    for i in 0..10 {
        assert!(!g.failed(peer, t0 + Duration::from_millis(i)));
    }
    assert!(!g.is_refused(peer, t0 + Duration::from_secs(1)));
    g.closed(peer);
    assert!(!g.failed(peer, t0 + Duration::from_secs(1)));
    assert!(!g.is_refused(peer, t0 + Duration::from_secs(1)));
    // With its last connection closed it is a source like any other.
    g.closed(peer);
    g.closed(peer);
    assert!(!g.failed(peer, t0 + Duration::from_secs(2)));
    assert!(g.failed(peer, t0 + Duration::from_secs(2)));
    assert!(g.is_refused(peer, t0 + Duration::from_secs(3)));
}

#[test]
fn the_source_guard_is_bounded() {
    let t0 = Instant::now();
    let mut g = SourceGuard::new(2, Duration::from_secs(60), Duration::from_secs(60), 8);
    let banned = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
    g.failed(banned, t0);
    g.failed(banned, t0);
    for i in 0..100u8 {
        g.failed(
            IpAddr::V4(Ipv4Addr::new(10, 1, 0, i)),
            t0 + Duration::from_millis(i as u64 + 1),
        );
        assert!(g.tracked() <= 8);
    }
    assert_eq!(g.tracked(), 8);
}

#[test]
fn rejections_are_counted_by_reason() {
    let r = Rejections::default();
    r.count(Reject::BadProof);
    r.count(Reject::BadProof);
    r.count(Reject::Banned);
    assert_eq!(r.get(Reject::BadProof), 2);
    assert_eq!(r.total(), 3);
    let l = r.labelled();
    assert_eq!(l.len(), Reject::ALL.len());
    assert!(l.contains(&("bad_proof", 2)));
    assert!(l.contains(&("unknown_link", 0)));
    assert!(!Reject::Busy.counts_against_source());
    assert!(Reject::BadRead.counts_against_source());
}
