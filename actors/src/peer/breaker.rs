//! The directory's circuit breaker: after `failures` failed calls in a row, or one call
//! past its deadline, the directory is skipped (queries plan from local blocks and the
//! links they have) until a probe after `cool_down` finds it answering again.
//!
//! Plain state with an injected `now`; the Redis directory drives it.

use std::time::{Duration, Instant};

/// What operators see.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum BreakerState {
    /// Calls go to the directory.
    #[default]
    Closed,
    /// Calls are skipped until the cool-down ends.
    Open,
    /// The cool-down ended; one probe decides (calls are still skipped meanwhile).
    HalfOpen,
}

impl BreakerState {
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }
}

/// A change the driver acts on: it re-announces what its nodes hold once the directory is
/// back, since writes were dropped while it was open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transition {
    Opened,
    Closed,
}

#[derive(Debug)]
pub struct Breaker {
    failures_to_open: u32,
    cool_down: Duration,
    state: State,
    trips: u64,
}

#[derive(Clone, Copy, Debug)]
enum State {
    Closed { failures: u32 },
    Open { until: Instant },
    HalfOpen,
}

impl Breaker {
    /// `failures_to_open` is at least 1 (0 reads as 1).
    pub fn new(failures_to_open: u32, cool_down: Duration) -> Self {
        Self {
            failures_to_open: failures_to_open.max(1),
            cool_down,
            state: State::Closed { failures: 0 },
            trips: 0,
        }
    }

    pub fn state(&self) -> BreakerState {
        match self.state {
            State::Closed { .. } => BreakerState::Closed,
            State::Open { .. } => BreakerState::Open,
            State::HalfOpen => BreakerState::HalfOpen,
        }
    }

    /// Times the breaker opened.
    pub fn trips(&self) -> u64 {
        self.trips
    }

    /// Whether a call may go to the directory now (only while closed: a probe is the
    /// driver's, never a query's).
    pub fn allows(&self) -> bool {
        matches!(self.state, State::Closed { .. })
    }

    /// True once, when the cool-down has ended: the caller sends one probe and reports it
    /// with [`Breaker::on_probe`].
    pub fn poll_probe(&mut self, now: Instant) -> bool {
        match self.state {
            State::Open { until } if now >= until => {
                self.state = State::HalfOpen;
                true
            }
            _ => false,
        }
    }

    /// A call that went while closed answered in time.
    pub fn on_success(&mut self) {
        if let State::Closed { failures } = &mut self.state {
            *failures = 0;
        }
    }

    /// A call that went while closed failed. Outcomes of calls that started before the
    /// breaker opened change nothing once it has.
    pub fn on_failure(&mut self, now: Instant) -> Option<Transition> {
        let State::Closed { failures } = &mut self.state else {
            return None;
        };
        *failures += 1;
        if *failures >= self.failures_to_open {
            return Some(self.open(now));
        }
        None
    }

    /// A call that missed its deadline: a directory that slow costs every query the whole
    /// bound, so one is enough.
    pub fn on_slow(&mut self, now: Instant) -> Option<Transition> {
        match self.state {
            State::Closed { .. } => Some(self.open(now)),
            _ => None,
        }
    }

    /// The probe's outcome: closed when it answered, open for another cool-down if not.
    pub fn on_probe(&mut self, ok: bool, now: Instant) -> Option<Transition> {
        if !matches!(self.state, State::HalfOpen) {
            return None;
        }
        if ok {
            self.state = State::Closed { failures: 0 };
            Some(Transition::Closed)
        } else {
            self.state = State::Open {
                until: now + self.cool_down,
            };
            None
        }
    }

    /// When the next probe is due (None unless open).
    pub fn probe_at(&self) -> Option<Instant> {
        match self.state {
            State::Open { until } => Some(until),
            _ => None,
        }
    }

    fn open(&mut self, now: Instant) -> Transition {
        self.trips += 1;
        self.state = State::Open {
            until: now + self.cool_down,
        };
        Transition::Opened
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const COOL: Duration = Duration::from_secs(2);

    #[test]
    fn opens_after_n_failures_in_a_row_and_a_success_resets_the_count() {
        let t0 = Instant::now();
        let mut b = Breaker::new(3, COOL);
        assert_eq!(b.on_failure(t0), None);
        assert_eq!(b.on_failure(t0), None);
        b.on_success();
        assert_eq!(b.on_failure(t0), None);
        assert_eq!(b.on_failure(t0), None);
        assert!(b.allows());
        assert_eq!(b.on_failure(t0), Some(Transition::Opened));
        assert!(!b.allows());
        assert_eq!((b.state(), b.trips()), (BreakerState::Open, 1));
        // Late outcomes of calls started before it opened change nothing.
        assert_eq!(b.on_failure(t0), None);
        b.on_success();
        assert_eq!(b.state(), BreakerState::Open);
        assert_eq!(b.probe_at(), Some(t0 + COOL));
    }

    #[test]
    fn one_slow_call_opens_it() {
        let t0 = Instant::now();
        let mut b = Breaker::new(5, COOL);
        assert_eq!(b.on_slow(t0), Some(Transition::Opened));
        assert_eq!(b.on_slow(t0), None, "already open");
        assert_eq!(b.trips(), 1);
    }

    #[test]
    fn half_open_probe_closes_or_reopens() {
        let t0 = Instant::now();
        let mut b = Breaker::new(1, COOL);
        b.on_failure(t0);
        assert!(!b.poll_probe(t0 + COOL - Duration::from_millis(1)));
        assert!(b.poll_probe(t0 + COOL));
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert!(
            !b.allows(),
            "queries wait for the probe's verdict elsewhere"
        );
        assert!(!b.poll_probe(t0 + COOL), "one probe at a time");
        // Failed probe: another full cool-down.
        let t1 = t0 + COOL;
        assert_eq!(b.on_probe(false, t1), None);
        assert_eq!(b.state(), BreakerState::Open);
        assert!(!b.poll_probe(t1 + COOL / 2));
        assert!(b.poll_probe(t1 + COOL));
        assert_eq!(b.on_probe(true, t1 + COOL), Some(Transition::Closed));
        assert!(b.allows());
        assert_eq!(b.trips(), 1, "a failed probe is not a new trip");
        // A probe outcome outside half-open is ignored.
        assert_eq!(b.on_probe(true, t1), None);
    }
}
