//! The lease table: plain state with an injected clock, driven by [`crate::lease::keeper`].

use std::collections::HashMap;
use std::time::{Duration, Instant};

pub use crate::error::LeaseError;
use crate::model::{InstanceId, LeaseId};

/// Default lease lifetime.
pub const DEFAULT_TTL: Duration = Duration::from_secs(600);

#[derive(Debug)]
struct Entry<P> {
    instance: InstanceId,
    world: u32,
    consumed: u64,
    expires: Instant,
    plan: P,
}

/// What a consume hands back: the rank's share of the plan, and whether this consume removed
/// the lease (it was the last rank).
#[derive(Debug)]
pub struct Consumed<P> {
    pub share: P,
    pub last: bool,
}

/// Leases by id. `P` is the plan each rank receives a share of; it is cloned per consume,
/// and dropped (releasing whatever it holds) when the lease leaves the table.
#[derive(Debug)]
pub struct LeaseTable<P> {
    leases: HashMap<LeaseId, Entry<P>>,
    ttl: Duration,
    expired: u64,
}

impl<P: Clone> LeaseTable<P> {
    pub fn new(ttl: Duration) -> Self {
        Self {
            leases: HashMap::new(),
            ttl,
            expired: 0,
        }
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Live leases (expired ones not yet swept count until the sweep).
    pub fn len(&self) -> usize {
        self.leases.len()
    }

    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }

    /// Leases removed by expiry so far.
    pub fn expired_total(&self) -> u64 {
        self.expired
    }

    /// Stores a plan under a fresh id.
    pub fn create(&mut self, instance: InstanceId, world: u32, plan: P, now: Instant) -> LeaseId {
        let mut id = LeaseId::random();
        while self.leases.contains_key(&id) {
            id = LeaseId::random();
        }
        self.leases.insert(
            id,
            Entry {
                instance,
                world,
                consumed: 0,
                expires: crate::clock::deadline(now, self.ttl),
                plan,
            },
        );
        id
    }

    /// Checks that `rank` of `instance` may consume the lease now, changing nothing.
    pub fn check(
        &self,
        id: LeaseId,
        instance: &InstanceId,
        rank: u32,
        now: Instant,
    ) -> Result<&P, LeaseError> {
        let e = self
            .leases
            .get(&id)
            .filter(|e| now < e.expires)
            .ok_or(LeaseError::UnknownOrExpired { lease: id })?;
        if &e.instance != instance {
            return Err(LeaseError::WrongInstance {
                lease: id,
                owner: e.instance.clone(),
                caller: instance.clone(),
            });
        }
        if rank >= e.world {
            return Err(LeaseError::RankOutOfRange {
                lease: id,
                rank,
                world: e.world,
            });
        }
        if e.consumed & (1 << rank) != 0 {
            return Err(LeaseError::RankConsumed { lease: id, rank });
        }
        Ok(&e.plan)
    }

    /// Consumes `rank`'s share; the last rank removes the lease.
    pub fn consume(
        &mut self,
        id: LeaseId,
        instance: &InstanceId,
        rank: u32,
        now: Instant,
    ) -> Result<Consumed<P>, LeaseError> {
        if let Err(e) = self.check(id, instance, rank, now) {
            if matches!(e, LeaseError::UnknownOrExpired { .. }) && self.leases.contains_key(&id) {
                // Expired but not swept yet: drop it now.
                self.leases.remove(&id);
                self.expired += 1;
            }
            return Err(e);
        }
        let e = self
            .leases
            .get_mut(&id)
            .ok_or(LeaseError::UnknownOrExpired { lease: id })?;
        e.consumed |= 1 << rank;
        let full = if e.world >= 64 {
            u64::MAX
        } else {
            (1u64 << e.world) - 1
        };
        if e.consumed == full {
            let e = self
                .leases
                .remove(&id)
                .ok_or(LeaseError::UnknownOrExpired { lease: id })?;
            Ok(Consumed {
                share: e.plan,
                last: true,
            })
        } else {
            Ok(Consumed {
                share: e.plan.clone(),
                last: false,
            })
        }
    }

    /// Removes a lease whatever its consumers still owe.
    pub fn release(&mut self, id: LeaseId) -> Result<P, LeaseError> {
        self.leases
            .remove(&id)
            .map(|e| e.plan)
            .ok_or(LeaseError::UnknownOrExpired { lease: id })
    }

    /// Removes every lease of an instance.
    pub fn release_instance(&mut self, instance: &InstanceId) -> Vec<P> {
        let ids: Vec<LeaseId> = self
            .leases
            .iter()
            .filter(|(_, e)| &e.instance == instance)
            .map(|(id, _)| *id)
            .collect();
        ids.into_iter()
            .filter_map(|id| self.leases.remove(&id))
            .map(|e| e.plan)
            .collect()
    }

