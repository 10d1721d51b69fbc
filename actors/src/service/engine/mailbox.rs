//! The node's side of a request mailbox: one thread per attached mailbox that takes posted
//! requests and runs them through the Engine service's own handlers, on the service's
//! runtime, so a mailbox request is checked, served and refused exactly as the gRPC call.
//! The thread serves the requests it took side by side (a save waiting for its copies does
//! not hold up a query or a load posted after it) and answers each when it is ready. It polls
//! for `engine.mailbox-spin-us` after each request (an engine's requests come in bursts: a
//! query, then its load) and sleeps on the doorbell otherwise; it ends when its session ends,
//! the client closes the mailbox, or the service stops, once what it took is answered.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use prost::Message;
use tonic::{Request, Status};

use crate::service::engine::server::EngineService;
use kvferry_proto::shm::mailbox::{Mailbox, Op};
use kvferry_proto::v1::engine_server::Engine;
use kvferry_proto::v1::{LoadRequest, QueryRequest, SaveRequest};

use kvferry_proto::MAX_ENGINE_MAILBOXES as MAX_MAILBOXES;

/// How long a sleeping thread waits before it looks at its stop flag again (a stop also
/// rings the doorbell; this bounds a missed ring).
const IDLE_CHECK: Duration = Duration::from_millis(200);

/// Owns an attached mailbox's thread: dropped (the session ended), the thread finishes the
/// request it serves and ends.
pub(crate) struct MailboxThread {
    stop: Arc<AtomicBool>,
    mailbox: Arc<Mailbox>,
}

impl Drop for MailboxThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.mailbox.ring();
    }
}

/// Starts the thread for `mailbox` (called on the service's runtime). Refused past
/// [`MAX_MAILBOXES`].
pub(crate) fn attach(
    service: EngineService,
    mailbox: Arc<Mailbox>,
) -> Result<MailboxThread, Status> {
    let shared = Arc::clone(&service.shared);
    if shared
        .mailboxes
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < MAX_MAILBOXES).then_some(n + 1)
        })
        .is_err()
    {
        return Err(Status::resource_exhausted(format!(
            "Session: {MAX_MAILBOXES} mailboxes are attached on this node"
        )));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let rt = tokio::runtime::Handle::current();
    let (m, s) = (Arc::clone(&mailbox), Arc::clone(&stop));
    let started = std::thread::Builder::new()
        .name("kvferry-mailbox".into())
        .spawn(move || {
            let _rt = rt.enter();
            run(&service, &m, &s);
            service.shared.mailboxes.fetch_sub(1, Ordering::AcqRel);
        });
    if let Err(e) = started {
        shared.mailboxes.fetch_sub(1, Ordering::AcqRel);
        return Err(Status::resource_exhausted(format!(
            "Session: no thread for the mailbox: {e}"
        )));
    }
    Ok(MailboxThread { stop, mailbox })
}

fn run(service: &EngineService, mailbox: &Arc<Mailbox>, stop: &AtomicBool) {
    let (options, answered) = (&service.shared.options, &service.shared.mailbox_requests);
    let timeout = options.call_timeout;
    serve_all(
        mailbox,
        stop,
        options.mailbox_spin,
        answered,
        |op, request| {
            let service = service.clone();
            Box::pin(async move { serve(&service, op, request, timeout).await })
        },
    );
}

/// One request being served: its answer's code and payload once ready.
type Serving = Pin<Box<dyn Future<Output = (u32, Vec<u8>)>>>;

/// Wakes the mailbox thread when a request it serves can go on: a flag it polls, and the
/// doorbell rung while it sleeps. Owned by the wakers: a handler may keep one past the
/// request (a channel's sender outliving its receiver).
struct Wakeup {
    woken: AtomicBool,
    asleep: AtomicBool,
    mailbox: Arc<Mailbox>,
}

impl Wake for Wakeup {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::SeqCst);
        if self.asleep.load(Ordering::SeqCst) {
            self.mailbox.ring();
        }
    }
}

