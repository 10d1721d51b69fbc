//! A completion queue shared by the QPs of one NIC; one poller thread drains it in batches.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::completion::{CompletionSink, WorkCompletion};

struct State {
    queue: VecDeque<WorkCompletion>,
    closed: bool,
}

/// Completions from every QP attached to it, in arrival order.
///
/// It never holds more entries than the sum of its QPs' send windows: each issued request
/// yields exactly one completion and a QP never issues past its window, so pushes never wait.
pub struct CompletionQueue {
    state: Mutex<State>,
    ready: Condvar,
}

impl std::fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("len", &self.len())
            .finish()
    }
}

impl CompletionQueue {
    /// `capacity_hint`: the sum of the attached QPs' send windows.
    pub fn new(capacity_hint: usize) -> Self {
        CompletionQueue {
            state: Mutex::new(State {
                queue: VecDeque::with_capacity(capacity_hint),
                closed: false,
            }),
            ready: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Updates are single push/pop operations; a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Moves up to `max` completions into `out` without waiting; returns how many.
    pub fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        let mut st = self.lock();
        let n = max.min(st.queue.len());
        out.extend(st.queue.drain(..n));
        n
    }

    /// Like `poll`, but waits up to `timeout` for the first completion. Returns 0 on timeout
    /// or once the queue is closed and empty.
    pub fn wait(&self, out: &mut Vec<WorkCompletion>, max: usize, timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        let mut st = self.lock();
        while st.queue.is_empty() && !st.closed {
            let now = Instant::now();
            if now >= deadline {
                return 0;
            }
            st = self
                .ready
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        let n = max.min(st.queue.len());
        out.extend(st.queue.drain(..n));
        n
    }

    /// Wakes waiters for good (poller shutdown); queued completions can still be polled.
    pub fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_all();
    }

    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    pub fn len(&self) -> usize {
        self.lock().queue.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl CompletionSink for CompletionQueue {
    fn push(&self, wc: WorkCompletion) {
        self.lock().queue.push_back(wc);
        self.ready.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::completion::CompletionStatus;
    use crate::qp_key::{NicId, NodeId, QpKey, QpNum};
    use std::sync::Arc;

    #[test]
    fn batches_and_waits() {
        let cq = Arc::new(CompletionQueue::new(8));
        let key = QpKey::new(NodeId(1), NicId(0), QpNum(7));
        let mut out = Vec::new();
        assert_eq!(cq.wait(&mut out, 4, Duration::from_millis(5)), 0);
        let cq2 = cq.clone();
        let t = std::thread::spawn(move || {
            for i in 0..6 {
                cq2.push(WorkCompletion {
                    qp: key,
                    wr_id: i,
                    status: CompletionStatus::Success,
                    bytes: 1,
                });
            }
        });
        t.join().unwrap();
        assert_eq!(cq.wait(&mut out, 4, Duration::from_secs(1)), 4);
        assert_eq!(cq.poll(&mut out, 4), 2);
        assert_eq!(
            out.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
            vec![0, 1, 2, 3, 4, 5]
        );
        cq.close();
        assert_eq!(cq.wait(&mut out, 4, Duration::from_secs(5)), 0);
    }
}
