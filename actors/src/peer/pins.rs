//! Owner side: pins held for peers, with a TTL, released on unpin, on expiry, or when the
//! requester's lease goes (it unpins).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::model::{BlockHash, Namespace};

/// Default lifetime of a peer pin.
pub const DEFAULT_PEER_PIN_TTL: Duration = Duration::from_secs(120);

#[derive(Debug)]
struct PeerPin {
    namespace: Namespace,
    hashes: Vec<BlockHash>,
    expires: Instant,
}

/// Pins by id. Plain state with an injected clock; the block store drives it.
#[derive(Debug)]
pub struct PeerPins {
    pins: HashMap<u64, PeerPin>,
    next: u64,
    ttl: Duration,
    expired: u64,
}

impl PeerPins {
    pub fn new(ttl: Duration) -> Self {
        Self {
            pins: HashMap::new(),
            next: 1,
            ttl,
            expired: 0,
        }
    }

    pub fn create(&mut self, namespace: Namespace, hashes: Vec<BlockHash>, now: Instant) -> u64 {
        let id = self.next;
        self.next += 1;
        self.pins.insert(
            id,
            PeerPin {
                namespace,
                hashes,
                expires: crate::clock::deadline(now, self.ttl),
            },
        );
        id
    }

    /// Removes a pin; returns what it pinned.
    pub fn remove(&mut self, id: u64) -> Option<(Namespace, Vec<BlockHash>)> {
        self.pins.remove(&id).map(|p| (p.namespace, p.hashes))
    }

    pub fn expire(&mut self, now: Instant) -> Vec<(Namespace, Vec<BlockHash>)> {
        let ids: Vec<u64> = self
            .pins
            .iter()
            .filter(|(_, p)| now >= p.expires)
            .map(|(id, _)| *id)
            .collect();
        self.expired += ids.len() as u64;
        ids.into_iter().filter_map(|id| self.remove(id)).collect()
    }

    pub fn len(&self) -> usize {
        self.pins.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pins.is_empty()
    }

    pub fn expired_total(&self) -> u64 {
        self.expired
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expiry_at_ttl() {
        let t0 = Instant::now();
        let mut p = PeerPins::new(DEFAULT_PEER_PIN_TTL);
        let ns = Namespace::new("m", "d", "f").unwrap();
        let a = p.create(ns.clone(), vec![BlockHash::from_u64(1)], t0);
        let b = p.create(ns, vec![BlockHash::from_u64(2)], t0);
        assert!(p.expire(t0 + Duration::from_secs(119)).is_empty());
        assert!(p.remove(a).is_some());
        assert!(p.remove(a).is_none());
        let gone = p.expire(t0 + Duration::from_secs(120));
        assert_eq!(gone.len(), 1);
        assert!(p.remove(b).is_none());
        assert!(p.is_empty());
        assert_eq!(p.expired_total(), 1);
    }
}
