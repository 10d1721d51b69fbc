//! Nodes of one in-process cluster ([`LocalCluster`]): each over its own host-emulated
//! device, all on one manual clock, reading each other's pools over the cluster's provider.

use std::sync::Arc;

use kvferry_actors::peer::{LocalCluster, Provider};
use kvferry_actors::{Clock, ManualClock, Node, NodeConfig};
use kvferry_gpu::{Device, HostDevice};

/// Nodes of one [`LocalCluster`], in the order they were named.
pub struct Cluster {
    pub cluster: Arc<LocalCluster>,
    /// Moves the clock every node reads (lease and pin expiry).
    pub hand: ManualClock,
    members: Vec<(Node, Arc<HostDevice>, Arc<dyn Device>)>,
}

impl Cluster {
    /// Nodes `names` (32 slots of 64 KiB each) in a fresh cluster over `provider`.
    pub fn new(provider: Provider, names: &[&str]) -> Self {
        Self::with(LocalCluster::new(provider), names)
    }

    /// Nodes `names` (32 slots of 64 KiB each) in `cluster` (its directory, its faults).
    pub fn with(cluster: Arc<LocalCluster>, names: &[&str]) -> Self {
        let configs = names
            .iter()
            .map(|n| {
                let mut cfg = super::config(64 << 10, 32);
                cfg.node_id = (*n).into();
                cfg
            })
            .collect();
        Self::of(cluster, configs)
    }

    /// A node per config (its `node-id` names it) in `cluster`.
    pub fn of(cluster: Arc<LocalCluster>, configs: Vec<NodeConfig>) -> Self {
        let (clock, hand) = Clock::manual();
        let members = configs
            .into_iter()
            .map(|cfg| {
                let host = HostDevice::new(0);
                let dev: Arc<dyn Device> = Arc::clone(&host) as Arc<dyn Device>;
                let node = Node::start_in(
                    cfg,
                    vec![Arc::clone(&dev)],
                    clock.clone(),
                    Some(Arc::clone(&cluster)),
                )
                .unwrap();
                (node, host, dev)
            })
            .collect();
        Self {
            cluster,
            hand,
            members,
        }
    }

    pub fn node(&self, i: usize) -> &Node {
        &self.members[i].0
    }

    /// Node `i`'s device, as instances register on it.
    pub fn dev(&self, i: usize) -> &Arc<dyn Device> {
        &self.members[i].2
    }

    /// Node `i`'s device as the host device it is (its allocation gauges).
    pub fn host(&self, i: usize) -> &Arc<HostDevice> {
        &self.members[i].1
    }

    /// Waits until every node's leak gauges and the pins peers hold on it are back to zero
    /// ([`super::settled_with_peers`]).
    pub async fn settled(&self) {
        for (node, _, _) in &self.members {
            super::settled_with_peers(node).await;
        }
    }
}
