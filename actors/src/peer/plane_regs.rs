//! A rank's device planes registered with the verbs NICs it is read into, kept for the
//! rank's life (GPU MRs per instance per NIC, as the design has them). Registering a plane is
//! a DMA-BUF export and an `ibv_reg_dmabuf_mr` of the whole plane, which on real hardware pins
//! and maps every page of a layer's KV: done for every direct load, a load of one block paid
//! it for every plane of the model. Now the first direct load through a NIC registers the
//! planes it reads into and later loads reuse them.
//!
//! Ownership follows the rank: the holder is a field of the rank's handle, which every
//! transfer into the rank holds, and each load keeps its own reference to the registrations
//! it uses until its reads have drained. They are deregistered when the handle drops — after
//! the rank was unregistered and the last transfer into it ended — and before its memory is
//! let go.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kvferry_gpu::DmaBuf;
use kvferry_transport::verbs::LocalMr;

/// One plane's registration with one NIC, shared by the rank and the loads that read into
/// the plane.
pub type PlaneRegistration = Arc<NicPlane>;

/// What keeps one plane registered with one NIC.
#[derive(Debug)]
pub enum NicPlane {
    /// The plane exported as a DMA-BUF and registered from it. Fields drop in order: the MR
    /// is undone before the DMA-BUF is closed.
    DmaBuf { mr: LocalMr, buf: DmaBuf },
    /// Host memory standing in for a GPU plane (the software verbs device only).
    StandIn(LocalMr),
}

/// One NIC's registrations of a rank's planes, by plane `(base, len)`.
type NicPlanes = HashMap<(u64, u64), PlaneRegistration>;

/// The NIC registrations of one rank's planes, by NIC name, then plane `(base, len)` (so a
/// load looks a plane up by the NIC's `&str`, with no key to allocate).
#[derive(Default)]
pub struct PlaneRegs {
    held: Mutex<HashMap<String, NicPlanes>>,
}

impl std::fmt::Debug for PlaneRegs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlaneRegs")
            .field("held", &self.len())
            .finish()
    }
}

impl PlaneRegs {
    /// The registration of plane `base+len` with `nic`, made by `register` where there is
    /// none yet. A failed registration is not kept: the next load tries again. Concurrent
    /// loads into one rank wait for each other here and share what the first one made.
    pub fn get_or_register<E>(
        &self,
        nic: &str,
        base: u64,
        len: u64,
        register: impl FnOnce() -> Result<PlaneRegistration, E>,
    ) -> Result<PlaneRegistration, E> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = held.get(nic).and_then(|planes| planes.get(&(base, len))) {
            return Ok(Arc::clone(r));
        }
        let r = register()?;
        held.entry(nic.to_owned())
            .or_default()
            .insert((base, len), Arc::clone(&r));
        Ok(r)
    }

    /// How many plane registrations are held (over every NIC).
    pub fn len(&self) -> usize {
        let held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        held.values().map(NicPlanes::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Counts live registrations: made on creation, undone on drop.
    struct Reg(Arc<AtomicUsize>);
    impl Drop for Reg {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_plane_is_registered_once_per_nic_and_undone_with_the_holder() {
        let live = Arc::new(AtomicUsize::new(0));
        let made = AtomicUsize::new(0);
        let make = || -> Result<PlaneRegistration, String> {
            made.fetch_add(1, Ordering::SeqCst);
            live.fetch_add(1, Ordering::SeqCst);
            Ok(Arc::new(NicPlane::StandIn(LocalMr::new(Reg(Arc::clone(
                &live,
            ))))))
        };
        let regs = PlaneRegs::default();
        let a = regs.get_or_register("mlx5_0", 0x1000, 64, make).unwrap();
        let b = regs.get_or_register("mlx5_0", 0x1000, 64, make).unwrap();
        assert!(
            Arc::ptr_eq(&a, &b),
            "the second load reuses the first one's"
        );
        regs.get_or_register("mlx5_1", 0x1000, 64, make).unwrap();
        regs.get_or_register("mlx5_0", 0x2000, 64, make).unwrap();
        assert_eq!(made.load(Ordering::SeqCst), 3);
        assert_eq!(regs.len(), 3);
        // A failure is reported and not kept; the next call registers.
        let err = regs.get_or_register("mlx5_0", 0x3000, 64, || {
            Err::<PlaneRegistration, _>("refused")
        });
        assert_eq!(err.err(), Some("refused"));
        assert_eq!(regs.len(), 3);
        // A load still holding one keeps it past the holder; the rest go with the holder.
        drop(b);
        drop(regs);
        assert_eq!(live.load(Ordering::SeqCst), 1);
        drop(a);
        assert_eq!(live.load(Ordering::SeqCst), 0);
    }
}
