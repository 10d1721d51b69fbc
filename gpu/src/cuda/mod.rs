//! The `cuda` backend: NVIDIA GPUs through the CUDA driver API, loaded at run time.
//!
//! [`CudaDevice`] implements [`crate::Device`]: pointer validation with the driver's pointer
//! attributes, allocations of this process or mapped from another one by CUDA IPC handle,
//! VMM allocations imported by POSIX fd (vLLM 0.34's extensible KV cache) and exported, a
//! client's host memfd registered as pinned host memory and copied like device memory,
//! DMA-BUF export and import, pinned host registrations (read-only for peers' pools), and
//! batched copies on one stream per direction completed by a backend thread. Fragmented
//! batches whose host side is long pinned runs go through a device staging buffer (copy
//! engines at link speed, then a device-to-device scatter); other fragmented batches run as
//! one launch of a gather/scatter kernel ([`CopyPath`]). Without a driver,
//! opening fails with [`crate::DeviceError::NoDriver`]; nothing here panics for lack of CUDA.
//!
//! Layers, as in cudarc: `ffi` makes every raw call; `CudaDevice` and the kernel wrapper own
//! the resources.

mod client_memfd;
mod context;
mod device;
mod dmabuf;
mod enqueue;
mod error;
mod ffi;
mod host_register;
mod ipc;
mod kernel;
mod lane;
mod open;
mod options;
mod plan;
mod release;
mod shared;
mod staging;
mod vmm;
mod vmm_fd;

pub use device::{driver_present, CudaDevice};
pub use error::CudaError;
pub use ipc::IpcHandle;
pub use lane::DEFER_MIN_OPS;
pub use open::{open_device, open_device_with};
pub use options::{
    CudaOptions, DEFAULT_COMPLETION_SPIN, DEFAULT_STAGING_CHUNKS, DEFAULT_STAGING_CHUNK_BYTES,
};
pub use plan::CopyPath;
pub use vmm_fd::VmmExport;
