//! Sessions: a stream that ties instances to this client, so the node unregisters them when
//! the client goes away.

use std::time::Duration;

use crate::error::EngineClientError;
use tokio::sync::mpsc;
use tonic::{Code, Streaming};

use kvferry_proto::model::InstanceId;
use kvferry_proto::v1::*;

/// An open session: dropping it (or [`Self::close`]) ends it, and the node unregisters
/// the bound instances.
pub struct EngineSession {
    pub(crate) tx: mpsc::Sender<SessionRequest>,
    pub(crate) events: Streaming<SessionEvent>,
    pub(crate) addr: String,
    pub(crate) deadline: Duration,
}

impl std::fmt::Debug for EngineSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineSession")
            .field("addr", &self.addr)
            .finish()
    }
}

impl EngineSession {
    /// Binds a registered instance to this session.
    pub async fn bind(&mut self, instance: &InstanceId) -> Result<(), EngineClientError> {
        let req = SessionRequest {
            bind: instance.as_str().to_owned(),
            mailbox: 0,
        };
        self.exchange(req, |e| e.bound == instance.as_str()).await
    }

    /// Attaches the mailbox of fd-socket handle `handle` (what
    /// [`crate::EngineClient::attach_mailbox`] does); the node serves it until the session ends.
    pub async fn attach(&mut self, handle: u64) -> Result<(), EngineClientError> {
        let req = SessionRequest {
            bind: String::new(),
            mailbox: handle,
        };
        self.exchange(req, |e| e.mailbox == handle).await
    }

    /// Resolves when the session ends: the node ended it (stopping, or refusing a message) or
    /// the connection broke.
    pub async fn ended(&mut self) {
        while let Ok(Some(_)) = self.events.message().await {}
    }

    async fn exchange(
        &mut self,
        req: SessionRequest,
        answers: impl Fn(&SessionEvent) -> bool,
    ) -> Result<(), EngineClientError> {
        let failed = |code, message: String| EngineClientError::Call {
            addr: self.addr.clone(),
            method: "Session",
            code,
            message,
        };
        let asked = format!("{req:?}");
        let exchange = async {
            self.tx
                .send(req)
                .await
                .map_err(|_| failed(Code::Unavailable, "the session has ended".into()))?;
            match self.events.message().await {
                Ok(Some(e)) if answers(&e) => Ok(()),
                Ok(Some(e)) => Err(failed(
                    Code::Internal,
                    format!("answered {e:?}, asked {asked}"),
                )),
                Ok(None) => Err(failed(Code::Unavailable, "the session has ended".into())),
                Err(s) => Err(failed(s.code(), s.message().to_owned())),
            }
        };
        tokio::time::timeout(self.deadline, exchange)
            .await
            .map_err(|_| failed(Code::DeadlineExceeded, format!("no answer to {asked}")))?
    }

    /// Ends the session (the node unregisters its instances).
    pub fn close(self) {}
}
