//! The BlockStore actor: a thin driver of [`Tiers`], the policy that decides what RAM and
//! the SSD tier hold. It owns what a plain struct cannot: the messages and the guards that
//! send back to it, the directory calls, the futures that wait on the disks and on save
//! transfers, and the answers of callers waiting for their blocks to be durable.
//!
//! Its messages, by concept: pins for leases and peers (`store/pins.rs`), puts and saves
//! (`save.rs`), a load's slots reserved once when it is planned (`reserve.rs`: staged remote
//! fetches, `fetch.rs`, and SSD staging, `ssd_read.rs`), SSD reads of loads (`ssd_read.rs`);
//! the queries are here.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use actix::fut::{wrap_future, ActorFutureExt};
use actix::{Actor, AsyncContext, Context, Handler, Message, ResponseActFuture};
use tokio::sync::oneshot;

use crate::clock::Clock;
use crate::metrics::Counters;
use crate::model::BlockKey;
use crate::peer::directory::Directory;
use crate::tier::cache::CacheStats;
use crate::tier::policy::{by_namespace, Effect, Tiers};
use crate::tier::pool::HostPool;
use crate::tier::ssd::tier::{PendingWrite, WriteRx};
use crate::tier::ssd::{SsdError, SsdStats, SsdTier};
use crate::tier::TierError;

mod events;
mod fetch;
mod pins;
mod reserve;
mod save;
mod ssd_read;

pub use crate::tier::policy::SsdBlock;
pub(crate) use fetch::{FetchGuard, FetchSlot};
pub use pins::{PeerPinCount, PinForPeer, PinGuard, PinPrefix, PinnedPrefix, SweepPeerPins};
pub use pins::{Unpin, UnpinForPeer};
pub(crate) use reserve::{LoadSlots, ReserveLoad, SsdSlots};
pub use save::Put;
pub(crate) use save::{Commit, ReserveSave, SaveSlots};
pub(crate) use ssd_read::{ReadFail, SsdReads, StagingGuard};

pub struct BlockStore {
    tiers: Tiers<SsdTier>,
    counters: Arc<Counters>,
    node_id: String,
    directory: Option<Arc<dyn Directory>>,
    clock: Clock,
    /// Where save transfers run: not on this actor's thread, which the keeper and the load
    /// transfers share. Submitting a save of 256 blocks (14,336 copies) takes a thread about
    /// a millisecond, which a load issued beside it would otherwise wait out.
    saves: Option<actix::ArbiterHandle>,
    /// Write-through answers waiting for their blocks to be on disk, by block.
    durable: HashMap<BlockKey, Vec<oneshot::Sender<Result<(), SsdError>>>>,
    /// The node's KV event log, fed from `run_effects` (`store/events.rs`); None: off.
    events: Option<Arc<crate::events::EventHub>>,
}

/// Where a write-through block's outcome arrives: Ok once it is on disk.
pub(crate) type Durable = oneshot::Receiver<Result<(), SsdError>>;

/// Waits until every block of `acks` is on disk; the answer of a write-through put or save.
pub(crate) async fn durable(acks: Vec<Durable>) -> Result<(), TierError> {
    let blocks = acks.len();
    let mut failed = 0;
    let mut first = None;
    for a in acks {
        let e = match a.await {
            Ok(Ok(())) => continue,
            Ok(Err(e)) => e,
            Err(_) => SsdError::Stopped {
                path: Default::default(),
            },
        };
        failed += 1;
        first.get_or_insert(e);
    }
    match first {
        None => Ok(()),
        Some(source) => Err(TierError::NotDurable {
            failed,
            blocks,
            source,
        }),
    }
}

impl BlockStore {
    pub fn new(
        pool: HostPool,
        counters: Arc<Counters>,
        node_id: String,
        directory: Option<Arc<dyn Directory>>,
        clock: Clock,
        peer_pin_ttl: Duration,
    ) -> Self {
        Self {
            tiers: Tiers::new(pool, None, peer_pin_ttl),
            counters,
            node_id,
            directory,
            clock,
            saves: None,
            durable: HashMap::new(),
            events: None,
        }
    }

