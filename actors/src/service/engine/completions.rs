//! Where accepted loads report: a completed load's result is retained (the last `retention`
//! per instance rank) until a `PollLoad` takes it, so the engine sees each result once. A
//! load that ended ok on a completion board was delivered by the board's final word: its
//! result is kept only for a `PollLoad` that wants its details, and dropping it past the
//! retention loses nothing undelivered. Plain state; the engine server holds it behind a
//! lock and never awaits while holding it (a waiting `PollLoad` waits on `Shared`'s
//! notifier, outside the lock).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::model::InstanceId;
use kvferry_proto::v1::LoadCompletion;

/// One engine worker: an instance's rank.
pub type RankKey = (InstanceId, u32);

/// The state of one load, as PollLoad answers it.
#[derive(Debug, PartialEq)]
pub enum LoadState {
    Running,
    Done(LoadCompletion),
    /// Never accepted, already consumed, or dropped (retention, session end).
    Unknown,
}

/// Accepted loads and their undelivered results.
pub struct CompletionBook {
    retention: usize,
    running: HashMap<u64, RankKey>,
    /// A running load's cancel flag, which its transfer reads before each batch.
    cancels: HashMap<u64, Arc<AtomicBool>>,
    done: HashMap<RankKey, VecDeque<LoadCompletion>>,
    /// Results a board delivered, for their details (the last `retention` per rank).
    shown: HashMap<RankKey, VecDeque<LoadCompletion>>,
    dropped: u64,
}

impl CompletionBook {
    pub fn new(retention: usize) -> Self {
        Self {
            retention: retention.max(1),
            running: HashMap::new(),
            cancels: HashMap::new(),
            done: HashMap::new(),
            shown: HashMap::new(),
            dropped: 0,
        }
    }

    /// Records an accepted load; returns its id (never 0).
    pub fn begin(&mut self, key: RankKey) -> u64 {
        let id = loop {
            let mut b = [0u8; 8];
            let id = match getrandom::fill(&mut b) {
                Ok(()) => u64::from_le_bytes(b) >> 1,
                Err(_) => self.running.keys().max().copied().unwrap_or(0) + 1,
            };
            if id != 0 && !self.running.contains_key(&id) && !self.is_done(id) {
                break id;
            }
        };
        self.running.insert(id, key);
        id
    }

    fn is_done(&self, id: u64) -> bool {
        self.done
            .values()
            .chain(self.shown.values())
            .any(|q| q.iter().any(|c| c.load_id == id))
    }

    /// Loads accepted for `key` that have not completed.
    /// Forgets a load that was never started (refused after [`Self::begin`]).
    pub fn abandon(&mut self, id: u64) {
        self.running.remove(&id);
        self.cancels.remove(&id);
    }

    /// The cancel flag of running load `id`, which its transfer reads (made on first use).
    pub fn cancel_flag(&mut self, id: u64) -> Arc<AtomicBool> {
        Arc::clone(self.cancels.entry(id).or_default())
    }

    /// Asks load `id` of `key` to stop: its transfer submits no more copies and the load
    /// ends failed once what it submitted has drained. False where `key` has no such load
    /// running (never accepted, another rank's, or already ended).
    pub fn cancel(&mut self, id: u64, key: &RankKey) -> bool {
        if self.running.get(&id) != Some(key) {
            return false;
        }
        self.cancel_flag(id).store(true, Ordering::Release);
        true
    }

    pub fn running_for(&self, key: &RankKey) -> usize {
        self.running.values().filter(|k| *k == key).count()
    }

    /// A load finished: retain its result. `shown`: a completion board delivered it (an ok
    /// end on the board), so it is kept for its details alone. A result of a load no longer
    /// tracked (its instance's session ended) is dropped.
    pub fn finish(&mut self, c: LoadCompletion, shown: bool) {
        self.cancels.remove(&c.load_id);
        let Some(key) = self.running.remove(&c.load_id) else {
            return;
        };
        if shown {
            let queue = self.shown.entry(key).or_default();
            queue.push_back(c);
            if queue.len() > self.retention {
                queue.pop_front();
            }
            return;
        }
        let queue = self.done.entry(key).or_default();
        queue.push_back(c);
        while queue.len() > self.retention {
            queue.pop_front();
            self.dropped += 1;
        }
    }

    /// Where load `id` stands; a completed result is consumed.
    pub fn poll(&mut self, id: u64) -> LoadState {
        if self.running.contains_key(&id) {
            return LoadState::Running;
        }
        match take(&mut self.done, id).or_else(|| take(&mut self.shown, id)) {
            Some(c) => LoadState::Done(c),
            None => LoadState::Unknown,
        }
    }

