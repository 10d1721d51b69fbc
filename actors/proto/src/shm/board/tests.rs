use super::*;
use std::sync::Arc;
use std::time::Instant;

fn pair(slots: u32) -> (Board, Board) {
    let client = Board::create(slots).unwrap();
    let fd = client.fd().try_clone_to_owned().unwrap();
    let node = Board::open(fd, board_bytes(slots)).unwrap();
    (client, node)
}

#[test]
fn the_node_writes_what_the_client_reads() {
    let (client, node) = pair(8);
    assert_eq!(node.slots(), 8);
    node.begin(3, 77, 28).unwrap();
    assert_eq!(
        client.view(3).unwrap(),
        SlotView {
            tag: 77,
            state: SlotState::Running,
            layers: 0,
            failed_blocks: 0,
        }
    );
    node.layers(3, 77, 4);
    node.layers(3, 77, 2); // never backwards
    node.layers(3, 76, 20); // another load's tag: ignored
    assert_eq!(client.view(3).unwrap().layers, 4);
    assert_eq!(client.view(3).unwrap().outcome(), None);
    // Busy while running.
    assert!(matches!(
        node.begin(3, 78, 28),
        Err(BoardError::SlotBusy { slot: 3, tag: 77 })
    ));
    node.finish(3, 77, Outcome::Ok);
    let v = client.view(3).unwrap();
    assert_eq!((v.state, v.layers, v.failed_blocks), (SlotState::Ok, 28, 0));
    assert_eq!(v.outcome(), Some(Outcome::Ok));
    // Reusable once done.
    node.begin(3, 78, 28).unwrap();
    node.layers(3, 78, 5);
    node.finish(3, 78, Outcome::Failed { blocks: 6 });
    let v = client.view(3).unwrap();
    assert_eq!((v.tag, v.state), (78, SlotState::Failed));
    assert!(matches!(
        node.begin(8, 1, 1),
        Err(BoardError::SlotRange { slot: 8, slots: 8 })
    ));
}

/// The word as the client maps it: a reader of another build sees exactly this.
fn raw(b: &Board, slot: u32) -> u64 {
    b.slot_word(slot).load(Ordering::Acquire)
}

#[test]
fn the_final_word_carries_the_outcome_and_the_failed_blocks() {
    let (client, node) = pair(4);
    node.begin(1, 41, 28).unwrap();
    node.layers(1, 41, 9);
    assert_eq!(raw(&client, 1), 41 << 32 | 1 << 24 | 9);
    node.finish(1, 41, Outcome::Failed { blocks: 7 });
    // One store: tag, "failed" and the failed blocks (not the 9 layers that landed).
    assert_eq!(raw(&client, 1), 41 << 32 | 3 << 24 | 7);
    let v = client.view(1).unwrap();
    assert_eq!(
        (v.state, v.failed_blocks, v.layers),
        (SlotState::Failed, 7, 0)
    );
    assert_eq!(v.outcome(), Some(Outcome::Failed { blocks: 7 }));
    // A layer report that comes after the end changes nothing.
    node.layers(1, 41, 20);
    assert_eq!(raw(&client, 1), 41 << 32 | 3 << 24 | 7);

    // Ok: every layer, no failed block.
    node.begin(1, 42, 28).unwrap();
    node.finish(1, 42, Outcome::Ok);
    assert_eq!(raw(&client, 1), 42 << 32 | 2 << 24 | 28);
    assert_eq!(client.view(1).unwrap().outcome(), Some(Outcome::Ok));

    // Counts the word cannot hold: a failure always names a block, and at most 2^24-1.
    node.begin(2, 1, 3).unwrap();
    node.finish(2, 1, Outcome::Failed { blocks: 0 });
    assert_eq!(client.view(2).unwrap().failed_blocks, 1);
    node.begin(2, 2, 3).unwrap();
    node.finish(2, 2, Outcome::Failed { blocks: u32::MAX });
    assert_eq!(client.view(2).unwrap().failed_blocks, COUNT_MAX);
    // The most blocks a load may name fit.
    node.begin(2, 3, 3).unwrap();
    let most = crate::MAX_ENGINE_BLOCKS as u32;
    node.finish(2, 3, Outcome::Failed { blocks: most });
    assert_eq!(client.view(2).unwrap().failed_blocks, most);
    // Another load's end never lands in the slot.
    node.finish(2, 99, Outcome::Ok);
    assert_eq!(client.view(2).unwrap().tag, 3);
}

