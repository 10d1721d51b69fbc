//! Host registration: pinning host memory (read-only for a peer's pool where the device can) so
//! copies reach it by DMA and the gather kernel through its device mapping.

use std::ffi::c_void;
use std::sync::Arc;

use crate::{DeviceError, HostRegistration};

use super::context::Context;
use super::ffi;
use super::plan::HostMap;
use super::release::{CudaRelease, Held};
use super::shared;

impl Context {
    pub(super) fn register_host(
        self: &Arc<Self>,
        addr: u64,
        len: u64,
        read_only: bool,
    ) -> Result<HostRegistration, DeviceError> {
        let fail = |reason: String| DeviceError::HostRegister { addr, len, reason };
        if len == 0 || addr.checked_add(len).is_none() {
            return Err(fail("empty or overflowing range".into()));
        }
        if read_only && !self.caps.read_only_host_register {
            return Err(DeviceError::Unsupported {
                what: "read-only host registration",
                reason: "CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED is 0".into(),
            });
        }
        self.bind()?;
        let size =
            usize::try_from(len).map_err(|_| fail("size exceeds the address space".into()))?;
        let device = shared::HOST.acquire((addr, len), || {
            // SAFETY: the caller owns the mapping; the returned registration is dropped (and
            // the range unregistered with the last one) before the caller unmaps it, as
            // `HostRegistration` documents.
            unsafe { ffi::mem_host_register(addr as *mut c_void, size, read_only) }
                .map_err(|e| fail(e.to_string()))?;
            let info = ffi::pointer_info(addr).unwrap_or_default();
            Ok(if info.device_pointer != 0 {
                info.device_pointer
            } else {
                addr
            })
        })?;
        if let Ok(mut hosts) = self.hosts.write() {
            hosts.insert(
                addr,
                HostMap {
                    start: addr,
                    end: addr + len,
                    device,
                },
            );
        }
        let owner = CudaRelease {
            inner: Arc::clone(self),
            held: Some(Held::Host(addr, len)),
        };
        Ok(HostRegistration::new(Box::new(owner)))
    }
}