    /// Forgets everything of `instance`: its running loads' results will be dropped, and its
    /// retained results are.
    pub fn drop_instance(&mut self, instance: &InstanceId) {
        self.running.retain(|_, k| k.0 != *instance);
        let running = &self.running;
        self.cancels.retain(|id, _| running.contains_key(id));
        self.shown.retain(|k, _| k.0 != *instance);
        self.done.retain(|k, q| {
            if k.0 == *instance {
                self.dropped += q.len() as u64;
                false
            } else {
                true
            }
        });
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Results retained undelivered (not those a board delivered).
    pub fn retained(&self) -> usize {
        self.done.values().map(VecDeque::len).sum()
    }

    /// Results dropped undelivered (past the retention, or with their instance's session).
    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}

/// Removes and returns load `id`'s result from `queues`, dropping a queue it empties.
fn take(
    queues: &mut HashMap<RankKey, VecDeque<LoadCompletion>>,
    id: u64,
) -> Option<LoadCompletion> {
    let (key, i) = queues.iter().find_map(|(key, q)| {
        q.iter()
            .position(|c| c.load_id == id)
            .map(|i| (key.clone(), i))
    })?;
    let queue = queues.get_mut(&key)?;
    let c = queue.remove(i);
    if queue.is_empty() {
        queues.remove(&key);
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: &str) -> RankKey {
        (InstanceId::new(i).unwrap(), 0)
    }

    fn done(id: u64) -> LoadCompletion {
        LoadCompletion {
            load_id: id,
            ..Default::default()
        }
    }

    #[test]
    fn only_a_running_load_of_its_own_rank_is_cancelled() {
        let mut b = CompletionBook::new(2);
        let id = b.begin(key("a"));
        let flag = b.cancel_flag(id);
        assert!(!b.cancel(id, &key("b")), "another instance's load");
        assert!(!b.cancel(id ^ 1, &key("a")), "no such load");
        assert!(!flag.load(Ordering::Acquire));
        assert!(b.cancel(id, &key("a")));
        assert!(flag.load(Ordering::Acquire));
        b.finish(done(id), false);
        assert!(!b.cancel(id, &key("a")), "it ended");
        // Flags go with their loads, however those end.
        let (x, y) = (b.begin(key("a")), b.begin(key("c")));
        b.cancel_flag(x);
        b.cancel_flag(y);
        b.abandon(x);
        b.drop_instance(&InstanceId::new("c").unwrap());
        assert!(b.cancels.is_empty());
    }

    #[test]
    fn poll_consumes_and_retention_drops_the_oldest() {
        let mut b = CompletionBook::new(2);
        let ids: Vec<u64> = (0..3).map(|_| b.begin(key("a"))).collect();
        assert_eq!(b.poll(ids[0]), LoadState::Running);
        assert_eq!(b.running_for(&key("a")), 3);
        for &id in &ids {
            b.finish(done(id), false);
        }
        assert_eq!((b.running(), b.retained(), b.dropped()), (0, 2, 1));
        assert_eq!(b.poll(ids[0]), LoadState::Unknown, "dropped past retention");
        assert_eq!(b.poll(ids[2]), LoadState::Done(done(ids[2])));
        assert_eq!(b.poll(ids[2]), LoadState::Unknown, "consumed by the poll");
        assert_eq!(b.poll(ids[1]), LoadState::Done(done(ids[1])));
        assert_eq!(b.retained(), 0);
    }

    #[test]
    fn a_result_a_board_delivered_is_kept_for_details_and_never_counted_dropped() {
        let mut b = CompletionBook::new(2);
        let ids: Vec<u64> = (0..3).map(|_| b.begin(key("a"))).collect();
        for &id in &ids {
            b.finish(done(id), true);
        }
        // Delivered already: not waiting for anyone, and none dropped undelivered.
        assert_eq!((b.running(), b.retained(), b.dropped()), (0, 0, 0));
        assert_eq!(b.poll(ids[0]), LoadState::Unknown, "past the retention");
        assert_eq!(b.poll(ids[2]), LoadState::Done(done(ids[2])));
        assert_eq!(b.poll(ids[2]), LoadState::Unknown, "consumed by the poll");
        // A failure (not shown) is retained as before, beside the details.
        let failed = b.begin(key("a"));
        b.finish(done(failed), false);
        assert_eq!(b.retained(), 1);
        assert_eq!(b.poll(failed), LoadState::Done(done(failed)));
        b.drop_instance(&InstanceId::new("a").unwrap());
        assert_eq!(b.poll(ids[1]), LoadState::Unknown, "gone with the instance");
        assert_eq!(b.dropped(), 0);
    }

    #[test]
    fn dropping_an_instance_forgets_its_loads() {
        let mut b = CompletionBook::new(4);
        let running = b.begin(key("a"));
        let finished = b.begin(key("a"));
        b.finish(done(finished), false);
        b.drop_instance(&InstanceId::new("a").unwrap());
        b.finish(done(running), false);
        assert_eq!(b.poll(running), LoadState::Unknown);
        assert_eq!(b.poll(finished), LoadState::Unknown);
        assert_eq!((b.running(), b.retained(), b.dropped()), (0, 0, 1));
    }
}
