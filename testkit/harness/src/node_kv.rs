//! The testkit's pattern KV on an in-process [`Node`]: its blocks put through the node's API
//! ([`put_pattern`]) and its device KV registered there ([`RegisterKv`]); what the testkit
//! itself builds as wire requests, this sends to the runtime.

use std::future::Future;
use std::ops::Range;

use kvferry_actors::{BlockHash, InstanceId, Node, NodeError, PutBlocks};
use kvferry_gpu::KvShape;
use kvferry_testkit::{rank_part, DeviceKv};

/// Puts pattern blocks `ids` (hash = pattern block = id) for `rank`, 16 blocks per call.
pub async fn put_pattern(
    node: &Node,
    instance: &InstanceId,
    shape: &KvShape,
    rank: u32,
    ids: Range<u64>,
) -> Result<(), NodeError> {
    let ids: Vec<u64> = ids.collect();
    for chunk in ids.chunks(16) {
        let blocks = chunk
            .iter()
            .map(|&i| (BlockHash::from_u64(i), rank_part(shape, i, rank)))
            .collect();
        node.put_blocks(PutBlocks {
            instance: instance.clone(),
            rank,
            blocks,
        })
        .await?;
    }
    Ok(())
}

/// Registers a testkit KV with a [`Node`] (in process, no client).
pub trait RegisterKv {
    /// Registers this KV as `rank` of `instance` on `node` (model `model`, dtype bf16).
    fn register(
        &self,
        node: &Node,
        instance: &str,
        model: &str,
        rank: u32,
    ) -> impl Future<Output = Result<InstanceId, NodeError>> + Send;
}

impl RegisterKv for DeviceKv {
    fn register(
        &self,
        node: &Node,
        instance: &str,
        model: &str,
        rank: u32,
    ) -> impl Future<Output = Result<InstanceId, NodeError>> + Send {
        let request = InstanceId::new(instance).map(|id| self.register_request(&id, model, rank));
        async move {
            let request = request?;
            let instance = request.instance.clone();
            node.register_instance(request).await?;
            Ok(instance)
        }
    }
}
