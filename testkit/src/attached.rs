//! The engine side of the fixture: a client process attached to a running node through
//! `kvferry.v1.Engine`, its KV a [`MemfdKv`] passed on the node's fd socket, its instance
//! tied to a session. Used by `kvferry demo --nodes`, `kvferry bench remote --nodes` and the
//! multi-process tests.

use std::time::Duration;

use thiserror::Error;

use kvferry_client::{EngineClient, EngineClientError, EngineSession, LoadOptions};
use kvferry_gpu::{DeviceError, KvShape};
use kvferry_proto::api::{LoadRequest, PutBlocks};
use kvferry_proto::v1::LoadCompletion;
use kvferry_proto::{BlockHash, InstanceId, LeaseId, ModelError};

use crate::memfd_kv::MemfdKv;
use crate::pattern::rank_part;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum AttachError {
    #[error(transparent)]
    Client(#[from] EngineClientError),
    #[error("client KV: {0}")]
    Memory(#[from] DeviceError),
    #[error(transparent)]
    Instance(#[from] ModelError),
    #[error(
        "the node at {addr} takes no memfd (fd socket {fd_socket:?}, memory kinds {kinds:?}): \
         give it an [engine] section with an fd-dir, on this host"
    )]
    NoMemfd {
        addr: String,
        fd_socket: String,
        kinds: Vec<String>,
    },
}

/// Puts pattern blocks `ids` of `shape` (hash and pattern block = id) for `rank` of
/// `instance` through `client` (`kvferry.v1.Engine`), 16 per call; the blocks written.
pub async fn put_pattern_over(
    client: &EngineClient,
    instance: &InstanceId,
    shape: &KvShape,
    rank: u32,
    ids: impl IntoIterator<Item = u64>,
) -> Result<u32, EngineClientError> {
    let ids: Vec<u64> = ids.into_iter().collect();
    let mut written = 0;
    for chunk in ids.chunks(16) {
        let r = client
            .put_blocks(&PutBlocks {
                instance: instance.clone(),
                rank,
                blocks: chunk
                    .iter()
                    .map(|&i| (BlockHash::from_u64(i), rank_part(shape, i, rank)))
                    .collect(),
            })
            .await?;
        written += r.written;
    }
    Ok(written)
}

/// One node as an engine process sees it: the client, this process's KV registered there
/// as rank 0 of `instance`, and the session that unregisters it when dropped.
pub struct Attached {
    pub client: EngineClient,
    pub kv: MemfdKv,
    pub instance: InstanceId,
    _session: EngineSession,
}

impl Attached {
    /// Connects to the engine service at `addr` and to the fd socket it names in
    /// `Capabilities`, passes a fresh memfd KV of `blocks` blocks (canaries everywhere) and
    /// registers it, then binds it to a session.
    pub async fn connect(
        addr: &str,
        token: &str,
        shape: KvShape,
        blocks: u32,
        instance: &str,
        model: &str,
    ) -> Result<Self, AttachError> {
        let probe = EngineClient::connect(addr, None, token).await?;
        let caps = probe.capabilities().await?;
        if caps.fd_socket.is_empty() || !caps.memory_kinds.iter().any(|k| k == "memfd") {
            return Err(AttachError::NoMemfd {
                addr: addr.into(),
                fd_socket: caps.fd_socket,
                kinds: caps.memory_kinds,
            });
        }
        let client = EngineClient::connect(addr, Some(caps.fd_socket.into()), token).await?;
        let instance = InstanceId::new(instance)?;
        let kv = MemfdKv::create(shape, blocks, 256)?;
        kv.register_with(&client, &instance, model, 0).await?;
        let session = client.open_session(std::slice::from_ref(&instance)).await?;
        Ok(Self {
            client,
            kv,
            instance,
            _session: session,
        })
    }

    /// Puts pattern blocks `ids` (hash and pattern block = id) as rank 0, 16 per call.
    pub async fn put_pattern(
        &self,
        ids: impl IntoIterator<Item = u64>,
    ) -> Result<(), EngineClientError> {
        put_pattern_over(&self.client, &self.instance, &self.kv.shape, 0, ids).await?;
        Ok(())
    }

    /// Starts rank 0's load of `lease` into `dest` and waits (at most `timeout`) for its
    /// completion (a poll the node holds until the load ends), whatever its status.
    pub async fn load(
        &self,
        lease: LeaseId,
        dest: &[u32],
        timeout: Duration,
    ) -> Result<LoadCompletion, EngineClientError> {
        let id = self.start_load(lease, dest).await?;
        self.client.wait_load(id, timeout).await
    }

    /// Starts rank 0's load of `lease` into `dest`; returns its load id.
    pub async fn start_load(&self, lease: LeaseId, dest: &[u32]) -> Result<u64, EngineClientError> {
        self.client
            .load(
                &LoadRequest {
                    lease,
                    instance: self.instance.clone(),
                    rank: 0,
                    dest_blocks: dest.to_vec(),
                    per_layer: false,
                },
                LoadOptions::default(),
            )
            .await
    }
}