/// The loop of a mailbox thread: takes every posted request and serves them side by side on
/// this thread (at most one per slot), so a save waiting for its copies does not hold up a
/// query or a load posted after it; answers each as it is ready. Polls for `spin` after the
/// last request, for [`ANSWER_SPIN`] while one is served, and sleeps on the doorbell
/// otherwise. On a stop or a close it takes nothing more and ends once those it took are
/// answered (each within the call deadline).
fn serve_all(
    mailbox: &Arc<Mailbox>,
    stop: &AtomicBool,
    spin: Duration,
    answered: &AtomicU64,
    mut start: impl FnMut(u32, Option<Vec<u8>>) -> Serving,
) {
    let wakeup = Arc::new(Wakeup {
        woken: AtomicBool::new(false),
        asleep: AtomicBool::new(false),
        mailbox: Arc::clone(mailbox),
    });
    let waker = Waker::from(Arc::clone(&wakeup));
    let mut cx = Context::from_waker(&waker);
    let mut serving: Vec<(u32, Serving)> = Vec::new();
    let mut last = Instant::now();
    mailbox.set_polling(!spin.is_zero());
    loop {
        if stop.load(Ordering::SeqCst) && !mailbox.is_closed() {
            // Takes nothing from here on: the client's next post is refused at once.
            mailbox.close();
        }
        let ending = mailbox.is_closed();
        if ending && serving.is_empty() {
            break;
        }
        let mut taken = false;
        while let Some(t) = (!ending).then(|| mailbox.take()).flatten() {
            serving.push((t.slot, start(t.op, t.request)));
            taken = true;
        }
        if taken || wakeup.woken.swap(false, Ordering::AcqRel) {
            // Polled all together: at most one per slot, and a pending one polls cheaply.
            serving.retain_mut(|(slot, f)| match f.as_mut().poll(&mut cx) {
                Poll::Ready((code, payload)) => {
                    // Counted before the answer: a client that saw it finds it counted.
                    answered.fetch_add(1, Ordering::Relaxed);
                    mailbox.answer(*slot, code, &payload);
                    false
                }
                Poll::Pending => true,
            });
            last = Instant::now();
            continue;
        }
        let window = if serving.is_empty() {
            spin
        } else {
            spin.max(ANSWER_SPIN)
        };
        if last.elapsed() < window {
            // Polls, yielding the core to the threads that do the work (the node may have few).
            std::thread::yield_now();
            continue;
        }
        // Asleep from here: clients and wake-ups ring; one look after saying so, then sleep
        // unless the doorbell moved since.
        mailbox.set_polling(false);
        wakeup.asleep.store(true, Ordering::SeqCst);
        let seen = mailbox.doorbell();
        if !mailbox.has_posted() && !wakeup.woken.load(Ordering::SeqCst) {
            mailbox.sleep(seen, IDLE_CHECK);
        }
        wakeup.asleep.store(false, Ordering::SeqCst);
        mailbox.set_polling(!spin.is_zero());
        if mailbox.doorbell() != seen {
            // Rung: poll again (a timeout alone does not).
            last = Instant::now();
        }
    }
    mailbox.set_polling(false);
}

/// Runs one request; the answer's code and payload.
async fn serve(
    service: &EngineService,
    op: u32,
    request: Option<Vec<u8>>,
    timeout: Duration,
) -> (u32, Vec<u8>) {
    let answered: Result<Vec<u8>, Status> = match (Op::from_code(op), request) {
        (None, _) => Err(Status::unimplemented(format!(
            "mailbox: op {op} is not a request this node serves (1 query, 2 load, 3 save)"
        ))),
        (Some(op), None) => Err(Status::invalid_argument(format!(
            "mailbox: the {} request's length lies past its slot",
            op.as_str()
        ))),
        (Some(Op::Query), Some(b)) => {
            handle::<QueryRequest, _, _>("Query", &b, timeout, |r| service.query(r)).await
        }
        (Some(Op::Load), Some(b)) => {
            handle::<LoadRequest, _, _>("Load", &b, timeout, |r| service.load(r)).await
        }
        (Some(Op::Save), Some(b)) => {
            handle::<SaveRequest, _, _>("Save", &b, timeout, |r| service.save(r)).await
        }
    };
    match answered {
        Ok(payload) => (0, payload),
        Err(s) => (s.code() as u32, s.message().as_bytes().to_vec()),
    }
}

/// Decodes a `Q`, runs `handler` on it (within `timeout`) and encodes its answer.
async fn handle<Q, R, F>(
    m: &str,
    bytes: &[u8],
    timeout: Duration,
    handler: impl FnOnce(Request<Q>) -> F,
) -> Result<Vec<u8>, Status>
where
    Q: Message + Default,
    R: Message,
    F: Future<Output = Result<tonic::Response<R>, Status>>,
{
    let q = Q::decode(bytes).map_err(|e| {
        Status::invalid_argument(format!("{m}: the mailbox request does not decode: {e}"))
    })?;
    deadline(timeout, handler(Request::new(q)))
        .await
        .map(|r| r.into_inner().encode_to_vec())
}

async fn deadline<T>(
    timeout: Duration,
    f: impl Future<Output = Result<T, Status>>,
) -> Result<T, Status> {
    tokio::time::timeout(timeout, f).await.unwrap_or_else(|_| {
        Err(Status::deadline_exceeded(format!(
            "no answer within {timeout:?}"
        )))
    })
}

