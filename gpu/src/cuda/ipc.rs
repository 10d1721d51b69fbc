//! CUDA IPC: mapping another process's allocation by its 64-byte handle (an engine's KV
//! tensors), and exporting one of ours.

use std::sync::Arc;

use crate::{DeviceBuffer, DeviceError};

use super::context::Context;
use super::device::CudaDevice;
use super::ffi;
use super::plan::Resolver;
use super::release::{CudaRelease, Held};
use super::shared;

/// A CUDA IPC handle of one allocation and the offset of the exported address inside it: what
/// an engine worker sends so that kvferry can map its KV tensors ([`crate::Device::import_ipc`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcHandle {
    pub bytes: [u8; 64],
    pub offset: u64,
}

impl CudaDevice {
    /// The CUDA IPC handle of the allocation holding `ptr` (the exporting side; engine
    /// workers normally do this through their framework).
    pub fn ipc_handle(&self, ptr: u64) -> Result<IpcHandle, DeviceError> {
        self.inner.bind()?;
        let (start, _) = self.inner.device_alloc(ptr, 1)?;
        let bytes =
            ffi::ipc_get_handle(start).map_err(|e| self.inner.driver("cuIpcGetMemHandle", e))?;
        Ok(IpcHandle {
            bytes,
            offset: ptr - start,
        })
    }
}

/// The 64-byte `cudaIpcMemHandle_t` inside `handle`: either that handle itself, or PyTorch's
/// storage handle (`storage._share_cuda_()[1]`: a version byte, the type `c` for a
/// `cudaMalloc` block, then the 64 bytes), so engines can pass what their framework gives them.
pub(super) fn ipc_payload(handle: &[u8]) -> Result<&[u8; 64], String> {
    let raw = match handle {
        [_version, b'c', rest @ ..] if rest.len() == 64 => rest,
        [_version, b'e', ..] if handle.len() != 64 => {
            return Err("PyTorch expandable segments cannot be imported by CUDA IPC handle".into())
        }
        _ => handle,
    };
    raw.try_into()
        .map_err(|_| format!("{} bytes, expected a 64-byte handle", handle.len()))
}

impl Context {
    pub(super) fn import_ipc(self: &Arc<Self>, handle: &[u8]) -> Result<DeviceBuffer, DeviceError> {
        let inner = self;
        let ordinal = inner.ordinal;
        let fail = |reason: String| DeviceError::Import {
            ordinal,
            what: "CUDA IPC handle",
            reason,
        };
        let bytes = ipc_payload(handle).map_err(fail)?;
        inner.bind()?;
        let base = shared::IPC
            .acquire((ordinal, *bytes), || ffi::ipc_open(bytes))
            .map_err(|e| fail(e.to_string()))?;
        let owner = CudaRelease {
            inner: Arc::clone(inner),
            held: Some(Held::Ipc(*bytes)),
        };
        let info = ffi::pointer_info(base).unwrap_or_default();
        // Dropping `owner` (through the buffer or on error) closes the mapping again.
        let buf = DeviceBuffer::new(base, info.range_size, ordinal, Box::new(owner));
        if info.memory_type != ffi::MEMORYTYPE_DEVICE || info.range_size == 0 {
            return Err(fail("the mapping is not device memory".into()));
        }
        if info.device_ordinal != ordinal as i32 {
            return Err(DeviceError::WrongDevice {
                ordinal,
                found: info.device_ordinal.max(0) as u32,
                ptr: base,
                len: info.range_size,
            });
        }
        Ok(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipc_handles_raw_and_pytorch_framed() {
        let raw = [9u8; 64];
        assert_eq!(ipc_payload(&raw).unwrap(), &raw);
        let mut torch = vec![2u8, b'c'];
        torch.extend_from_slice(&raw);
        assert_eq!(ipc_payload(&torch).unwrap(), &raw);
        let mut expandable = vec![2u8, b'e'];
        expandable.extend_from_slice(&[0; 40]);
        assert!(ipc_payload(&expandable).unwrap_err().contains("expandable"));
        assert!(ipc_payload(&[1, 2, 3]).unwrap_err().contains("3 bytes"));
    }
}