    /// Holds the namespaces to RAM quotas ([`crate::tier::quota`]); before any block is
    /// stored (the node's start).
    pub fn with_quotas(mut self, rules: crate::tier::quota::QuotaRules) -> Self {
        self.tiers.set_quotas(rules);
        self
    }

    /// Runs save transfers on `arbiter` (see the field); without one they run here.
    pub fn with_save_arbiter(mut self, arbiter: Option<actix::ArbiterHandle>) -> Self {
        self.saves = arbiter;
        self
    }

    /// Records what the tiers store and drop in `events` (see `store/events.rs`).
    pub fn with_events(mut self, events: Option<Arc<crate::events::EventHub>>) -> Self {
        self.events = events;
        self
    }

    /// Puts an SSD tier behind the pool: evicted sealed blocks are written to it (and every
    /// sealed block if it writes through), lookups continue into it, and what it found on
    /// disk at open is advertised when the store starts.
    pub fn with_ssd(mut self, ssd: Option<SsdTier>) -> Self {
        self.tiers.set_ssd(ssd);
        self
    }

    /// Runs what the policy asked for. The directory only queues its calls (it writes in
    /// batches off this thread), so this never waits on the network.
    fn run_effects(&mut self, ctx: &mut Context<Self>) {
        let effects = self.tiers.take_effects();
        self.note_events(&effects);
        for fx in effects {
            match fx {
                Effect::Publish { namespace, hashes } => {
                    if let Some(dir) = &self.directory {
                        dir.publish(&self.node_id, &namespace, &hashes);
                    }
                }
                Effect::Withdraw { namespace, hashes } => {
                    if let Some(dir) = &self.directory {
                        dir.withdraw(&self.node_id, &namespace, &hashes);
                    }
                }
                Effect::Watch { write, wait } => self.watch_write(write, wait, ctx),
                Effect::Durable { key, out } => self.answer_durable(&key, out),
                // The node still serves them: the directory is unchanged (the event log
                // heard of it in note_events).
                Effect::LeftTier { .. } => {}
            }
        }
    }

    /// Where each of `keys`' next write outcome arrives; registered before the effects
    /// that may answer them run.
    fn await_durable(&mut self, keys: Vec<BlockKey>) -> Vec<Durable> {
        keys.into_iter()
            .map(|key| {
                let (tx, rx) = oneshot::channel();
                self.durable.entry(key).or_default().push(tx);
                rx
            })
            .collect()
    }

    /// Answers everyone waiting for `key` to be on disk.
    fn answer_durable(&mut self, key: &BlockKey, out: Result<(), SsdError>) {
        let Some(waiting) = self.durable.remove(key) else {
            return;
        };
        for tx in waiting {
            let _ = tx.send(match &out {
                Ok(()) => Ok(()),
                Err(e) => Err(e.again()),
            });
        }
    }

    /// Hands a queued SSD write's outcome to the policy when the disk is done with it.
    fn watch_write(&mut self, w: PendingWrite, rx: WriteRx, ctx: &mut Context<Self>) {
        ctx.spawn(wrap_future(rx).map(move |r, act: &mut Self, ctx| {
            let out = r.unwrap_or_else(|_| {
                Err(SsdError::Stopped {
                    path: Default::default(),
                })
            });
            act.tiers.handle_write_done(w, out);
            act.run_effects(ctx);
        }));
    }
}

impl Actor for BlockStore {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.run_interval(Duration::from_secs(1), |act, _| {
            act.tiers.sweep_peer_pins(act.clock.now());
        });
        // A warm restart: what the SSD tier found on disk is served again, to peers too.
        let found = self
            .tiers
            .ssd()
            .map(|ssd| by_namespace(ssd.keys().cloned()));
        if let (Some(found), Some(dir)) = (&found, &self.directory) {
            for (ns, hashes) in found {
                dir.publish(&self.node_id, ns, hashes);
            }
        }
        if let Some(found) = &found {
            self.note_found_on_disk(found);
        }
    }

    fn stopped(&mut self, _: &mut Self::Context) {
        if let Some(dir) = &self.directory {
            dir.withdraw_node(&self.node_id);
        }
    }
}

