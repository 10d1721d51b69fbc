//! Host KV in memfds, as an engine without a GPU hands it to a node over the node's fd
//! socket.

use std::sync::Arc;

use kvferry_client::KvFd;
use kvferry_client::Registration;
use kvferry_client::{EngineClient, EngineClientError, MemoryRegion, RegisterRegions};
use kvferry_gpu::{Device, DeviceBuffer, DeviceError, KvLayoutSpec, KvShape};
use kvferry_proto::api::RegisterInstance;
use kvferry_proto::InstanceId;

use crate::device_kv::{DeviceKv, KvKind};

/// Host KV in a memfd, as an engine without a GPU hands it to a node over the node's fd
/// socket: split K/V planes one after another inside the memfd (block stride = one
/// segment), mapped in this process too, with the pattern and canaries of [`DeviceKv`]
/// (which it dereferences to).
pub struct MemfdKv {
    kv: DeviceKv,
    fd: std::os::fd::OwnedFd,
    base: u64,
    len: u64,
}

/// A memfd of `len` bytes, and its mapping as memory of `device`.
fn memfd(
    device: &kvferry_gpu::HostDevice,
    len: u64,
) -> Result<(std::os::fd::OwnedFd, DeviceBuffer), DeviceError> {
    use rustix::fs::MemfdFlags;
    let fail = |what: &str, e: std::io::Error| DeviceError::Import {
        ordinal: 0,
        what: "memfd",
        reason: format!("{what}: {e}"),
    };
    // Sealing allowed, as an engine's allocator may seal its KV memfd against shrinking.
    let fd = rustix::fs::memfd_create(
        c"kvferry-client-kv",
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )
    .map_err(|e| fail("memfd_create", e.into()))?;
    rustix::fs::ftruncate(&fd, len).map_err(|e| fail("ftruncate", e.into()))?;
    // std's clone is F_DUPFD_CLOEXEC: the copy stays close-on-exec like the original.
    let mine = fd.try_clone().map_err(|e| fail("dup", e))?;
    let memory = device.import_memfd(mine, len)?;
    Ok((fd, memory))
}

impl MemfdKv {
    pub fn create(shape: KvShape, num_blocks: u32, view_offset: u64) -> Result<Self, DeviceError> {
        let len = DeviceKv::in_one_bytes(shape, num_blocks, view_offset);
        let device = kvferry_gpu::HostDevice::new(0);
        let (fd, memory) = memfd(&device, len)?;
        let base = memory.ptr();
        let kv = DeviceKv::in_one(device, memory, shape, num_blocks, view_offset)?;
        Ok(Self { kv, fd, base, len })
    }

    /// The memfd to pass to the node.
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.fd.as_fd()
    }

    /// Bytes of the memfd.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The layout to register: offsets inside the memfd.
    pub fn spec(&self) -> KvLayoutSpec {
        self.kv.spec_from(self.base)
    }

    /// The registration of this KV as `rank` of `instance` (model `model`, dtype bf16).
    pub fn register_request(
        &self,
        instance: &InstanceId,
        model: &str,
        rank: u32,
    ) -> RegisterInstance {
        RegisterInstance {
            instance: instance.clone(),
            model: model.into(),
            dtype: "bf16".into(),
            shape: self.kv.shape,
            rank,
            device: 0,
            layout: self.spec(),
        }
    }
}

impl MemfdKv {
    /// Passes this KV to a node through `client` (its fd socket) and registers it as `rank`
    /// of `instance`. Returns the namespace the node answered.
    pub async fn register_with(
        &self,
        client: &EngineClient,
        instance: &InstanceId,
        model: &str,
        rank: u32,
    ) -> Result<String, EngineClientError> {
        let handle = client
            .send_kv(
                instance,
                rank,
                0,
                self.fd(),
                KvFd::Memfd { len: self.len() },
            )
            .await?;
        client
            .register(Registration::in_handle(
                &self.register_request(instance, model, rank),
                handle,
            ))
            .await
    }
}

impl std::ops::Deref for MemfdKv {
    type Target = DeviceKv;

    fn deref(&self) -> &DeviceKv {
        &self.kv
    }
}

/// Host KV in one memfd per buffer — an engine's one tensor per layer (or per plane) — in
/// any [`KvKind`], registered with one memory region per memfd (engine protocol 2), with the
/// pattern and canaries of [`DeviceKv`] (which it dereferences to).
pub struct MemfdRegionsKv {
    kv: DeviceKv,
    fds: Vec<std::os::fd::OwnedFd>,
}

impl MemfdRegionsKv {
    pub fn create(
        shape: KvShape,
        kind: KvKind,
        num_blocks: u32,
        block_stride: u64,
        view_offset: u64,
    ) -> Result<Self, DeviceError> {
        let device = kvferry_gpu::HostDevice::new(0);
        let mut fds = Vec::new();
        let host = Arc::clone(&device);
        let kv = DeviceKv::alloc_with(
            device,
            shape,
            kind,
            num_blocks,
            block_stride,
            view_offset,
            |len| {
                let (fd, mem) = memfd(&host, len)?;
                fds.push(fd);
                Ok(mem)
            },
        )?;
        Ok(Self { kv, fds })
    }

    /// The registration of this KV as `rank` of `instance`, region i being memory handle
    /// `handles[i]` (memfd i sent on the fd socket).
    pub fn registration(
        &self,
        instance: &InstanceId,
        model: &str,
        rank: u32,
        handles: &[u64],
    ) -> RegisterRegions {
        RegisterRegions {
            instance: instance.clone(),
            model: model.into(),
            dtype: "bf16".into(),
            shape: self.kv.shape,
            rank,
            device: 0,
            kind: self.kv.spec().kind,
            block_stride: self.kv.block_stride,
            num_blocks: self.kv.num_blocks,
            regions: handles.iter().map(|&h| MemoryRegion::Handle(h)).collect(),
            layers: self.kv.placements(),
        }
    }

    /// Memfd `i` (buffer `i`'s memory).
    pub fn fd_of(&self, i: usize) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.fds[i].as_fd()
    }

    /// Sends every memfd through `client` and registers them as `rank` of `instance`.
    pub async fn register_with(
        &self,
        client: &EngineClient,
        instance: &InstanceId,
        model: &str,
        rank: u32,
    ) -> Result<String, EngineClientError> {
        let mut handles = Vec::with_capacity(self.fds.len());
        for (fd, len) in self.fds.iter().zip(self.kv.buffer_lens()) {
            use std::os::fd::AsFd;
            handles.push(
                client
                    .send_kv(instance, rank, 0, fd.as_fd(), KvFd::Memfd { len })
                    .await?,
            );
        }
        client
            .register(Registration::regions(
                &self.registration(instance, model, rank, &handles),
            ))
            .await
    }
}

impl std::ops::Deref for MemfdRegionsKv {
    type Target = DeviceKv;

    fn deref(&self) -> &DeviceKv {
        &self.kv
    }
}
