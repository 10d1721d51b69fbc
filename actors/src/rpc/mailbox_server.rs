//! The node's side of a request mailbox: one thread per attached mailbox that takes posted
//! requests and runs them through the Engine service's own handlers, on the service's
//! runtime, so a mailbox request is checked, served and refused exactly as the gRPC call.
//! The thread polls for `engine.mailbox-spin-us` after each request (an engine's requests
//! come in bursts: a query, then its load) and sleeps on the doorbell otherwise; it ends when
//! its session ends, the client closes the mailbox, or the service stops.

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;
use std::time::{Duration, Instant};

use prost::Message;
use tonic::{Request, Status};

use super::engine_server::EngineService;
use super::mailbox::{Mailbox, Op};
use super::proto::engine_server::Engine;
use super::proto::{LoadRequest, QueryRequest, SaveRequest};

use super::MAX_ENGINE_MAILBOXES as MAX_MAILBOXES;

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

fn run(service: &EngineService, mailbox: &Mailbox, stop: &AtomicBool) {
    let spin = service.shared.options.mailbox_spin;
    let timeout = service.shared.options.call_timeout;
    let mut last = Instant::now();
    mailbox.set_polling(!spin.is_zero());
    loop {
        if stop.load(Ordering::SeqCst) || mailbox.is_closed() {
            break;
        }
        if let Some(t) = mailbox.take() {
            let (code, payload) = serve(service, t.op, t.request, timeout);
            // Counted before the answer: a client that saw it finds it counted.
            service
                .shared
                .mailbox_requests
                .fetch_add(1, Ordering::Relaxed);
            mailbox.answer(t.slot, code, &payload);
            last = Instant::now();
            continue;
        }
        if last.elapsed() < spin {
            // Polls, yielding the core to the threads that do the work (the node may have few).
            std::thread::yield_now();
            continue;
        }
        // Asleep from here: clients ring; one scan after saying so, then sleep unless the
        // doorbell moved since.
        mailbox.set_polling(false);
        let seen = mailbox.doorbell();
        if !mailbox.has_posted() {
            mailbox.sleep(seen, IDLE_CHECK);
        }
        mailbox.set_polling(!spin.is_zero());
        if mailbox.doorbell() != seen {
            // Rung: poll again (a timeout alone does not).
            last = Instant::now();
        }
    }
    mailbox.set_polling(false);
}

/// Runs one request; the answer's code and payload.
fn serve(
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
            handle::<QueryRequest, _, _>("Query", &b, timeout, |r| service.query(r))
        }
        (Some(Op::Load), Some(b)) => {
            handle::<LoadRequest, _, _>("Load", &b, timeout, |r| service.load(r))
        }
        (Some(Op::Save), Some(b)) => {
            handle::<SaveRequest, _, _>("Save", &b, timeout, |r| service.save(r))
        }
    };
    match answered {
        Ok(payload) => (0, payload),
        Err(s) => (s.code() as u32, s.message().as_bytes().to_vec()),
    }
}

/// Decodes a `Q`, runs `handler` on it (within `timeout`) and encodes its answer.
fn handle<Q, R, F>(
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
    block_spinning(deadline(timeout, handler(Request::new(q))))
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

/// Wakes the thread that polls the future.
struct Flag {
    woken: AtomicBool,
    thread: Thread,
}

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.thread.unpark();
    }
}

/// How long [`block_spinning`] polls before it parks: the node's answer to a handler (a
/// message to the keeper and back) takes tens of microseconds, and a parked thread takes as
/// long again to wake.
const ANSWER_SPIN: Duration = Duration::from_millis(1);

/// Runs `f` to completion on this thread, polling for a wake-up for a while before parking.
fn block_spinning<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    let flag = Arc::new(Flag {
        woken: AtomicBool::new(false),
        thread: std::thread::current(),
    });
    let waker = Waker::from(Arc::clone(&flag));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        let t = Instant::now();
        while !flag.woken.swap(false, Ordering::AcqRel) {
            if t.elapsed() < ANSWER_SPIN {
                std::thread::yield_now();
            } else {
                std::thread::park_timeout(IDLE_CHECK);
            }
        }
    }
}
