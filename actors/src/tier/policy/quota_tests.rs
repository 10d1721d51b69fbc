//! Tenants in RAM: keys that never collide, and quotas at admission, on the policy with no
//! disk behind it.

use std::time::Duration;

use kvferry_gpu::KvShape;

use super::{Effect, Tiers};
use crate::model::{BlockHash, Namespace};
use crate::tier::cache::CacheError;
use crate::tier::pool::HostPool;
use crate::tier::quota::{NsMatch, QuotaRule, QuotaRules};
use crate::tier::ssd::SsdTier;
use crate::tier::TierError;

const BLOCK: u64 = 4096;

fn ns(model: &str) -> Namespace {
    Namespace::new(model, "bf16", "t").unwrap()
}

fn h(i: u64) -> BlockHash {
    BlockHash::from_u64(i)
}

fn shape() -> KvShape {
    KvShape::new(1, 1, 1, BLOCK).unwrap()
}

/// RAM of `slots` blocks, no disk; `quotas`: (model prefix, blocks).
fn tiers(slots: u64, quotas: &[(&str, u64)]) -> Tiers<SsdTier> {
    let rules = QuotaRules {
        rules: quotas
            .iter()
            .map(|(p, blocks)| QuotaRule {
                matches: NsMatch::Prefix(format!("{p}/")),
                ram: Some(blocks * BLOCK),
                ssd: None,
            })
            .collect(),
        ..Default::default()
    };
    Tiers::with_quotas(
        HostPool::new(slots * BLOCK, BLOCK, false).unwrap(),
        None,
        Duration::from_secs(30),
        rules,
    )
}

/// A block's bytes: its id and its tenant's tag.
fn bytes(i: u64, tag: u8) -> Vec<u8> {
    let mut b = vec![tag; BLOCK as usize];
    b[..8].copy_from_slice(&i.to_le_bytes());
    b
}

fn put(t: &mut Tiers<SsdTier>, n: &Namespace, ids: &[u64], tag: u8) -> Result<usize, TierError> {
    let blocks: Vec<_> = ids.iter().map(|&i| (h(i), bytes(i, tag))).collect();
    t.put(n, &shape(), 0, &blocks).map(|(r, _)| r.written)
}

fn held(t: &Tiers<SsdTier>, n: &Namespace, ids: &[u64]) -> Vec<u64> {
    ids.iter()
        .copied()
        .filter(|&i| t.cache().prefix_len(n, &[h(i)]) == 1)
        .collect()
}

fn blocks_of(t: &Tiers<SsdTier>, n: &Namespace) -> usize {
    t.cache()
        .usage()
        .iter()
        .find(|u| &u.namespace == n)
        .map_or(0, |u| u.blocks)
}

fn withdrawn(fx: &[Effect<crate::tier::ssd::tier::WriteRx>]) -> Vec<BlockHash> {
    fx.iter()
        .flat_map(|e| match e {
            Effect::Withdraw { hashes, .. } => hashes.clone(),
            _ => Vec::new(),
        })
        .collect()
}

#[test]
fn equal_hashes_of_two_namespaces_are_two_blocks() {
    // Two tenants whose engines sent the same hashes (equal token ids, an engine that does
    // not salt): each finds its own bytes and never the other's.
    let (a, b) = (ns("llama%2Blora=sql"), ns("llama%2Blora=chat"));
    let mut t = tiers(16, &[]);
    assert_eq!(put(&mut t, &a, &[1, 2, 3, 4], 0xAA).unwrap(), 4);
    assert_eq!(t.cache().prefix_len(&b, &[h(1), h(2), h(3), h(4)]), 0);
    assert_eq!(put(&mut t, &b, &[1, 2, 3, 4], 0xBB).unwrap(), 4);
    assert_eq!(t.cache().stats().blocks, 8);
    let hashes = [h(1), h(2), h(3), h(4)];
    for (n, tag) in [(&a, 0xAA), (&b, 0xBB)] {
        let pin = t.pin_prefix(n, &hashes);
        assert_eq!(pin.blocks.len(), 4);
        for (i, s) in pin.blocks.iter().enumerate() {
            let mut got = vec![0u8; BLOCK as usize];
            t.pool().read(s.slot, 0, &mut got);
            assert_eq!(got, bytes(i as u64 + 1, tag), "{n} block {i}");
        }
        t.unpin(n, &hashes, &pin.holds);
    }
    assert_eq!(t.cache().stats().pins, 0);
}

