//! `CompletionPoller`: one OS thread per [`CompletionQueue`] that waits for completions and
//! sends them in batches through a bounded `crossbeam-channel`; the NIC worker reads the other
//! end as a stream, and drains every batch that is ready in one round.
//!
//! Why crossbeam rather than a tokio channel: the sender is a plain OS thread that must block
//! when the worker falls behind (back-pressure, without a runtime on that thread), and the
//! receiver is cloned so the worker can take every ready batch in the round it was woken for.
//! An [`AtomicWaker`] wakes the worker's task after each send.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::Duration;

use actix::prelude::Stream;
use atomic_waker::AtomicWaker;
use crossbeam_channel::{Receiver, Sender, TryRecvError};
use kvferry_transport::{CompletionQueue, WorkCompletion};

/// The receiving end of a poller, as a stream of batches.
#[derive(Debug, Clone)]
pub struct CompletionStream {
    rx: Receiver<Vec<WorkCompletion>>,
    waker: Arc<AtomicWaker>,
}

impl CompletionStream {
    /// A batch that is ready now, without waiting.
    pub fn try_next(&self) -> Option<Vec<WorkCompletion>> {
        self.rx.try_recv().ok()
    }
}

impl Stream for CompletionStream {
    type Item = Vec<WorkCompletion>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let poll = |rx: &Receiver<Vec<WorkCompletion>>| match rx.try_recv() {
            Ok(b) => Some(Poll::Ready(Some(b))),
            Err(TryRecvError::Disconnected) => Some(Poll::Ready(None)),
            Err(TryRecvError::Empty) => None,
        };
        if let Some(p) = poll(&self.rx) {
            return p;
        }
        // Register, then look again: a send between the first look and the registration
        // would otherwise wake nobody.
        self.waker.register(cx.waker());
        poll(&self.rx).unwrap_or(Poll::Pending)
    }
}

/// Owns the poller thread. Dropping it closes the queue, which ends the thread once the
/// remaining completions are sent or the stream is gone.
#[derive(Debug)]
pub struct CompletionPoller {
    cq: Arc<CompletionQueue>,
    thread: Option<JoinHandle<()>>,
}

impl CompletionPoller {
    /// `max_batch`: completions per message; `channel`: batches buffered before the thread
    /// waits for the worker; `idle`: how often the thread looks for a closed queue.
    pub fn spawn(
        name: &str,
        cq: Arc<CompletionQueue>,
        max_batch: usize,
        channel: usize,
        idle: Duration,
    ) -> io::Result<(Self, CompletionStream)> {
        let (tx, rx) = crossbeam_channel::bounded(channel.max(1));
        let waker = Arc::new(AtomicWaker::new());
        let max_batch = max_batch.max(1);
        let queue = cq.clone();
        let wake = Arc::clone(&waker);
        let thread = std::thread::Builder::new()
            .name(format!("kvf-cq-{name}"))
            .spawn(move || {
                run(&queue, &tx, &wake, max_batch, idle);
                // The stream sees the channel closed on its next look.
                drop(tx);
                wake.wake();
            })?;
        Ok((
            CompletionPoller {
                cq,
                thread: Some(thread),
            },
            CompletionStream { rx, waker },
        ))
    }

    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(JoinHandle::is_finished)
    }
}

fn run(
    cq: &CompletionQueue,
    tx: &Sender<Vec<WorkCompletion>>,
    waker: &AtomicWaker,
    max_batch: usize,
    idle: Duration,
) {
    loop {
        let mut batch = Vec::with_capacity(max_batch);
        if cq.wait(&mut batch, max_batch, idle) == 0 {
            if cq.is_closed() && cq.is_empty() {
                return;
            }
            continue;
        }
        // Blocks while the channel is full: the worker is behind, and the queue holds at
        // most what admission lets the QPs owe, so providers never wait on us. Fails once
        // the stream is gone.
        if tx.send(batch).is_err() {
            return;
        }
        waker.wake();
    }
}

impl Drop for CompletionPoller {
    fn drop(&mut self) {
        self.cq.close();
        // Not joined: the thread may be blocked sending to a full channel whose receiver is
        // dropped after us; it ends on its own as soon as the receiver goes.
        drop(self.thread.take());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvferry_transport::{CompletionSink, CompletionStatus, NicId, NodeId, QpKey, QpNum};

    fn wc(i: u64) -> WorkCompletion {
        WorkCompletion {
            qp: QpKey::new(NodeId(1), NicId(0), QpNum(1)),
            wr_id: i,
            status: CompletionStatus::Success,
            bytes: 1,
        }
    }

    /// Completions arrive in order, in batches of at most `max_batch`, and the stream ends
    /// once the poller is dropped and the queue is empty.
    #[test]
    fn batches_in_order_then_ends() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            use std::future::poll_fn;
            let cq = Arc::new(CompletionQueue::new(16));
            let (poller, mut stream) =
                CompletionPoller::spawn("t", cq.clone(), 4, 2, Duration::from_millis(5)).unwrap();
            for i in 0..10 {
                cq.push(wc(i));
            }
            let mut got = Vec::new();
            while got.len() < 10 {
                let b = poll_fn(|cx| Pin::new(&mut stream).poll_next(cx))
                    .await
                    .unwrap();
                assert!(!b.is_empty() && b.len() <= 4, "{b:?}");
                got.extend(b.iter().map(|w| w.wr_id));
                while let Some(more) = stream.try_next() {
                    got.extend(more.iter().map(|w| w.wr_id));
                }
            }
            assert_eq!(got, (0..10).collect::<Vec<_>>());
            drop(poller);
            let end = tokio::time::timeout(
                Duration::from_secs(5),
                poll_fn(|cx| Pin::new(&mut stream).poll_next(cx)),
            )
            .await
            .expect("the stream ends");
            assert!(end.is_none());
        });
    }
}
