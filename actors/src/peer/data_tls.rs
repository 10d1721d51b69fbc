//! TLS on a node's tcp data plane: the server config its data port serves with (a peer
//! certificate the CA signed is required) and the client config it reads owners with, both
//! over the node's [`TlsContext`], so a reload reaches new connections of both sides. Its
//! connector counts this node's own failed handshakes to owners (`data-client`), as the
//! owner counts its refusals (`data`): a requester with the wrong CA, or one whose owner
//! refuses its certificate, shows on the requester's scrape, not only the owner's.

use std::net::SocketAddr;
use std::sync::Arc;

use kvferry_transport::tcp::{ClientTls, TcpConnector};
use kvferry_transport::{CompletionSink, Connection, ConnectionError, Connector, LinkGrant, QpKey};

use crate::peer::cluster::transport_id;
use crate::peer::error::RemoteError;
use crate::tls::{TlsContext, TlsError, TlsSide, TlsStats};

/// How a node serves and reads the tcp data plane over TLS.
#[derive(Clone, Debug)]
pub(crate) struct DataTls {
    pub(crate) ctx: TlsContext,
    pub(crate) server: Arc<rustls::ServerConfig>,
    pub(crate) client: Arc<rustls::ClientConfig>,
}

impl DataTls {
    pub(crate) fn new(ctx: TlsContext) -> Result<Self, TlsError> {
        let (server, client) = ctx.data_plane_configs()?;
        Ok(Self {
            ctx,
            server,
            client,
        })
    }

    /// Dials owner `to` at `addr` over TLS, expecting its node id in its certificate, and
    /// proving `grant` inside TLS.
    pub(crate) fn connector(
        &self,
        from: &str,
        to: &str,
        addr: SocketAddr,
        grant: LinkGrant,
    ) -> Result<Arc<dyn Connector>, RemoteError> {
        let server_name =
            crate::tls::peer_server_name(to).map_err(|e| RemoteError::refused(e.to_string()))?;
        let inner = TcpConnector::new(transport_id(from), transport_id(to), addr, grant).with_tls(
            ClientTls {
                config: Arc::clone(&self.client),
                server_name,
            },
        );
        Ok(Arc::new(Counted {
            inner,
            stats: Arc::clone(self.ctx.stats()),
            peer: format!("{to} ({addr})"),
        }))
    }
}

/// A TLS connector whose failed handshakes are counted and logged.
struct Counted {
    inner: TcpConnector,
    stats: Arc<TlsStats>,
    peer: String,
}

impl Connector for Counted {
    fn connect(
        &self,
        qp: QpKey,
        sink: Arc<dyn CompletionSink>,
    ) -> Result<Box<dyn Connection>, ConnectionError> {
        self.inner.connect(qp, sink).inspect_err(|e| {
            if let ConnectionError::Tls { source, .. } = e {
                crate::tls::handshake_failed(&self.stats, TlsSide::DataClient, &self.peer, source);
            }
        })
    }
}