#[test]
fn a_namespace_at_its_quota_replaces_its_own_oldest_blocks_never_anothers() {
    let (a, b) = (ns("a"), ns("b"));
    // 8 slots: a may hold 3, b is unlimited.
    let mut t = tiers(8, &[("a", 3)]);
    put(&mut t, &b, &[1, 2, 3, 4], 0xBB).unwrap();
    t.take_effects();
    for i in 10..16 {
        assert_eq!(put(&mut t, &a, &[i], 0xAA).unwrap(), 1);
    }
    // The pool had room for all 6: the quota kept a to 3 anyway, its oldest gone first.
    assert_eq!(
        held(&t, &a, &(10..16).collect::<Vec<_>>()),
        vec![13, 14, 15]
    );
    assert_eq!(held(&t, &b, &[1, 2, 3, 4]), vec![1, 2, 3, 4]);
    assert_eq!((blocks_of(&t, &a), blocks_of(&t, &b)), (3, 4));
    // What a gave up left the node: withdrawn, no other namespace's block among them.
    assert_eq!(withdrawn(&t.take_effects()), vec![h(10), h(11), h(12)]);
    // A namespace under its quota (b has none) is admitted as before: a full pool evicts
    // the pool's oldest block, whoever's it is (here b's own first ones).
    put(&mut t, &b, &[5, 6, 7], 0xBB).unwrap();
    assert_eq!(t.cache().stats().blocks, 8);
    assert_eq!(held(&t, &b, &[1, 2, 3, 4, 5, 6, 7]), vec![3, 4, 5, 6, 7]);
    assert_eq!(held(&t, &a, &[13, 14, 15]), vec![13, 14, 15]);
    assert_eq!(t.cache().stats().evictions, 5);
}

#[test]
fn a_request_over_the_quota_keeps_its_prefix_and_drops_the_rest() {
    let a = ns("a");
    let mut t = tiers(16, &[("a", 3)]);
    // A put of 5 blocks: the first 3 are stored, the last 2 refused (not the first 2
    // evicted: a prefix is what a later query can use).
    assert_eq!(put(&mut t, &a, &[1, 2, 3, 4, 5], 0xAA).unwrap(), 3);
    assert_eq!(held(&t, &a, &[1, 2, 3, 4, 5]), vec![1, 2, 3]);
    // A save likewise: reserved up to the quota (its older blocks give way first).
    let (slots, present) = t
        .reserve_save(&a, 1, 0, BLOCK, &[h(7), h(8), h(9), h(10), h(11)])
        .unwrap();
    assert_eq!((slots.len(), present), (3, 0));
    let (sealed, _) = t.commit(&a, 0, &[h(7), h(8), h(9)]);
    assert_eq!(sealed, 3);
    assert_eq!(held(&t, &a, &[1, 2, 3, 7, 8, 9, 10]), vec![7, 8, 9]);
    let s = t.cache().stats();
    assert_eq!((s.blocks, s.pinned_blocks, s.pins), (3, 0, 0));
    let u = t.cache().usage();
    // One refusal ended each request.
    assert_eq!(u[0].refused, 2);
}

#[test]
fn a_quota_all_pinned_refuses_with_the_namespace_and_the_next_put_works() {
    let (a, b) = (ns("a"), ns("b"));
    let mut t = tiers(8, &[("a", 2)]);
    put(&mut t, &a, &[1, 2], 0xAA).unwrap();
    // A lease holds both.
    let lease = t.pin_prefix(&a, &[h(1), h(2)]);
    assert_eq!(lease.blocks.len(), 2);
    let e = put(&mut t, &a, &[3], 0xAA).unwrap_err();
    match &e {
        TierError::Cache(CacheError::OverQuota {
            namespace,
            quota,
            blocks,
        }) => assert_eq!((namespace, *quota, *blocks), (&a, 2 * BLOCK, 2)),
        other => panic!("{other:?}"),
    }
    assert!(e.to_string().contains("a/bf16/t"), "{e}");
    // Nothing else changed: a still holds its two, b is served as before.
    assert_eq!(held(&t, &a, &[1, 2, 3]), vec![1, 2]);
    assert_eq!(put(&mut t, &b, &[1, 2, 3], 0xBB).unwrap(), 3);
    // The lease goes: the next put of a replaces its oldest.
    t.unpin(&a, &[h(1), h(2)], &lease.holds);
    assert_eq!(t.cache().stats().pinned_blocks, 0);
    assert_eq!(put(&mut t, &a, &[3], 0xAA).unwrap(), 1);
    assert_eq!(held(&t, &a, &[1, 2, 3]), vec![2, 3]);
}

#[test]
fn a_quota_of_zero_is_never_admitted() {
    let (off, b) = (ns("off"), ns("b"));
    let mut t = tiers(8, &[("off", 0)]);
    let e = put(&mut t, &off, &[1, 2], 0xAA).unwrap_err();
    assert!(
        matches!(&e, TierError::Cache(CacheError::NotAdmitted { namespace }) if *namespace == off),
        "{e:?}"
    );
    assert!(e.to_string().contains("never admitted"), "{e}");
    let r = t.reserve_save(&off, 1, 0, BLOCK, &[h(3)]);
    assert!(matches!(r, Err(CacheError::NotAdmitted { .. })), "{r:?}");
    // Fetched copies of it are refused too; nothing of it is held, nothing left pinned.
    assert!(t.reserve_fetch(&off, 1, 0, BLOCK, &[h(4)]).is_err());
    let s = t.cache().stats();
    assert_eq!((s.blocks, s.pinned_blocks, s.pins), (0, 0, 0));
    assert_eq!(put(&mut t, &b, &[1, 2], 0xBB).unwrap(), 2);
}