#[test]
fn a_layer_landing_wakes_the_forward_asleep_behind_the_loader() {
    // A sync load: the rank's loader sleeps in wait_ends from the load's start, and the
    // forward (wait_for_layer_load) in wait for its next layer, behind it in the futex's
    // queue. A landed layer must wake the forward, not only the first sleeper: a forward
    // that sleeps through the layers runs after the whole copy (vLLM 0.26 on the H200: a
    // 10K-token sync hit took 54.9 ms with a node whose wake woke one thread, against
    // 40.7 ms before the loader slept on the board too).
    let (client, node) = pair(4);
    let client = Arc::new(client);
    node.begin(1, 7, 32).unwrap();
    let loader = {
        let c = Arc::clone(&client);
        std::thread::spawn(move || c.wait_ends(&[(1, 7)], Duration::from_secs(5)).unwrap())
    };
    // Past its spin: the loader is first in the queue.
    std::thread::sleep(WAIT_SPIN * 30);
    let forward = {
        let c = Arc::clone(&client);
        std::thread::spawn(move || {
            let t = Instant::now();
            let v = c.wait(1, 7, 16, Duration::from_secs(5)).unwrap();
            (v, t.elapsed())
        })
    };
    std::thread::sleep(WAIT_SPIN * 30);
    node.layers(1, 7, 16);
    let (v, took) = forward.join().unwrap();
    assert_eq!((v.state, v.layers), (SlotState::Running, 16));
    assert!(
        took < Duration::from_millis(2500),
        "the forward saw layer 16 after {took:?} (its wait's timeout is 5 s)"
    );
    // The loader slept through the layer (no end yet) and wakes for the end.
    node.finish(1, 7, Outcome::Ok);
    let ended = loader.join().unwrap();
    assert_eq!(ended.len(), 1);
    assert_eq!(ended[0].1.state, SlotState::Ok);
}

#[test]
fn an_end_wakes_every_thread_asleep_on_the_board() {
    // A rank's loader (wait_ends) and its forward (wait) sleep on one board at once.
    let (client, node) = pair(4);
    let client = Arc::new(client);
    node.begin(1, 7, 28).unwrap();
    let waiters: Vec<_> = (0..3)
        .map(|i| {
            let c = Arc::clone(&client);
            std::thread::spawn(move || {
                let t = Instant::now();
                let done = if i == 0 {
                    !c.wait_ends(&[(1, 7)], Duration::from_secs(20))
                        .unwrap()
                        .is_empty()
                } else {
                    c.wait(1, 7, u32::MAX, Duration::from_secs(20))
                        .unwrap()
                        .state
                        .is_done()
                };
                (done, t.elapsed())
            })
        })
        .collect();
    // Past their spin: all asleep on the futex.
    std::thread::sleep(WAIT_SPIN * 30);
    node.finish(1, 7, Outcome::Ok);
    for w in waiters {
        let (done, took) = w.join().unwrap();
        assert!(
            done && took < Duration::from_secs(10),
            "{done} after {took:?}"
        );
    }
}

#[test]
fn a_board_of_another_version_is_refused_on_either_side() {
    // The client refuses a board no node has said it takes as this version.
    let (client, node) = pair(4);
    client.accepted().unwrap();
    node.word32(ACCEPTED_OFFSET).store(1, Ordering::Release);
    assert!(matches!(
        client.accepted(),
        Err(BoardError::NotAccepted { version: 1 })
    ));
    let fresh = Board::create(4).unwrap();
    assert!(matches!(
        fresh.accepted(),
        Err(BoardError::NotAccepted { version: 0 })
    ));

    let c = Board::create(4).unwrap();
    assert_eq!(c.word32(4).load(Ordering::Relaxed), VERSION);
    // A version 1 board: its failed slots hold landed layers, not failed blocks.
    c.word32(4).store(1, Ordering::Relaxed);
    let fd = c.fd().try_clone_to_owned().unwrap();
    assert!(matches!(
        Board::open(fd, board_bytes(4)),
        Err(BoardError::Header { version: 1, .. })
    ));
}

