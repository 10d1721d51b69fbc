//! Pins for leases (RAM blocks pinned, SSD blocks held on disk) and for peers (SSD blocks
//! read into RAM first, so a peer reads pool memory).

use std::sync::Arc;

use actix::fut::{wrap_future, ActorFutureExt};
use actix::{Addr, AsyncContext, Context, Handler, Message, ResponseActFuture};

use super::BlockStore;
use crate::model::{BlockHash, BlockKey, Namespace};
use crate::peer::link::{PinnedRemote, RemoteBlock};
use crate::tier::cache::SlotRef;
use crate::tier::policy::SsdBlock;
use crate::tier::pool::PoolMemory;
use crate::tier::ssd::index::Entry as SsdEntry;

/// Pins on a prefix (RAM blocks pinned, SSD blocks held on disk), released when the last
/// holder (a lease, or a transfer using its share) drops it. Also keeps the pool memory
/// mapped.
pub struct PinGuard {
    store: Addr<BlockStore>,
    namespace: Namespace,
    hashes: Vec<BlockHash>,
    ssd: Vec<(BlockKey, SsdEntry)>,
    memory: Arc<PoolMemory>,
}

impl PinGuard {
    /// The pool memory the pinned blocks lie in, mapped while this guard lives.
    pub(crate) fn memory(&self) -> &Arc<PoolMemory> {
        &self.memory
    }
}

impl Drop for PinGuard {
    fn drop(&mut self) {
        let hashes = std::mem::take(&mut self.hashes);
        let ssd = std::mem::take(&mut self.ssd);
        if !hashes.is_empty() || !ssd.is_empty() {
            self.store.do_send(Unpin {
                namespace: self.namespace.clone(),
                hashes,
                ssd,
            });
        }
    }
}

impl std::fmt::Debug for PinGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinGuard")
            .field("blocks", &self.hashes.len())
            .field("ssd_blocks", &self.ssd.len())
            .finish()
    }
}

/// A pinned prefix: RAM blocks pinned, SSD blocks held on disk.
#[derive(Debug, Clone)]
pub struct PinnedPrefix {
    /// The RAM blocks, in prefix order.
    pub blocks: Arc<Vec<SlotRef>>,
    /// The SSD blocks, in prefix order.
    pub ssd: Arc<Vec<SsdBlock>>,
    pub guard: Option<Arc<PinGuard>>,
    /// `ssd.len()`: how many of the prefix's blocks are on SSD.
    pub ssd_blocks: usize,
}

impl PinnedPrefix {
    /// Blocks in the local prefix, both tiers.
    pub fn len(&self) -> usize {
        self.blocks.len() + self.ssd.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Message)]
#[rtype(result = "PinnedPrefix")]
pub struct PinPrefix {
    pub namespace: Namespace,
    pub hashes: Vec<BlockHash>,
}

/// Pins the prefix of `hashes` held here: RAM blocks are pinned, SSD blocks are held on
/// disk (not read: the load reads them, pipelined with its copies to the device). Nothing
/// waits: the answer is immediate.
impl Handler<PinPrefix> for BlockStore {
    type Result = actix::MessageResult<PinPrefix>;

    fn handle(&mut self, m: PinPrefix, ctx: &mut Context<Self>) -> Self::Result {
        let pin = self.tiers.pin_prefix(&m.namespace, &m.hashes);
        let (blocks, ssd, holds) = (pin.blocks, pin.ssd, pin.holds);
        let guard = (!blocks.is_empty() || !holds.is_empty()).then(|| {
            Arc::new(PinGuard {
                store: ctx.address(),
                namespace: m.namespace,
                hashes: blocks.iter().map(|b| b.hash).collect(),
                ssd: holds,
                memory: Arc::clone(self.tiers.pool().memory()),
            })
        });
        actix::MessageResult(PinnedPrefix {
            blocks: Arc::new(blocks),
            ssd_blocks: ssd.len(),
            ssd: Arc::new(ssd),
            guard,
        })
    }
}

