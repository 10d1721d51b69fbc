//! The owner side of `kvferry.v1.Peer`: requesters in other processes exchange versions,
//! learn where this node's pool is read, and pin blocks through the node's [`PinService`].
//!
//! Every request is checked (token, then shape) before it reaches the store, so a refused
//! request changes nothing. The server runs on the caller's tokio runtime; the store lives
//! on the node's actix thread, and its pins are awaited, never blocked on.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};

use crate::model::{BlockHash, ModelError, Namespace};
use crate::peer::endpoint::{check_answer, endpoints_from_proto, Role, VerbsResponder};
use crate::peer::pin_service::PinService;
use crate::peer::Provider;
use crate::statuses::{same_token, AsPromised};
use kvferry_proto::v1::peer_server::{Peer, PeerServer};
use kvferry_proto::v1::{
    HandshakeRequest, HandshakeResponse, HelloRequest, HelloResponse, NodeInfo, PinBlocksRequest,
    PinBlocksResponse, PinnedBlock, PoolRegion, UnpinRequest, UnpinResponse,
};
use kvferry_proto::{CAPABILITIES, MAX_PEER_REQUEST_BYTES, MAX_PIN_HASHES, PROTOCOL, VERSION};
use kvferry_transport::DataAuth;

/// Requests in flight on one connection; more wait for a free slot.
const MAX_IN_FLIGHT_PER_CONNECTION: usize = 64;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum PeerServeError {
    #[error("peer service on {addr}: reading the listener's address")]
    LocalAddr {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("peer service on {addr} failed")]
    Serve {
        addr: String,
        #[source]
        source: tonic::transport::Error,
    },
}

/// The pool's registration on one NIC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NicRegistration {
    pub nic: String,
    pub rkey: u64,
}

/// One data path this node serves its pool on (a `TcpOwner`, an `ShmOwner`, verbs NICs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataEndpoint {
    pub provider: Provider,
    /// Where requesters connect: "host:port" for tcp, the Unix socket path for shm.
    pub endpoint: String,
    pub nics: Vec<NicRegistration>,
    /// tcp: the grants the data server checks; each Handshake issues one to its requester.
    pub auth: Option<DataAuth>,
}

/// What the Peer service needs from a node: its store, id, pool and peer-pin TTL, and the
/// data paths whoever serves the pool has added. `Node::peer_backend` makes one.
#[derive(Clone, Debug)]
pub struct PeerBackend {
    store: Arc<dyn PinService>,
    node_id: String,
    pool_addr: u64,
    pool_len: u64,
    slot_bytes: u64,
    pin_ttl: Duration,
    endpoints: Vec<DataEndpoint>,
    verbs: Option<Arc<dyn VerbsResponder>>,
    /// Random and fixed for this backend's life: a requester whose handshake saw another
    /// one talks to a restarted owner.
    incarnation: u64,
}

/// A random nonzero incarnation.
fn new_incarnation() -> u64 {
    let mut b = [0u8; 8];
    // Without randomness, the time still tells two lives of one node apart.
    if getrandom::fill(&mut b).is_err() {
        b = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
            .to_le_bytes();
    }
    u64::from_le_bytes(b).max(1)
}

impl PeerBackend {
    /// `pool` is the host pool's `(addr, len)`; `slot_bytes` is what each pinned block's
    /// address may be read for.
    pub fn new(
        store: Arc<dyn PinService>,
        node_id: String,
        pool: (u64, u64),
        slot_bytes: u64,
        pin_ttl: Duration,
    ) -> Self {
        Self {
            store,
            node_id,
            pool_addr: pool.0,
            pool_len: pool.1,
            slot_bytes,
            pin_ttl,
            endpoints: Vec::new(),
            verbs: None,
            incarnation: new_incarnation(),
        }
    }

    /// This owner's incarnation, as Handshake and PinBlocks announce it.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// Serves the pool over verbs: Hello announces the responder's ports, and verbs
    /// Handshakes get owner QPs made by it, with the pool's MRs per NIC.
    pub fn with_verbs(mut self, responder: Arc<dyn VerbsResponder>) -> Self {
        self.verbs = Some(responder);
        self
    }

    /// Announces a data path in Hello and answers Handshakes for its provider with it.
    pub fn with_endpoint(mut self, endpoint: DataEndpoint) -> Self {
        self.endpoints.retain(|e| e.provider != endpoint.provider);
        self.endpoints.push(endpoint);
        self
    }

    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// The host pool's `(addr, len)` in this node's address space.
    pub fn pool(&self) -> (u64, u64) {
        (self.pool_addr, self.pool_len)
    }

