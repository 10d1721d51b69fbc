//! Fences: the moment a requester gives up on a request, on a clock it shares with its node.
//!
//! An engine and its node share a host (the engine's KV reaches the node as a memfd, a
//! DMA-BUF or a CUDA IPC handle), so both read the same `CLOCK_MONOTONIC`. A Save, PutBlocks
//! or Query may carry a [`Fence`] (protocol 6): the nanosecond on that clock at which its
//! client stops waiting for the answer. The node checks it at the one point where the
//! request takes effect — a save's blocks are sealed only if the copies out of the engine's
//! memory completed before the fence, a query's lease is handed out only before it — and
//! otherwise discards what it did and answers the runtime's `NodeError::DeadlinePassed`.
//!
//! Why that is enough for a save: every read of the source blocks ended before the fence,
//! and the client lets its engine reuse the blocks only once the node answered or the fence
//! has passed (`EngineClient::save` returns no earlier). So a save the client gave up on can
//! never seal bytes the engine has since written for another request, whatever the timing:
//! a node stalled or slow past the fence discards its copies instead.

use std::time::Duration;

/// A moment on the host's `CLOCK_MONOTONIC`, in nanoseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Fence(u64);

impl Fence {
    /// The fence at `ns` on `CLOCK_MONOTONIC` (what a client sent).
    pub fn at_ns(ns: u64) -> Self {
        Fence(ns)
    }

    /// `after` from now, saturating.
    pub fn after(after: Duration) -> Self {
        let ns = u64::try_from(after.as_nanos()).unwrap_or(u64::MAX);
        Fence(monotonic_ns().saturating_add(ns))
    }

    pub fn as_ns(self) -> u64 {
        self.0
    }

    /// Whether the fence has passed at `now_ns`.
    pub fn passed_at(self, now_ns: u64) -> bool {
        now_ns >= self.0
    }

    /// Whether the fence has passed now.
    pub fn passed(self) -> bool {
        self.passed_at(monotonic_ns())
    }

    /// How long until the fence (zero once it passed).
    pub fn left(self) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(monotonic_ns()))
    }

    /// How long ago the fence passed, at `now_ns` (zero before it).
    pub fn late_by(self, now_ns: u64) -> Duration {
        Duration::from_nanos(now_ns.saturating_sub(self.0))
    }

    /// The earlier of `self` and `other` (`None`: no bound).
    pub fn min_with(self, other: Option<Fence>) -> Fence {
        other.map_or(self, |o| self.min(o))
    }
}

/// Now on `CLOCK_MONOTONIC`, in nanoseconds (what Python's `time.monotonic_ns()` reads on
/// Linux, and what `std::time::Instant` is built on there).
pub fn monotonic_ns() -> u64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fences_pass_on_the_monotonic_clock() {
        let a = monotonic_ns();
        let f = Fence::after(Duration::from_millis(50));
        assert!(!f.passed());
        assert!(f.left() > Duration::from_millis(40));
        assert!(f.as_ns() >= a + 50_000_000);
        std::thread::sleep(Duration::from_millis(60));
        assert!(f.passed());
        assert_eq!(f.left(), Duration::ZERO);
        assert!(f.late_by(monotonic_ns()) >= Duration::from_millis(10));
        // Saturating, never a panic.
        assert_eq!(Fence::after(Duration::MAX).as_ns(), u64::MAX);
        assert_eq!(f.min_with(Some(Fence::at_ns(1))), Fence::at_ns(1));
        assert_eq!(f.min_with(None), f);
        // std's Instant reads the same clock: an Instant-based wait and a fence agree.
        let f = Fence::after(Duration::from_millis(20));
        let t = std::time::Instant::now() + Duration::from_millis(20);
        while std::time::Instant::now() < t {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(f.passed());
    }
}
