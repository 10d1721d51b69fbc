//! Completion boards: a load's progress visible to the engine without an RPC. The client
//! creates a small memfd, sends it on the fd socket (`board <instance> <rank> 0 <len>`) and
//! names the handle in `RegisterInstance.completion_board`; each `Load` may then name a slot
//! and a tag. The node writes the slot as the load's layers land and when it ends, and bumps
//! a futex word that wakes the client's waiters (futexes work across processes on shared
//! mappings). The detailed result (bytes, stages, failed blocks) still comes on the
//! `Completions` stream or `PollLoad`; the board says *when*.
//!
//! Layout, little-endian, all fields naturally aligned:
//!
//! ```text
//! 0   u32 magic "KVFB" (0x4246_564b)   4  u32 version (1)   8  u32 slots   12 u32 reserved
//! 16  u32 wake (futex word, bumped on every write)           20..64 reserved
//! 64 + 16·i: slot i —  u64 word = tag << 32 | state << 24 | layers,  u32 total,  u32 reserved
//! ```
//!
//! One 64-bit store publishes a slot's tag, state and landed layers together, so a reader
//! never pairs one load's tag with another's state. States: 0 idle, 1 running, 2 ok, 3 failed.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use thiserror::Error;

use super::shared_map::{futex_wake, poll_then_sleep, MapError, OsError, SharedMap};

pub const MAGIC: u32 = 0x4246_564b;
pub const VERSION: u32 = 1;
pub const HEADER_BYTES: u64 = 64;
pub const SLOT_BYTES: u64 = 16;
/// Most slots a board may have.
pub const MAX_SLOTS: u32 = 4096;

const WAKE_OFFSET: usize = 16;
/// How long [`Board::wait`] polls the slot before sleeping on the futex: a woken sleeper
/// runs tens of microseconds after the node's write (about 50 us on the H200, as much as a
/// one-block copy takes), a poller at once, and loads of up to ~16 blocks end within this.
/// A waiter stands between the engine and its next step anyway; it spins for at most this.
pub const WAIT_SPIN: Duration = Duration::from_millis(1);

/// A slot's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    Idle,
    Running,
    Ok,
    Failed,
}

impl SlotState {
    fn code(self) -> u64 {
        match self {
            SlotState::Idle => 0,
            SlotState::Running => 1,
            SlotState::Ok => 2,
            SlotState::Failed => 3,
        }
    }

    fn from_code(c: u64) -> Self {
        match c {
            1 => SlotState::Running,
            2 => SlotState::Ok,
            3 => SlotState::Failed,
            _ => SlotState::Idle,
        }
    }

    pub fn is_done(self) -> bool {
        matches!(self, SlotState::Ok | SlotState::Failed)
    }
}

/// What one slot says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotView {
    pub tag: u32,
    pub state: SlotState,
    pub layers: u32,
}

fn pack(tag: u32, state: SlotState, layers: u32) -> u64 {
    u64::from(tag) << 32 | state.code() << 24 | u64::from(layers.min(0x00ff_ffff))
}

fn unpack(w: u64) -> SlotView {
    SlotView {
        tag: (w >> 32) as u32,
        state: SlotState::from_code((w >> 24) & 0xff),
        layers: (w & 0x00ff_ffff) as u32,
    }
}

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum BoardError {
    #[error("a board of {slots} slots must be {want} bytes, the memfd has {len}")]
    Size { slots: u32, want: u64, len: u64 },
    #[error("a board has 1 to {MAX_SLOTS} slots, this one says {slots}")]
    Slots { slots: u32 },
    #[error("not a completion board (magic {magic:#x}, version {version})")]
    Header { magic: u32, version: u32 },
    #[error("slot {slot} is out of range (the board has {slots})")]
    SlotRange { slot: u32, slots: u32 },
    #[error("slot {slot} still shows a running load (tag {tag})")]
    SlotBusy { slot: u32, tag: u32 },
    #[error("{call} failed")]
    Os {
        call: &'static str,
        #[source]
        source: std::io::Error,
    },
}

impl From<OsError> for BoardError {
    fn from(e: OsError) -> Self {
        BoardError::Os {
            call: e.call,
            source: e.source,
        }
    }
}

/// Bytes of a board with `slots` slots.
pub fn board_bytes(slots: u32) -> u64 {
    HEADER_BYTES + SLOT_BYTES * u64::from(slots)
}

/// A mapped board (either side).
#[derive(Debug)]
pub struct Board {
    map: SharedMap,
    slots: u32,
}

