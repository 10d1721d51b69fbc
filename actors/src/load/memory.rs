//! The host memory a transfer's copies touch, as the guard its batches hold: pool memory
//! together with whatever keeps its slots pinned and the destination KV registered, so a
//! batch dropped while it runs (an actor stopped mid-load) keeps all of it until the copies
//! have resolved, on the gpu crate's drain thread.

use std::sync::Arc;

use kvferry_gpu::{HostMemory, HostSpan, SpanError};

use crate::tier::pool::PoolMemory;

/// Pool memory `[addr, addr + len)` and `K`, what keeps it mapped and its slots pinned (a
/// lease share, a staging or fetch guard, the rank handle of the destinations).
pub struct PoolGuard<K> {
    addr: u64,
    len: u64,
    _memory: Option<Arc<PoolMemory>>,
    _keep: K,
}

impl<K: Send + Sync + 'static> PoolGuard<K> {
    /// The whole pool mapping, kept mapped by this guard itself.
    pub fn whole(memory: Arc<PoolMemory>, keep: K) -> Self {
        Self {
            addr: memory.addr(),
            len: memory.len() as u64,
            _memory: Some(memory),
            _keep: keep,
        }
    }

    /// No pool memory (a load without a local prefix): an empty span.
    pub fn none(keep: K) -> Self {
        Self {
            addr: 0,
            len: 0,
            _memory: None,
            _keep: keep,
        }
    }

    /// One span over all of it: the host side every batch of the transfer is checked against.
    pub fn into_span(self) -> Result<HostSpan, SpanError> {
        let len = self.len;
        HostSpan::new(Arc::new(self), 0, len)
    }
}

// SAFETY: the range is fixed at construction and is the whole pool mapping, kept mapped by
// `_memory`, or empty. The pool is
// a `HostRegion`, which never hands out references to its bytes; who writes which slot when
// is the pins' protocol, as the trait leaves it.
unsafe impl<K: Send + Sync + 'static> HostMemory for PoolGuard<K> {
    fn span(&self) -> (u64, u64) {
        (self.addr, self.len)
    }
}
