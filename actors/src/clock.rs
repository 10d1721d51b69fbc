//! The clock the lease keeper reads: the system's, or a manual one for tests.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A source of `Instant`s.
#[derive(Clone)]
pub struct Clock(Arc<dyn Fn() -> Instant + Send + Sync>);

/// Advances a manual clock.
#[derive(Clone, Debug)]
pub struct ManualClock(Arc<Mutex<Instant>>);

impl Clock {
    pub fn system() -> Self {
        Clock(Arc::new(Instant::now))
    }

    /// A clock that only moves when the returned handle advances it.
    pub fn manual() -> (Self, ManualClock) {
        let t = Arc::new(Mutex::new(Instant::now()));
        let read = Arc::clone(&t);
        let clock = Clock(Arc::new(move || match read.lock() {
            Ok(g) => *g,
            Err(p) => *p.into_inner(),
        }));
        (clock, ManualClock(t))
    }

    pub fn now(&self) -> Instant {
        (self.0)()
    }
}

impl ManualClock {
    pub fn advance(&self, d: Duration) {
        match self.0.lock() {
            Ok(mut g) => *g += d,
            Err(p) => *p.into_inner() += d,
        }
    }
}

impl fmt::Debug for Clock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Clock")
    }
}

/// `now + after`, saturating: a deadline past what an `Instant` can hold is "about a
/// century from now", never a panic. Every TTL from a config or a request meets the clock
/// here.
pub fn deadline(now: Instant, after: Duration) -> Instant {
    const FAR: Duration = Duration::from_secs(100 * 365 * 86_400);
    now.checked_add(after.min(FAR))
        .or_else(|| now.checked_add(Duration::from_secs(86_400)))
        .unwrap_or(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_past_the_clock_saturates() {
        let now = Instant::now();
        assert_eq!(
            deadline(now, Duration::from_secs(5)),
            now + Duration::from_secs(5)
        );
        let far = deadline(now, Duration::from_secs(u64::MAX));
        assert!(far > now + Duration::from_secs(86_400));
        assert_eq!(deadline(now, Duration::MAX), far);
    }
}
