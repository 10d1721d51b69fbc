//! The Redis directory's address, parsed once for the config check and the node alike, and
//! shown everywhere without its password.
//!
//! Accepted: `host`, `host:port`, `[v6]:port`, and `redis://[[user]:password@]host[:port][/db]`
//! (the redis crate's own URL parser: percent-encoded credentials, `AUTH password` or an ACL
//! user's `AUTH user password`, `SELECT db`). Refused with the reason: `rediss://` (this build's
//! Redis client has no TLS), Unix-socket URLs, a user without a password (the redis client
//! would not send it), a negative database, no host.

use std::fmt;

use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo};
use thiserror::Error;

/// Redis' port when an address names none.
pub const DEFAULT_PORT: u16 = 6379;

/// Why an address is not one the directory can connect to. `addr` is shown masked.
#[derive(Debug, Error)]
#[error("bad redis address {addr:?}: {reason}")]
pub struct RedisUrlError {
    /// The address as given, its password replaced ([`redact_url`]).
    pub addr: String,
    pub reason: String,
}

/// A Redis server to connect to, with its credentials and database.
#[derive(Clone)]
pub struct RedisUrl {
    info: ConnectionInfo,
    host: String,
    port: u16,
}

impl RedisUrl {
    /// Parses an address the way the node will connect to it (see the module doc).
    pub fn parse(addr: &str) -> Result<Self, RedisUrlError> {
        let bad = |reason: String| RedisUrlError {
            addr: redact_url(addr),
            reason,
        };
        let url = if addr.contains("://") {
            addr.to_owned()
        } else {
            format!("redis://{addr}")
        };
        let scheme = redis::parse_redis_url(&url).map(|u| u.scheme().to_owned());
        match scheme.as_deref() {
            Some("redis" | "valkey") => {}
            Some("rediss" | "valkeys") => {
                return Err(bad(
                    "rediss:// (TLS) is not supported: this build's Redis client \
                     has no TLS; use redis:// on a trusted network (or a TLS tunnel to it)"
                        .into(),
                ))
            }
            Some(_) => return Err(bad("Unix-socket Redis URLs are not supported".into())),
            None => {
                return Err(bad(
                    "not host[:port] or redis://[[user]:password@]host[:port][/db]".into(),
                ))
            }
        }
        // The redis crate's errors name no part of the URL: safe to show.
        let info = url
            .as_str()
            .into_connection_info()
            .map_err(|e| bad(e.to_string()))?;
        let (host, port) = match info.addr() {
            ConnectionAddr::Tcp(host, port) => (host.clone(), *port),
            _ => return Err(bad("only TCP addresses are supported".into())),
        };
        if host.is_empty() {
            return Err(bad("no host".into()));
        }
        let redis = info.redis_settings();
        if redis.username().is_some() && redis.password().is_none() {
            return Err(bad(
                "a user without a password: write redis://user:password@host (ACL) or \
                 redis://:password@host (requirepass)"
                    .into(),
            ));
        }
        if redis.db() < 0 {
            return Err(bad(format!("database {} is negative", redis.db())));
        }
        Ok(Self { info, host, port })
    }

    /// What the redis client connects with (credentials included: never print it).
    pub fn connection_info(&self) -> ConnectionInfo {
        self.info.clone()
    }

    pub fn db(&self) -> i64 {
        self.info.redis_settings().db()
    }

    pub fn username(&self) -> Option<&str> {
        self.info.redis_settings().username()
    }

    pub fn has_password(&self) -> bool {
        self.info.redis_settings().password().is_some()
    }
}

/// `[user[:***]@]host:port[/db]`: the password never shows.
impl fmt::Display for RedisUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.username(), self.has_password()) {
            (Some(u), _) => write!(f, "{u}:***@")?,
            (None, true) => f.write_str(":***@")?,
            (None, false) => {}
        }
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)?;
        } else {
            write!(f, "{}:{}", self.host, self.port)?;
        }
        match self.db() {
            0 => Ok(()),
            db => write!(f, "/{db}"),
        }
    }
}

/// As Display: a `{:?}` of a config or an error must not show the password either.
impl fmt::Debug for RedisUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RedisUrl({self})")
    }
}

