//! The store's one hook into the node's event log ([`crate::events::EventHub`]): what a
//! round of the policy's effects changed, per namespace and tier.
//!
//! From the effects alone: a block newly sealed in RAM (`Publish`) is stored in RAM; a
//! queued SSD write (`Watch`) is stored on disk, and if RAM no longer holds the block it was
//! spilled (removed from RAM); a failed write (`Durable` with an error) left the disk; a
//! withdrawn block (`Withdraw`) left the node, so it is removed from both tiers; a block
//! that left one tier while the other still holds it (`LeftTier`: RAM evicting a block the
//! disk already holds, the disk evicting one RAM still holds) is removed from that tier.

use std::time::SystemTime;

use crate::events::{EventHub, EventKind, Medium};
use crate::model::{BlockHash, Namespace};
use crate::tier::policy::Effect;

use super::BlockStore;

/// Events of one round, merged while they keep namespace, kind and medium, in order.
#[derive(Default)]
struct Round(Vec<(Namespace, EventKind, Medium, Vec<BlockHash>)>);

impl Round {
    fn add(&mut self, ns: &Namespace, kind: EventKind, medium: Medium, hashes: &[BlockHash]) {
        if hashes.is_empty() {
            return;
        }
        match self.0.last_mut() {
            Some((n, k, m, hs)) if n == ns && *k == kind && *m == medium => {
                hs.extend_from_slice(hashes)
            }
            _ => self.0.push((ns.clone(), kind, medium, hashes.to_vec())),
        }
    }

    fn record(self, hub: &EventHub) {
        let now = SystemTime::now();
        for (ns, kind, medium, hashes) in self.0 {
            hub.record(now, &ns, kind, medium, &hashes);
        }
    }
}

impl BlockStore {
    /// Records what `effects` changed; nothing without an event log.
    pub(super) fn note_events<W>(&self, effects: &[Effect<W>]) {
        let Some(hub) = &self.events else {
            return;
        };
        let ssd = self.tiers.ssd();
        let mut round = Round::default();
        for fx in effects {
            match fx {
                Effect::Publish { namespace, hashes } => {
                    round.add(namespace, EventKind::Stored, Medium::Ram, hashes)
                }
                Effect::Withdraw { namespace, hashes } => {
                    round.add(namespace, EventKind::Removed, Medium::Ram, hashes);
                    if ssd.is_some() {
                        round.add(namespace, EventKind::Removed, Medium::Disk, hashes);
                    }
                }
                Effect::Watch { write, .. } => {
                    let k = &write.key;
                    round.add(&k.namespace, EventKind::Stored, Medium::Disk, &[k.hash]);
                    if !self.tiers.cache().contains(&k.namespace, k.hash) {
                        round.add(&k.namespace, EventKind::Removed, Medium::Ram, &[k.hash]);
                    }
                }
                Effect::Durable { key, out: Err(_) } => {
                    if !ssd.is_some_and(|s| s.contains(key)) {
                        round.add(
                            &key.namespace,
                            EventKind::Removed,
                            Medium::Disk,
                            &[key.hash],
                        );
                    }
                }
                Effect::Durable { .. } => {}
                Effect::LeftTier {
                    namespace,
                    hashes,
                    tier,
                } => {
                    let medium = match tier {
                        crate::tier::quota::Tier::Ram => Medium::Ram,
                        crate::tier::quota::Tier::Ssd => Medium::Disk,
                    };
                    round.add(namespace, EventKind::Removed, medium, hashes);
                }
            }
        }
        round.record(hub);
    }

    /// A warm restart: what the SSD tier found on disk is stored there.
    pub(super) fn note_found_on_disk(&self, found: &[(Namespace, Vec<BlockHash>)]) {
        let Some(hub) = &self.events else {
            return;
        };
        let mut round = Round::default();
        for (ns, hashes) in found {
            round.add(ns, EventKind::Stored, Medium::Disk, hashes);
        }
        round.record(hub);
    }
}
