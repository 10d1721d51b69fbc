//! Save and PutBlocks: blocks into the node's pool, from the client's memory or the request.

use tonic::{Request, Response, Status};

use crate::api;
use crate::service::engine::request::{self as check, status};
use crate::service::engine::service::EngineService;
use kvferry_proto::v1::*;

impl EngineService {
    pub(super) async fn handle_save(
        &self,
        req: Request<SaveRequest>,
    ) -> Result<Response<StoreResponse>, Status> {
        const M: &str = "Save";
        let r = req.into_inner();
        let instance = check::instance(M, &r.instance)?;
        let hashes = check::hashes(M, &r.hashes)?;
        if r.src_blocks.len() != hashes.len() {
            return Err(Status::invalid_argument(format!(
                "{M}: {} hashes but {} source blocks",
                hashes.len(),
                r.src_blocks.len()
            )));
        }
        let fence = self.fence(r.fence_ns);
        let rep = self
            .shared
            .node
            .save_fenced(
                api::SaveRequest {
                    instance,
                    rank: r.rank,
                    hashes,
                    src_blocks: r.src_blocks,
                    tenant: (!r.tenant.is_empty()).then_some(r.tenant),
                },
                Some(fence),
            )
            .await
            .map_err(|e| status(M, e))?;
        Ok(Response::new(store_response(rep)))
    }

    pub(super) async fn handle_put_blocks(
        &self,
        req: Request<PutBlocksRequest>,
    ) -> Result<Response<StoreResponse>, Status> {
        const M: &str = "PutBlocks";
        let r = req.into_inner();
        let instance = check::instance(M, &r.instance)?;
        let hashes: Vec<Vec<u8>> = r.blocks.iter().map(|b| b.hash.clone()).collect();
        let hashes = check::hashes(M, &hashes)?;
        if let Some(i) = r.blocks.iter().position(|b| b.data.is_empty()) {
            return Err(Status::invalid_argument(format!(
                "{M}: block #{i} has no data"
            )));
        }
        let blocks = hashes
            .into_iter()
            .zip(r.blocks)
            .map(|(h, b)| (h, b.data))
            .collect();
        let fence = self.fence(r.fence_ns);
        let rep = self
            .shared
            .node
            .put_blocks_fenced(
                api::PutBlocks {
                    instance,
                    rank: r.rank,
                    blocks,
                },
                Some(fence),
            )
            .await
            .map_err(|e| status(M, e))?;
        Ok(Response::new(store_response(rep)))
    }
}

fn store_response(r: api::StoreReport) -> StoreResponse {
    StoreResponse {
        written: r.written as u32,
        present: r.present as u32,
        sealed: r.sealed as u32,
        bytes: r.bytes,
        seconds: r.seconds,
        not_stored: u32::try_from(r.not_stored).unwrap_or(u32::MAX),
    }
}
