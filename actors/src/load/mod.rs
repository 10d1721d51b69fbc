//! A load, from plan to end: [`plan`] (pure: local copies, SSD reads, remote reads per
//! owner, staging), [`transfer::Transfer`] (one actor per load or save, owning what its
//! copies touch, replying once), the remote suffix's reads ([`remote`]) and the SSD
//! prefix's reads ([`ssd`]); `memory` is the guard their copy batches hold.

mod memory;
pub mod plan;
pub mod rank;
pub mod remote;
pub(crate) mod save;
pub mod share;
pub mod ssd;
pub mod transfer;