/// An address as written, its password replaced (`redis://user:secret@host` →
/// `redis://user:***@host`), for showing one that may not parse. The one masking rule for
/// directory addresses; a parsed one shows through [`RedisUrl`]'s Display.
pub fn redact_url(url: &str) -> String {
    let Some(scheme) = url.find("://") else {
        return match url.rfind('@') {
            Some(at) => format!("***{}", &url[at..]),
            None => url.to_owned(),
        };
    };
    let rest = &url[scheme + 3..];
    // The authority ends at the first '/', '?' or '#' after the last '@' before them; a
    // password may itself hold '@' or '/' only percent-encoded, but mask generously anyway.
    let Some(at) = rest.rfind('@') else {
        return url.to_owned();
    };
    let auth = &rest[..at];
    match auth.split_once(':') {
        Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &rest[at..]),
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_form_parses_or_is_refused_with_its_reason() {
        let ok = |a: &str| RedisUrl::parse(a).unwrap_or_else(|e| panic!("{a}: {e}"));
        for (addr, shown, user, pass, db) in [
            ("127.0.0.1:6379", "127.0.0.1:6379", None, false, 0),
            ("localhost", "localhost:6379", None, false, 0),
            ("[::1]:7000", "[::1]:7000", None, false, 0),
            ("redis://127.0.0.1:7000", "127.0.0.1:7000", None, false, 0),
            ("redis://127.0.0.1:7000/", "127.0.0.1:7000", None, false, 0),
            ("redis://127.0.0.1:7000/0", "127.0.0.1:7000", None, false, 0),
            ("redis://[::1]:7000", "[::1]:7000", None, false, 0),
            ("redis://h/3", "h:6379/3", None, false, 3),
            ("redis://:pw@h:1", ":***@h:1", None, true, 0),
            ("redis://u:pw@h:1/2", "u:***@h:1/2", Some("u"), true, 2),
            ("redis://u:p%40ss@h", "u:***@h:6379", Some("u"), true, 0),
            ("valkey://h:1", "h:1", None, false, 0),
        ] {
            let u = ok(addr);
            assert_eq!(u.to_string(), shown, "{addr}");
            assert_eq!(format!("{u:?}"), format!("RedisUrl({shown})"));
            assert_eq!(
                (u.username(), u.has_password(), u.db()),
                (user, pass, db),
                "{addr}"
            );
        }
        assert_eq!(
            ok("redis://u:p%40ss@h")
                .connection_info()
                .redis_settings()
                .password(),
            Some("p@ss")
        );
        for (bad, why) in [
            ("", "host"),
            ("redis://", "host"),
            ("redis://:6379", "host"),
            ("rediss://h:1", "TLS"),
            ("rediss://u:secret@h:1", "TLS"),
            ("unix:///tmp/redis.sock", "Unix"),
            ("redis+unix:///tmp/redis.sock", "Unix"),
            ("http://h:1", "not host[:port]"),
            ("redis://h:6379/db", "database"),
            ("redis://h:1/-1", "negative"),
            ("redis://h:65536", ""),
            ("redis://u@h:1", "without a password"),
            ("redis://0.0.0.0:1", "wildcard"),
        ] {
            let e = RedisUrl::parse(bad).map(|u| u.to_string()).unwrap_err();
            let s = e.to_string();
            assert!(
                s.to_lowercase().contains(&why.to_lowercase()),
                "{bad:?}: {s}"
            );
            assert!(!s.contains("secret"), "{s}");
        }
    }

    #[test]
    fn passwords_never_show() {
        for (url, shown) in [
            ("redis://u:secret@h:1/2", "redis://u:***@h:1/2"),
            ("redis://:secret@h", "redis://:***@h"),
            ("rediss://u:secret@h", "rediss://u:***@h"),
            ("redis://u@h", "redis://u@h"),
            ("redis://h:1", "redis://h:1"),
            ("u:secret@h:1", "***@h:1"),
            ("redis://u:se@cret@h", "redis://u:***@h"),
            ("redis://u:secret@", "redis://u:***@"),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
        let e = RedisUrl::parse("redis://u:secret@h:1/x").unwrap_err();
        assert!(!e.to_string().contains("secret"), "{e}");
        assert!(!format!("{e:?}").contains("secret"), "{e:?}");
    }
}