    fn info(&self) -> NodeInfo {
        let mut nics: Vec<String> = Vec::new();
        for e in &self.endpoints {
            for n in &e.nics {
                if !nics.contains(&n.nic) {
                    nics.push(n.nic.clone());
                }
            }
        }
        let mut providers: Vec<String> = self
            .endpoints
            .iter()
            .map(|e| e.provider.as_str().to_owned())
            .collect();
        let ports = self.verbs.as_ref().map(|v| v.ports()).unwrap_or_default();
        if self.verbs.is_some() {
            providers.push(Provider::Verbs.as_str().to_owned());
        }
        for p in &ports {
            if !nics.contains(&p.nic) {
                nics.push(p.nic.clone());
            }
        }
        NodeInfo {
            node_id: self.node_id.clone(),
            version: VERSION.to_owned(),
            protocol: PROTOCOL,
            capabilities: CAPABILITIES.iter().map(|c| (*c).to_owned()).collect(),
            providers,
            nics,
            verbs: ports.iter().map(|p| p.to_proto()).collect(),
        }
    }
}

/// Serves `kvferry.v1.Peer` on `listener` until `shutdown` resolves, then waits for the
/// open calls to finish. An empty `token` accepts every request.
pub async fn serve(
    listener: TcpListener,
    backend: PeerBackend,
    token: String,
    shutdown: impl Future<Output = ()>,
) -> Result<(), PeerServeError> {
    serve_with_tls(listener, backend, token, None, shutdown).await
}

/// [`serve`], over TLS where `tls` is given (with mutual TLS, only peers whose certificate
/// the cluster CA signed get past the handshake).
pub async fn serve_with_tls(
    listener: TcpListener,
    backend: PeerBackend,
    token: String,
    tls: Option<crate::tls::TlsServing>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), PeerServeError> {
    let addr = listener
        .local_addr()
        .map(|a| a.to_string())
        .map_err(|source| PeerServeError::LocalAddr {
            addr: "?".into(),
            source,
        })?;
    // Nothing legitimate comes close to tonic's 4 MiB default; larger requests, and bodies
    // that do not decode, get the statuses the proto promises.
    let service = AsPromised(
        PeerServer::new(PeerService { backend, token })
            .max_decoding_message_size(MAX_PEER_REQUEST_BYTES),
    );
    let builder = tonic::transport::Server::builder()
        .concurrency_limit_per_connection(MAX_IN_FLIGHT_PER_CONNECTION);
    match tls {
        Some(tls) => {
            builder
                .serve_with_incoming_shutdown(
                    service,
                    crate::tls::tls_incoming(listener, tls),
                    shutdown,
                )
                .await
        }
        None => {
            builder
                .serve_with_incoming_shutdown(
                    service,
                    TcpIncoming::from(listener).with_nodelay(Some(true)),
                    shutdown,
                )
                .await
        }
    }
    .map_err(|source| PeerServeError::Serve { addr, source })
}

/// Wrong-token calls, logged at most once a minute (a misconfigured peer retries).
static BAD_TOKENS: crate::log_limit::LogLimit =
    crate::log_limit::LogLimit::new(std::time::Duration::from_secs(60));

struct PeerService {
    backend: PeerBackend,
    token: String,
}

/// A namespace as `Namespace` displays itself.
pub fn parse_namespace(s: &str) -> Result<Namespace, ModelError> {
    Namespace::parse(s)
}

fn valid_node_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 128 && id.chars().all(|c| c.is_ascii_graphic())
}

impl PeerService {
    fn check_token(&self, got: &str) -> Result<(), Status> {
        if self.token.is_empty() || same_token(self.token.as_bytes(), got.as_bytes()) {
            Ok(())
        } else {
            if let Some(held_back) = BAD_TOKENS.allow("") {
                tracing::warn!(
                    node = %self.backend.node_id,
                    held_back,
                    "refused a peer call with a wrong cluster token"
                );
            }
            Err(Status::unauthenticated(format!(
                "node {}: the request's cluster token does not match",
                self.backend.node_id
            )))
        }
    }

