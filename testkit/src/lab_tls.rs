//! A lab CA and node certificates written as PEM files, made in process with rcgen: what
//! `scripts/tls-lab-certs` makes with openssl, for tests and for `kvferry bench … --tls`.
//! Every certificate is a leaf the CA signed for server and client use (mutual TLS between
//! nodes), naming the node ids given; keys are written 0600, and files are replaced by a
//! rename, so a node reloading them never reads half a file.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LabTlsError {
    #[error("making a lab certificate")]
    Make(#[from] rcgen::Error),
    #[error("writing {}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0:?} is before 1970")]
    Time(SystemTime),
}

/// The files of one issued certificate, as a node's `[tls]` names them (the harness turns
/// them into the runtime's `TlsFiles`: `kvferry_harness::tls_files`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertFiles {
    /// The certificate, PEM.
    pub cert: PathBuf,
    /// Its private key, PEM (0600).
    pub key: PathBuf,
    /// The CA's certificate, PEM.
    pub ca: PathBuf,
}

/// A CA whose certificate is `<dir>/ca.pem`; its key stays in memory.
pub struct LabCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
    dir: PathBuf,
}

impl std::fmt::Debug for LabCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LabCa").field("dir", &self.dir).finish()
    }
}

/// Writes `text` to `path` through a file beside it renamed over it.
fn write_atomic(path: &Path, text: &str, mode: u32) -> Result<(), LabTlsError> {
    let err = |source| LabTlsError::Write {
        path: path.to_owned(),
        source,
    };
    let tmp = path.with_extension("new");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .map_err(err)?;
    f.write_all(text.as_bytes()).map_err(err)?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(err)
}

/// `t` as time since the epoch (rcgen's dates are the epoch plus that).
fn since_epoch(t: SystemTime) -> Result<Duration, LabTlsError> {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_err(|_| LabTlsError::Time(t))
}

impl LabCa {
    /// A new CA named `name` in `dir` (made 0700 if missing).
    pub fn new(dir: &Path, name: &str) -> Result<Self, LabTlsError> {
        let mkdir = |source| LabTlsError::Write {
            path: dir.to_owned(),
            source,
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(mkdir)?;
        let mut p = CertificateParams::new(Vec::<String>::new())?;
        p.distinguished_name
            .push(rcgen::DnType::CommonName, name.to_owned());
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let issuer = CertifiedIssuer::self_signed(p, KeyPair::generate()?)?;
        let ca = Self {
            issuer,
            dir: dir.to_owned(),
        };
        write_atomic(&ca.ca(), &ca.issuer.pem(), 0o644)?;
        Ok(ca)
    }

    /// The CA certificate's file.
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// (Re)writes `<stem>.pem` and `<stem>.key`: a fresh key and a certificate naming
    /// `names` (and localhost), valid from 1975 to 4096.
    pub fn issue(&self, stem: &str, names: &[&str]) -> Result<CertFiles, LabTlsError> {
        self.issue_with(stem, names, |_| {})
    }

    /// [`Self::issue`] with the certificate valid from an hour before now until `not_after`
    /// (which may be past: an expired certificate).
    pub fn issue_until(
        &self,
        stem: &str,
        names: &[&str],
        not_after: SystemTime,
    ) -> Result<CertFiles, LabTlsError> {
        let not_before = since_epoch(
            not_after
                .min(SystemTime::now())
                .checked_sub(Duration::from_secs(3600))
                .unwrap_or(SystemTime::UNIX_EPOCH),
        )?;
        let not_after = since_epoch(not_after)?;
        self.issue_with(stem, names, |p| {
            p.not_before = rcgen::date_time_ymd(1970, 1, 1) + not_before;
            p.not_after = rcgen::date_time_ymd(1970, 1, 1) + not_after;
        })
    }

    fn issue_with(
        &self,
        stem: &str,
        names: &[&str],
        edit: impl FnOnce(&mut CertificateParams),
    ) -> Result<CertFiles, LabTlsError> {
        let mut sans: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        sans.push("localhost".into());
        let mut p = CertificateParams::new(sans)?;
        p.distinguished_name.push(
            rcgen::DnType::CommonName,
            names.first().copied().unwrap_or(stem),
        );
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        edit(&mut p);
        let key = KeyPair::generate()?;
        let cert = p.signed_by(&key, &self.issuer)?;
        let files = CertFiles {
            cert: self.dir.join(format!("{stem}.pem")),
            key: self.dir.join(format!("{stem}.key")),
            ca: self.ca(),
        };
        // Key first: a reload between the two renames sees the new key with the old
        // certificate, refuses the pair and keeps what it had.
        write_atomic(&files.key, &key.serialize_pem(), 0o600)?;
        write_atomic(&files.cert, &cert.pem(), 0o644)?;
        Ok(files)
    }
}