impl Drop for BlockStore {
    /// A stopping node keeps what RAM holds: every sealed block not on SSD yet is queued
    /// for writing, and the tier (dropped right after) finishes its queue before it goes.
    /// Runs however the actor ends (a stopped System drops its actors).
    fn drop(&mut self) {
        let queued = self.tiers.write_back_all();
        if queued > 0 {
            tracing::info!(
                blocks = queued,
                "ssd: writing RAM's blocks before the node stops"
            );
        }
    }
}

#[derive(Message)]
#[rtype(result = "CacheStats")]
pub struct GetCacheStats;

impl Handler<GetCacheStats> for BlockStore {
    type Result = actix::MessageResult<GetCacheStats>;

    fn handle(&mut self, _: GetCacheStats, _: &mut Context<Self>) -> Self::Result {
        actix::MessageResult(self.tiers.cache().stats())
    }
}

/// Every namespace's use of RAM, with its quota (metrics and operators).
#[derive(Message)]
#[rtype(result = "Vec<crate::tier::quota::TenantUsage>")]
pub struct GetNamespaceUsage;

impl Handler<GetNamespaceUsage> for BlockStore {
    type Result = actix::MessageResult<GetNamespaceUsage>;

    fn handle(&mut self, _: GetNamespaceUsage, _: &mut Context<Self>) -> Self::Result {
        actix::MessageResult(self.tiers.cache().usage())
    }
}

/// Every namespace's use of the SSD tier, with its SSD quota; None without a tier.
#[derive(Message)]
#[rtype(result = "Option<Vec<crate::tier::quota::TenantUsage>>")]
pub struct GetSsdNamespaceUsage;

impl Handler<GetSsdNamespaceUsage> for BlockStore {
    type Result = actix::MessageResult<GetSsdNamespaceUsage>;

    fn handle(&mut self, _: GetSsdNamespaceUsage, _: &mut Context<Self>) -> Self::Result {
        actix::MessageResult(self.tiers.ssd().map(SsdTier::usage))
    }
}

/// How many leading `hashes` this node holds, in RAM or on SSD (Lookup on a node without
/// peers).
#[derive(Message)]
#[rtype(result = "usize")]
pub struct PrefixLen {
    pub namespace: crate::model::Namespace,
    pub hashes: Vec<crate::model::BlockHash>,
}

impl Handler<PrefixLen> for BlockStore {
    type Result = usize;

    fn handle(&mut self, m: PrefixLen, _: &mut Context<Self>) -> usize {
        self.tiers.held_prefix_len(&m.namespace, &m.hashes)
    }
}

/// Evicts every unpinned fetched copy (benchmarks and operators: start cold).
#[derive(Message)]
#[rtype(result = "usize")]
pub struct DropReclaimable;

impl Handler<DropReclaimable> for BlockStore {
    type Result = usize;

    fn handle(&mut self, _: DropReclaimable, ctx: &mut Context<Self>) -> usize {
        let n = self.tiers.drop_reclaimable();
        self.run_effects(ctx);
        n
    }
}

/// The SSD tier's counters and gauges; None without one.
#[derive(Message)]
#[rtype(result = "Option<SsdStats>")]
pub struct GetSsdStats;

impl Handler<GetSsdStats> for BlockStore {
    type Result = actix::MessageResult<GetSsdStats>;

    fn handle(&mut self, _: GetSsdStats, _: &mut Context<Self>) -> Self::Result {
        actix::MessageResult(self.tiers.ssd().map(|t| SsdStats {
            held_blocks: self.tiers.ssd_held(),
            staging_slots: self.tiers.staging(),
            ..t.stats()
        }))
    }
}

/// Replies once every SSD write and read queued so far is done (tests and benchmarks).
#[derive(Message)]
#[rtype(result = "()")]
pub struct SsdSync;

impl Handler<SsdSync> for BlockStore {
    type Result = ResponseActFuture<Self, ()>;

    fn handle(&mut self, _: SsdSync, _: &mut Context<Self>) -> Self::Result {
        let wait = self.tiers.ssd().map(SsdTier::barrier);
        Box::pin(
            wrap_future(async move {
                if let Some(w) = wait {
                    w.await;
                }
            })
            // One turn more: the write completions the barrier waited for run first.
            .map(|_, _: &mut Self, _| ()),
        )
    }
}
