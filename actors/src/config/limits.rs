//! The limits several sections share, and the rules that check them.

use crate::config::ConfigError;

/// The longest any TTL of the config may be (`lease.ttl-secs`, `lease.peer-pin-ttl-secs`,
/// `engine.handle-ttl-secs`): a day. Longer ones are mistakes, and near `u64::MAX` they
/// overflow the clock.
pub const MAX_TTL_SECS: u64 = 86_400;

/// The largest `pool.slot-bytes`: one block of every TP rank of the largest models is far
/// smaller.
pub const MAX_SLOT_BYTES: u64 = 1 << 30;

/// The longest Unix socket path (`sun_path` is 108 bytes with its terminating NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// A token's rule (engine and cluster): what goes on a header and a socket line.
pub(super) fn check_token(key: &'static str, token: &str) -> Result<(), ConfigError> {
    if token.chars().all(|c| c.is_ascii_graphic()) && token.len() <= 256 {
        return Ok(());
    }
    Err(ConfigError::Invalid {
        key,
        reason: "must be at most 256 printable ASCII characters without spaces".into(),
    })
}

/// A TTL's rule: 1 s to [`MAX_TTL_SECS`].
pub(super) fn check_ttl(key: &'static str, secs: u64) -> Result<(), ConfigError> {
    if (1..=MAX_TTL_SECS).contains(&secs) {
        return Ok(());
    }
    Err(ConfigError::Invalid {
        key,
        reason: format!("{secs} must be 1 to {MAX_TTL_SECS} (a day)"),
    })
}

/// A Unix socket `name` in `dir` must fit `sun_path`.
pub(super) fn check_socket_dir(
    key: &'static str,
    dir: &str,
    name: &str,
) -> Result<(), ConfigError> {
    let path = std::path::Path::new(dir).join(name);
    let len = path.as_os_str().len();
    if len <= MAX_SOCKET_PATH {
        return Ok(());
    }
    Err(ConfigError::Invalid {
        key,
        reason: format!(
            "the socket path {} is {len} bytes; a Unix socket path holds at most \
             {MAX_SOCKET_PATH}: use a shorter directory",
            path.display()
        ),
    })
}
