//! Completion boards: a load's progress visible to the engine without an RPC. The client
//! creates a small memfd, sends it on the fd socket (`board <instance> <rank> 0 <len>`) and
//! names the handle in `RegisterInstance.completion_board`; each `Load` may then name a slot
//! and a tag. The node writes the slot as the load's layers land and when it ends, and bumps
//! a futex word that wakes the client's waiters (futexes work across processes on shared
//! mappings). The slot's final word carries the outcome: ok, or failed with how many
//! destination blocks failed. An engine reports a load that ended ok on the board alone;
//! only a failure's details (the error, which blocks) need a `PollLoad`.
//!
//! Layout, little-endian, all fields naturally aligned:
//!
//! ```text
//! 0   u32 magic "KVFB" (0x4246_564b)   4  u32 version (2)   8  u32 slots
//! 12  u32 accepted (the version the node took it as, written by the node; 0 before)
//! 16  u32 wake (futex word, bumped on every write)           20..64 reserved
//! 64 + 16·i: slot i —  u64 word = tag << 32 | state << 24 | count,  u32 total,  u32 reserved
//! ```
//!
//! One 64-bit store publishes a slot's tag, state and count together, so a reader never
//! pairs one load's tag with another's state or outcome. States: 0 idle, 1 running, 2 ok,
//! 3 failed. The 24-bit count is the layers landed while running (every layer once ok), and
//! the failed destination blocks once failed (a load names at most
//! [`crate::MAX_ENGINE_BLOCKS`]). Version 1 boards wrote the landed layers in a failed
//! slot, which a reader of this version would take for failed blocks: the node refuses a
//! board of any other version, and writes the version it took it as into the header, which
//! `EngineClient::send_board` (in `kvferry-client`) checks (a node that did not say so is
//! refused on the client side).

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use thiserror::Error;

use super::shared_map::{futex_wake, poll_then_sleep, SharedMap, ShmError};

pub const MAGIC: u32 = 0x4246_564b;
/// The board layout and word this build writes and reads (2: a failed slot's count is its
/// failed blocks).
pub const VERSION: u32 = 2;
pub const HEADER_BYTES: u64 = 64;
pub const SLOT_BYTES: u64 = 16;
/// Most slots a board may have.
pub const MAX_SLOTS: u32 = 4096;

/// Where the node writes the version it took the board as (the header's word at 12).
const ACCEPTED_OFFSET: usize = 12;
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

/// How a load ended, as its slot's final word says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    /// `blocks` of its destination blocks failed (all of them, today: a load fails whole).
    Failed {
        blocks: u32,
    },
}

/// What one slot says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotView {
    pub tag: u32,
    pub state: SlotState,
    /// Layers landed (every layer once ok; 0 once failed: the word carries the failed
    /// blocks instead).
    pub layers: u32,
    /// Destination blocks that failed (0 unless failed).
    pub failed_blocks: u32,
}

impl SlotView {
    /// The load's outcome once it ended; `None` while it runs (or the slot is idle).
    pub fn outcome(&self) -> Option<Outcome> {
        match self.state {
            SlotState::Ok => Some(Outcome::Ok),
            SlotState::Failed => Some(Outcome::Failed {
                blocks: self.failed_blocks,
            }),
            SlotState::Idle | SlotState::Running => None,
        }
    }
}

/// The largest count a slot word holds.
const COUNT_MAX: u32 = 0x00ff_ffff;

fn pack(tag: u32, state: SlotState, count: u32) -> u64 {
    u64::from(tag) << 32 | state.code() << 24 | u64::from(count.min(COUNT_MAX))
}

