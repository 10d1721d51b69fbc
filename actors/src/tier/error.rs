//! What the store and its policy answer when a put, save, fetch or read-back fails.

use thiserror::Error;

use crate::tier::cache::CacheError;
use crate::tier::pool::PoolError;
use crate::tier::ssd::SsdError;

/// A tier operation that failed; the node's `NodeError` has a variant of the same name for
/// each, so callers above `tier/` see what they saw before.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TierError {
    /// The RAM cache refused: full, over quota, not admitted.
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error(transparent)]
    Pool(#[from] PoolError),
    #[error(transparent)]
    Ssd(#[from] SsdError),
    /// Write-through: sealed blocks of this request are in RAM but not on disk, so a crash
    /// would lose them; the put or save is not acknowledged.
    #[error(
        "write-through: {failed} of {blocks} sealed block(s) are not on disk (RAM still \
         holds them): {source}"
    )]
    NotDurable {
        failed: usize,
        blocks: usize,
        #[source]
        source: SsdError,
    },
    /// The request's fence passed before it took effect: nothing was written.
    #[error("{what}: the client's deadline passed {late:?} ago; discarded")]
    DeadlinePassed {
        what: &'static str,
        late: std::time::Duration,
    },
    #[error("bad request: {reason}")]
    BadRequest { reason: String },
    #[error("the node is shutting down ({what})")]
    Stopped { what: &'static str },
}

impl TierError {
    pub(crate) fn bad(reason: impl Into<String>) -> Self {
        TierError::BadRequest {
            reason: reason.into(),
        }
    }
}

impl From<actix::MailboxError> for TierError {
    fn from(_: actix::MailboxError) -> Self {
        TierError::Stopped {
            what: "actor mailbox closed",
        }
    }
}
