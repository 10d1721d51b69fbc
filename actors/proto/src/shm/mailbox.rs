//! Request mailboxes: `Query`, `Load` and `Save` without the gRPC stack. A gRPC call crosses the
//! client's runtime, HTTP/2 on both sides and a wake-up of a parked node thread each way
//! (70–170 us on the H200, more than a one-block copy); a mailbox is a small memfd the
//! client sends on the fd socket (`mailbox <instance> <rank> 0 <len>`) and attaches to its
//! `Session` (`SessionRequest.mailbox`). The client writes a request's protobuf encoding into
//! a free slot and rings the doorbell; a node thread that polls for a while after each request
//! (and sleeps on the doorbell's futex otherwise) runs it through the same handler as the gRPC
//! call and writes the answer back into the slot, where the client polls for it.
//!
//! Layout, little-endian, all fields naturally aligned:
//!
//! ```text
//! 0   u32 magic "KVFM" (0x4d46_564b)   4  u32 version (1)   8  u32 slots   12 u32 slot_bytes
//! 16  u32 doorbell (futex word the client bumps after posting)
//! 20  u32 closed (the client is done: 1)   24 u32 polling (1 while the node polls)
//! 64 + i·(64 + slot_bytes): slot i — u32 state (futex word), u32 op, u32 len, u32 code,
//!                           48 reserved, then slot_bytes of request or answer
//! ```
//!
//! A slot's state goes free (0) → posted (1, client) → taken (2, node) → answered (3, node)
//! → free (client, once it read the answer). Ops: 1 `Query` (a `QueryRequest`, answered with
//! a `QueryResponse`), 2 `Load` (`LoadRequest` → `LoadResponse`), 3 `Save` (`SaveRequest` →
//! `StoreResponse`). An answer's code is 0 with
//! the response message, or a gRPC status code with its message in UTF-8. The node trusts
//! nothing it reads: lengths are bounded by the slot, payloads are copied out before they are
//! decoded, and it writes only into the slot it answers.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use thiserror::Error;

use super::shared_map::{futex_wait, futex_wake, poll_then_sleep, SharedMap, ShmError};

pub const MAGIC: u32 = 0x4d46_564b;
pub const VERSION: u32 = 1;
pub const HEADER_BYTES: u64 = 64;
pub const SLOT_HEADER_BYTES: u64 = 64;
/// Most slots a mailbox may have (one per request a client has in flight at once).
pub const MAX_SLOTS: u32 = 64;
/// Bounds of one slot's payload, a multiple of 64.
pub const MIN_SLOT_BYTES: u32 = 4 << 10;
pub const MAX_SLOT_BYTES: u32 = 4 << 20;
/// What [`Mailbox::create`] callers take by default: four requests in flight, each up to a
/// query of the most hashes a request may carry (4,096 of 32 bytes, packed).
pub const DEFAULT_SLOTS: u32 = 4;
pub const DEFAULT_SLOT_BYTES: u32 = 256 << 10;
/// How long a client polls for an answer before sleeping on the slot.
pub const ANSWER_SPIN: Duration = Duration::from_millis(2);

const DOORBELL: usize = 16;
const CLOSED: usize = 20;
const POLLING: usize = 24;

const FREE: u32 = 0;
const POSTED: u32 = 1;
const TAKEN: u32 = 2;
const ANSWERED: u32 = 3;

/// What a request asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Query,
    Load,
    Save,
}

impl Op {
    pub fn code(self) -> u32 {
        match self {
            Op::Query => 1,
            Op::Load => 2,
            Op::Save => 3,
        }
    }

