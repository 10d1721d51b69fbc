//! The testkit's lab certificates as the runtime's [`TlsFiles`].

use kvferry_actors::tls::TlsFiles;
use kvferry_testkit::CertFiles;

/// The files of a [`kvferry_testkit::LabCa`] certificate as a node's `[tls]` takes them.
pub fn tls_files(files: CertFiles) -> TlsFiles {
    let CertFiles { cert, key, ca } = files;
    TlsFiles { cert, key, ca }
}
