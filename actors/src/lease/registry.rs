//! The instance registry: engine instances, their ranks' validated KV layouts and devices.
//! A plain struct the [`LeaseKeeper`] owns (a load finds its rank handle without a round
//! trip); its messages are handled by the keeper. Transfers hold a rank's handle;
//! unregistering waits until the last one drops.

use std::collections::HashMap;
use std::sync::Arc;

use actix::{Context, Handler, Message};
use kvferry_gpu::{Device, KvLayout, KvShape};
use tokio::sync::oneshot;

use crate::api::RegisterInstance;
use crate::error::NodeError;
use crate::lease::keeper::LeaseKeeper;
use crate::load::rank::RankKv;
use crate::model::{InstanceId, Namespace};

pub use crate::load::rank::{Memory, RankHandle};

#[derive(Debug)]
struct Instance {
    namespace: Namespace,
    shape: KvShape,
    ranks: Vec<Option<(Arc<RankHandle>, oneshot::Receiver<()>)>>,
}

/// Instances and their ranks.
pub struct InstanceRegistry {
    devices: Vec<Arc<dyn Device>>,
    instances: HashMap<InstanceId, Instance>,
}

impl InstanceRegistry {
    pub fn new(devices: Vec<Arc<dyn Device>>) -> Self {
        Self {
            devices,
            instances: HashMap::new(),
        }
    }

    /// A rank's handle, for a transfer.
    pub fn rank(&self, instance: &InstanceId, rank: u32) -> Result<Arc<RankHandle>, NodeError> {
        let inst = self
            .instances
            .get(instance)
            .ok_or_else(|| NodeError::UnknownInstance {
                instance: instance.clone(),
            })?;
        inst.ranks
            .get(rank as usize)
            .and_then(|r| r.as_ref())
            .map(|(h, _)| Arc::clone(h))
            .ok_or_else(|| NodeError::UnknownRank {
                instance: instance.clone(),
                rank,
            })
    }

    /// Namespace and shape of an instance, for a query.
    pub fn instance(&self, instance: &InstanceId) -> Result<(Namespace, KvShape), NodeError> {
        self.instances
            .get(instance)
            .map(|i| (i.namespace.clone(), i.shape))
            .ok_or_else(|| NodeError::UnknownInstance {
                instance: instance.clone(),
            })
    }

    pub fn len(&self) -> usize {
        self.instances.len()
    }

    pub fn is_empty(&self) -> bool {
        self.instances.is_empty()
    }
}

/// Registers one rank (validating its layout against its device's memory), keeping
/// `memory` (one entry per region it lies in) alive with the registration.
#[derive(Message)]
#[rtype(result = "Result<Namespace, NodeError>")]
pub struct Register(pub RegisterInstance, pub Vec<Memory>);

impl Handler<Register> for LeaseKeeper {
    type Result = Result<Namespace, NodeError>;

    fn handle(&mut self, Register(req, memory): Register, _: &mut Context<Self>) -> Self::Result {
        self.registry.register(req, memory)
    }
}

impl InstanceRegistry {
    fn register(
        &mut self,
        req: RegisterInstance,
        memory: Vec<Memory>,
    ) -> Result<Namespace, NodeError> {
        let device =
            self.devices
                .get(req.device as usize)
                .cloned()
                .ok_or(NodeError::NoSuchDevice {
                    ordinal: req.device,
                    count: self.devices.len(),
                })?;
        let namespace = Namespace::new(&req.model, &req.dtype, &req.shape.fingerprint())?;
        if req.rank >= req.shape.tp_size() {
            return Err(NodeError::bad(format!(
                "rank {} is out of range for tp {}",
                req.rank,
                req.shape.tp_size()
            )));
        }
        if let Some(inst) = self.instances.get(&req.instance) {
            if inst.namespace != namespace || inst.shape != req.shape {
                return Err(NodeError::InstanceMismatch {
                    instance: req.instance,
                    rank: req.rank,
                    existing: inst.namespace.to_string(),
                    requested: namespace.to_string(),
                });
            }
            if inst.ranks[req.rank as usize].is_some() {
                return Err(NodeError::RankRegistered {
                    instance: req.instance,
                    rank: req.rank,
                });
            }
        }
        let layout = KvLayout::new_on(req.layout, &req.shape, device.as_ref())?;
        let (tx, rx) = oneshot::channel();
        let handle = Arc::new(RankHandle::new(
            RankKv {
                instance: req.instance.clone(),
                rank: req.rank,
                namespace: namespace.clone(),
                shape: req.shape,
                layout,
                device,
            },
            memory,
            tx,
        ));
        let inst = self
            .instances
            .entry(req.instance)
            .or_insert_with(|| Instance {
                namespace: namespace.clone(),
                shape: req.shape,
                ranks: (0..req.shape.tp_size()).map(|_| None).collect(),
            });
        inst.ranks[req.rank as usize] = Some((handle, rx));
        Ok(namespace)
    }
}

/// A rank's handle, for a transfer.
#[derive(Message)]
#[rtype(result = "Result<Arc<RankHandle>, NodeError>")]
pub struct GetRank {
    pub instance: InstanceId,
    pub rank: u32,
}

impl Handler<GetRank> for LeaseKeeper {
    type Result = Result<Arc<RankHandle>, NodeError>;

    fn handle(&mut self, m: GetRank, _: &mut Context<Self>) -> Self::Result {
        self.registry.rank(&m.instance, m.rank)
    }
}

/// Namespace and shape of an instance, for a query.
#[derive(Message)]
#[rtype(result = "Result<(Namespace, KvShape), NodeError>")]
pub struct GetInstance(pub InstanceId);

impl Handler<GetInstance> for LeaseKeeper {
    type Result = Result<(Namespace, KvShape), NodeError>;

    fn handle(&mut self, m: GetInstance, _: &mut Context<Self>) -> Self::Result {
        self.registry.instance(&m.0)
    }
}

/// Removes an instance at once (no new transfer can find it) and returns one receiver per
/// registered rank that resolves when the last transfer using that rank has dropped it.
#[derive(Message)]
#[rtype(result = "Result<Vec<oneshot::Receiver<()>>, NodeError>")]
pub struct Unregister(pub InstanceId);

impl Handler<Unregister> for LeaseKeeper {
    type Result = Result<Vec<oneshot::Receiver<()>>, NodeError>;

    fn handle(&mut self, m: Unregister, _: &mut Context<Self>) -> Self::Result {
        let inst = self
            .registry
            .instances
            .remove(&m.0)
            .ok_or(NodeError::UnknownInstance { instance: m.0 })?;
        // Dropping our handle here leaves only the transfers' clones.
        Ok(inst.ranks.into_iter().flatten().map(|(_, rx)| rx).collect())
    }
}

/// Number of registered instances.
#[derive(Message)]
#[rtype(result = "usize")]
pub struct CountInstances;

impl Handler<CountInstances> for LeaseKeeper {
    type Result = usize;

    fn handle(&mut self, _: CountInstances, _: &mut Context<Self>) -> usize {
        self.registry.len()
    }
}