    pub fn from_code(c: u32) -> Option<Self> {
        match c {
            1 => Some(Op::Query),
            2 => Some(Op::Load),
            3 => Some(Op::Save),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Op::Query => "query",
            Op::Load => "load",
            Op::Save => "save",
        }
    }
}

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum MailboxError {
    #[error(
        "a mailbox has 1 to {MAX_SLOTS} slots of {MIN_SLOT_BYTES} to {MAX_SLOT_BYTES} bytes (a \
         multiple of 64); this one says {slots} of {slot_bytes}"
    )]
    Shape { slots: u32, slot_bytes: u32 },
    #[error("a mailbox of its header's shape is {want} bytes, the memfd has {len}")]
    Size { want: u64, len: u64 },
    #[error("not a request mailbox (magic {magic:#x}, version {version})")]
    Header { magic: u32, version: u32 },
    #[error("a {op} request of {len} bytes does not fit a slot of {slot_bytes}")]
    TooLarge {
        op: &'static str,
        len: usize,
        slot_bytes: u32,
    },
    #[error("all {slots} slots hold requests in flight")]
    Full { slots: u32 },
    #[error("the mailbox is closed: the node's thread for it stopped, or the client closed it")]
    Closed,
    #[error("no answer to a {op} request within {waited:?}")]
    TimedOut { op: &'static str, waited: Duration },
    #[error("the node answered with a length of {len} bytes, past the slot")]
    BadAnswer { len: u32 },
    /// Its memfd could not be made or mapped, or could shrink under the node's mapping.
    #[error("the request mailbox memfd: {source}")]
    Shm {
        #[from]
        source: ShmError,
    },
}

/// Bytes of a mailbox of `slots` slots of `slot_bytes` each.
pub fn mailbox_bytes(slots: u32, slot_bytes: u32) -> u64 {
    HEADER_BYTES + u64::from(slots) * (SLOT_HEADER_BYTES + u64::from(slot_bytes))
}

fn check_shape(slots: u32, slot_bytes: u32) -> Result<(), MailboxError> {
    let ok = (1..=MAX_SLOTS).contains(&slots)
        && (MIN_SLOT_BYTES..=MAX_SLOT_BYTES).contains(&slot_bytes)
        && slot_bytes.is_multiple_of(64);
    if ok {
        Ok(())
    } else {
        Err(MailboxError::Shape { slots, slot_bytes })
    }
}

/// A mapped mailbox (either side).
#[derive(Debug)]
pub struct Mailbox {
    map: SharedMap,
    slots: u32,
    slot_bytes: u32,
    /// Client side: the slots this process has a ticket for.
    claimed: Mutex<u64>,
    /// Node side: where the next scan starts, so no slot waits behind a busy one.
    cursor: AtomicU32,
}

/// A request taken from a slot (node side). `request` is `None` when the slot's stated
/// length lies past the slot.
#[derive(Debug)]
pub struct Taken {
    pub slot: u32,
    pub op: u32,
    pub request: Option<Vec<u8>>,
}

/// What the node answered.
#[derive(Debug, PartialEq, Eq)]
pub struct Answer {
    /// 0, or the gRPC status code.
    pub code: u32,
    /// The response message, or the status message.
    pub payload: Vec<u8>,
}

impl Mailbox {
    /// A new mailbox in a new memfd (the client side).
    pub fn create(slots: u32, slot_bytes: u32) -> Result<Self, MailboxError> {
        check_shape(slots, slot_bytes)?;
        let m = Self::new(
            SharedMap::create("kvferry-mailbox", mailbox_bytes(slots, slot_bytes))?,
            slots,
            slot_bytes,
        );
        m.map.word32(4).store(VERSION, Ordering::Relaxed);
        m.map.word32(8).store(slots, Ordering::Relaxed);
        m.map.word32(12).store(slot_bytes, Ordering::Relaxed);
        m.map.word32(0).store(MAGIC, Ordering::Release);
        Ok(m)
    }