fn unpack(w: u64) -> SlotView {
    let state = SlotState::from_code((w >> 24) & 0xff);
    let count = (w & u64::from(COUNT_MAX)) as u32;
    let (layers, failed_blocks) = match state {
        SlotState::Failed => (0, count),
        _ => (count, 0),
    };
    SlotView {
        tag: (w >> 32) as u32,
        state,
        layers,
        failed_blocks,
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
    #[error(
        "the node did not take the completion board as version {VERSION} (it says {version}; \
         0: an older node)"
    )]
    NotAccepted { version: u32 },
    #[error("slot {slot} is out of range (the board has {slots})")]
    SlotRange { slot: u32, slots: u32 },
    #[error("slot {slot} still shows a running load (tag {tag})")]
    SlotBusy { slot: u32, tag: u32 },
    /// Its memfd could not be made or mapped, or could shrink under the node's mapping.
    #[error("the completion board memfd: {source}")]
    Shm {
        #[from]
        source: ShmError,
    },
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
    /// Set by [`Board::interrupt`], taken by the next [`Board::wait_ends`] (this process
    /// only: not in the shared mapping).
    interrupted: AtomicBool,
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
            interrupted: AtomicBool::new(false),
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
        }
        // Mapped first; the header's slot count is checked against the stated length below.
        let mut b = Self {
            map: SharedMap::map(fd, len)?,
            slots: 0,
            interrupted: AtomicBool::new(false),
        };
        let (magic, version) = (
            b.word32(0).load(Ordering::Acquire),
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
        // What this node reads and writes, for the client to check (see `accepted`).
        b.word32(ACCEPTED_OFFSET).store(VERSION, Ordering::Release);
        Ok(b)
    }

    /// Client side, once the node has taken the board: refused unless the node said it
    /// writes this build's version (a node that took it without saying so, or says another
    /// version, would write words this client reads wrong).
    pub fn accepted(&self) -> Result<(), BoardError> {
        match self.word32(ACCEPTED_OFFSET).load(Ordering::Acquire) {
            VERSION => Ok(()),
            version => Err(BoardError::NotAccepted { version }),
        }
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

    fn publish(&self, slot: u32, tag: u32, state: SlotState, count: u32) {
        self.slot_word(slot)
            .store(pack(tag, state, count), Ordering::Release);
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
        self.publish(slot, tag, SlotState::Running, 0);
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

    /// Node side: the load ended with `outcome` (its details are already available to
    /// `PollLoad`). A failure of more blocks than a word holds shows the most it holds;
    /// a failure of none shows one, so a reader never sees a failed load without a block.
    pub fn finish(&self, slot: u32, tag: u32, outcome: Outcome) {
        let Ok(v) = self.view(slot) else { return };
        if v.tag != tag {
            return;
        }
        match outcome {
            Outcome::Ok => {
                let total = self.slot_total(slot).load(Ordering::Relaxed);
                self.publish(slot, tag, SlotState::Ok, total);
            }
            Outcome::Failed { blocks } => {
                self.publish(slot, tag, SlotState::Failed, blocks.clamp(1, COUNT_MAX));
            }
        }
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

impl Board {
    /// Client side: waits until at least one of `loads` (slot, tag) shows its end, an
    /// [`Board::interrupt`] came since the last call, or `timeout` passed; returns the ended
    /// loads with what their slots say (none: interrupted or timed out). For the one thread
    /// of a rank that watches all its loads at once: it sleeps through the layers landing
    /// and wakes for an end, or when it has a new load to start. Slots out of range are
    /// refused before waiting.
    pub fn wait_ends(
        &self,
        loads: &[(u32, u32)],
        timeout: Duration,
    ) -> Result<Vec<(u32, SlotView)>, BoardError> {
        for &(slot, _) in loads {
            self.check(slot)?;
        }
        let ended = |out: &mut Vec<(u32, SlotView)>| {
            for &(slot, tag) in loads {
                let v = unpack(self.slot_word(slot).load(Ordering::Acquire));
                if v.tag == tag && v.state.is_done() {
                    out.push((slot, v));
                }
            }
        };
        let seen = poll_then_sleep(self.word32(WAKE_OFFSET), WAIT_SPIN, timeout, || {
            let mut out = Vec::new();
            ended(&mut out);
            if !out.is_empty() || self.interrupted.swap(false, Ordering::AcqRel) {
                return Some(out);
            }
            None
        });
        Ok(seen.unwrap_or_default())
    }

    /// Ends the current (or the next) [`Board::wait_ends`] of this process at once: a new
    /// load was handed to the waiting thread.
    pub fn interrupt(&self) {
        self.interrupted.store(true, Ordering::Release);
        self.wake();
    }
}

#[cfg(test)]
mod tests;
