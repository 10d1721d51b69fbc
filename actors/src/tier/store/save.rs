//! Puts (bytes from the client's request) and saves (device → host copies) into the pool.
//! With write-through, both answer once the blocks they sealed are on disk.

use std::sync::Arc;
use std::time::Instant;

use actix::{Actor, Addr, AsyncContext, Context, Handler, Message, ResponseFuture};
use kvferry_gpu::{CopyDirection, CopyList};
use tokio::sync::oneshot;

use super::{durable, BlockStore, Durable};
use crate::api::{Stage, StageName, StoreReport, TransferPath};
use crate::error::NodeError;
use crate::fence::{monotonic_ns, Fence};
use crate::load::rank::RankHandle;
use crate::load::transfer::{Transfer, TransferSpec};
use crate::metrics::InFlight;
use crate::model::{BlockHash, Namespace};

/// Writes one rank's bytes of whole blocks from host memory.
#[derive(Message)]
#[rtype(result = "Result<StoreReport, NodeError>")]
pub struct Put {
    pub handle: Arc<RankHandle>,
    pub blocks: Vec<(BlockHash, Vec<u8>)>,
    /// Past it the client has given up: nothing is written (see [`crate::fence`]).
    pub fence: Option<Fence>,
}

/// Write-through: answered once the blocks it sealed are on disk, or with
/// [`NodeError::NotDurable`] if any of them could not be written.
impl Handler<Put> for BlockStore {
    type Result = ResponseFuture<Result<StoreReport, NodeError>>;

    fn handle(&mut self, m: Put, ctx: &mut Context<Self>) -> Self::Result {
        let t0 = Instant::now();
        let put = self.put(m, ctx);
        Box::pin(async move {
            let (mut report, acks) = put?;
            if !acks.is_empty() {
                durable(acks).await?;
                report.seconds = t0.elapsed().as_secs_f64();
            }
            Ok(report)
        })
    }
}

impl BlockStore {
    /// Writes a put's blocks into RAM; returns its report and, with write-through, where
    /// the sealed blocks' disk writes answer.
    fn put(
        &mut self,
        m: Put,
        ctx: &mut Context<Self>,
    ) -> Result<(StoreReport, Vec<Durable>), NodeError> {
        let t0 = Instant::now();
        let h = &m.handle;
        if let Some(f) = m.fence {
            let now = monotonic_ns();
            if f.passed_at(now) {
                let late = f.late_by(now);
                self.counters.abandoned("put_blocks", m.blocks.len(), late);
                return Err(NodeError::DeadlinePassed {
                    what: "PutBlocks",
                    late,
                });
            }
        }
        let put = self.tiers.put(&h.namespace, &h.shape, h.rank, &m.blocks);
        let out = put.map(|(mut report, keys)| {
            let acks = self.await_durable(keys);
            report.seconds = t0.elapsed().as_secs_f64();
            (report, acks)
        });
        self.run_effects(ctx);
        out
    }
}

/// A writer pin on one rank part; aborts the reservation if dropped before commit.
pub(crate) struct WriteGuard {
    store: Addr<BlockStore>,
    namespace: Namespace,
    hash: BlockHash,
    armed: bool,
}

impl Drop for WriteGuard {
    fn drop(&mut self) {
        if self.armed {
            self.store.do_send(Abort {
                namespace: self.namespace.clone(),
                hash: self.hash,
            });
        }
    }
}

#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Abort {
    namespace: Namespace,
    hash: BlockHash,
}

impl Handler<Abort> for BlockStore {
    type Result = ();

    fn handle(&mut self, m: Abort, ctx: &mut Context<Self>) {
        self.tiers.abort(&m.namespace, m.hash);
        self.run_effects(ctx);
    }
}

/// Marks rank parts written; replies with how many blocks this sealed. With a fence that
/// has passed, marks nothing and answers [`NodeError::DeadlinePassed`]: the caller's writer
/// guards then abort the reservations (the copied bytes are never sealed nor published).
#[derive(Message)]
#[rtype(result = "Result<(usize, Vec<Durable>), NodeError>")]
pub(crate) struct Commit {
    pub(crate) namespace: Namespace,
    pub(crate) rank: u32,
    pub(crate) hashes: Vec<BlockHash>,
    pub(crate) fence: Option<Fence>,
}

/// Also replies, with write-through, where each sealed block's disk write answers.
impl Handler<Commit> for BlockStore {
    type Result = Result<(usize, Vec<Durable>), NodeError>;

    fn handle(&mut self, m: Commit, ctx: &mut Context<Self>) -> Self::Result {
        // Checked here, on the thread that seals, after the copies out of the client's
        // memory completed: if the fence is still ahead, every read of the source blocks
        // ended before the client could have let its engine reuse them.
        if let Some(f) = m.fence {
            let now = monotonic_ns();
            if f.passed_at(now) {
                let late = f.late_by(now);
                self.counters.abandoned("save", m.hashes.len(), late);
                return Err(NodeError::DeadlinePassed { what: "Save", late });
            }
        }
        let (sealed, keys) = self.tiers.commit(&m.namespace, m.rank, &m.hashes);
        let acks = self.await_durable(keys);
        self.run_effects(ctx);
        Ok((sealed, acks))
    }
}

