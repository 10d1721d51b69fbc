//! Directories and files only the node's user may touch, whatever the umask.
//!
//! Every directory the node creates or puts something in (the engine fd socket's, the shm
//! socket's, each SSD directory) goes through [`private_dir`]: made 0700 when missing, and
//! refused when group or others may write it, since they could then unlink a socket and bind
//! their own, or plant a block file of forged blocks. Files the node creates are opened with
//! [`FILE_MODE`] and set to it where they already existed.

use std::io;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use thiserror::Error;

/// The mode of every directory the node creates (and sets on one it is given).
pub const DIR_MODE: u32 = 0o700;

/// The mode of every file the node creates (block files, sockets).
pub const FILE_MODE: u32 = 0o600;

/// Why a directory cannot be used as a private one.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum PrivateDirError {
    #[error("{}: {op}", path.display())]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{} is not a directory", path.display())]
    NotDir { path: PathBuf },
    /// Group or others may write it: refused, not repaired, since what is in it may already
    /// be someone else's.
    #[error(
        "{} is writable by group or others (mode {mode:04o}): another user could replace what \
         the node keeps there; use a directory only this user may write (chmod 700)",
        path.display()
    )]
    Writable { path: PathBuf, mode: u32 },
}

/// Makes `path` a directory only this user may enter: created (with missing parents) with
/// mode 0700 when missing, set to 0700 when it exists and group and others cannot write it,
/// refused when they can. The mode is set explicitly after creation too, since the umask
/// applies to the one given at creation.
pub fn private_dir(path: &Path) -> Result<(), PrivateDirError> {
    let io = |op| {
        move |source| PrivateDirError::Io {
            path: path.to_path_buf(),
            op,
            source,
        }
    };
    match std::fs::metadata(path) {
        Ok(meta) => {
            if !meta.is_dir() {
                return Err(PrivateDirError::NotDir {
                    path: path.to_path_buf(),
                });
            }
            let mode = meta.permissions().mode() & 0o7777;
            if mode & 0o022 != 0 {
                return Err(PrivateDirError::Writable {
                    path: path.to_path_buf(),
                    mode,
                });
            }
            if mode & 0o777 == DIR_MODE {
                return Ok(());
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(DIR_MODE)
                .create(path)
                .map_err(io("creating it"))?;
        }
        Err(e) => return Err(io("reading its mode")(e)),
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(DIR_MODE))
        .map_err(io("setting its mode to 0700"))
}

/// Sets an open file's mode to [`FILE_MODE`] (fchmod: the file opened, not a path that
/// might have been swapped since).
pub fn private_file(file: &std::fs::File) -> io::Result<()> {
    file.set_permissions(std::fs::Permissions::from_mode(FILE_MODE))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
    }

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvferry-private-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_missing_directory_is_made_0700_and_an_open_one_is_refused() {
        let d = scratch("dirs");
        let inner = d.join("a/b");
        private_dir(&inner).unwrap();
        assert_eq!(mode(&inner), 0o700);
        // Idempotent; a readable one is narrowed.
        private_dir(&inner).unwrap();
        std::fs::set_permissions(&inner, std::fs::Permissions::from_mode(0o755)).unwrap();
        private_dir(&inner).unwrap();
        assert_eq!(mode(&inner), 0o700);
        // Writable by others or group (sticky or not): refused, left as it was.
        for m in [0o777, 0o1777, 0o770, 0o702] {
            std::fs::set_permissions(&inner, std::fs::Permissions::from_mode(m)).unwrap();
            let e = private_dir(&inner).unwrap_err();
            assert!(matches!(e, PrivateDirError::Writable { .. }), "{e}");
            let s = e.to_string();
            assert!(s.contains(&inner.display().to_string()), "{s}");
            assert!(s.contains(&format!("{m:04o}")), "{s}");
            assert_eq!(mode(&inner), m);
        }
        std::fs::set_permissions(&inner, std::fs::Permissions::from_mode(0o700)).unwrap();
        // A file where the directory should be.
        let f = d.join("file");
        std::fs::write(&f, b"x").unwrap();
        assert!(matches!(
            private_dir(&f),
            Err(PrivateDirError::NotDir { .. })
        ));
        std::fs::remove_dir_all(&d).unwrap();
    }
}
