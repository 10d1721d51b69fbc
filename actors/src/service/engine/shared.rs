//! What the gRPC service and the fd socket share: the node, the memory handles, the
//! completion book and boards, and the counts a scrape reads.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::{watch, Notify};
use tonic::Status;

use crate::model::InstanceId;
use crate::node::Node;
use crate::service::engine::completions::{CompletionBook, RankKey};
use crate::service::engine::memory_handles::MemoryHandles;
use crate::service::engine::server::EngineOptions;
use crate::statuses::same_token;
use kvferry_proto::shm::board::Board;

/// What the gRPC service and the fd socket share.
pub(crate) struct Shared {
    pub(super) node: Node,
    pub(crate) options: EngineOptions,
    pub(super) handles: Mutex<MemoryHandles>,
    pub(super) book: Mutex<CompletionBook>,
    /// Woken whenever a result enters the book or an instance's results leave it, for the
    /// PollLoads that wait.
    pub(super) ended: Notify,
    /// Completion boards of registered ranks, with the rank's layer count.
    pub(super) boards: Mutex<HashMap<RankKey, (Arc<Board>, u32)>>,
    pub(super) sessions: AtomicUsize,
    /// Request mailboxes attached, and the requests they served.
    pub(crate) mailboxes: AtomicUsize,
    pub(crate) mailbox_requests: std::sync::atomic::AtomicU64,
    pub(super) fd_path: Option<String>,
    pub(super) stop: watch::Receiver<bool>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The guarded state stays consistent between statements, so a poisoned lock is usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    pub(crate) fn node(&self) -> &Node {
        &self.node
    }

    pub(crate) fn handles(&self) -> MutexGuard<'_, MemoryHandles> {
        lock(&self.handles)
    }

    pub(super) fn book(&self) -> MutexGuard<'_, CompletionBook> {
        lock(&self.book)
    }

    pub(super) fn boards(&self) -> MutexGuard<'_, HashMap<RankKey, (Arc<Board>, u32)>> {
        lock(&self.boards)
    }

    pub(crate) fn check_token(&self, got: &str) -> Result<(), Status> {
        let want = &self.options.token;
        if want.is_empty() || same_token(want.as_bytes(), got.as_bytes()) {
            Ok(())
        } else {
            Err(Status::unauthenticated(format!(
                "node {}: the engine token is missing or wrong",
                self.node.config().node_id
            )))
        }
    }

    /// Everything a session bound goes: the instances are unregistered (their leases
    /// released, their transfers drained), their unused handles closed, their results
    /// dropped.
    pub(super) async fn end_session(&self, bound: Vec<InstanceId>) {
        for instance in bound {
            // Already unregistered by the client: nothing left to do.
            let _ = self.node.unregister_instance(instance.clone()).await;
            self.handles().drop_instance(&instance);
            self.book().drop_instance(&instance);
            self.ended.notify_waiters();
            self.boards().retain(|(i, _), _| *i != instance);
        }
        self.sessions.fetch_sub(1, Ordering::Relaxed);
    }
}

impl crate::metrics::EngineProbe for Shared {
    fn engine_gauges(&self) -> crate::metrics::EngineGauges {
        let memory_handles = self.handles().len() as u64;
        let b = self.book();
        crate::metrics::EngineGauges {
            sessions: self.sessions.load(Ordering::Relaxed) as u64,
            memory_handles,
            loads_pending: b.running() as u64,
            completions_retained: b.retained() as u64,
            completions_dropped: b.dropped(),
            mailboxes: self.mailboxes.load(Ordering::Relaxed) as u64,
            mailbox_requests: self.mailbox_requests.load(Ordering::Relaxed),
        }
    }
}
