//! Query, Load and Save through an attached request mailbox, falling back to calls once
//! the session that serves it ended.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{EngineClient, LATE_ANSWER_WAIT};
use crate::error::EngineClientError;
use prost::Message;
use tonic::{Code, Status};

use kvferry_proto::model::InstanceId;
use kvferry_proto::shm::mailbox::{self, Mailbox, MailboxError, Op};

/// How often a mailbox wait looks whether the session holding the mailbox ended.
const ENDED_CHECK: Duration = Duration::from_millis(20);

/// An attached mailbox, held on the node by a session that a task of its own watches.
pub(super) struct MailboxLink {
    mailbox: Arc<Mailbox>,
    /// The session ended (the node stopped, restarted or dropped it): its thread no longer
    /// serves the mailbox, so requests go as calls from then on.
    ended: Arc<std::sync::atomic::AtomicBool>,
    /// Dropped with the link: the watcher then ends the session.
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl MailboxLink {
    fn ended(&self) -> bool {
        self.ended.load(std::sync::atomic::Ordering::Acquire)
    }
}

impl std::fmt::Debug for MailboxLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MailboxLink")
            .field("slots", &self.mailbox.slots())
            .finish()
    }
}

impl Drop for MailboxLink {
    fn drop(&mut self) {
        // The node's thread ends now, not when it notices the session's end.
        self.mailbox.close();
    }
}

impl EngineClient {
    /// Attaches a request mailbox (see [`kvferry_proto::shm::mailbox`]): from then on Query, Load and Save of
    /// this handle and its clones go through it, and fall back to the gRPC call only where a
    /// request does not fit a slot or every slot is in flight. `instance` names the client
    /// on the fd socket. False (nothing attached) where the node's protocol is older than 5,
    /// and on a handle whose mailbox's session ended (the node stopped or restarted: requests
    /// go as calls; a new client attaches a new mailbox).
    pub async fn attach_mailbox(&self, instance: &InstanceId) -> Result<bool, EngineClientError> {
        if let Some(link) = self.mailbox.get() {
            return Ok(!link.ended());
        }
        if self.capabilities().await?.protocol < 5 {
            return Ok(false);
        }
        let failed = |source| EngineClientError::Mailbox {
            addr: self.addr.clone(),
            source,
        };
        let mailbox = Arc::new(
            Mailbox::create(mailbox::DEFAULT_SLOTS, mailbox::DEFAULT_SLOT_BYTES).map_err(failed)?,
        );
        let handle = self.send_mailbox(instance, &mailbox).await?;
        let mut session = self.open_session(&[]).await?;
        session.attach(handle).await?;
        let ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let flag = Arc::clone(&ended);
        tokio::spawn(async move {
            tokio::select! {
                () = session.ended() => {}
                _ = stopped => {}
            }
            flag.store(true, std::sync::atomic::Ordering::Release);
        });
        let link = MailboxLink {
            mailbox,
            ended,
            _stop: stop,
        };
        // Two attaching at once: the second link drops, closing its own mailbox.
        let _ = self.mailbox.set(link);
        Ok(true)
    }

    /// Whether Query, Load and Save go through a mailbox: one is attached and the session
    /// holding it has not ended (a node that stopped or restarted ends it; a new client
    /// attaches a new one).
    pub fn has_mailbox(&self) -> bool {
        self.mailbox.get().is_some_and(|l| !l.ended())
    }

    /// Sends `req` through the attached mailbox and decodes the answer; `None` where there
    /// is none, the request does not fit a slot, or every slot is in flight (the caller
    /// makes the gRPC call). The answer is polled for on this thread for a moment (a query
    /// or a load's start is answered within it), then waited for on a blocking thread.
    ///
    /// `late` (if any) is given an answer that comes after the wait gave up: a thread keeps
    /// waiting for it for [`LATE_ANSWER_WAIT`] while the mailbox's session lasts.
    pub(super) async fn through_mailbox<Req: Message, Resp: Message + Default>(
        &self,
        op: Op,
        method: &'static str,
        req: &Req,
        late: Option<LateAnswer>,
    ) -> Option<Result<Resp, EngineClientError>> {
        let link = self.mailbox.get().filter(|l| !l.ended())?;
        let ticket = match link.mailbox.post(op, &req.encode_to_vec()) {
            Ok(t) => t,
            // The node's thread for the mailbox stopped (its session is ending): the call goes
            // the usual way and meets whatever the node says there.
            Err(
                MailboxError::TooLarge { .. } | MailboxError::Full { .. } | MailboxError::Closed,
            ) => return None,
            Err(source) => {
                return Some(Err(EngineClientError::Mailbox {
                    addr: self.addr.clone(),
                    source,
                }));
            }
        };
        let (spin, deadline) = (mailbox::ANSWER_SPIN.min(self.deadline), self.deadline);
        let answer = match ticket.wait(spin, spin) {
            Err(MailboxError::TimedOut { .. }) if deadline > spin => {
                let end = Instant::now() + (deadline - spin);
                let ended = Arc::clone(&link.ended);
                // In slices, so a session that ends meanwhile (the node died) ends the wait.
                let waited = tokio::task::spawn_blocking(move || {
                    let answer = wait_ticket(&ticket, end, &ended);
                    if let (Err(MailboxError::TimedOut { .. }), Some(late)) = (&answer, late) {
                        // Given up on: the answer still lands in the slot; read it there.
                        std::thread::spawn(move || {
                            let until = Instant::now() + LATE_ANSWER_WAIT;
                            if let Ok(a) = wait_ticket(&ticket, until, &ended) {
                                late(a);
                            }
                        });
                    }
                    answer
                })
                .await;
                waited.unwrap_or(Err(MailboxError::TimedOut {
                    op: op.as_str(),
                    waited: deadline,
                }))
            }
            other => other,
        };
        if link.ended() && answer.is_err() {
            return Some(Err(self.failed(
                method,
                Status::unavailable(
                    "the session holding the request mailbox ended (the node stopped or \
                     restarted)",
                ),
            )));
        }
        Some(match answer {
            Ok(a) if a.code == 0 => {
                Resp::decode(&a.payload[..]).map_err(|e| EngineClientError::Malformed {
                    addr: self.addr.clone(),
                    method,
                    reason: format!("the mailbox answer does not decode: {e}"),
                })
            }
            Ok(a) => Err(self.failed(
                method,
                Status::new(
                    Code::from(a.code as i32),
                    String::from_utf8_lossy(&a.payload).into_owned(),
                ),
            )),
            Err(MailboxError::TimedOut { .. }) => Err(self.failed(
                method,
                Status::deadline_exceeded(format!("no answer within {deadline:?}")),
            )),
            Err(source) => Err(EngineClientError::Mailbox {
                addr: self.addr.clone(),
                source,
            }),
        })
    }
}

/// What becomes of a mailbox answer that arrives after its call gave up.
pub(super) type LateAnswer = Box<dyn FnOnce(mailbox::Answer) + Send>;

/// Waits for a ticket's answer until `end`, in slices, so a session that ends meanwhile (the
/// node died) ends the wait.
fn wait_ticket(
    ticket: &mailbox::Ticket,
    end: Instant,
    ended: &std::sync::atomic::AtomicBool,
) -> Result<mailbox::Answer, MailboxError> {
    loop {
        let left = end.saturating_duration_since(Instant::now());
        match ticket.wait(Duration::ZERO, left.min(ENDED_CHECK)) {
            Err(MailboxError::TimedOut { .. })
                if !left.is_zero() && !ended.load(std::sync::atomic::Ordering::Acquire) => {}
            other => return other,
        }
    }
}
