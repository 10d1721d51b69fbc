//! Why a Redis directory could not start.

use thiserror::Error;

use crate::peer::redis_url::RedisUrlError;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RedisError {
    /// The address does not parse, or names what the client cannot reach (TLS, a socket).
    #[error(transparent)]
    Address(#[from] RedisUrlError),
    #[error("the redis key prefix must not be empty")]
    EmptyPrefix,
    /// The directory's own thread or runtime could not start.
    #[error("cannot start the redis directory's thread: {source}")]
    Thread {
        #[source]
        source: std::io::Error,
    },
    /// The redis client refused the address or configuration.
    #[error("redis client for {addr}: {source}")]
    Client {
        addr: String,
        #[source]
        source: redis::RedisError,
    },
    /// The server is unreachable or did not answer PING at start.
    #[error("cannot connect to redis at {addr}: {reason}")]
    Connect { addr: String, reason: String },
}
