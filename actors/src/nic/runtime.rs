//! Embedding: the NIC actors on an actix `System` running on its own named thread, with one
//! `Arbiter` per NIC. `Addr`s are `Send + Sync`, so callers on any runtime send to them.

use std::sync::mpsc;
use std::thread::JoinHandle;

use actix::{Actor, Addr, Arbiter, System};
use kvferry_transport::{MrTable, NicConfig, NicId};
use thiserror::Error;

use super::mr_registry::MrRegistry;
use super::worker::{NicWorker, WorkerError};

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RuntimeError {
    #[error("starting the nic system thread failed")]
    Thread(#[source] std::io::Error),
    #[error("the nic system thread ended during start")]
    Lost,
    #[error("nic {nic} could not start")]
    Worker {
        nic: String,
        #[source]
        source: Box<WorkerError>,
    },
    #[error("nic {nic}: {reason}")]
    Config { nic: String, reason: String },
}

struct Started {
    system: System,
    registry: Addr<MrRegistry>,
    workers: Vec<Addr<NicWorker>>,
    arbiters: Vec<Arbiter>,
}

/// The running NIC actors. Dropping it stops every worker and the system, and joins the
/// system thread.
pub struct NicRuntime {
    pub registry: Addr<MrRegistry>,
    /// Index = NIC id.
    pub workers: Vec<Addr<NicWorker>>,
    /// Index = NIC id; the local MR table each worker checks destinations against.
    pub tables: Vec<MrTable>,
    system: System,
    arbiters: Vec<Arbiter>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for NicRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NicRuntime")
            .field("nics", &self.workers.len())
            .finish()
    }
}

impl NicRuntime {
    pub fn start(nics: Vec<NicConfig>) -> Result<Self, RuntimeError> {
        for n in &nics {
            n.validate().map_err(|e| RuntimeError::Config {
                nic: n.name.clone(),
                reason: e.to_string(),
            })?;
        }
        let tables: Vec<MrTable> = nics.iter().map(|_| MrTable::new()).collect();
        let tables_for_system = tables.clone();
        let (tx, rx) = mpsc::channel::<Result<Started, RuntimeError>>();
        let thread = std::thread::Builder::new()
            .name("kvf-nic-system".into())
            .spawn(move || {
                let sys = System::new();
                sys.block_on(async move {
                    let _ = tx.send(start_actors(nics, tables_for_system));
                });
                // Returns once `System::stop` is called.
                let _ = sys.run();
            })
            .map_err(RuntimeError::Thread)?;
        let started = match rx.recv() {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(RuntimeError::Lost);
            }
        };
        Ok(NicRuntime {
            registry: started.registry,
            workers: started.workers,
            tables,
            system: started.system,
            arbiters: started.arbiters,
            thread: Some(thread),
        })
    }
}

fn start_actors(nics: Vec<NicConfig>, tables: Vec<MrTable>) -> Result<Started, RuntimeError> {
    let system = System::current();
    let registry = MrRegistry::new(tables.clone()).start();
    let mut workers = Vec::with_capacity(nics.len());
    let mut arbiters = Vec::with_capacity(nics.len());
    for (i, (cfg, table)) in nics.into_iter().zip(tables).enumerate() {
        let nic = NicId(u16::try_from(i).unwrap_or(u16::MAX));
        let name = cfg.name.clone();
        let worker = NicWorker::new(nic, cfg, table).map_err(|source| RuntimeError::Worker {
            nic: name,
            source: Box::new(source),
        })?;
        let arbiter = Arbiter::new();
        workers.push(NicWorker::start_in_arbiter(&arbiter.handle(), move |_| {
            worker
        }));
        arbiters.push(arbiter);
    }
    Ok(Started {
        system,
        registry,
        workers,
        arbiters,
    })
}

impl Drop for NicRuntime {
    fn drop(&mut self) {
        for a in &self.arbiters {
            a.stop();
        }
        for a in self.arbiters.drain(..) {
            let _ = a.join();
        }
        self.system.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
