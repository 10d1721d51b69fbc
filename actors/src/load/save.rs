//! A save: one rank's device KV blocks copied into host blocks (device → host through the
//! layout). The store reserves the slots and seals them once the copies are done; the copies
//! run as a [`Transfer`] on the store's save arbiter, never on the store's thread.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Instant;

use actix::{Actor, Addr, ArbiterHandle};
use kvferry_gpu::{CopyDirection, CopyList};
use tokio::sync::oneshot;

use crate::api::{Stage, StageName, StoreReport, TransferPath};
use crate::error::NodeError;
use crate::fence::{monotonic_ns, Fence};
use crate::load::rank::RankHandle;
use crate::load::transfer::{Transfer, TransferSpec};
use crate::metrics::{Counters, InFlight};
use crate::model::{BlockHash, Namespace};
use crate::tier::store::{durable, BlockStore, Commit, ReserveSave, SaveSlots};

/// One rank's blocks to save: `hashes[i]` is the content of device block `src_blocks[i]`.
pub(crate) struct SaveArgs {
    pub(crate) handle: Arc<RankHandle>,
    /// Where the blocks go: the instance's namespace, or its tenant's.
    pub(crate) namespace: Namespace,
    pub(crate) hashes: Vec<BlockHash>,
    pub(crate) src_blocks: Vec<u32>,
    /// The copies are sealed only if they completed before it (see [`crate::fence`]).
    pub(crate) fence: Option<Fence>,
}

/// Runs a save to its end. With write-through, answered once the blocks it sealed are on
/// disk, or with [`NodeError::NotDurable`].
pub(crate) async fn save(
    store: &Addr<BlockStore>,
    counters: &Arc<Counters>,
    m: SaveArgs,
) -> Result<StoreReport, NodeError> {
    let t0 = Instant::now();
    if let Some(f) = m.fence {
        let now = monotonic_ns();
        if f.passed_at(now) {
            // Given up on before it started: nothing is read.
            let late = f.late_by(now);
            counters.abandoned("save", m.hashes.len(), late);
            return Err(NodeError::DeadlinePassed { what: "Save", late });
        }
    }
    let h = &m.handle;
    if m.hashes.len() != m.src_blocks.len() {
        return Err(NodeError::bad(format!(
            "{} hashes but {} source blocks",
            m.hashes.len(),
            m.src_blocks.len()
        )));
    }
    h.layout.check_blocks(&m.src_blocks)?;
    let reserved: SaveSlots = store
        .send(ReserveSave {
            namespace: m.namespace.clone(),
            shape: h.shape,
            rank: h.rank,
            hashes: m.hashes.clone(),
        })
        .await??;
    let (present, reserving) = (reserved.present, reserved.guards.len());
    let mut report = StoreReport {
        present,
        not_stored: m.hashes.len().saturating_sub(present + reserving),
        ..Default::default()
    };
    if reserving == 0 {
        report.seconds = t0.elapsed().as_secs_f64();
        return Ok(report);
    }
    let plan = t0.elapsed().as_secs_f64();
    // From here the save runs to its end whatever the caller does: a caller that gives up
    // (its call's deadline drops this future) must neither free the slots while the copies
    // still write them nor skip the commit that sees its fence passed and counts the save
    // abandoned. It is polled here, so a save that is awaited costs no thread wake; only one
    // dropped before its end moves to the save arbiter.
    let arbiter = reserved.arbiter.clone();
    RunToEnd {
        fut: Some(Box::pin(finish(
            store.clone(),
            Arc::clone(counters),
            m,
            reserved,
            report,
            plan,
            t0,
        ))),
        arbiter,
    }
    .await
}

/// A future that is finished even if its awaiter drops it: polled in place while awaited,
/// handed to `arbiter` (its output discarded) if dropped before its end.
struct RunToEnd<T: Send + 'static> {
    fut: Option<Pin<Box<dyn Future<Output = T> + Send>>>,
    arbiter: ArbiterHandle,
}

impl<T: Send + 'static> Future for RunToEnd<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let Some(fut) = self.fut.as_mut() else {
            // Polled again after its end: nothing more will come.
            return Poll::Pending;
        };
        let out = ready!(fut.as_mut().poll(cx));
        self.fut = None;
        Poll::Ready(out)
    }
}

impl<T: Send + 'static> Drop for RunToEnd<T> {
    fn drop(&mut self) {
        if let Some(fut) = self.fut.take() {
            // A stopped arbiter drops it here: its guards abort the reservations.
            let _ = self.arbiter.spawn(async move {
                let _ = fut.await;
            });
        }
    }
}

/// The copies, then the commit (which checks the fence) and, with write-through, the wait
/// for the disk.
async fn finish(
    store: Addr<BlockStore>,
    counters: Arc<Counters>,
    m: SaveArgs,
    r: SaveSlots,
    mut report: StoreReport,
    plan: f64,
    t0: Instant,
) -> Result<StoreReport, NodeError> {
    let SaveSlots {
        slots,
        mut guards,
        memory,
        arbiter,
        ..
    } = r;
    let h = &m.handle;
    let shape = &h.shape;
    let mut list =
        CopyList::with_capacity(slots.len() * (shape.layers() * shape.segments()) as usize);
    let scatter = kvferry_gpu::Scatter::new(shape, &h.layout, h.rank);
    for (i, addr) in slots {
        scatter.push_block(
            &mut list,
            CopyDirection::DeviceToHost,
            addr,
            m.src_blocks[i],
        );
    }
    let (tx, rx) = oneshot::channel();
    let spec = TransferSpec {
        path: TransferPath::Save,
        dir: CopyDirection::DeviceToHost,
        device: Arc::clone(&h.device),
        list,
        blocks: guards.len(),
        memory,
        rank: Arc::clone(h),
        on_success: None,
        stages: vec![Stage {
            name: StageName::Plan,
            seconds: plan,
        }],
        started: t0,
        in_flight: InFlight::new(Arc::clone(&counters)),
        then: None,
    };
    Transfer::start_in_arbiter(&arbiter, move |_| Transfer::new(spec, tx));
    // The guards stay here until the copies are done: the blocks cannot be evicted or
    // reused while the device writes them.
    let done = rx.await.map_err(|_| NodeError::Stopped {
        what: "save transfer",
    })??;
    let hashes: Vec<BlockHash> = guards.iter().map(|g| g.hash()).collect();
    // A passed fence: the guards drop armed and abort the reservations.
    let (sealed, acks) = store
        .send(Commit {
            namespace: m.namespace.clone(),
            rank: h.rank,
            hashes,
            fence: m.fence,
        })
        .await??;
    report.sealed = sealed;
    for g in &mut guards {
        g.disarm();
    }
    // Write-through: answered once the sealed blocks are on disk.
    durable(acks).await?;
    report.written = guards.len();
    report.bytes = done.bytes;
    report.seconds = t0.elapsed().as_secs_f64();
    Ok(report)
}