    /// Maps a mailbox a client sent (the node side), checking its header against `len`.
    pub fn open(fd: OwnedFd, len: u64) -> Result<Self, MailboxError> {
        let actual = SharedMap::sealed_len(&fd)?;
        if len < HEADER_BYTES || actual < len {
            return Err(MailboxError::Size {
                want: len.max(HEADER_BYTES),
                len: actual,
            });
        }
        // Mapped whole (the file holds `len` bytes); the header is checked against `len` below.
        let map = SharedMap::map(fd, len)?;
        let (magic, version) = (
            map.word32(0).load(Ordering::Acquire),
            map.word32(4).load(Ordering::Relaxed),
        );
        if magic != MAGIC || version != VERSION {
            return Err(MailboxError::Header { magic, version });
        }
        let (slots, slot_bytes) = (
            map.word32(8).load(Ordering::Relaxed),
            map.word32(12).load(Ordering::Relaxed),
        );
        check_shape(slots, slot_bytes)?;
        let want = mailbox_bytes(slots, slot_bytes);
        if want != len {
            return Err(MailboxError::Size { want, len });
        }
        // The shape is kept here: a client that rewrites its header later changes nothing on
        // this side.
        Ok(Self::new(map, slots, slot_bytes))
    }

    fn new(map: SharedMap, slots: u32, slot_bytes: u32) -> Self {
        Self {
            map,
            slots,
            slot_bytes,
            claimed: Mutex::new(0),
            cursor: AtomicU32::new(0),
        }
    }

