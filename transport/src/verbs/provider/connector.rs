//! Connecting a requester QP to one peer: create it, exchange endpoints through the peer,
//! and walk it to ready-to-send.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::connection::VerbsConnection;
use super::send_queue::{ConnShared, SendQueue};
use super::{lock, EndpointExchange, VerbsNic};
use crate::completion::CompletionSink;
use crate::connection::{Connection, ConnectionError, Connector};
use crate::qp_key::{NodeId, QpKey};
use crate::verbs::device::{DeviceError, VerbsDevice};
use crate::verbs::qp_attrs::{connect_transitions, responder_depth, QpEndpoint};
use crate::verbs::registration::KeyMap;

/// Connects QPs to one peer over one NIC.
pub struct VerbsConnector {
    nic: Arc<VerbsNic>,
    peer: NodeId,
    exchange: Arc<dyn EndpointExchange>,
}

impl VerbsConnector {
    pub fn new(nic: Arc<VerbsNic>, peer: NodeId, exchange: Arc<dyn EndpointExchange>) -> Self {
        VerbsConnector {
            nic,
            peer,
            exchange,
        }
    }
}

/// What this side of a new QP tells its peer: the QP number, a fresh PSN, the port's
/// address and how many reads it lets the peer have outstanding.
pub(super) fn local_endpoint(dev: &VerbsDevice, qpn: u32, max_rd_atomic: u32) -> QpEndpoint {
    let addr = dev.address();
    QpEndpoint {
        qpn,
        psn: psn_seed(qpn),
        lid: addr.lid,
        gid: addr.gid,
        mtu: addr.mtu,
        responder_depth: responder_depth(max_rd_atomic, dev.read_depth()),
    }
}

fn psn_seed(qpn: u32) -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    (nanos ^ qpn.rotate_left(8)) & 0x00ff_ffff
}

impl Connector for VerbsConnector {
    fn connect(
        &self,
        qp: QpKey,
        sink: Arc<dyn CompletionSink>,
    ) -> Result<Box<dyn Connection>, ConnectionError> {
        let peer = self.peer;
        let setup = |what: &'static str, e: DeviceError| ConnectionError::Handshake {
            peer,
            reason: format!("{what}: {e}"),
        };
        let dev = self.nic.inner.device.clone();
        let caps = self.nic.caps();
        let (raw, qpn, cq) = dev.create_qp(caps).map_err(|e| ConnectionError::Setup {
            peer,
            what: "RC queue pair",
            source: std::io::Error::other(e.to_string()),
        })?;
        let shared = Arc::new(ConnShared {
            key: qp,
            peer,
            qp: raw,
            cq,
            device: dev.clone(),
            max_send_wr: caps.max_send_wr as usize,
            sink,
            pending: Mutex::new(HashMap::new()),
            sq: Mutex::new(SendQueue::default()),
        });
        let mut conn = VerbsConnection {
            nic: self.nic.clone(),
            shared,
            qpn,
            remote_keys: KeyMap::new(),
            max_sge: caps.max_send_sge,
            max_msg: dev.max_msg_sz(),
            peer,
            aborted: false,
        };
        let local = local_endpoint(&dev, qpn, self.nic.nic.max_rd_atomic);
        let (addr, psn) = (dev.address(), local.psn);
        let (remote, keys) = self.exchange.exchange(qp, local)?;
        conn.remote_keys = keys;
        let steps = connect_transitions(
            &self.nic.cfg,
            self.nic.nic.max_rd_atomic,
            dev.read_depth(),
            &addr,
            &remote,
            psn,
            // Least privilege: the requester's QP only issues reads; nobody reads through it.
            0,
        );
        for t in &steps {
            dev.modify(raw, t)
                .map_err(|e| setup("bringing the QP to ready-to-send", e))?;
        }
        lock(&self.nic.inner.conns).insert(qpn, conn.shared.clone());
        Ok(Box::new(conn))
    }
}