/// Saves one rank's device KV blocks into host blocks (device → host through the layout).
#[derive(Message)]
#[rtype(result = "Result<StoreReport, NodeError>")]
pub struct Save {
    pub handle: Arc<RankHandle>,
    pub hashes: Vec<BlockHash>,
    pub src_blocks: Vec<u32>,
    /// The copies are sealed only if they completed before it (see [`crate::fence`]).
    pub fence: Option<Fence>,
}

impl Handler<Save> for BlockStore {
    type Result = ResponseFuture<Result<StoreReport, NodeError>>;

    fn handle(&mut self, m: Save, ctx: &mut Context<Self>) -> Self::Result {
        let t0 = Instant::now();
        if let Some(f) = m.fence {
            let now = monotonic_ns();
            if f.passed_at(now) {
                // Given up on before it started: nothing is read.
                let late = f.late_by(now);
                self.counters.abandoned("save", m.hashes.len(), late);
                return Box::pin(
                    async move { Err(NodeError::DeadlinePassed { what: "Save", late }) },
                );
            }
        }
        let fence = m.fence;
        let prepared = self.prepare_save(&m, ctx);
        self.run_effects(ctx);
        let (guards, present, list) = match prepared {
            Ok(p) => p,
            Err(e) => return Box::pin(async move { Err(e) }),
        };
        let mut report = StoreReport {
            present,
            not_stored: m.hashes.len().saturating_sub(present + guards.len()),
            ..Default::default()
        };
        if guards.is_empty() {
            report.seconds = t0.elapsed().as_secs_f64();
            return Box::pin(async move { Ok(report) });
        }
        let plan = t0.elapsed().as_secs_f64();
        let (tx, rx) = oneshot::channel();
        let spec = TransferSpec {
            path: TransferPath::Save,
            dir: CopyDirection::DeviceToHost,
            device: Arc::clone(&m.handle.device),
            list,
            blocks: guards.len(),
            memory: Arc::clone(self.tiers.pool().memory()),
            rank: Arc::clone(&m.handle),
            on_success: None,
            stages: vec![Stage {
                name: StageName::Plan,
                seconds: plan,
            }],
            started: t0,
            in_flight: InFlight::new(Arc::clone(&self.counters)),
            then: None,
        };
        match &self.saves {
            Some(a) => {
                Transfer::start_in_arbiter(a, move |_| Transfer::new(spec, tx));
            }
            None => {
                Transfer::new(spec, tx).start();
            }
        }
        let store = ctx.address();
        let (namespace, rank) = (m.handle.namespace.clone(), m.handle.rank);
        Box::pin(async move {
            // The guards stay here until the copies are done: the blocks cannot be evicted
            // or reused while the device writes them.
            let mut guards = guards;
            let done = rx.await.map_err(|_| NodeError::Stopped {
                what: "save transfer",
            })??;
            let hashes: Vec<BlockHash> = guards.iter().map(|g| g.hash).collect();
            // A passed fence: the guards drop armed and abort the reservations.
            let (sealed, acks) = store
                .send(Commit {
                    namespace,
                    rank,
                    hashes,
                    fence,
                })
                .await??;
            report.sealed = sealed;
            for g in &mut guards {
                g.armed = false;
            }
            // Write-through: answered once the sealed blocks are on disk.
            durable(acks).await?;
            report.written = guards.len();
            report.bytes = done.bytes;
            report.seconds = t0.elapsed().as_secs_f64();
            Ok(report)
        })
    }
}

impl BlockStore {
    /// Validates a save, reserves its blocks and builds its copy list; on any error every
    /// reservation made so far is aborted.
    fn prepare_save(
        &mut self,
        m: &Save,
        ctx: &mut Context<Self>,
    ) -> Result<(Vec<WriteGuard>, usize, CopyList), NodeError> {
        let h = &m.handle;
        let shape = &h.shape;
        self.tiers
            .learn_shape(&h.namespace, shape.tp_size(), shape.block_bytes());
        if m.hashes.len() != m.src_blocks.len() {
            return Err(NodeError::bad(format!(
                "{} hashes but {} source blocks",
                m.hashes.len(),
                m.src_blocks.len()
            )));
        }
        h.layout.check_blocks(&m.src_blocks)?;
        let (slots, present) = self.tiers.reserve_save(
            &h.namespace,
            shape.tp_size(),
            h.rank,
            shape.block_bytes(),
            &m.hashes,
        )?;
        let me = ctx.address();
        let mut guards = Vec::with_capacity(slots.len());
        let mut list =
            CopyList::with_capacity(m.hashes.len() * (shape.layers() * shape.segments()) as usize);
        let scatter = kvferry_gpu::Scatter::new(shape, &h.layout, h.rank);
        for (i, slot) in slots {
            guards.push(WriteGuard {
                store: me.clone(),
                namespace: h.namespace.clone(),
                hash: m.hashes[i],
                armed: true,
            });
            scatter.push_block(
                &mut list,
                CopyDirection::DeviceToHost,
                slot.addr,
                m.src_blocks[i],
            );
        }
        Ok((guards, present, list))
    }
}