/// How long the thread polls while it serves a request: the node's answer to a handler (a
/// message to the keeper and back) takes tens of microseconds, and a sleeping thread takes as
/// long again to wake.
const ANSWER_SPIN: Duration = Duration::from_millis(1);

#[cfg(test)]
mod tests {
    use super::*;
    use kvferry_proto::shm::mailbox::{mailbox_bytes, MailboxError, Op, MIN_SLOT_BYTES};

    const WAIT: Duration = Duration::from_secs(10);

    /// A node thread over a mailbox both sides map; its Save requests wait for `release`,
    /// anything else is answered at once with its own payload.
    struct Served {
        client: Arc<Mailbox>,
        stop: Arc<AtomicBool>,
        answered: Arc<AtomicU64>,
        thread: std::thread::JoinHandle<()>,
    }

    fn serve_with(spin: Duration, release: tokio::sync::watch::Receiver<bool>) -> Served {
        let client = Arc::new(Mailbox::create(4, MIN_SLOT_BYTES).unwrap());
        let fd = client.fd().try_clone_to_owned().unwrap();
        let node = Arc::new(Mailbox::open(fd, mailbox_bytes(4, MIN_SLOT_BYTES)).unwrap());
        let stop = Arc::new(AtomicBool::new(false));
        let answered = Arc::new(AtomicU64::new(0));
        let (s, a) = (Arc::clone(&stop), Arc::clone(&answered));
        let thread = std::thread::spawn(move || {
            serve_all(&node, &s, spin, &a, |op, request| {
                let mut release = release.clone();
                Box::pin(async move {
                    if Op::from_code(op) == Some(Op::Save) {
                        release.wait_for(|r| *r).await.unwrap();
                    }
                    (0, request.unwrap_or_default())
                })
            })
        });
        Served {
            client,
            stop,
            answered,
            thread,
        }
    }

    fn wait_taken(m: &Mailbox) {
        let t = Instant::now();
        while m.has_posted() {
            assert!(t.elapsed() < WAIT, "the node thread took nothing");
            std::thread::yield_now();
        }
    }

    /// A request still being served (a save waiting for its copies) does not hold up the ones
    /// posted after it, whether the thread polls or sleeps meanwhile; a stop takes nothing
    /// more and ends the thread once what it took is answered.
    #[test]
    fn requests_posted_behind_a_pending_one_are_answered_first() {
        for spin in [Duration::ZERO, Duration::from_millis(2)] {
            let (release, rx) = tokio::sync::watch::channel(false);
            let s = serve_with(spin, rx);
            let save = s.client.post(Op::Save, b"saved").unwrap();
            wait_taken(&s.client);
            for (op, body) in [(Op::Query, &b"q"[..]), (Op::Load, b"l")] {
                let t = s.client.post(op, body).unwrap();
                let a = t.wait(Duration::from_millis(1), WAIT).unwrap();
                assert_eq!((a.code, &a.payload[..]), (0, body), "{spin:?}");
            }
            assert!(save.try_answer().unwrap().is_none(), "{spin:?}");
            // Let the thread go to sleep (its poll window is 1 ms): the save's wake-up
            // rings it.
            std::thread::sleep(Duration::from_millis(20));
            release.send(true).unwrap();
            let a = save.wait(Duration::from_millis(1), WAIT).unwrap();
            assert_eq!((a.code, &a.payload[..]), (0, &b"saved"[..]), "{spin:?}");
            assert_eq!(s.answered.load(Ordering::Relaxed), 3);

            // A stop while a save is served: the thread answers it, then ends; a request
            // posted after the stop is not taken.
            release.send(false).unwrap();
            let save = s.client.post(Op::Save, b"again").unwrap();
            wait_taken(&s.client);
            s.stop.store(true, Ordering::SeqCst);
            s.client.ring();
            // The thread closes the mailbox once it saw the stop; a post after that is refused.
            let until = Instant::now() + WAIT;
            while !s.client.is_closed() && Instant::now() < until {
                std::thread::yield_now();
            }
            assert!(matches!(
                s.client.post(Op::Query, b"late"),
                Err(MailboxError::Closed)
            ));
            std::thread::sleep(Duration::from_millis(20));
            assert!(
                !s.thread.is_finished(),
                "{spin:?}: ended with a request unanswered"
            );
            release.send(true).unwrap();
            s.thread.join().unwrap();
            let a = save.try_answer().unwrap().expect("answered before the end");
            assert_eq!(&a.payload[..], b"again");
            assert_eq!(s.answered.load(Ordering::Relaxed), 4);
        }
    }
}