    /// Removes every lease whose deadline has passed.
    pub fn expire(&mut self, now: Instant) -> Vec<(LeaseId, P)> {
        let ids: Vec<LeaseId> = self
            .leases
            .iter()
            .filter(|(_, e)| now >= e.expires)
            .map(|(id, _)| *id)
            .collect();
        self.expired += ids.len() as u64;
        ids.into_iter()
            .filter_map(|id| self.leases.remove(&id).map(|e| (id, e.plan)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::rc::Rc;

    use super::*;

    fn inst(s: &str) -> InstanceId {
        InstanceId::new(s).unwrap()
    }

    /// A plan whose clones are counted, so tests see when every share is gone.
    type Plan = Rc<&'static str>;

    #[test]
    fn expiry_just_before_and_after_ttl() {
        let t0 = Instant::now();
        let mut t = LeaseTable::<Plan>::new(DEFAULT_TTL);
        let a = t.create(inst("e"), 1, Rc::new("a"), t0);
        let b = t.create(inst("e"), 1, Rc::new("b"), t0);
        let just_before = t0 + Duration::from_secs(600) - Duration::from_millis(1);
        assert!(t.expire(just_before).is_empty());
        assert!(t.check(a, &inst("e"), 0, just_before).is_ok());
        let at = t0 + Duration::from_secs(600);
        assert_eq!(
            t.consume(a, &inst("e"), 0, at).unwrap_err(),
            LeaseError::UnknownOrExpired { lease: a }
        );
        assert_eq!(t.len(), 1, "the expired lease was dropped at consume");
        let swept = t.expire(at + Duration::from_millis(1));
        assert_eq!(swept.len(), 1);
        assert_eq!(swept[0].0, b);
        assert!(t.is_empty());
        assert_eq!(t.expired_total(), 2);
    }

    #[test]
    fn tp2_each_rank_once_then_gone() {
        let now = Instant::now();
        let mut t = LeaseTable::<Plan>::new(DEFAULT_TTL);
        let plan = Rc::new("p");
        let id = t.create(inst("e"), 2, Rc::clone(&plan), now);
        let c1 = t.consume(id, &inst("e"), 1, now).unwrap();
        assert!(!c1.last);
        assert_eq!(
            t.consume(id, &inst("e"), 1, now).unwrap_err(),
            LeaseError::RankConsumed { lease: id, rank: 1 }
        );
        assert_eq!(
            t.consume(id, &inst("e"), 2, now).unwrap_err(),
            LeaseError::RankOutOfRange {
                lease: id,
                rank: 2,
                world: 2
            }
        );
        assert!(matches!(
            t.consume(id, &inst("x"), 0, now),
            Err(LeaseError::WrongInstance { .. })
        ));
        let c0 = t.consume(id, &inst("e"), 0, now).unwrap();
        assert!(c0.last);
        assert!(t.is_empty(), "last consume removes the lease");
        assert_eq!(
            t.consume(id, &inst("e"), 0, now).unwrap_err(),
            LeaseError::UnknownOrExpired { lease: id }
        );
        // Shares outlive the lease until the transfers drop them.
        assert_eq!(Rc::strong_count(&plan), 3);
        drop((c0, c1));
        assert_eq!(Rc::strong_count(&plan), 1);
    }

    #[test]
    fn release_paths() {
        let now = Instant::now();
        let mut t = LeaseTable::<Plan>::new(DEFAULT_TTL);
        let unknown = LeaseId::random();
        assert_eq!(
            t.release(unknown).unwrap_err(),
            LeaseError::UnknownOrExpired { lease: unknown }
        );
        // Release while rank 1 still owes its consume.
        let id = t.create(inst("e"), 2, Rc::new("p"), now);
        let _share = t.consume(id, &inst("e"), 0, now).unwrap();
        assert!(t.release(id).is_ok());
        assert!(t.is_empty());
        assert!(t.consume(id, &inst("e"), 1, now).is_err());
        // Unregistering an instance releases its leases only.
        let a = t.create(inst("a"), 1, Rc::new("a1"), now);
        let _a2 = t.create(inst("a"), 1, Rc::new("a2"), now);
        let b = t.create(inst("b"), 1, Rc::new("b"), now);
        assert_eq!(t.release_instance(&inst("a")).len(), 2);
        assert!(t.check(a, &inst("a"), 0, now).is_err());
        assert!(t.check(b, &inst("b"), 0, now).is_ok());
    }
}
