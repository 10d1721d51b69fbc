//! Picking a backend by name.

use std::sync::Arc;

use crate::{Device, DeviceError, HostDevice};

use super::{CudaDevice, CudaOptions};

/// Opens a device by kind: `"cuda"` (a GPU, or a typed error), `"host"` (emulated device
/// memory) or `"auto"` (the GPU where a driver and the device are present, else host).
pub fn open_device(kind: &str, ordinal: u32) -> Result<Arc<dyn Device>, DeviceError> {
    open_device_with(kind, ordinal, CudaOptions::default())
}

/// Like [`open_device`], a GPU opened with `options` (the host device has no copy paths
/// and ignores them).
pub fn open_device_with(
    kind: &str,
    ordinal: u32,
    options: CudaOptions,
) -> Result<Arc<dyn Device>, DeviceError> {
    match kind {
        "cuda" => Ok(CudaDevice::open_with(ordinal, options)?),
        "host" => Ok(HostDevice::new(ordinal)),
        "auto" => match CudaDevice::open_with(ordinal, options) {
            Ok(d) => Ok(d),
            Err(DeviceError::NoDriver { .. } | DeviceError::NoSuchDevice { .. }) => {
                Ok(HostDevice::new(ordinal))
            }
            Err(e) => Err(e),
        },
        other => Err(DeviceError::Unsupported {
            what: "device kind",
            reason: format!("{other:?} (expected cuda, host or auto)"),
        }),
    }
}
