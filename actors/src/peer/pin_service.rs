//! What the peer side needs from the local block store: pinning blocks an owner serves to a
//! requester, and releasing those pins. The owner's Peer service and in-process links reach
//! the store only through this, so `peer/` does not know which actor (or test double) holds
//! the blocks; the node implements it over its store's address.

use std::fmt;

use thiserror::Error;

use crate::model::{BlockHash, Namespace};
use crate::peer::link::{BoxFut, PinnedRemote};

/// Why the store did not answer. Callers name the peer and the side they are on, so the
/// variants only say which call found the store gone.
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PinServiceError {
    #[error("pinning blocks for a peer: the block store has stopped")]
    PinStopped,
    #[error("releasing peer pin {pin_id}: the block store has stopped")]
    UnpinStopped { pin_id: u64 },
}

/// The owner side's pins for peers. Every method returns without waiting on the store: the
/// futures do the waiting, so a caller on any executor (the Peer service's tokio runtime, a
/// link's caller) never blocks the store's thread or its own.
pub trait PinService: Send + Sync + fmt::Debug {
    /// Pins the present sealed prefix of `hashes` for a peer; blocks that vanished since the
    /// peer's lookup shorten the answer (pin id 0 and no blocks when none is present).
    fn pin(
        &self,
        namespace: Namespace,
        hashes: Vec<BlockHash>,
    ) -> BoxFut<Result<PinnedRemote, PinServiceError>>;
    /// Releases a pin; resolves once it is gone (unknown ids are ignored: they expired).
    fn unpin(&self, pin_id: u64) -> BoxFut<Result<(), PinServiceError>>;
    /// Releases a pin without waiting for it (control, and callable from `Drop`).
    fn unpin_detached(&self, pin_id: u64);
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::peer::link::{Control, RemoteBlock};

    /// Pins what it is asked for (every block, at its index as address), records unpins.
    #[derive(Debug, Default)]
    struct Recording {
        unpinned: Mutex<Vec<(u64, bool)>>,
        stopped: bool,
    }

    impl PinService for Recording {
        fn pin(
            &self,
            _: Namespace,
            hashes: Vec<BlockHash>,
        ) -> BoxFut<Result<PinnedRemote, PinServiceError>> {
            let r = if self.stopped {
                Err(PinServiceError::PinStopped)
            } else {
                Ok(PinnedRemote {
                    pin_id: 7,
                    blocks: hashes
                        .iter()
                        .enumerate()
                        .map(|(i, h)| RemoteBlock {
                            hash: *h,
                            addr: i as u64,
                        })
                        .collect(),
                })
            };
            Box::pin(std::future::ready(r))
        }

        fn unpin(&self, pin_id: u64) -> BoxFut<Result<(), PinServiceError>> {
            self.unpinned.lock().unwrap().push((pin_id, true));
            Box::pin(std::future::ready(Ok(())))
        }

        fn unpin_detached(&self, pin_id: u64) {
            self.unpinned.lock().unwrap().push((pin_id, false));
        }
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    /// A link's control path over a local store pins through it, unpins without waiting,
    /// never sends pin 0, and names the owner when the store is gone.
    #[test]
    fn local_control_pins_and_unpins_through_the_service() {
        let store = Arc::new(Recording::default());
        let control = Control::Local(store.clone());
        let ns = Namespace::new("m", "d", "f").unwrap();
        let hashes = vec![BlockHash::from_u64(1), BlockHash::from_u64(2)];
        let pinned = block_on(control.pin("b", ns.clone(), hashes.clone())).unwrap();
        assert_eq!(pinned.pin_id, 7);
        assert_eq!(pinned.blocks.len(), 2);
        assert_eq!(pinned.blocks[1].hash, hashes[1]);
        control.unpin(0);
        control.unpin(7);
        assert_eq!(*store.unpinned.lock().unwrap(), vec![(7, false)]);

        let gone = Control::Local(Arc::new(Recording {
            stopped: true,
            ..Default::default()
        }));
        let e = block_on(gone.pin("b", ns, hashes)).unwrap_err().to_string();
        assert!(e.contains('b'), "{e}");
    }
}