impl Board {
    /// Creates a board of `slots` slots in a new memfd (the client side): the fd to send,
    /// and the mapping to wait on.
    pub fn create(slots: u32) -> Result<Self, BoardError> {
        if slots == 0 || slots > MAX_SLOTS {
            return Err(BoardError::Slots { slots });
        }
        let b = Self {
            map: SharedMap::create("kvferry-board", board_bytes(slots))?,
            slots,
        };
        b.word32(4).store(VERSION, Ordering::Relaxed);
        b.word32(8).store(slots, Ordering::Relaxed);
        b.word32(0).store(MAGIC, Ordering::Release);
        Ok(b)
    }

    /// Maps a board a client sent (the node side), checking its header and size.
    pub fn open(fd: OwnedFd, len: u64) -> Result<Self, BoardError> {
        let actual = SharedMap::sealed_len(&fd)?;
        if len < HEADER_BYTES || actual < len {
            return Err(BoardError::Size {
                slots: 0,
                want: len.max(HEADER_BYTES),
                len: actual,
            });
    /// The memfd could shrink under the node's mapping (a fault the node cannot catch), and
    /// it cannot be sealed: refused.
    #[error("the completion board memfd cannot be kept from shrinking: {source}")]
    Unsealable {
        #[source]
        source: kvferry_gpu::memfd::SealError,
    },
        }
        // Mapped first; the header's slot count is checked against the stated length below.
        let mut b = Self {
            map: SharedMap::map(fd, len)?,
            slots: 0,
        };
        let (magic, version) = (
            b.word32(0).load(Ordering::Acquire),
impl From<MapError> for BoardError {
    fn from(e: MapError) -> Self {
        match e {
            MapError::Os(e) => e.into(),
            MapError::Unsealable(source) => BoardError::Unsealable { source },
        }
    }
}

            b.word32(4).load(Ordering::Relaxed),
        );
        if magic != MAGIC || version != VERSION {
            return Err(BoardError::Header { magic, version });
        }
        let slots = b.word32(8).load(Ordering::Relaxed);
        if slots == 0 || slots > MAX_SLOTS {
            return Err(BoardError::Slots { slots });
        }
        if board_bytes(slots) != len {
            return Err(BoardError::Size {
                slots,
                want: board_bytes(slots),
                len,
            });
        }
        b.slots = slots;
        Ok(b)
    }