    /// The fd to send to the node.
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.map.fd()
    }

    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    pub fn slots(&self) -> u32 {
        self.slots
    }

    pub fn slot_bytes(&self) -> u32 {
        self.slot_bytes
    }

    fn slot_off(&self, slot: u32) -> usize {
        (HEADER_BYTES + u64::from(slot) * (SLOT_HEADER_BYTES + u64::from(self.slot_bytes))) as usize
    }

    fn state(&self, slot: u32) -> &AtomicU32 {
        self.map.word32(self.slot_off(slot))
    }

    fn field(&self, slot: u32, i: usize) -> &AtomicU32 {
        self.map.word32(self.slot_off(slot) + 4 * i)
    }

    fn payload_off(&self, slot: u32) -> usize {
        self.slot_off(slot) + SLOT_HEADER_BYTES as usize
    }

    // ---- client side ----

    /// Posts `request` as `op` in a free slot and rings the doorbell. The ticket waits for
    /// the answer; dropped before it, the slot stays out of use until the node answered.
    pub fn post(self: &Arc<Self>, op: Op, request: &[u8]) -> Result<Ticket, MailboxError> {
        if self.is_closed() {
            return Err(MailboxError::Closed);
        }
        if request.len() > self.slot_bytes as usize {
            return Err(MailboxError::TooLarge {
                op: op.as_str(),
                len: request.len(),
                slot_bytes: self.slot_bytes,
            });
        }
        let slot = {
            let mut claimed = self.claimed.lock().unwrap_or_else(|p| p.into_inner());
            let slot = (0..self.slots)
                .find(|&s| {
                    *claimed & (1 << s) == 0
                        && matches!(self.state(s).load(Ordering::Acquire), FREE | ANSWERED)
                })
                .ok_or(MailboxError::Full { slots: self.slots })?;
            *claimed |= 1 << slot;
            slot
        };
        self.map.write(self.payload_off(slot), request);
        self.field(slot, 1).store(op.code(), Ordering::Relaxed);
        self.field(slot, 2)
            .store(request.len() as u32, Ordering::Relaxed);
        self.state(slot).store(POSTED, Ordering::SeqCst);
        self.ring_if_asleep();
        Ok(Ticket {
            mailbox: Arc::clone(self),
            slot,
            op,
        })
    }

    /// Wakes the node's thread unless it says it polls. Ordered with its `set_polling`: a
    /// thread that stops polling scans the slots once more before it sleeps.
    fn ring_if_asleep(&self) {
        self.map.word32(DOORBELL).fetch_add(1, Ordering::SeqCst);
        if self.map.word32(POLLING).load(Ordering::SeqCst) == 0 {
            futex_wake(self.map.word32(DOORBELL));
        }
    }

    /// Tells the node this client is done (its thread for the mailbox ends); also what
    /// dropping the client's mailbox does, and what the node's thread does when it stops
    /// taking requests (later posts are refused at once instead of waiting for an answer that
    /// cannot come).
    pub fn close(&self) {
        self.map.word32(CLOSED).store(1, Ordering::SeqCst);
        self.ring();
    }

    // ---- node side ----

    /// Takes the next posted request, if any.
    pub fn take(&self) -> Option<Taken> {
        let start = self.cursor.load(Ordering::Relaxed);
        for i in 0..self.slots {
            let slot = (start + i) % self.slots;
            let st = self.state(slot);
            if st.load(Ordering::Acquire) != POSTED
                || st
                    .compare_exchange(POSTED, TAKEN, Ordering::AcqRel, Ordering::Acquire)
                    .is_err()
            {
                continue;
            }
            self.cursor.store(slot + 1, Ordering::Relaxed);
            let op = self.field(slot, 1).load(Ordering::Relaxed);
            let len = self.field(slot, 2).load(Ordering::Relaxed);
            let request = (len <= self.slot_bytes)
                .then(|| self.map.read(self.payload_off(slot), len as usize))
                .flatten();
            return Some(Taken { slot, op, request });
        }
        None
    }

    /// Whether a request waits in some slot.
    pub fn has_posted(&self) -> bool {
        (0..self.slots).any(|s| self.state(s).load(Ordering::SeqCst) == POSTED)
    }

    /// Answers `slot` and wakes its waiter. An answer past the slot becomes a
    /// RESOURCE_EXHAUSTED one saying so.
    pub fn answer(&self, slot: u32, code: u32, payload: &[u8]) {
        if slot >= self.slots {
            return;
        }
        let long;
        let (code, payload) = if payload.len() > self.slot_bytes as usize {
            long = format!(
                "the answer ({} bytes) does not fit the mailbox slot ({} bytes)",
                payload.len(),
                self.slot_bytes
            );
            (tonic::Code::ResourceExhausted as u32, long.as_bytes())
        } else {
            (code, payload)
        };
        self.map.write(self.payload_off(slot), payload);
        self.field(slot, 2)
            .store(payload.len() as u32, Ordering::Relaxed);
        self.field(slot, 3).store(code, Ordering::Relaxed);
        self.state(slot).store(ANSWERED, Ordering::Release);
        futex_wake(self.state(slot));
    }

    /// The doorbell's count, read before a last scan and then slept on.
    pub fn doorbell(&self) -> u32 {
        self.map.word32(DOORBELL).load(Ordering::SeqCst)
    }

    /// Node side: whether its thread polls (clients then skip the wake-up call).
    pub fn set_polling(&self, polling: bool) {
        self.map
            .word32(POLLING)
            .store(u32::from(polling), Ordering::SeqCst);
    }

    /// Sleeps while the doorbell still shows `seen`, at most `timeout`.
    pub fn sleep(&self, seen: u32, timeout: Duration) {
        futex_wait(self.map.word32(DOORBELL), seen, timeout);
    }

    /// Wakes whoever sleeps on the doorbell (the node stopping its own thread, or a close).
    pub fn ring(&self) {
        self.map.word32(DOORBELL).fetch_add(1, Ordering::SeqCst);
        futex_wake(self.map.word32(DOORBELL));
    }

    pub fn is_closed(&self) -> bool {
        self.map.word32(CLOSED).load(Ordering::SeqCst) != 0
    }
}

/// One request in flight (client side).
#[derive(Debug)]
pub struct Ticket {
    mailbox: Arc<Mailbox>,
    slot: u32,
    op: Op,
}

impl Ticket {
    /// The answer, if the node has written it.
    pub fn try_answer(&self) -> Result<Option<Answer>, MailboxError> {
        let m = &self.mailbox;
        if m.state(self.slot).load(Ordering::Acquire) != ANSWERED {
            return Ok(None);
        }
        let code = m.field(self.slot, 3).load(Ordering::Relaxed);
        let len = m.field(self.slot, 2).load(Ordering::Relaxed);
        let payload = (len <= m.slot_bytes)
            .then(|| m.map.read(m.payload_off(self.slot), len as usize))
            .flatten();
        m.state(self.slot).store(FREE, Ordering::Release);
        let payload = payload.ok_or(MailboxError::BadAnswer { len })?;
        Ok(Some(Answer { code, payload }))
    }

