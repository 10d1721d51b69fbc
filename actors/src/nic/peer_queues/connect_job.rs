//! Connects run off the driver's thread: the job that carries a QP out and its outcome that
//! brings it back.

use std::sync::Arc;

use kvferry_transport::{CompletionSink, Connector, Qp, QpError, QpKey};

/// One QP to bring from reset to ready-to-send: the connection and the handshake block on
/// the network, so the driver runs [`ConnectJob::run`] off its thread and feeds the outcome
/// back with [`PeerQueues::handle_connected`](super::PeerQueues::handle_connected).
pub struct ConnectJob {
    pub(super) qp: Qp,
    pub(super) connector: Arc<dyn Connector>,
    pub(super) sink: Arc<dyn CompletionSink>,
    pub(super) generation: u64,
}

impl std::fmt::Debug for ConnectJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectJob").field("qp", &self.qp).finish()
    }
}

impl ConnectJob {
    pub fn key(&self) -> QpKey {
        self.qp.key()
    }

    /// Connects (blocking).
    pub fn run(mut self) -> Connected {
        let result = self.qp.connect(&self.connector, self.sink.clone());
        Connected {
            qp: self.qp,
            result,
            generation: self.generation,
        }
    }
}

/// A connect job's outcome, with its QP.
pub struct Connected {
    pub(super) qp: Qp,
    pub(super) result: Result<(), QpError>,
    pub(super) generation: u64,
}

impl std::fmt::Debug for Connected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connected")
            .field("qp", &self.qp)
            .field("result", &self.result)
            .finish()
    }
}
