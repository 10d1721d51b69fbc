//! What a [`DeviceBuffer`] or [`HostRegistration`] of the CUDA backend undoes on drop, in the
//! one place teardown errors are recorded instead of raised.

use std::ffi::c_void;
use std::sync::Arc;

use crate::device::Release;
#[cfg(doc)]
use crate::{DeviceBuffer, HostRegistration};

use super::context::Context;
use super::ffi;
use super::shared;
use super::vmm::VmmMap;
use crate::memfd::ClientMap;

/// What a [`DeviceBuffer`] or [`HostRegistration`] of this backend undoes on drop.
pub(super) enum Held {
    Alloc(u64),
    Ipc([u8; 64]),
    Host(u64, u64),
    Vmm(VmmMap),
    /// A client's memfd, registered (`import_memfd`).
    Memfd(ClientMap),
}

pub(super) struct CudaRelease {
    pub(super) inner: Arc<Context>,
    pub(super) held: Option<Held>,
}

impl Release for CudaRelease {
    fn release(&mut self) {
        let Some(held) = self.held.take() else { return };
        let inner = &self.inner;
        if let Err(e) = inner.bind() {
            inner.record_teardown(e);
            return;
        }
        let r = match held {
            // SAFETY: allocated by `alloc`, released once (`held` is taken); the owner of the
            // buffer guarantees no batch still uses it (buffers outlive their loads).
            Held::Alloc(p) => unsafe { ffi::mem_free(p) }.map_err(|e| inner.driver("cuMemFree", e)),
            // SAFETY: opened by `import_ipc`, closed once, same guarantee as above.
            Held::Ipc(handle) => shared::IPC.release((inner.ordinal, handle), |p| {
                // SAFETY: opened by `import_ipc`, closed by the last reference only; the
                // buffers' owners guarantee no batch still uses it.
                unsafe { ffi::ipc_close(p) }.map_err(|e| inner.driver("cuIpcCloseMemHandle", e))
            }),
            Held::Vmm(mut map) => {
                if let Ok(mut vmms) = inner.vmms.write() {
                    vmms.remove(&map.ptr());
                }
                map.teardown().map_err(|(call, e)| inner.driver(call, e))
            }
            Held::Memfd(map) => inner.release_memfd(map),
            Held::Host(p, len) => {
                if let Ok(mut hosts) = inner.hosts.write() {
                    hosts.remove(&p);
                }
                shared::HOST.release((p, len), |_| {
                    // SAFETY: registered by `register_host`, unregistered by the last
                    // reference only; the registrations' owners guarantee no batch still
                    // reads it.
                    unsafe { ffi::mem_host_unregister(p as *mut c_void) }
                        .map_err(|e| inner.driver("cuMemHostUnregister", e))
                })
            }
        };
        if let Err(e) = r {
            inner.record_teardown(e);
        }
    }
}
