//! What `Debug` shows of a secret: whether one is set, never the secret itself, so a config
//! (or the options made from it) can be logged, or printed by a failed test, without
//! handing out a token or a Redis password.

use std::fmt;

/// A token as `Debug` shows it: `""` where none is set (so "not checked" stays visible),
/// else `<redacted>`.
pub(crate) struct Redacted<'a>(pub(crate) &'a str);

impl fmt::Debug for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            f.write_str("\"\"")
        } else {
            f.write_str("<redacted>")
        }
    }
}

/// A directory address as `Debug` shows it: the URL with its password masked.
pub(crate) struct RedactedUrl<'a>(pub(crate) &'a str);

impl fmt::Debug for RedactedUrl<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&crate::peer::redact_url(self.0), f)
    }
}
