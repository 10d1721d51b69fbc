//! Tenants of the RAM cache and of the SSD tier: which namespace may hold how much of the
//! pool or of the disks, and what a namespace at its quota does when it stores more. Plain
//! state, no I/O: the [`crate::tier::cache::BlockCache`] (RAM) and the
//! [`crate::tier::ssd::index::SsdIndex`] (SSD) each keep a [`Tenants`] of their tier, ask it
//! before they give a new block a slot, and tell it what they stored and dropped.
//!
//! The rules (the README's "Tenants and quotas" says the same to users):
//! - Per tier (`ram`, `ssd`), a namespace's quota is the first rule naming it exactly that
//!   sets that tier, else the longest prefix rule that matches it and sets that tier, else
//!   the tier's default; none of them: unlimited. A quota is counted in slots (RAM: `ram /
//!   slot-bytes`; SSD: `ssd /` a disk slot, the block and its header; rounded down), since a
//!   block takes a whole slot whatever its size; every block of the namespace in the tier
//!   counts (in RAM: saved, put or fetched from a peer; on SSD: written behind or through).
//! - **On SSD the same rules hold at admission** (a write-behind of a block RAM evicts, or a
//!   write-through): a namespace at its SSD quota replaces its own oldest idle disk block,
//!   never another namespace's; when all of its disk blocks are busy (read, held by leases,
//!   being written) the write is skipped, and a block RAM evicted then leaves the node.
//! - **Hard at admission.** A namespace below its quota is admitted as any block is (a full
//!   pool evicts its oldest unpinned block, whoever's it is). A namespace at its quota
//!   replaces its own oldest unpinned block (fetched copies first, then saved ones): it
//!   never takes a slot from another namespace, so a tenant cannot push the others out.
//!   When all its blocks are pinned (by leases and writers), the block is refused, with an
//!   error naming the namespace and its quota; the blocks before it in the request stay.
//! - So no namespace is ever over its quota: the eviction that "prefers the namespace over
//!   its quota" is the admission rule itself, and the pool-wide eviction stays plain LRU.
//! - **A quota of 0** means "never admitted": the namespace's blocks are refused at once
//!   (for a model that must never be cached here, or a tenant switched off).
//! - Quotas larger than the pool are refused by the config's `validate()`; quotas that add
//!   up to more than the pool are allowed (each is a cap, not a reservation).

mod rules;
mod tenants;

pub use crate::metrics::namespaces::TenantUsage;
pub use rules::{NsMatch, QuotaRule, QuotaRules, Tier};
pub use tenants::{Admission, TenantId, Tenants};
