//! The node's ZMQ publisher: a PUB socket sending each event of the [`EventHub`] as one
//! `KVEventBatch` (topic, sequence, payload: [`super::wire`]), and a ROUTER socket
//! answering replay requests from the ring, as vLLM's `ZmqEventPublisher` does.
//!
//! Both run on a thread of their own (`kvferry-events`, a tokio runtime of one thread), so
//! nothing on the actor threads waits for a subscriber. The PUB socket drops a message for a
//! subscriber whose queue is full (ZMTP's rule for PUB); that subscriber sees a gap in the
//! sequence numbers and asks for a replay. Events the ring let go before this thread sent
//! them are counted in `kvferry_events_dropped_total`. A replay request that is not
//! `["", seq]` is answered with the end marker carrying the reason, and a replay to a client
//! that does not read is abandoned after [`REPLAY_SEND_TIMEOUT`].
//!
//! The first message (sequence 0, `AllBlocksCleared`: the node started) goes out
//! [`START_GRACE`] after the bind: subscribers of the node's earlier run reconnect on their
//! own (ZMQ retries every 100 ms unless told otherwise), and a message sent before they are
//! back is lost to them. Events recorded meanwhile wait in the ring.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;
use thiserror::Error;
use tokio::sync::oneshot;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::wire::{encode_batch, parse_replay_request, topic, Layout, END_SEQ};
use super::{EventHub, EventsConfig};

/// Events read from the ring per round.
const ROUND: usize = 1024;
/// How long one replay message may wait for a client's queue.
pub const REPLAY_SEND_TIMEOUT: Duration = Duration::from_secs(2);
/// How long after the bind the first message waits (see the module's header).
pub const START_GRACE: Duration = Duration::from_millis(500);

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum PublisherError {
    /// The endpoint could not be bound (in use, not an address of this host).
    #[error("binding {key} = {endpoint}")]
    Bind {
        key: &'static str,
        endpoint: String,
        #[source]
        source: zeromq::ZmqError,
    },
    #[error("starting the events thread")]
    Thread(#[source] std::io::Error),
}

/// The running publisher; dropping it stops the thread and closes the sockets.
#[derive(Debug)]
pub struct EventPublisher {
    publish: String,
    replay: Option<String>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl EventPublisher {
    /// Binds the sockets of `config` (errors name the key) and starts publishing `hub`.
    pub fn start(config: &EventsConfig, hub: Arc<EventHub>) -> Result<Self, PublisherError> {
        let config = config.clone();
        let (bound_tx, bound_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("kvferry-events".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = bound_tx.send(Err(PublisherError::Thread(e)));
                        return;
                    }
                };
                rt.block_on(async move {
                    let (pub_socket, publish) =
                        match bind(PubSocket::new(), "events.publish", &config.publish).await {
                            Ok(b) => b,
                            Err(e) => {
                                let _ = bound_tx.send(Err(e));
                                return;
                            }
                        };
                    let router = if config.replay.is_empty() {
                        None
                    } else {
                        match bind(RouterSocket::new(), "events.replay", &config.replay).await {
                            Ok(b) => Some(b),
                            Err(e) => {
                                let _ = bound_tx.send(Err(e));
                                return;
                            }
                        }
                    };
                    let replay = router.as_ref().map(|(_, e)| e.clone());
                    let _ = bound_tx.send(Ok((publish, replay)));
                    let prefix: Arc<str> = config.topic.as_str().into();
                    let layout = config.layout;
                    if let Some((router, _)) = router {
                        let (hub, prefix) = (Arc::clone(&hub), Arc::clone(&prefix));
                        // A task of its own: a panic in the socket library's receive path
                        // ends replays, not publishing.
                        tokio::spawn(serve_replays(router, hub, prefix, layout));
                    }
                    tokio::select! {
                        _ = publish_loop(pub_socket, Arc::clone(&hub), prefix, layout) => {}
                        _ = stop_rx => {}
                    }
                });
            })
            .map_err(PublisherError::Thread)?;
        match bound_rx.recv() {
            Ok(Ok((publish, replay))) => {
                tracing::info!(
                    publish,
                    replay = replay.as_deref().unwrap_or(""),
                    "events: publishing"
                );
                Ok(Self {
                    publish,
                    replay,
                    stop: Some(stop_tx),
                    thread: Some(thread),
                })
            }
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err(PublisherError::Thread(std::io::Error::other(
                    "the events thread ended before binding",
                )))
            }
        }
    }

    /// The PUB endpoint bound (the port resolved where the config said 0).
    pub fn publish_endpoint(&self) -> &str {
        &self.publish
    }

    /// The ROUTER endpoint bound, if any.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay.as_deref()
    }
}

