//! A client's host memfd (a CPU engine's KV, SGLang's HiCache host pool) as memory a CUDA
//! device copies into and out of: mapped shared, registered with the driver as pinned host
//! memory mapped for the device, and accepted by range checks like an allocation of the
//! device. The copies are the device's own (copy engines, or the gather kernel through the
//! mapping), so a host-device node and a CUDA node serve the same clients.

use std::ffi::c_void;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::memfd::{map_client, ClientMap};
use crate::{DeviceBuffer, DeviceError};

use super::context::Context;
use super::ffi;
use super::release::{CudaRelease, Held};

impl Context {
    /// See [`crate::Device::import_memfd`].
    pub(super) fn import_memfd(
        self: &Arc<Self>,
        fd: OwnedFd,
        len: u64,
    ) -> Result<DeviceBuffer, DeviceError> {
        let ordinal = self.ordinal;
        let fail = |reason: String| DeviceError::Import {
            ordinal,
            what: "memfd",
            reason,
        };
        let map = map_client(fd, len).map_err(fail)?;
        let ptr = map.ptr();
        let size =
            usize::try_from(len).map_err(|_| fail("size exceeds the address space".into()))?;
        self.bind()?;
        // SAFETY: `map` stays mapped until `Held::Memfd` is released, which unregisters the
        // range before it drops (unmaps) the mapping.
        unsafe { ffi::mem_host_register(ptr as *mut c_void, size, false) }
            .map_err(|e| fail(format!("cuMemHostRegister: {e}")))?;
        let unregister = |why: String| {
            // SAFETY: registered just above; nothing was queued on it yet.
            let _ = unsafe { ffi::mem_host_unregister(ptr as *mut c_void) };
            fail(why)
        };
        // Copies and the gather kernel address it by the host address: that needs unified
        // addressing (every 64-bit Linux driver of a device kvferry runs on has it).
        match ffi::pointer_info(ptr) {
            Ok(info) if info.device_pointer == ptr => {}
            Ok(info) => {
                return Err(unregister(format!(
                    "the device maps it at {:#x}, not at its host address (no unified addressing)",
                    info.device_pointer
                )))
            }
            Err(e) => return Err(unregister(format!("cuPointerGetAttributes: {e}"))),
        }
        match self.client_maps.write() {
            Ok(mut m) => {
                m.insert(ptr, ptr + len);
            }
            Err(_) => return Err(unregister("the device's tables are poisoned".into())),
        }
        let owner = CudaRelease {
            inner: Arc::clone(self),
            held: Some(Held::Memfd(map)),
        };
        Ok(DeviceBuffer::new(ptr, len, ordinal, Box::new(owner)))
    }

    /// The client memfd mapping of this device holding all of `[ptr, ptr + len)`.
    pub(super) fn client_map_range(&self, ptr: u64, len: u64) -> Option<(u64, u64)> {
        let end = ptr.checked_add(len)?;
        let maps = self.client_maps.read().ok()?;
        let (&start, &stop) = maps.range(..=ptr).next_back()?;
        (end <= stop).then_some((start, stop))
    }

    /// Undoes [`Self::import_memfd`]: out of the table, unregistered, then unmapped.
    pub(super) fn release_memfd(&self, map: ClientMap) -> Result<(), DeviceError> {
        if let Ok(mut m) = self.client_maps.write() {
            m.remove(&map.ptr());
        }
        // SAFETY: registered by `import_memfd` and unregistered once (here); the buffer's
        // owner guarantees no batch still uses it (buffers outlive their loads).
        let r = unsafe { ffi::mem_host_unregister(map.ptr() as *mut c_void) }
            .map_err(|e| self.driver("cuMemHostUnregister", e));
        drop(map);
        r
    }
}