    /// Waits for the answer: polls for `spin`, then sleeps on the slot, for `timeout` in
    /// all.
    pub fn wait(&self, spin: Duration, timeout: Duration) -> Result<Answer, MailboxError> {
        // The node stores the slot's state last, then wakes it.
        poll_then_sleep(self.mailbox.state(self.slot), spin, timeout, || {
            self.try_answer().transpose()
        })
        .unwrap_or(Err(MailboxError::TimedOut {
            op: self.op.as_str(),
            waited: timeout,
        }))
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        // The slot is free again for this process once the node has answered (`post` checks
        // its state), whether or not the answer was read.
        let mut claimed = self
            .mailbox
            .claimed
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        *claimed &= !(1 << self.slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn pair(slots: u32) -> (Arc<Mailbox>, Mailbox) {
        let client = Arc::new(Mailbox::create(slots, MIN_SLOT_BYTES).unwrap());
        let fd = client.fd().try_clone_to_owned().unwrap();
        let node = Mailbox::open(fd, mailbox_bytes(slots, MIN_SLOT_BYTES)).unwrap();
        (client, node)
    }

    #[test]
    fn a_request_and_its_answer_cross_and_the_slot_is_reused() {
        for op in [Op::Query, Op::Load, Op::Save] {
            assert_eq!(Op::from_code(op.code()), Some(op));
        }
        assert_eq!(Op::from_code(0), None);
        let (client, node) = pair(2);
        assert!(node.take().is_none());
        let t = client.post(Op::Query, b"hello").unwrap();
        assert!(t.try_answer().unwrap().is_none());
        let got = node.take().unwrap();
        assert_eq!((got.op, got.request.as_deref()), (1, Some(&b"hello"[..])));
        assert!(node.take().is_none(), "taken once");
        node.answer(got.slot, 0, b"world");
        let a = t.wait(Duration::ZERO, Duration::from_secs(1)).unwrap();
        assert_eq!(
            a,
            Answer {
                code: 0,
                payload: b"world".to_vec()
            }
        );
        drop(t);
        // Both slots usable again, and two requests are taken in turn.
        let (a, b) = (
            client.post(Op::Load, b"a").unwrap(),
            client.post(Op::Query, b"b").unwrap(),
        );
        let (x, y) = (node.take().unwrap(), node.take().unwrap());
        assert_ne!(x.slot, y.slot);
        node.answer(x.slot, 5, b"no");
        node.answer(y.slot, 0, b"");
        let answers = [
            a.wait(Duration::ZERO, Duration::from_secs(1)).unwrap(),
            b.wait(Duration::ZERO, Duration::from_secs(1)).unwrap(),
        ];
        assert!(answers.iter().any(|a| a.code == 5 && a.payload == b"no"));
    }

    #[test]
    fn an_abandoned_slot_waits_for_its_answer_before_reuse() {
        let (client, node) = pair(1);
        let t = client.post(Op::Query, b"x").unwrap();
        assert!(matches!(
            client.post(Op::Query, b"y"),
            Err(MailboxError::Full { slots: 1 })
        ));
        drop(t);
        assert!(
            matches!(client.post(Op::Query, b"y"), Err(MailboxError::Full { .. })),
            "posted, not answered: the node may still write its answer there"
        );
        let got = node.take().unwrap();
        assert!(matches!(
            client.post(Op::Query, b"y"),
            Err(MailboxError::Full { .. })
        ));
        node.answer(got.slot, 0, b"late");
        let t = client.post(Op::Query, b"y").unwrap();
        assert_eq!(node.take().unwrap().request.unwrap(), b"y");
        // Nothing answered: the wait ends at its deadline with the op named.
        let e = t
            .wait(Duration::ZERO, Duration::from_millis(20))
            .unwrap_err();
        assert!(
            matches!(e, MailboxError::TimedOut { op: "query", .. }),
            "{e}"
        );
    }

    #[test]
    fn what_a_client_scribbles_is_bounded() {
        let (client, node) = pair(1);
        let big = vec![0u8; MIN_SLOT_BYTES as usize + 1];
        assert!(matches!(
            client.post(Op::Load, &big),
            Err(MailboxError::TooLarge { op: "load", .. })
        ));
        let t = client.post(Op::Load, b"abc").unwrap();
        // A length past the slot, and an op nobody knows.
        client.field(0, 2).store(u32::MAX, Ordering::Relaxed);
        client.field(0, 1).store(77, Ordering::Relaxed);
        let got = node.take().unwrap();
        assert_eq!((got.op, got.request), (77, None));
        // An answer past the slot becomes a short refusal.
        node.answer(got.slot, 0, &big);
        let a = t.wait(Duration::ZERO, Duration::from_secs(1)).unwrap();
        assert_eq!(a.code, tonic::Code::ResourceExhausted as u32);
        assert!(String::from_utf8(a.payload)
            .unwrap()
            .contains("does not fit"));
        node.answer(5, 0, b"out of range: ignored");
    }

    #[test]
    fn bad_mailboxes_are_refused() {
        let c = Mailbox::create(2, MIN_SLOT_BYTES).unwrap();
        let fd = c.fd().try_clone_to_owned().unwrap();
        assert!(matches!(
            Mailbox::open(fd, mailbox_bytes(3, MIN_SLOT_BYTES)),
            Err(MailboxError::Size { .. })
        ));
        let memfd = |flags| {
            let fd = rustix::fs::memfd_create("x", flags).unwrap();
            rustix::fs::ftruncate(&fd, mailbox_bytes(2, MIN_SLOT_BYTES)).unwrap();
            fd
        };
        use rustix::fs::MemfdFlags;
        assert!(matches!(
            Mailbox::open(
                memfd(MemfdFlags::ALLOW_SEALING),
                mailbox_bytes(2, MIN_SLOT_BYTES)
            ),
            Err(MailboxError::Header { magic: 0, .. })
        ));
        // A memfd that could shrink under the node's mapping, and cannot be sealed.
        let e = Mailbox::open(memfd(MemfdFlags::CLOEXEC), mailbox_bytes(2, MIN_SLOT_BYTES))
            .unwrap_err();
        assert!(
            matches!(
                e,
                MailboxError::Shm {
                    source: ShmError::Unsealable { .. }
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("request mailbox"), "{e}");
        for (slots, bytes) in [
            (0, MIN_SLOT_BYTES),
            (MAX_SLOTS + 1, MIN_SLOT_BYTES),
            (1, 100),
            (1, MAX_SLOT_BYTES + 64),
        ] {
            assert!(matches!(
                Mailbox::create(slots, bytes),
                Err(MailboxError::Shape { .. })
            ));
        }
    }

    #[test]
    fn a_sleeping_node_thread_wakes_on_a_post_and_on_close() {
        let (client, node) = pair(1);
        let node = Arc::new(node);
        node.set_polling(false);
        let n = Arc::clone(&node);
        let server = std::thread::spawn(move || {
            let mut served = 0;
            while !n.is_closed() {
                let seen = n.doorbell();
                match n.take() {
                    Some(t) => {
                        n.answer(t.slot, 0, &t.request.unwrap());
                        served += 1;
                    }
                    None => n.sleep(seen, Duration::from_secs(30)),
                }
            }
            served
        });
        let t0 = Instant::now();
        for i in 0..3u8 {
            std::thread::sleep(Duration::from_millis(5));
            let t = client.post(Op::Query, &[i]).unwrap();
            let a = t.wait(Duration::ZERO, Duration::from_secs(10)).unwrap();
            assert_eq!(a.payload, [i]);
        }
        client.close();
        assert_eq!(server.join().unwrap(), 3);
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "woken, not timed out"
        );
    }
}
