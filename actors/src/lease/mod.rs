//! Leases: a query answered with the longest prefix held here and the remote suffix others
//! hold ([`keeper::LeaseKeeper`], the actor), the plain lease table it keeps
//! ([`table::LeaseTable`]), and the engine instances loads go into
//! ([`registry::InstanceRegistry`]), and the tenants its queries and saves keep apart
//! ([`tenants::TenantBook`]).

pub mod keeper;
pub mod registry;
pub mod table;
pub mod tenants;