    /// The fd to send to the node.
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.map.fd()
    }

    pub fn slots(&self) -> u32 {
        self.slots
    }

    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    fn word32(&self, off: usize) -> &AtomicU32 {
        self.map.word32(off)
    }

    fn slot_word(&self, slot: u32) -> &AtomicU64 {
        // Callers check `slot < self.slots`, which `open` checked against the length.
        self.map
            .word64((HEADER_BYTES + SLOT_BYTES * u64::from(slot)) as usize)
    }

    fn slot_total(&self, slot: u32) -> &AtomicU32 {
        self.map
            .word32((HEADER_BYTES + SLOT_BYTES * u64::from(slot)) as usize + 8)
    }

    fn check(&self, slot: u32) -> Result<(), BoardError> {
        if slot >= self.slots {
            return Err(BoardError::SlotRange {
                slot,
                slots: self.slots,
            });
        }
        Ok(())
    }

    /// What slot `slot` says now.
    pub fn view(&self, slot: u32) -> Result<SlotView, BoardError> {
        self.check(slot)?;
        Ok(unpack(self.slot_word(slot).load(Ordering::Acquire)))
    }

    /// The layer count of the load that slot `slot` shows (what its `begin` said).
    pub fn total(&self, slot: u32) -> Result<u32, BoardError> {
        self.check(slot)?;
        Ok(self.slot_total(slot).load(Ordering::Relaxed))
    }

    fn publish(&self, slot: u32, v: SlotView) {
        self.slot_word(slot)
            .store(pack(v.tag, v.state, v.layers), Ordering::Release);
        self.wake();
    }

    fn wake(&self) {
        self.word32(WAKE_OFFSET).fetch_add(1, Ordering::Release);
        futex_wake(self.word32(WAKE_OFFSET));
    }

    /// Node side: a load starts in `slot` under `tag` with `total` layers. Refused while the
    /// slot still shows a running load.
    pub fn begin(&self, slot: u32, tag: u32, total: u32) -> Result<(), BoardError> {
        let v = self.view(slot)?;
        if v.state == SlotState::Running {
            return Err(BoardError::SlotBusy { slot, tag: v.tag });
        }
        self.slot_total(slot).store(total, Ordering::Relaxed);
        self.publish(
            slot,
            SlotView {
                tag,
                state: SlotState::Running,
                layers: 0,
            },
        );
        Ok(())
    }

    /// Node side: `layers` have landed (ignored if the slot moved on or already shows more).
    /// Reports may come from two threads (the device's completion thread and the node's), so
    /// the count only grows and never overwrites an end.
    pub fn layers(&self, slot: u32, tag: u32, layers: u32) {
        if self.check(slot).is_err() {
            return;
        }
        let word = self.slot_word(slot);
        let mut cur = word.load(Ordering::Acquire);
        loop {
            let v = unpack(cur);
            if v.tag != tag || v.state != SlotState::Running || v.layers >= layers {
                return;
            }
            let next = pack(tag, SlotState::Running, layers);
            match word.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
        self.wake();
    }

    /// Node side: the load ended (its result is already available to `PollLoad`).
    pub fn finish(&self, slot: u32, tag: u32, ok: bool) {
        let Ok(v) = self.view(slot) else { return };
        if v.tag != tag {
            return;
        }
        let total = self.slot_total(slot).load(Ordering::Relaxed);
        self.publish(
            slot,
            SlotView {
                tag,
                state: if ok { SlotState::Ok } else { SlotState::Failed },
                layers: if ok { total } else { v.layers },
            },
        );
    }

    /// Client side: waits until slot `slot` shows `tag` with at least `layers` landed or the
    /// load ended, or until `timeout`. Returns what the slot says then (the caller checks).
    pub fn wait(
        &self,
        slot: u32,
        tag: u32,
        layers: u32,
        timeout: Duration,
    ) -> Result<SlotView, BoardError> {
        self.wait_spinning(slot, tag, layers, timeout, WAIT_SPIN)
    }

    /// [`Board::wait`], polling for `spin` (at most `timeout`) before sleeping: a waiter
    /// that expects a longer load and can spare a core sees its end sooner.
    pub fn wait_spinning(
        &self,
        slot: u32,
        tag: u32,
        layers: u32,
        timeout: Duration,
        spin: Duration,
    ) -> Result<SlotView, BoardError> {
        self.check(slot)?;
        // Every write bumps the wake word after the slot.
        let seen = poll_then_sleep(self.word32(WAKE_OFFSET), spin, timeout, || {
            let v = unpack(self.slot_word(slot).load(Ordering::Acquire));
            (v.tag == tag && (v.state.is_done() || v.layers >= layers)).then_some(v)
        });
        match seen {
            Some(v) => Ok(v),
            None => self.view(slot),
        }
    }
}

#[cfg(test)]
mod tests {
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
                layers: 0
            }
        );
        node.layers(3, 77, 4);
        node.layers(3, 77, 2); // never backwards
        node.layers(3, 76, 20); // another load's tag: ignored
        assert_eq!(client.view(3).unwrap().layers, 4);
        // Busy while running.
        assert!(matches!(
            node.begin(3, 78, 28),
            Err(BoardError::SlotBusy { slot: 3, tag: 77 })
        ));
        node.finish(3, 77, true);
        let v = client.view(3).unwrap();
        assert_eq!((v.state, v.layers), (SlotState::Ok, 28));
        // Reusable once done; a failure keeps the layers that had landed.
        node.begin(3, 78, 28).unwrap();
        node.layers(3, 78, 5);
        node.finish(3, 78, false);
        let v = client.view(3).unwrap();
        assert_eq!((v.tag, v.state, v.layers), (78, SlotState::Failed, 5));
        assert!(matches!(
            node.begin(8, 1, 1),
            Err(BoardError::SlotRange { slot: 8, slots: 8 })
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
            n.finish(1, 5, true);
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
        assert!(matches!(
            Board::create(0),
            Err(BoardError::Slots { slots: 0 })
        ));
        assert!(matches!(
            Board::create(MAX_SLOTS + 1),
            Err(BoardError::Slots { .. })
        ));
    }
}
        // A memfd that could shrink under the node's mapping, and cannot be sealed.
        let e = Board::open(memfd(MemfdFlags::CLOEXEC), board_bytes(4)).unwrap_err();
        assert!(matches!(e, BoardError::Unsealable { .. }), "{e}");
        assert!(e.to_string().contains("completion board"), "{e}");
