use super::*;

fn ns() -> Namespace {
    Namespace::new("m", "bf16", "t").unwrap()
}

fn h(i: u64) -> BlockHash {
    BlockHash::from_u64(i)
}

fn cache(slots: u64) -> BlockCache {
    BlockCache::new(HostPool::new(slots * 4096, 4096, false).unwrap())
}

fn put(c: &mut BlockCache, i: u64, class: BlockClass) {
    match c.reserve(&ns(), h(i), 1, 0, 4096, class).unwrap() {
        Reservation::Write(_) => assert!(c.commit(&ns(), h(i), 0)),
        Reservation::Present => {}
    }
}

#[test]
fn seals_when_every_rank_is_written() {
    let mut c = cache(4);
    let Reservation::Write(a) = c
        .reserve(&ns(), h(1), 2, 0, 4096, BlockClass::Retained)
        .unwrap()
    else {
        panic!("expected a write reservation")
    };
    assert!(!c.commit(&ns(), h(1), 0));
    assert_eq!(
        c.prefix_len(&ns(), &[h(1)]),
        0,
        "half-written block is not a hit"
    );
    assert_eq!(
        c.reserve(&ns(), h(1), 2, 0, 4096, BlockClass::Retained)
            .unwrap(),
        Reservation::Present
    );
    let Reservation::Write(b) = c
        .reserve(&ns(), h(1), 2, 1, 4096, BlockClass::Retained)
        .unwrap()
    else {
        panic!("expected a write reservation")
    };
    assert_eq!(a.slot, b.slot, "every rank of one block shares one slot");
    assert!(c.commit(&ns(), h(1), 1));
    assert_eq!(c.prefix_len(&ns(), &[h(1), h(2)]), 1);
    assert!(matches!(
        c.reserve(&ns(), h(1), 1, 0, 4096, BlockClass::Retained),
        Err(CacheError::TpMismatch {
            stored: 2,
            tp: 1,
            ..
        })
    ));
    assert!(matches!(
        c.reserve(&ns(), h(9), 2, 2, 4096, BlockClass::Retained),
        Err(CacheError::RankOutOfRange { rank: 2, tp: 2 })
    ));
    assert!(matches!(
        c.reserve(&ns(), h(9), 1, 0, 8192, BlockClass::Retained),
        Err(CacheError::BlockTooLarge {
            need: 8192,
            slot: 4096
        })
    ));
}

#[test]
fn prefix_stops_at_first_miss() {
    let mut c = cache(8);
    for i in [0, 1, 2, 4] {
        put(&mut c, i, BlockClass::Retained);
    }
    let hashes: Vec<_> = (0..5).map(h).collect();
    assert_eq!(c.prefix_len(&ns(), &hashes), 3);
    let other = Namespace::new("m", "fp8", "t").unwrap();
    assert_eq!(c.prefix_len(&other, &hashes), 0, "namespaces do not mix");
}

#[test]
fn eviction_never_touches_pinned_blocks_and_prefers_reclaimable() {
    let mut c = cache(3);
    put(&mut c, 0, BlockClass::Retained);
    put(&mut c, 1, BlockClass::Reclaimable);
    put(&mut c, 2, BlockClass::Retained);
    let pinned = c.pin_prefix(&ns(), &[h(0)]);
    assert_eq!(pinned.len(), 1);
    // Needs a slot: the reclaimable block 1 goes first although block 0 is older.
    put(&mut c, 3, BlockClass::Retained);
    assert!(!c.contains(&ns(), h(1)));
    assert!(c.contains(&ns(), h(0)) && c.contains(&ns(), h(2)));
    // Next: oldest unpinned retained block is 2 (0 is pinned).
    put(&mut c, 4, BlockClass::Retained);
    assert!(!c.contains(&ns(), h(2)));
    assert!(c.contains(&ns(), h(0)));
    // Pin everything: the pool is full and nothing is evictable.
    let all = c.pin_prefix(&ns(), &[h(3)]);
    let all2 = c.pin_prefix(&ns(), &[h(4)]);
    assert_eq!(all.len() + all2.len(), 2);
    let err = c
        .reserve(&ns(), h(5), 1, 0, 4096, BlockClass::Retained)
        .unwrap_err();
    assert!(
        matches!(
            err,
            CacheError::Full {
                capacity: 3,
                pinned: 3
            }
        ),
        "{err}"
    );
    assert_eq!(c.stats().pinned_blocks, 3);
    // The failed reservation changed nothing.
    assert_eq!(c.stats().blocks, 3);
    c.unpin(&ns(), &[h(0), h(3), h(4)]);
    assert_eq!(c.stats().pinned_blocks, 0);
    assert_eq!(c.stats().pins, 0);
    put(&mut c, 5, BlockClass::Retained);
    assert!(
        !c.contains(&ns(), h(0)),
        "block 0 was unpinned first, so it is oldest"
    );
    assert_eq!(c.stats().evictions, 3);
}

#[test]
fn the_sealed_count_follows_seals_evictions_and_drops() {
    let walk = |c: &BlockCache| c.sealed_blocks().count();
    let mut c = cache(3);
    put(&mut c, 0, BlockClass::Retained);
    put(&mut c, 1, BlockClass::Reclaimable);
    // Half of a TP-2 block: held, not sealed.
    c.reserve(&ns(), h(2), 2, 0, 4096, BlockClass::Retained)
        .unwrap();
    c.commit(&ns(), h(2), 0);
    assert_eq!((c.stats().sealed, walk(&c)), (2, 2));
    // Committing a rank again seals nothing new.
    c.reserve(&ns(), h(2), 2, 1, 4096, BlockClass::Retained)
        .unwrap();
    c.commit(&ns(), h(2), 1);
    c.commit(&ns(), h(2), 1);
    assert_eq!((c.stats().sealed, walk(&c)), (3, 3));
    put(&mut c, 3, BlockClass::Retained); // evicts the reclaimable block 1
    assert_eq!((c.stats().sealed, walk(&c)), (3, 3));
    put(&mut c, 4, BlockClass::Reclaimable);
    assert_eq!(c.drop_reclaimable(), 1);
    assert_eq!((c.stats().sealed, walk(&c)), (2, 2));
    // An aborted reservation (in the slot block 4 left) seals nothing.
    c.reserve(&ns(), h(5), 1, 0, 4096, BlockClass::Retained)
        .unwrap();
    c.abort(&ns(), h(5));
    assert_eq!((c.stats().sealed, walk(&c)), (2, 2));
}

#[test]
fn abort_frees_an_unwritten_block() {
    let mut c = cache(1);
    let r = c
        .reserve(&ns(), h(1), 1, 0, 4096, BlockClass::Retained)
        .unwrap();
    assert!(matches!(r, Reservation::Write(_)));
    c.abort(&ns(), h(1));
    assert_eq!(
        c.stats(),
        CacheStats {
            capacity: 1,
            ..Default::default()
        }
    );
    put(&mut c, 2, BlockClass::Retained);
    assert!(c.contains(&ns(), h(2)));
}

#[test]
fn reclaimable_saved_locally_becomes_retained() {
    let mut c = cache(2);
    put(&mut c, 0, BlockClass::Reclaimable);
    put(&mut c, 1, BlockClass::Retained);
    // Saving block 0 here moves it to the retained class: block 1 (older retained) goes.
    assert_eq!(
        c.reserve(&ns(), h(0), 1, 0, 4096, BlockClass::Retained)
            .unwrap(),
        Reservation::Present
    );
    put(&mut c, 2, BlockClass::Retained);
    assert!(c.contains(&ns(), h(0)));
    assert!(!c.contains(&ns(), h(1)));
}
