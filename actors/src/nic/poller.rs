//! `CompletionPoller`: one OS thread per [`CompletionQueue`] that waits for completions and
//! sends them in batches through a bounded channel; the NIC worker reads the other end as a
//! stream.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::Duration;

use actix::prelude::Stream;
use kvferry_transport::{CompletionQueue, WorkCompletion};
use tokio::sync::mpsc;

/// The receiving end of a poller, as a stream of batches.
#[derive(Debug)]
pub struct CompletionStream {
    rx: mpsc::Receiver<Vec<WorkCompletion>>,
}

impl Stream for CompletionStream {
    type Item = Vec<WorkCompletion>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx)
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
    /// waits for the worker; `idle`: how often the thread looks for a closed channel.
    pub fn spawn(
        name: &str,
        cq: Arc<CompletionQueue>,
        max_batch: usize,
        channel: usize,
        idle: Duration,
    ) -> io::Result<(Self, CompletionStream)> {
        let (tx, rx) = mpsc::channel(channel.max(1));
        let max_batch = max_batch.max(1);
        let queue = cq.clone();
        let thread = std::thread::Builder::new()
            .name(format!("kvf-cq-{name}"))
            .spawn(move || run(&queue, &tx, max_batch, idle))?;
        Ok((
            CompletionPoller {
                cq,
                thread: Some(thread),
            },
            CompletionStream { rx },
        ))
    }

    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(JoinHandle::is_finished)
    }
}

fn run(
    cq: &CompletionQueue,
    tx: &mpsc::Sender<Vec<WorkCompletion>>,
    max_batch: usize,
    idle: Duration,
) {
    loop {
        let mut batch = Vec::with_capacity(max_batch);
        if cq.wait(&mut batch, max_batch, idle) == 0 {
            if tx.is_closed() || cq.is_closed() && cq.is_empty() {
                return;
            }
            continue;
        }
        // Blocks while the channel is full: the worker is behind, and the queue holds at
        // most the sum of the send windows, so providers never wait on us.
        if tx.blocking_send(batch).is_err() {
            return;
        }
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
