//! The completion stream: loads of one instance rank, as the node reports them ending.

use std::time::Duration;

use crate::error::EngineClientError;
use tonic::{Code, Streaming};

use kvferry_proto::v1::*;

/// Completed loads of one instance rank, as the node delivers them.
pub struct CompletionStream {
    pub(crate) stream: Streaming<LoadCompletion>,
    /// Completions that arrived while waiting for another one.
    pub(crate) early: Vec<LoadCompletion>,
    pub(crate) addr: String,
}

impl std::fmt::Debug for CompletionStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionStream")
            .field("addr", &self.addr)
            .field("early", &self.early.len())
            .finish()
    }
}

impl CompletionStream {
    /// The next completion; `None` when the node ended the stream.
    pub async fn next(&mut self) -> Result<Option<LoadCompletion>, EngineClientError> {
        if !self.early.is_empty() {
            return Ok(Some(self.early.remove(0)));
        }
        self.stream
            .message()
            .await
            .map_err(|s| EngineClientError::Call {
                addr: self.addr.clone(),
                method: "Completions",
                code: s.code(),
                message: s.message().to_owned(),
            })
    }

    /// Waits up to `timeout` for the completion of `load_id`, keeping the others for
    /// [`Self::next`].
    pub async fn wait_for(
        &mut self,
        load_id: u64,
        timeout: Duration,
    ) -> Result<LoadCompletion, EngineClientError> {
        if let Some(i) = self.early.iter().position(|c| c.load_id == load_id) {
            return Ok(self.early.remove(i));
        }
        let wait = async {
            loop {
                match self.stream.message().await {
                    Ok(Some(c)) if c.load_id == load_id => return Ok(c),
                    Ok(Some(c)) => self.early.push(c),
                    Ok(None) => {
                        return Err(EngineClientError::Call {
                            addr: self.addr.clone(),
                            method: "Completions",
                            code: Code::Unavailable,
                            message: "the node ended the stream".into(),
                        });
                    }
                    Err(s) => {
                        return Err(EngineClientError::Call {
                            addr: self.addr.clone(),
                            method: "Completions",
                            code: s.code(),
                            message: s.message().to_owned(),
                        });
                    }
                }
            }
        };
        tokio::time::timeout(timeout, wait)
            .await
            .map_err(|_| EngineClientError::WaitTimeout {
                load_id,
                after: timeout,
            })?
    }
}
