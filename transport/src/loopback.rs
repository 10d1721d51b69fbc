//! In-process provider: reads copy straight from a peer's MR table, synchronously inside
//! `issue`, so runs are deterministic.

use std::sync::Arc;

use crate::completion::{CompletionSink, CompletionStatus, WorkCompletion};
use crate::connection::{Connection, ConnectionError, Connector, WorkRequest};
use crate::mr_table::MrTable;
use crate::qp_key::{NodeId, QpKey};

/// Connects QPs to a peer living in the same process.
#[derive(Clone, Debug)]
pub struct LoopbackConnector {
    peer: NodeId,
    peer_table: MrTable,
}

impl LoopbackConnector {
    pub fn new(peer: NodeId, peer_table: MrTable) -> Self {
        LoopbackConnector { peer, peer_table }
    }
}

impl Connector for LoopbackConnector {
    fn connect(
        &self,
        _qp: QpKey,
        sink: Arc<dyn CompletionSink>,
    ) -> Result<Box<dyn Connection>, ConnectionError> {
        Ok(Box::new(LoopbackConnection {
            peer: self.peer,
            table: self.peer_table.clone(),
            sink,
            aborted: false,
        }))
    }
}

struct LoopbackConnection {
    peer: NodeId,
    table: MrTable,
    sink: Arc<dyn CompletionSink>,
    aborted: bool,
}

impl Connection for LoopbackConnection {
    fn peer(&self) -> NodeId {
        self.peer
    }

    fn issue(&mut self, wr: WorkRequest) -> Result<(), ConnectionError> {
        if self.aborted {
            return Err(ConnectionError::ConnectionLost { peer: self.peer });
        }
        let (qp, wr_id, len) = (wr.qp, wr.wr_id, wr.remote.len);
        let status = match self
            .table
            .acquire_remote_read(wr.remote.rkey, wr.remote.addr, len)
        {
            Err(_) => CompletionStatus::RemoteAccessError,
            Ok(src) => {
                // SAFETY: `src` pins the owner's region and the table checked addr+len against
                // it, so `src.ptr()..+len` is readable for this call.
                let copied = unsafe { wr.scatter.write_from_ptr(src.ptr(), len) };
                match copied.and_then(|()| wr.scatter.finish()) {
                    Ok(()) => CompletionStatus::Success,
                    Err(_) => CompletionStatus::LocalWriteError,
                }
            }
        };
        drop(wr);
        self.sink.push(WorkCompletion {
            qp,
            wr_id,
            status,
            bytes: if status.is_success() { len } else { 0 },
        });
        Ok(())
    }

    fn abort(&mut self) {
        // Requests complete inside `issue`, so nothing is ever in flight to flush.
        self.aborted = true;
    }
}
