//! When a node rereads its TLS files: on SIGHUP, and when their modification times change
//! (polled). Each trigger calls [`TlsContext::reload`]; a failed reload keeps the old
//! material, so a half-copied file is retried on the next trigger.

use std::time::Duration;

use crate::tls::TlsContext;

/// Runs until `stop` resolves: reloads `ctx` on SIGHUP (if `sighup`) and every `poll`
/// (if nonzero) when a file changed.
pub async fn watch(
    ctx: TlsContext,
    sighup: bool,
    poll: Duration,
    stop: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut hup = if sighup {
        Some(signal(SignalKind::hangup())?)
    } else {
        None
    };
    let mut tick = (!poll.is_zero()).then(|| tokio::time::interval(poll));
    let mut stamps = ctx.files().stamps();
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => return Ok(()),
            Some(()) = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => {
                tracing::info!("SIGHUP: reloading the TLS certificate, key and CA");
                let _ = ctx.reload();
                stamps = ctx.files().stamps();
            }
            _ = async { match tick.as_mut() { Some(t) => { t.tick().await; } None => std::future::pending().await } } => {
                let now = ctx.files().stamps();
                if now != stamps && ctx.reload().is_ok() {
                    stamps = now;
                }
            }
        }
    }
}
