//! A `kvferry node` child process for the tests that restart one on the same directory.

use std::process::{Command, Stdio};
use std::time::Duration;

use kvferry_harness::wait_listening;

/// A node process, killed if the test fails before it ends it.
pub struct NodeChild(std::process::Child);

impl Drop for NodeChild {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

impl NodeChild {
    /// Starts `kvferry node --config cfg`; returns it and its engine address.
    pub fn start(cfg: &std::path::Path) -> (Self, String) {
        let mut child = NodeChild(
            Command::new(env!("CARGO_BIN_EXE_kvferry"))
                .args(["node", "--config", cfg.to_str().unwrap()])
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let out = child.0.stdout.take().unwrap();
        let mut addrs = wait_listening(out, &["engine"], Duration::from_secs(30))
            .unwrap_or_else(|seen| panic!("the node did not start serving engines: {seen}"));
        (child, addrs.remove(0))
    }

    /// SIGTERM, and the clean exit it must lead to.
    #[allow(dead_code)] // each test binary uses one way to end it
    pub fn stop(mut self) {
        // SAFETY: signalling our own child process by its pid.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let status = self.0.wait().unwrap();
        assert!(status.success(), "{status:?}");
    }

    /// SIGKILL: no stop path runs, nothing is flushed by the node.
    #[allow(dead_code)] // each test binary uses one way to end it
    pub fn kill(mut self) {
        // SAFETY: signalling our own child process by its pid.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGKILL) };
        let _ = self.0.wait();
    }
}
