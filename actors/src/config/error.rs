//! What can go wrong reading a config: the file, its syntax, or a value.

use thiserror::Error;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ConfigError {
    #[error("config {path}: {message}")]
    Parse { path: String, message: String },
    #[error("config key {key}: {reason}")]
    Invalid { key: &'static str, reason: String },
    #[error("reading config {path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
}
