//! An in-process cluster: nodes of one process sharing an embedded directory, reaching each
//! other's pools over a chosen provider (loopback: the owner's own mapping; shm: the owner's
//! memfd passed over a Unix socket and mapped read-only).

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use actix::Addr;
use kvferry_transport::shm::{ShmConnector, ShmOwner};
use kvferry_transport::{Access, HostRegion, MrHandle, MrTable, NodeId};

use super::directory::{Directory, EmbeddedDirectory};
use super::link::{MappedLink, MappedView, PeerLink};
use crate::error::NodeError;
use crate::store::BlockStore;

/// How nodes of a cluster read each other's pools.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Provider {
    Loopback,
    Shm,
}

impl Provider {
    pub fn parse(s: &str) -> Result<Self, NodeError> {
        match s {
            "loopback" => Ok(Provider::Loopback),
            "shm" => Ok(Provider::Shm),
            other => Err(NodeError::bad(format!(
                "provider {other:?} is not one of loopback, shm"
            ))),
        }
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            Provider::Loopback => "loopback",
            Provider::Shm => "shm",
        }
    }
}

/// The transport node id of a kvferry node id.
pub fn transport_id(node: &str) -> NodeId {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    node.hash(&mut h);
    NodeId(h.finish())
}

struct Member {
    store: Addr<BlockStore>,
    memory: Arc<HostRegion>,
    _table: MrTable,
    _mr: MrHandle,
    shm: Option<(PathBuf, ShmOwner)>,
}

/// Nodes of one process.
pub struct LocalCluster {
    directory: Arc<dyn Directory>,
    provider: Provider,
    members: Mutex<HashMap<String, Member>>,
    links: Mutex<HashMap<(String, String), Arc<dyn PeerLink>>>,
    dir: PathBuf,
}

impl std::fmt::Debug for LocalCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalCluster")
            .field("provider", &self.provider)
            .finish()
    }
}

impl LocalCluster {
    pub fn new(provider: Provider) -> Arc<Self> {
        Self::with_directory(provider, Arc::new(EmbeddedDirectory::new()))
    }

    pub fn with_directory(provider: Provider, directory: Arc<dyn Directory>) -> Arc<Self> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("kvferry-{}-{n}", std::process::id()));
        Arc::new(Self {
            directory,
            provider,
            members: Mutex::new(HashMap::new()),
            links: Mutex::new(HashMap::new()),
            dir,
        })
    }

    pub fn directory(&self) -> &Arc<dyn Directory> {
        &self.directory
    }

    pub fn provider(&self) -> Provider {
        self.provider
    }

    /// Adds a node: its pool is registered for remote read and served on the provider.
    pub(crate) fn join(
        &self,
        node: &str,
        store: Addr<BlockStore>,
        memory: Arc<HostRegion>,
    ) -> Result<(), NodeError> {
        let table = MrTable::new();
        let mr = table
            .register_host(Arc::clone(&memory), Access::REMOTE_READ)
            .map_err(|e| NodeError::Remote {
                peer: node.into(),
                reason: e.to_string(),
            })?;
        let shm =
            match self.provider {
                Provider::Loopback => None,
                Provider::Shm => {
                    std::fs::create_dir_all(&self.dir).map_err(|e| NodeError::Remote {
                        peer: node.into(),
                        reason: format!("creating {}: {e}", self.dir.display()),
                    })?;
                    let path = self.dir.join(format!("{node}.sock"));
                    let _ = std::fs::remove_file(&path);
                    let listener = UnixListener::bind(&path).map_err(|e| NodeError::Remote {
                        peer: node.into(),
                        reason: format!("binding {}: {e}", path.display()),
                    })?;
                    let owner = ShmOwner::spawn(listener, transport_id(node), table.clone())
                        .map_err(|e| NodeError::Remote {
                            peer: node.into(),
                            reason: e.to_string(),
                        })?;
                    Some((path, owner))
                }
            };
        let m = Member {
            store,
            memory,
            _table: table,
            _mr: mr,
            shm,
        };
        self.members
            .lock()
            .map_err(|_| NodeError::Stopped { what: "cluster" })?
            .insert(node.to_owned(), m);
        Ok(())
    }

    /// Removes a node: its entries leave the directory and links to it are dropped.
    pub(crate) fn leave(&self, node: &str) {
        self.directory.withdraw_node(node);
        if let Ok(mut l) = self.links.lock() {
            l.retain(|(a, b), _| a != node && b != node);
        }
        let gone = self.members.lock().ok().and_then(|mut m| m.remove(node));
        if let Some(Member {
            shm: Some((path, owner)),
            ..
        }) = gone
        {
            owner.shutdown();
            let _ = std::fs::remove_file(path);
        }
    }

    /// A link from `from` to `to`, made once and shared.
    pub(crate) fn link(&self, from: &str, to: &str) -> Result<Arc<dyn PeerLink>, NodeError> {
        let key = (from.to_owned(), to.to_owned());
        if let Some(l) = self.links.lock().ok().and_then(|l| l.get(&key).cloned()) {
            return Ok(l);
        }
        let unreachable = |reason: String| NodeError::Remote {
            peer: to.to_owned(),
            reason,
        };
        let (store, view) = {
            let members = self
                .members
                .lock()
                .map_err(|_| NodeError::Stopped { what: "cluster" })?;
            let m = members
                .get(to)
                .ok_or_else(|| unreachable("not a member of this cluster".into()))?;
            let view = match (&self.provider, &m.shm) {
                (Provider::Shm, Some((path, _))) => {
                    let mapping = ShmConnector::new(transport_id(from), transport_id(to), path)
                        .map_exports()
                        .map_err(|e| unreachable(e.to_string()))?;
                    let r = mapping
                        .regions()
                        .into_iter()
                        .find(|r| r.remote_addr == m.memory.addr())
                        .ok_or_else(|| unreachable("owner exports no pool".into()))?;
                    MappedView {
                        holder: Arc::new(Mutex::new(mapping)),
                        remote_base: r.remote_addr,
                        local_base: r.local_addr,
                        len: r.len,
                    }
                }
                _ => MappedView {
                    holder: Arc::clone(&m.memory) as Arc<dyn std::any::Any + Send + Sync>,
                    remote_base: m.memory.addr(),
                    local_base: m.memory.addr(),
                    len: m.memory.len() as u64,
                },
            };
            (m.store.clone(), view)
        };
        let link: Arc<dyn PeerLink> = Arc::new(MappedLink::new(
            to.to_owned(),
            self.provider.as_str(),
            store,
            view,
        ));
        if let Ok(mut l) = self.links.lock() {
            l.insert(key, Arc::clone(&link));
        }
        Ok(link)
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
