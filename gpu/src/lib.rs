//! Device memory for kvferry: the [`Device`] trait, the emulated [`HostDevice`] backend, KV
//! layouts ([`KvShape`], [`KvLayout`], [`Scatter`], the one block scatter) and batched copies:
//! [`CopyBatch`] built from checked [`HostSpan`]s and [`DeviceSpan`]s, whose
//! [`OwnedCopyEvent`] keeps the host memory ([`HostMemory`]) alive until the copies resolved,
//! on top of the raw [`CopyList`] of the unsafe [`Device::submit`].
//!
//! The crate never links CUDA at build time; backends that need a driver load it at run time
//! and fail with a typed error where none is present.

mod batch;
mod copy;
pub mod cuda;
mod device;
mod drain;
mod host;
mod layout;
pub mod memfd;
mod owned_event;
mod scatter;
mod shape;
mod span;

pub use batch::CopyBatch;
pub use copy::{CopyList, CopyOp};
pub use cuda::{open_device, open_device_with, CudaDevice};
pub use device::{
    CopyDirection, CopyDone, CopyEvent, CopyStats, Device, DeviceBuffer, DeviceCaps, DeviceError,
    DeviceKind, DmaBuf, HostRegistration, Landed,
};
pub use host::HostDevice;
pub use layout::{GroupKind, KvLayout, KvLayoutSpec, LayerLayout, LayoutError};
pub use owned_event::OwnedCopyEvent;
pub use scatter::Scatter;
pub use shape::{KvShape, ShapeError};
pub use span::{copy_host, DeviceSpan, HostMemory, HostSpan, SpanError};
