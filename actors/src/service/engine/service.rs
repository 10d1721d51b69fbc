//! The [`Engine`] service: each call handed to its group's handler (`info`,
//! `registration`, `load`, `save`, `session`), and what the groups share.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use tonic::codegen::tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

use crate::fence::Fence;
use crate::service::engine::memory_handles::MemoryHandle;
use crate::service::engine::shared::Shared;
use kvferry_proto::v1::engine_server::Engine;
use kvferry_proto::v1::*;

/// The gRPC service over the [`Shared`] state; mailbox threads run its handlers too.
#[derive(Clone)]
pub(crate) struct EngineService {
    pub(crate) shared: Arc<Shared>,
}

impl EngineService {
    /// The fence a request takes effect by: the client's (`fence_ns`, 0: none), and in any
    /// case this node's call timeout from now, at which the service answers
    /// DEADLINE_EXCEEDED itself and stops waiting for the node.
    pub(super) fn fence(&self, fence_ns: u64) -> Fence {
        let own = Fence::after(self.shared.options.call_timeout);
        own.min_with((fence_ns != 0).then(|| Fence::at_ns(fence_ns)))
    }

    /// The fd-socket handle `id`, or NOT_FOUND saying `missing`.
    pub(super) fn handle(
        &self,
        id: u64,
        missing: impl FnOnce() -> String,
    ) -> Result<MemoryHandle, Status> {
        self.shared
            .handles()
            .get(id, Instant::now())
            .cloned()
            .ok_or_else(|| Status::not_found(missing()))
    }
}

pub(super) type EventStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl Engine for EngineService {
    async fn capabilities(
        &self,
        req: Request<CapabilitiesRequest>,
    ) -> Result<Response<CapabilitiesResponse>, Status> {
        self.handle_capabilities(req).await
    }

    async fn register_instance(
        &self,
        req: Request<RegisterInstanceRequest>,
    ) -> Result<Response<RegisterInstanceResponse>, Status> {
        self.handle_register_instance(req).await
    }

    async fn unregister_instance(
        &self,
        req: Request<UnregisterInstanceRequest>,
    ) -> Result<Response<UnregisterInstanceResponse>, Status> {
        self.handle_unregister_instance(req).await
    }

    async fn save(&self, req: Request<SaveRequest>) -> Result<Response<StoreResponse>, Status> {
        self.handle_save(req).await
    }

    async fn put_blocks(
        &self,
        req: Request<PutBlocksRequest>,
    ) -> Result<Response<StoreResponse>, Status> {
        self.handle_put_blocks(req).await
    }

    async fn query(&self, req: Request<QueryRequest>) -> Result<Response<QueryResponse>, Status> {
        self.handle_query(req).await
    }

    async fn load(&self, req: Request<LoadRequest>) -> Result<Response<LoadResponse>, Status> {
        self.handle_load(req).await
    }

    async fn release(
        &self,
        req: Request<ReleaseRequest>,
    ) -> Result<Response<ReleaseResponse>, Status> {
        self.handle_release(req).await
    }

    async fn health(
        &self,
        req: Request<HealthRequest>,
    ) -> Result<Response<HealthResponse>, Status> {
        self.handle_health(req).await
    }

    async fn stats(&self, req: Request<StatsRequest>) -> Result<Response<StatsResponse>, Status> {
        self.handle_stats(req).await
    }

    async fn lookup(
        &self,
        req: Request<LookupRequest>,
    ) -> Result<Response<LookupResponse>, Status> {
        self.handle_lookup(req).await
    }

    type SessionStream = EventStream<SessionEvent>;

    async fn session(
        &self,
        req: Request<Streaming<SessionRequest>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        self.handle_session(req).await
    }

    async fn poll_load(
        &self,
        req: Request<PollLoadRequest>,
    ) -> Result<Response<PollLoadResponse>, Status> {
        self.handle_poll_load(req).await
    }

    async fn cancel_load(
        &self,
        req: Request<CancelLoadRequest>,
    ) -> Result<Response<CancelLoadResponse>, Status> {
        self.handle_cancel_load(req).await
    }
}
