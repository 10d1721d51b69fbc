//! Process-wide reference counts for driver state that belongs to the process (host
//! registrations) or to a GPU's primary context (IPC mappings) rather than to one
//! [`super::CudaDevice`]: two handles of one GPU, such as two TP ranks served by one process,
//! share them, and the driver refuses a second registration or mapping of the same memory.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Mutex, MutexGuard, OnceLock};

/// Key → (value, references).
pub struct Counted<K> {
    map: OnceLock<Mutex<HashMap<K, (u64, usize)>>>,
}

impl<K: Eq + Hash + Copy> Counted<K> {
    pub const fn new() -> Self {
        Self {
            map: OnceLock::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<K, (u64, usize)>> {
        let m = self.map.get_or_init(|| Mutex::new(HashMap::new()));
        match m.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// The value for `key`, creating it with `make` on first use.
    pub fn acquire<E>(&self, key: K, make: impl FnOnce() -> Result<u64, E>) -> Result<u64, E> {
        let mut map = self.lock();
        if let Some((v, refs)) = map.get_mut(&key) {
            *refs += 1;
            return Ok(*v);
        }
        let v = make()?;
        map.insert(key, (v, 1));
        Ok(v)
    }

    /// Drops one reference; the last one runs `destroy` with the value.
    pub fn release<E>(&self, key: K, destroy: impl FnOnce(u64) -> Result<(), E>) -> Result<(), E> {
        let mut map = self.lock();
        let last = match map.get_mut(&key) {
            Some((_, refs)) if *refs > 1 => {
                *refs -= 1;
                None
            }
            Some(_) => map.remove(&key).map(|(v, _)| v),
            None => None,
        };
        match last {
            Some(v) => destroy(v),
            None => Ok(()),
        }
    }
}

/// Host registrations by (address, length); the value is the device address of the start.
pub static HOST: Counted<(u64, u64)> = Counted::new();
/// IPC mappings by (device ordinal, handle); the value is the mapped base.
pub static IPC: Counted<(u32, [u8; 64])> = Counted::new();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_release_destroys_once() {
        let c: Counted<u32> = Counted::new();
        let mut made = 0;
        for _ in 0..2 {
            let v = c.acquire::<()>(7, || {
                made += 1;
                Ok(42)
            });
            assert_eq!(v, Ok(42));
        }
        assert_eq!(made, 1);
        let mut destroyed = Vec::new();
        c.release::<()>(7, |v| {
            destroyed.push(v);
            Ok(())
        })
        .unwrap();
        assert!(destroyed.is_empty());
        c.release::<()>(7, |v| {
            destroyed.push(v);
            Ok(())
        })
        .unwrap();
        assert_eq!(destroyed, vec![42]);
        // A failed creation leaves nothing behind.
        assert_eq!(c.acquire(8, || Err("no")), Err("no"));
        assert_eq!(c.acquire::<()>(8, || Ok(1)), Ok(1));
    }
}
