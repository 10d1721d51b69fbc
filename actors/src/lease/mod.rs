//! Leases: a query answered with the longest prefix held here and the remote suffix others
//! hold ([`keeper::LeaseKeeper`], the actor), the plain lease table it keeps
//! ([`table::LeaseTable`]), and the engine instances loads go into
//! ([`registry::InstanceRegistry`]).

pub mod keeper;
pub mod registry;
pub mod table;