    /// The owner side of a verbs Handshake: owner QPs for the requester's, made by the
    /// responder; its answer is checked like any received one before it is sent.
    fn verbs_handshake(
        &self,
        peer: &str,
        asked: &[crate::peer::VerbsPeerEndpoint],
    ) -> Result<Response<HandshakeResponse>, Status> {
        let b = &self.backend;
        let Some(responder) = &b.verbs else {
            return Err(Status::failed_precondition(format!(
                "node {} does not serve its pool over verbs (it has no usable RDMA nic)",
                b.node_id
            )));
        };
        let answer = responder.accept(peer, asked).map_err(|reason| {
            Status::unavailable(format!(
                "node {}: making verbs queue pairs failed: {reason}",
                b.node_id
            ))
        })?;
        let wire: Vec<_> = answer.iter().map(|e| e.to_proto()).collect();
        endpoints_from_proto(&wire, Role::Answer)
            .and_then(|a| check_answer(asked, &a))
            .map_err(|e| Status::internal(format!("node {}: own verbs answer: {e}", b.node_id)))?;
        Ok(Response::new(HandshakeResponse {
            provider: Provider::Verbs.as_str().to_owned(),
            endpoint: String::new(),
            regions: wire.iter().flat_map(|e| e.regions.clone()).collect(),
            verbs: wire,
            incarnation: b.incarnation,
            data_link: 0,
            data_secret: Vec::new(),
        }))
    }

    fn stopped(&self) -> Status {
        Status::unavailable(format!("node {} is shutting down", self.backend.node_id))
    }
}

#[tonic::async_trait]
impl Peer for PeerService {
    async fn hello(&self, req: Request<HelloRequest>) -> Result<Response<HelloResponse>, Status> {
        let req = req.into_inner();
        self.check_token(&req.token)?;
        let peer = req
            .node
            .ok_or_else(|| Status::invalid_argument("Hello carries no node info"))?;
        if !valid_node_id(&peer.node_id) {
            return Err(Status::invalid_argument(format!(
                "Hello: node id must be 1 to 128 printable characters, got {}",
                crate::model::shown(&peer.node_id)
            )));
        }
        if peer.protocol != PROTOCOL {
            tracing::warn!(
                node = %self.backend.node_id,
                peer = %peer.node_id,
                protocol = peer.protocol,
                ours = PROTOCOL,
                "refused a peer of another protocol revision"
            );
            return Err(Status::failed_precondition(format!(
                "peer {} speaks peer protocol {}; node {} speaks {PROTOCOL}",
                peer.node_id, peer.protocol, self.backend.node_id
            )));
        }
        endpoints_from_proto(&peer.verbs, Role::Announce)
            .map_err(|e| Status::invalid_argument(format!("Hello: {e}")))?;
        Ok(Response::new(HelloResponse {
            node: Some(self.backend.info()),
        }))
    }

    async fn handshake(
        &self,
        req: Request<HandshakeRequest>,
    ) -> Result<Response<HandshakeResponse>, Status> {
        let req = req.into_inner();
        self.check_token(&req.token)?;
        if !valid_node_id(&req.node_id) {
            return Err(Status::invalid_argument(format!(
                "Handshake: node id must be 1 to 128 printable characters, got {}",
                crate::model::shown(&req.node_id)
            )));
        }
        let provider = Provider::parse(&req.provider)
            .map_err(|e| Status::invalid_argument(format!("Handshake: {e}")))?;
        // Every field of the requester's endpoints is checked before anything is made.
        let asked = endpoints_from_proto(&req.verbs, Role::Request)
            .map_err(|e| Status::invalid_argument(format!("Handshake: {e}")))?;
        match (provider, asked.is_empty()) {
            (Provider::Verbs, true) => {
                return Err(Status::invalid_argument(
                    "Handshake: a verbs handshake names no nic endpoint",
                ))
            }
            (Provider::Verbs, false) => return self.verbs_handshake(&req.node_id, &asked),
            (_, false) => {
                return Err(Status::invalid_argument(format!(
                    "Handshake: verbs endpoints sent for provider {}",
                    provider.as_str()
                )))
            }
            (_, true) => {}
        }
        let b = &self.backend;
        let Some(ep) = b.endpoints.iter().find(|e| e.provider == provider) else {
            let served: Vec<&str> = b.endpoints.iter().map(|e| e.provider.as_str()).collect();
            return Err(Status::failed_precondition(format!(
                "node {} does not serve its pool over {} (serves: [{}])",
                b.node_id,
                provider.as_str(),
                served.join(", ")
            )));
        };
        // A tcp data connection must prove a grant of this handshake (bound to the
        // requester's node id; its previous one is revoked).
        let grant = match &ep.auth {
            Some(auth) => Some(
                auth.issue(crate::peer::cluster::transport_id(&req.node_id))
                    .map_err(|e| Status::unavailable(format!("node {}: {e}", b.node_id)))?,
            ),
            None => None,
        };
        tracing::info!(
            node = %b.node_id,
            peer = %req.node_id,
            provider = provider.as_str(),
            "peer handshake: serving the pool"
        );
        let (data_link, data_secret) = grant
            .map(|g| (g.link, g.secret.as_bytes().to_vec()))
            .unwrap_or_default();
        Ok(Response::new(HandshakeResponse {
            data_link,
            data_secret,
            incarnation: b.incarnation,
            provider: provider.as_str().to_owned(),
            endpoint: ep.endpoint.clone(),
            regions: ep
                .nics
                .iter()
                .map(|n| PoolRegion {
                    nic: n.nic.clone(),
                    addr: b.pool_addr,
                    len: b.pool_len,
                    rkey: n.rkey,
                })
                .collect(),
            verbs: Vec::new(),
        }))
    }

