//! Cross-process provider over TCP. A data connection proves a link grant the owner's Peer
//! service issued ([`crate::data_auth`]) before anything is read; the owner then checks key,
//! access and bounds of every read against its MR table and streams the bytes from its
//! registered memory; the requester receives them straight into the destination region
//! (device pieces through a bounce buffer and the sink). A connection that fails its hello or
//! names a read the owner does not serve is closed and counted ([`Rejections`](crate::data_auth::Rejections)), and a source
//! that keeps failing is refused for a while ([`SourceGuard`](crate::data_auth::SourceGuard)).
//!
//! The owner side (accepting, the hello, serving reads) is `owner`; the requester side
//! (connecting, posting reads, receiving them) is `connector`.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

mod connector;
mod owner;

pub(crate) use connector::check_ack;
pub use connector::{ClientTls, TcpConnector};
pub use owner::{
    RejectHook, TcpOwner, TcpOwnerOptions, HELLO_DEADLINE, MAX_CONNECTIONS, MAX_PENDING_HELLOS,
};

/// How often blocked receivers wake to check for aborts and timeouts.
const POLL_INTERVAL: Duration = Duration::from_millis(20);
/// Bounce buffer for device destinations: a run of device pieces is received in chunks of
/// this size.
const BOUNCE: usize = 1 << 20;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section here leaves the data consistent, so poisoning carries no meaning.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
