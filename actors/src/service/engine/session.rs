//! Session: the stream that ties a client's instances and request mailboxes to it; when it
//! ends, they go.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::sync::mpsc;
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::model::InstanceId;
use crate::service::engine::mailbox::{self as mailbox_thread, MailboxThread};
use crate::service::engine::memory_handles::Held;
use crate::service::engine::request::{self as check, status};
use crate::service::engine::service::{EngineService, EventStream};
use crate::statuses;
use kvferry_proto::v1::*;

impl EngineService {
    pub(super) async fn handle_session(
        &self,
        req: Request<Streaming<SessionRequest>>,
    ) -> Result<Response<EventStream<SessionEvent>>, Status> {
        const M: &str = "Session";
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let shared = Arc::clone(&self.shared);
        let mut stop = self.shared.stop.clone();
        shared.sessions.fetch_add(1, Ordering::Relaxed);
        let service = self.clone();
        tokio::spawn(async move {
            let mut bound: Vec<InstanceId> = Vec::new();
            // Their threads end when this task does: the session's end detaches them.
            let mut mailboxes = Vec::new();
            loop {
                let msg = tokio::select! {
                    m = inbound.message() => m,
                    _ = stop.wait_for(|s| *s) => break,
                };
                // End of stream or a broken connection: the session ends. A message that does
                // not decode (or is too large) ends it with the status saying so.
                let m = match msg {
                    Ok(Some(m)) => m,
                    Ok(None) => break,
                    Err(e) => {
                        shared.end_session(std::mem::take(&mut bound)).await;
                        let _ = tx.send(Err(statuses::inbound(M, e))).await;
                        return;
                    }
                };
                let answer = match check::instance(M, &m.bind) {
                    _ if m.mailbox != 0 => service.attach_mailbox(m.mailbox).map(|t| {
                        mailboxes.push(t);
                        SessionEvent {
                            bound: String::new(),
                            mailbox: m.mailbox,
                        }
                    }),
                    Ok(instance) => match shared.node.check_registered(&instance, None).await {
                        Ok(()) => {
                            if !bound.contains(&instance) {
                                bound.push(instance.clone());
                            }
                            Ok(SessionEvent {
                                bound: instance.as_str().to_owned(),
                                mailbox: 0,
                            })
                        }
                        Err(e) => Err(status(M, e)),
                    },
                    Err(s) => Err(s),
                };
                match answer {
                    Ok(event) => {
                        if tx.send(Ok(event)).await.is_err() {
                            break;
                        }
                    }
                    Err(refused) => {
                        // The session ends on a refused bind; its cleanup is done by the
                        // time the client reads why.
                        shared.end_session(std::mem::take(&mut bound)).await;
                        let _ = tx.send(Err(refused)).await;
                        return;
                    }
                }
            }
            drop(tx);
            shared.end_session(bound).await;
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    /// Takes the mailbox of fd-socket handle `id` and starts its thread.
    fn attach_mailbox(&self, id: u64) -> Result<MailboxThread, Status> {
        const M: &str = "Session";
        let h = self.handle(id, || {
            format!("{M}: mailbox {id} is unknown, expired or already attached")
        })?;
        let kind = h.kind;
        let Held::Mailbox(mailbox) = h.memory else {
            return Err(Status::invalid_argument(format!(
                "{M}: handle {id} is {} memory, not a mailbox",
                kind.as_str()
            )));
        };
        let thread = mailbox_thread::attach(self.clone(), mailbox)?;
        self.shared.handles().take(id);
        Ok(thread)
    }
}
