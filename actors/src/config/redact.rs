//! What `Debug` shows of a secret: whether one is set, never the secret itself, so a config
//! (or the options made from it) can be logged, or printed by a failed test, without
//! handing out a token or a Redis password.

use std::fmt;

pub(crate) use crate::statuses::Redacted;

/// A directory address as `Debug` shows it: the URL with its password masked.
pub(crate) struct RedactedUrl<'a>(pub(crate) &'a str);

impl fmt::Debug for RedactedUrl<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&crate::peer::redact_url(self.0), f)
    }
}
