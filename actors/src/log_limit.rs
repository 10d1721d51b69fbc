//! Rate limits for log lines of faults that repeat (a peer that is down fails every query's
//! pin; a peer with the wrong token retries): the first line per key is written, then at
//! most one per period, each saying how many it stands for.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Keys remembered at once; past it the stalest is forgotten (its next line is written).
/// Keys are peers, addresses and operations: few.
const MAX_KEYS: usize = 256;

/// One log line per key per period.
#[derive(Debug)]
pub struct LogLimit {
    period: Duration,
    /// (key, when its last line was written, lines held back since).
    seen: Mutex<Vec<(String, Instant, u64)>>,
}

impl LogLimit {
    pub const fn new(period: Duration) -> Self {
        Self {
            period,
            seen: Mutex::new(Vec::new()),
        }
    }

    /// `Some(lines held back since the last one)` when a line for `key` may be written now.
    pub fn allow(&self, key: &str) -> Option<u64> {
        self.allow_at(key, Instant::now())
    }

    pub fn allow_at(&self, key: &str, now: Instant) -> Option<u64> {
        let mut seen = self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((_, last, held)) = seen.iter_mut().find(|(k, _, _)| k == key) {
            if now.saturating_duration_since(*last) < self.period {
                *held += 1;
                return None;
            }
            let n = std::mem::take(held);
            *last = now;
            return Some(n);
        }
        if seen.len() >= MAX_KEYS {
            if let Some(stalest) = seen
                .iter()
                .enumerate()
                .min_by_key(|(_, (_, last, _))| *last)
                .map(|(i, _)| i)
            {
                seen.swap_remove(stalest);
            }
        }
        seen.push((key.to_owned(), now, 0));
        Some(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_key_per_period_counting_the_rest() {
        let l = LogLimit::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(l.allow_at("a", t0), Some(0));
        assert_eq!(l.allow_at("b", t0), Some(0), "keys are apart");
        for s in 1..10 {
            assert_eq!(l.allow_at("a", t0 + Duration::from_secs(s)), None);
        }
        assert_eq!(l.allow_at("a", t0 + Duration::from_secs(10)), Some(9));
        assert_eq!(l.allow_at("a", t0 + Duration::from_secs(11)), None);
        assert_eq!(l.allow_at("b", t0 + Duration::from_secs(11)), Some(0));
    }

    #[test]
    fn keys_are_bounded_and_the_stalest_is_forgotten() {
        let l = LogLimit::new(Duration::from_secs(10));
        let t0 = Instant::now();
        for i in 0..MAX_KEYS {
            let at = t0 + Duration::from_millis(i as u64);
            assert_eq!(l.allow_at(&i.to_string(), at), Some(0));
        }
        let later = t0 + Duration::from_secs(1);
        assert_eq!(l.allow_at("new", later), Some(0));
        assert_eq!(l.seen.lock().unwrap().len(), MAX_KEYS);
        // "0" was the stalest: forgotten, so its next line is written at once.
        assert_eq!(l.allow_at("0", later), Some(0));
        assert_eq!(l.allow_at("new", later), None);
    }
}