    async fn pin_blocks(
        &self,
        req: Request<PinBlocksRequest>,
    ) -> Result<Response<PinBlocksResponse>, Status> {
        let req = req.into_inner();
        self.check_token(&req.token)?;
        if req.hashes.len() > MAX_PIN_HASHES {
            return Err(Status::resource_exhausted(format!(
                "PinBlocks asks for {} hashes; at most {MAX_PIN_HASHES} per request",
                req.hashes.len()
            )));
        }
        let namespace = parse_namespace(&req.namespace)
            .map_err(|e| Status::invalid_argument(format!("PinBlocks: {e}")))?;
        let hashes = BlockHash::parse_all(&req.hashes)
            .map_err(|e| Status::invalid_argument(format!("PinBlocks: {e}")))?;
        let pinned = self
            .backend
            .store
            .pin(namespace, hashes)
            .await
            .map_err(|_| self.stopped())?;
        let len = self.backend.slot_bytes;
        Ok(Response::new(PinBlocksResponse {
            incarnation: self.backend.incarnation,
            pin_id: pinned.pin_id,
            ttl_ms: u64::try_from(self.backend.pin_ttl.as_millis()).unwrap_or(u64::MAX),
            blocks: pinned
                .blocks
                .iter()
                .map(|b| PinnedBlock {
                    hash: b.hash.as_bytes().to_vec(),
                    addr: b.addr,
                    len,
                })
                .collect(),
        }))
    }

    async fn unpin(&self, req: Request<UnpinRequest>) -> Result<Response<UnpinResponse>, Status> {
        let req = req.into_inner();
        self.check_token(&req.token)?;
        if req.pin_id != 0 {
            // Awaited, not detached: the pin is gone when the requester sees the answer.
            self.backend
                .store
                .unpin(req.pin_id)
                .await
                .map_err(|_| self.stopped())?;
        }
        Ok(Response::new(UnpinResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens() {
        assert!(same_token(b"abc", b"abc"));
        assert!(!same_token(b"abc", b"abd"));
        assert!(!same_token(b"abc", b"ab"));
        assert!(same_token(b"", b""));
    }

    #[test]
    fn namespaces() {
        let ns = Namespace::new("m", "bf16", "l4").unwrap();
        assert_eq!(parse_namespace(ns.as_str()).unwrap(), ns);
        for bad in [
            "",
            "m/bf16",
            "m/bf16/x/y/z",
            "m//x",
            "m/bf 16/x",
            "m/bf16/x/",
            "m/b/x/a b",
        ] {
            assert!(parse_namespace(bad).is_err(), "{bad:?}");
        }
        let e = parse_namespace("m/bf16").unwrap_err().to_string();
        assert_eq!(
            e,
            "namespace must be model/dtype/fingerprint, or model/dtype/fingerprint/tenant \
             (parts separated by '/'), got \"m/bf16\""
        );
        // A tenant's namespace is one of its own, and reads back as itself.
        let lora = ns.with_tenant("lora-a").unwrap();
        assert_eq!(lora.as_str(), "m/bf16/l4/lora-a");
        assert_eq!(lora.tenant(), Some("lora-a"));
        assert_eq!(ns.tenant(), None);
        assert_ne!(lora, ns);
        assert_ne!(lora, ns.with_tenant("lora-b").unwrap());
        assert_eq!(parse_namespace(lora.as_str()).unwrap(), lora);
        assert_eq!(lora.with_tenant("other").unwrap(), lora);
        let e = ns.with_tenant("a/b").unwrap_err().to_string();
        assert!(e.starts_with("namespace tenant must be 1 to 128"), "{e}");
        assert!(ns.with_tenant("").is_err());
        assert!(ns.with_tenant(&"x".repeat(129)).is_err());
        let e = parse_namespace("m//x").unwrap_err().to_string();
        assert!(e.starts_with("namespace dtype must be 1 to 128"), "{e}");
    }
}
