//! The tenants a node keeps apart: a Query or Save naming a `tenant` (a LoRA adapter, say)
//! reads and writes the namespace `model/dtype/fingerprint/tenant` of its instance's model.
//! Each tenant namespace has its own use, quota and metric label for as long as the node
//! runs, so there is a bound ([`MAX_TENANTS`]): a new tenant past it is refused, one already
//! seen is always served.

use std::collections::HashSet;
use std::sync::Mutex;

use crate::error::NodeError;
use crate::model::Namespace;
use kvferry_proto::MAX_TENANTS;

/// The tenant namespaces seen, shared by the lease keeper (queries) and the node (saves).
#[derive(Debug)]
pub struct TenantBook {
    limit: usize,
    seen: Mutex<HashSet<Namespace>>,
}

impl Default for TenantBook {
    fn default() -> Self {
        Self::with_limit(MAX_TENANTS)
    }
}

impl TenantBook {
    pub fn with_limit(limit: usize) -> Self {
        Self {
            limit,
            seen: Mutex::new(HashSet::new()),
        }
    }

    /// The namespace a request of an instance in `base` reads and writes: `base` itself
    /// without a tenant, else `base`'s tenant namespace (a bad name is
    /// [`NodeError::Model`]; a new one past the limit [`NodeError::TooManyTenants`]).
    pub fn namespace(
        &self,
        base: &Namespace,
        tenant: Option<&str>,
    ) -> Result<Namespace, NodeError> {
        let Some(tenant) = tenant else {
            return Ok(base.clone());
        };
        let ns = base.with_tenant(tenant)?;
        // A poisoned lock only means a panic elsewhere mid-insert; the set is still whole.
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if !seen.contains(&ns) {
            if seen.len() >= self.limit {
                return Err(NodeError::TooManyTenants { limit: self.limit });
            }
            seen.insert(ns.clone());
        }
        Ok(ns)
    }

    /// Tenant namespaces seen.
    pub fn len(&self) -> usize {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenants_get_namespaces_of_their_own_up_to_the_limit() {
        let book = TenantBook::with_limit(2);
        let base = Namespace::new("llama", "bf16", "f").unwrap();
        assert_eq!(book.namespace(&base, None).unwrap(), base);
        let a = book.namespace(&base, Some("lora-a")).unwrap();
        assert_eq!(a.as_str(), "llama/bf16/f/lora-a");
        let b = book.namespace(&base, Some("lora-b")).unwrap();
        assert_ne!(a, b);
        // Past the limit a new tenant is refused, naming it; those seen are still served.
        let e = book.namespace(&base, Some("lora-c")).unwrap_err();
        assert!(matches!(e, NodeError::TooManyTenants { limit: 2 }), "{e}");
        assert_eq!(book.namespace(&base, Some("lora-a")).unwrap(), a);
        assert_eq!(book.len(), 2);
        // A bad name is the model's error, and takes no place.
        let e = book.namespace(&base, Some("a/b")).unwrap_err();
        assert!(matches!(e, NodeError::Model(_)), "{e}");
        assert!(e.to_string().contains("tenant"), "{e}");
    }
}