/// Control: drop one pin on each block, and the disk holds.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Unpin {
    pub namespace: Namespace,
    pub hashes: Vec<BlockHash>,
    ssd: Vec<(BlockKey, SsdEntry)>,
}

impl Handler<Unpin> for BlockStore {
    type Result = ();

    fn handle(&mut self, m: Unpin, _: &mut Context<Self>) {
        self.tiers.unpin(&m.namespace, &m.hashes, &m.ssd);
    }
}

/// Owner side: pins the present sealed prefix of `hashes` for a peer. Blocks that vanished
/// since the peer's lookup shorten the answer.
#[derive(Message)]
#[rtype(result = "PinnedRemote")]
pub struct PinForPeer {
    pub namespace: Namespace,
    pub hashes: Vec<BlockHash>,
}

/// SSD-held blocks are read into RAM first (the reply waits), so a peer reads pool memory.
impl Handler<PinForPeer> for BlockStore {
    type Result = ResponseActFuture<Self, PinnedRemote>;

    fn handle(&mut self, m: PinForPeer, ctx: &mut Context<Self>) -> Self::Result {
        let (pin, waits) = self.tiers.begin_pin_local(&m.namespace, &m.hashes);
        let ns = m.namespace;
        if waits.is_empty() {
            // Nothing read from disk: the prefix is settled now, as the pins were taken.
            let (blocks, _) = self.tiers.finish_pin_local(pin, Vec::new());
            self.run_effects(ctx);
            return Box::pin(
                actix::fut::ready(blocks)
                    .map(move |blocks, act: &mut Self, _| act.pinned_for_peer(ns, blocks)),
            );
        }
        self.run_effects(ctx);
        let wait = async move {
            let mut out = Vec::with_capacity(waits.len());
            for rx in waits {
                out.push(rx.await.ok());
            }
            out
        };
        Box::pin(wrap_future(wait).map(move |outcomes, act: &mut Self, ctx| {
            let (blocks, _) = act.tiers.finish_pin_local(pin, outcomes);
            act.run_effects(ctx);
            act.pinned_for_peer(ns, blocks)
        }))
    }
}

impl BlockStore {
    /// The peer's answer: its pin over `blocks` (pinned here already), none if empty.
    fn pinned_for_peer(&mut self, ns: Namespace, blocks: Vec<SlotRef>) -> PinnedRemote {
        if blocks.is_empty() {
            return PinnedRemote {
                pin_id: 0,
                blocks: Vec::new(),
            };
        }
        let pin_id = self.tiers.pin_for_peer(ns, &blocks, self.clock.now());
        let blocks = blocks
            .iter()
            .map(|b| RemoteBlock {
                hash: b.hash,
                addr: b.addr,
            })
            .collect();
        PinnedRemote { pin_id, blocks }
    }
}

/// Owner side, control: releases a peer pin (unknown ids are ignored: it expired).
#[derive(Message)]
#[rtype(result = "()")]
pub struct UnpinForPeer(pub u64);

impl Handler<UnpinForPeer> for BlockStore {
    type Result = ();

    fn handle(&mut self, m: UnpinForPeer, _: &mut Context<Self>) {
        self.tiers.unpin_peer(m.0);
    }
}

/// Expires due peer pins now; replies with how many (the store also sweeps every second).
#[derive(Message)]
#[rtype(result = "usize")]
pub struct SweepPeerPins;

impl Handler<SweepPeerPins> for BlockStore {
    type Result = usize;

    fn handle(&mut self, _: SweepPeerPins, _: &mut Context<Self>) -> usize {
        self.tiers.sweep_peer_pins(self.clock.now())
    }
}

/// Live peer pins held by this owner.
#[derive(Message)]
#[rtype(result = "usize")]
pub struct PeerPinCount;

impl Handler<PeerPinCount> for BlockStore {
    type Result = usize;

    fn handle(&mut self, _: PeerPinCount, _: &mut Context<Self>) -> usize {
        self.tiers.peer_pin_count()
    }
}