impl Drop for EventPublisher {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn bind<S: Socket>(
    mut socket: S,
    key: &'static str,
    endpoint: &str,
) -> Result<(S, String), PublisherError> {
    match socket.bind(endpoint).await {
        Ok(bound) => Ok((socket, bound.to_string())),
        Err(source) => Err(PublisherError::Bind {
            key,
            endpoint: endpoint.to_owned(),
            source,
        }),
    }
}

fn frames(parts: [Bytes; 3]) -> ZmqMessage {
    let mut m = ZmqMessage::from(parts[0].clone());
    m.push_back(parts[1].clone());
    m.push_back(parts[2].clone());
    m
}

/// One event as its three frames.
fn event_frames(prefix: &str, e: &super::NodeEvent, layout: Layout) -> [Bytes; 3] {
    [
        Bytes::from(topic(prefix, e.namespace.as_ref())),
        Bytes::copy_from_slice(&e.seq.to_be_bytes()),
        Bytes::from(encode_batch(std::slice::from_ref(e), layout)),
    ]
}

async fn publish_loop(mut socket: PubSocket, hub: Arc<EventHub>, prefix: Arc<str>, layout: Layout) {
    tokio::time::sleep(START_GRACE).await;
    let mut next = 0;
    loop {
        let read = hub.since(next, None, ROUND);
        if read.missed > 0 {
            hub.stats().dropped.fetch_add(read.missed, Relaxed);
        }
        next = read.next;
        let sent = read.events.len();
        for e in &read.events {
            // Never blocks: a subscriber whose queue is full misses this message, and the
            // socket does not say so (zeromq 0.4's PubSocket::send ignores BufferFull and
            // answers Ok; its per-subscriber queues are private), so the node cannot count
            // it; the subscriber sees the gap in the sequence and replays.
            match socket.send(frames(event_frames(&prefix, e, layout))).await {
                Ok(()) => {
                    hub.stats().published.fetch_add(1, Relaxed);
                }
                Err(_) => {
                    hub.stats().dropped.fetch_add(1, Relaxed);
                }
            }
        }
        if sent < ROUND {
            hub.changed().await;
        } else {
            // A long backlog: let the socket's tasks write before the next round.
            tokio::task::yield_now().await;
        }
    }
}

async fn serve_replays(
    mut socket: RouterSocket,
    hub: Arc<EventHub>,
    prefix: Arc<str>,
    layout: Layout,
) {
    loop {
        let Ok(request) = socket.recv().await else {
            continue;
        };
        let parts: Vec<Bytes> = request.into_vec();
        let Some((identity, rest)) = parts.split_first() else {
            continue;
        };
        let rest: Vec<&[u8]> = rest.iter().map(|b| b.as_ref()).collect();
        let start = match parse_replay_request(&rest) {
            Ok(seq) => seq,
            Err(e) => {
                hub.stats().replays_refused.fetch_add(1, Relaxed);
                let reason = Bytes::from(format!("error: {e}"));
                let _ = send_to(&mut socket, identity, end_marker(reason)).await;
                continue;
            }
        };
        hub.stats().replays.fetch_add(1, Relaxed);
        let mut from = start;
        let mut alive = true;
        'replay: loop {
            let read = hub.since(from, None, ROUND);
            for e in &read.events {
                if send_to(&mut socket, identity, event_frames(&prefix, e, layout))
                    .await
                    .is_err()
                {
                    alive = false;
                    break 'replay;
                }
            }
            if read.events.len() < ROUND || read.next == from {
                break;
            }
            from = read.next;
        }
        if alive {
            let _ = send_to(&mut socket, identity, end_marker(Bytes::new())).await;
        }
    }
}

fn end_marker(payload: Bytes) -> [Bytes; 3] {
    [Bytes::new(), Bytes::copy_from_slice(&END_SEQ), payload]
}

/// `[identity, "", topic, seq, payload]`, as vLLM's replay socket answers.
async fn send_to(socket: &mut RouterSocket, identity: &Bytes, parts: [Bytes; 3]) -> Result<(), ()> {
    let mut m = ZmqMessage::from(identity.clone());
    m.push_back(Bytes::new());
    for p in parts {
        m.push_back(p);
    }
    match tokio::time::timeout(REPLAY_SEND_TIMEOUT, socket.send(m)).await {
        Ok(Ok(())) => Ok(()),
        _ => Err(()),
    }
}