#[test]
fn a_watcher_of_many_loads_wakes_for_an_end_or_an_interrupt_not_for_layers() {
    let (client, node) = pair(4);
    let client = Arc::new(client);
    node.begin(0, 10, 28).unwrap();
    node.begin(2, 12, 28).unwrap();
    let loads = [(0, 10), (2, 12)];
    // Nothing ended: the whole timeout, and nothing.
    let t = Instant::now();
    node.layers(0, 10, 27);
    assert!(client
        .wait_ends(&loads, Duration::from_millis(20))
        .unwrap()
        .is_empty());
    assert!(t.elapsed() >= Duration::from_millis(15));
    // An end of one of them, while the other runs.
    let n = Arc::new(node);
    let writer = {
        let n = Arc::clone(&n);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(5));
            n.layers(2, 12, 3);
            n.finish(2, 12, Outcome::Failed { blocks: 4 });
        })
    };
    let got = client.wait_ends(&loads, Duration::from_secs(10)).unwrap();
    writer.join().unwrap();
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!((got[0].0, got[0].1.failed_blocks), (2, 4));
    // An interrupt from another thread ends the wait with nothing ended.
    let waiter = {
        let c = Arc::clone(&client);
        std::thread::spawn(move || {
            let t = Instant::now();
            (
                c.wait_ends(&[(0, 10)], Duration::from_secs(10)),
                t.elapsed(),
            )
        })
    };
    std::thread::sleep(Duration::from_millis(5));
    client.interrupt();
    let (got, took) = waiter.join().unwrap();
    assert!(got.unwrap().is_empty());
    assert!(took < Duration::from_secs(5), "{took:?}");
    // An interrupt before the wait is not lost; it is taken once.
    client.interrupt();
    assert!(client
        .wait_ends(&[(0, 10)], Duration::from_secs(10))
        .unwrap()
        .is_empty());
    let t = Instant::now();
    client
        .wait_ends(&[(0, 10)], Duration::from_millis(10))
        .unwrap();
    assert!(t.elapsed() >= Duration::from_millis(8));
    assert!(matches!(
        client.wait_ends(&[(4, 1)], Duration::ZERO),
        Err(BoardError::SlotRange { slot: 4, slots: 4 })
    ));
}

#[test]
fn a_waiter_wakes_when_its_layer_lands_and_times_out_otherwise() {
    let (client, node) = pair(4);
    let node = Arc::new(node);
    node.begin(1, 5, 10).unwrap();
    let t = Instant::now();
    let v = client.wait(1, 5, 3, Duration::from_millis(30)).unwrap();
    assert!(t.elapsed() >= Duration::from_millis(25));
    assert_eq!(v.layers, 0);
    let n = Arc::clone(&node);
    let writer = std::thread::spawn(move || {
        for l in 1..=10 {
            std::thread::sleep(Duration::from_millis(2));
            n.layers(1, 5, l);
        }
        n.finish(1, 5, Outcome::Ok);
    });
    let v = client.wait(1, 5, 3, Duration::from_secs(10)).unwrap();
    assert!(v.layers >= 3, "{v:?}");
    let v = client.wait(1, 5, 10, Duration::from_secs(10)).unwrap();
    assert!(v.layers == 10);
    writer.join().unwrap();
    let v = client
        .wait(1, 5, u32::MAX, Duration::from_secs(10))
        .unwrap();
    assert_eq!(v.state, SlotState::Ok);
}

#[test]
fn bad_boards_are_refused() {
    // Wrong stated length.
    let c = Board::create(4).unwrap();
    let fd = c.fd().try_clone_to_owned().unwrap();
    assert!(matches!(
        Board::open(fd, board_bytes(5)),
        Err(BoardError::Size { .. })
    ));
    // Not a board: a zeroed memfd.
    let memfd = |flags| {
        let fd = rustix::fs::memfd_create("x", flags).unwrap();
        rustix::fs::ftruncate(&fd, board_bytes(4)).unwrap();
        fd
    };
    use rustix::fs::MemfdFlags;
    assert!(matches!(
        Board::open(memfd(MemfdFlags::ALLOW_SEALING), board_bytes(4)),
        Err(BoardError::Header { magic: 0, .. })
    ));
    // A memfd that could shrink under the node's mapping, and cannot be sealed.
    let e = Board::open(memfd(MemfdFlags::CLOEXEC), board_bytes(4)).unwrap_err();
    assert!(
        matches!(
            e,
            BoardError::Shm {
                source: ShmError::Unsealable { .. }
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("completion board"), "{e}");
    assert!(matches!(
        Board::create(0),
        Err(BoardError::Slots { slots: 0 })
    ));
    assert!(matches!(
        Board::create(MAX_SLOTS + 1),
        Err(BoardError::Slots { .. })
    ));
}
