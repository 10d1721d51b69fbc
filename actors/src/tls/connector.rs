//! TLS for this node's gRPC calls to its peers: a tonic channel whose connector dials TCP
//! and runs the handshake with the node's [`rustls::ClientConfig`], checking the peer's
//! certificate against the CA and the peer's node id. A refused handshake is counted
//! (`peer-client`) and logged.

use std::sync::Arc;

use hyper_util::rt::TokioIo;
use rustls::ClientConfig;
use rustls_pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::tls::incoming::handshake_failed;
use crate::tls::{TlsSide, TlsStats};

/// How a client reaches one peer over TLS.
#[derive(Clone, Debug)]
pub struct TlsDial {
    pub config: Arc<ClientConfig>,
    /// The name the peer's certificate must carry.
    pub server_name: ServerName<'static>,
    pub stats: Arc<TlsStats>,
    pub side: TlsSide,
}

/// Connects `endpoint` (an `http://host:port` URI) through TLS.
pub async fn connect_tls(
    endpoint: Endpoint,
    dial: TlsDial,
) -> Result<Channel, tonic::transport::Error> {
    let connector = tower::service_fn(move |uri: Uri| {
        let dial = dial.clone();
        async move {
            let host = uri
                .host()
                .unwrap_or("")
                .trim_matches(|c| c == '[' || c == ']')
                .to_owned();
            let port = uri.port_u16().unwrap_or(443);
            let tcp = TcpStream::connect((host.as_str(), port)).await?;
            let _ = tcp.set_nodelay(true);
            let peer = format!("{host}:{port}");
            match TlsConnector::from(Arc::clone(&dial.config))
                .connect(dial.server_name.clone(), tcp)
                .await
            {
                Ok(s) => Ok(TokioIo::new(s)),
                Err(e) => {
                    handshake_failed(&dial.stats, dial.side, &peer, &e);
                    Err(e)
                }
            }
        }
    });
    endpoint.connect_with_connector(connector).await
}
