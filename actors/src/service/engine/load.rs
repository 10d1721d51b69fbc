//! Query, Load, Release and the load results: a lease handed over only to a client still
//! waiting, loads accepted at once with an id, and their results reported into the
//! completion book (PollLoad, which may wait for them) and the client's completion board.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tonic::{Request, Response, Status};

use crate::api;
use crate::fence::Fence;
use crate::service::engine::completions::LoadState;
use crate::service::engine::request::{self as check, status};
use crate::service::engine::service::EngineService;
use crate::service::engine::shared::Shared;
use kvferry_proto::shm::board::{Board, BoardError, Outcome};
use kvferry_proto::v1::*;
use kvferry_proto::MAX_POLL_WAIT_MS;

/// Loads accepted and not yet completed, per instance rank.
const MAX_RUNNING_PER_RANK: usize = 4096;

impl EngineService {
    /// Queries on a task of its own and hands the answer over; a lease nobody takes is
    /// released. The handler's future may be dropped at any await (the service's timeout, a
    /// mailbox thread's deadline, a client gone): a lease granted meanwhile must not stay
    /// until its TTL. An answer that would leave after `fence` releases its lease too: the
    /// client has stopped waiting for it.
    async fn lease_handed_over(
        &self,
        req: api::QueryRequest,
        fence: Fence,
    ) -> Result<api::QueryResponse, Status> {
        const M: &str = "Query";
        let node = self.shared.node.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let r = node.query_fenced(req, Some(fence)).await;
            let late = match tx.send(r) {
                Ok(()) => return,
                Err(r) => r,
            };
            if let Ok(api::QueryResponse {
                lease: Some(lease),
                local_blocks,
                remote_blocks,
                ..
            }) = late
            {
                // Released already (the instance went) is fine.
                let _ = node.release(lease).await;
                node.counters()
                    .abandoned("query", local_blocks + remote_blocks, Duration::ZERO);
            }
        });
        let q = rx
            .await
            .map_err(|_| status(M, crate::NodeError::Stopped { what: "query" }))?
            .map_err(|e| status(M, e))?;
        let now = crate::fence::monotonic_ns();
        if fence.passed_at(now) {
            if let Some(lease) = q.lease {
                let _ = self.shared.node.release(lease).await;
            }
            let late = fence.late_by(now);
            self.shared
                .node
                .counters()
                .abandoned("query", q.hit_blocks(), late);
            return Err(status(
                M,
                crate::NodeError::DeadlinePassed {
                    what: "Query",
                    late,
                },
            ));
        }
        Ok(q)
    }

    pub(super) async fn handle_query(
        &self,
        req: Request<QueryRequest>,
    ) -> Result<Response<QueryResponse>, Status> {
        const M: &str = "Query";
        let r = req.into_inner();
        let instance = check::instance(M, &r.instance)?;
        let hashes = check::query_hashes(M, &r.hashes, &r.packed_hashes, r.hash_len)?;
        let fence = self.fence(r.fence_ns);
        let req = api::QueryRequest {
            instance,
            hashes,
            direct_gpu: r.direct_gpu,
            tenant: (!r.tenant.is_empty()).then_some(r.tenant),
        };
        let q = self.lease_handed_over(req, fence).await?;
        let (direct, direct_reason) = match q.direct {
            api::DirectGrant::NotRequested => (DirectGrant::DirectNotRequested, String::new()),
            api::DirectGrant::Granted => (DirectGrant::DirectGranted, String::new()),
            api::DirectGrant::Refused { reason } => (DirectGrant::DirectRefused, reason),
        };
        Ok(Response::new(QueryResponse {
            lease: q.lease.map(|l| l.to_hex()).unwrap_or_default(),
            namespace: q.namespace.to_string(),
            local_blocks: q.local_blocks as u32,
            remote_blocks: q.remote_blocks as u32,
            direct: direct as i32,
            direct_reason,
            ssd_blocks: q.ssd_blocks as u32,
        }))
    }

    pub(super) async fn handle_load(
        &self,
        req: Request<LoadRequest>,
    ) -> Result<Response<LoadResponse>, Status> {
        const M: &str = "Load";
        let r = req.into_inner();
        let lease = check::lease(M, &r.lease)?;
        let instance = check::instance(M, &r.instance)?;
        check::blocks(M, "destination blocks", &r.dest_blocks)?;
        let key = (instance.clone(), r.rank);
        if self.shared.book().running_for(&key) >= MAX_RUNNING_PER_RANK {
            return Err(Status::resource_exhausted(format!(
                "{M}: {MAX_RUNNING_PER_RANK} loads of {instance} rank {} are still running",
                r.rank
            )));
        }
        let board = match r.board_slot {
            None => None,
            Some(slot) => {
                let (board, layers) = self.shared.boards().get(&key).cloned().ok_or_else(|| {
                    Status::failed_precondition(format!(
                        "{M}: {instance} rank {} registered no completion board; register \
                         with one to name a board slot",
                        r.rank
                    ))
                })?;
                board
                    .begin(slot, r.board_tag, layers)
                    .map_err(|e| match e {
                        BoardError::SlotRange { .. } => {
                            Status::invalid_argument(format!("{M}: completion board: {e}"))
                        }
                        _ => Status::failed_precondition(format!("{M}: completion board: {e}")),
                    })?;
                Some((board, slot, r.board_tag))
            }
        };
        let load = api::LoadRequest {
            lease,
            instance,
            rank: r.rank,
            dest_blocks: r.dest_blocks,
            per_layer: r.per_layer,
        };
        // The id first: the watch reports into the book from the node's thread, and a small
        // load may end before `start_load_observed` returns.
        let (load_id, cancel) = {
            let mut book = self.shared.book();
            let id = book.begin(key);
            (id, book.cancel_flag(id))
        };
        let watch = Arc::new(LoadWatch {
            shared: Arc::clone(&self.shared),
            load_id,
            req: load.clone(),
            board,
            reported: AtomicBool::new(false),
            cancel,
        });
        let observer: Arc<dyn api::LoadObserver> = watch.clone();
        let fence = self.fence(r.fence_ns);
        let rx = match self
            .shared
            .node
            .start_load_fenced(load, observer, Some(fence))
            .await
        {
            Ok(rx) => rx,
            Err(e) => {
                // Refused: no result to keep, and the slot must not stay "running".
                self.shared.book().abandon(load_id);
                if let Some((b, slot, tag)) = &watch.board {
                    let blocks = u32::try_from(watch.req.dest_blocks.len()).unwrap_or(u32::MAX);
                    b.finish(*slot, *tag, Outcome::Failed { blocks });
                }
                return Err(status(M, e));
            }
        };
        tokio::spawn(async move {
            // The watch has reported unless the transfer ended without a report.
            let r = rx.await.map_err(|_| ());
            watch.report(r.as_ref().map_err(|_| ()));
        });
        Ok(Response::new(LoadResponse { load_id }))
    }

    /// Asks a running load to stop (see [`api::LoadObserver::cancelled`]); its end reaches
    /// the board and PollLoad as any load's does.
    pub(super) async fn handle_cancel_load(
        &self,
        req: Request<CancelLoadRequest>,
    ) -> Result<Response<CancelLoadResponse>, Status> {
        const M: &str = "CancelLoad";
        let r = req.into_inner();
        let instance = check::instance(M, &r.instance)?;
        let running = self.shared.book().cancel(r.load_id, &(instance, r.rank));
        Ok(Response::new(CancelLoadResponse { running }))
    }

    pub(super) async fn handle_release(
        &self,
        req: Request<ReleaseRequest>,
    ) -> Result<Response<ReleaseResponse>, Status> {
        const M: &str = "Release";
        let lease = check::lease(M, &req.into_inner().lease)?;
        self.shared
            .node
            .release(lease)
            .await
            .map_err(|e| status(M, e))?;
        Ok(Response::new(ReleaseResponse {}))
    }

    /// Where a load stands; with `wait_ms`, answers when it ends (or its instance's results
    /// are dropped, or the node stops) or the wait is over, whichever comes first. The wait
    /// stays inside the service's call timeout.
    pub(super) async fn handle_poll_load(
        &self,
        req: Request<PollLoadRequest>,
    ) -> Result<Response<PollLoadResponse>, Status> {
        const M: &str = "PollLoad";
        let r = req.into_inner();
        if r.wait_ms > MAX_POLL_WAIT_MS {
            return Err(Status::resource_exhausted(format!(
                "{M}: wait_ms {} is over {MAX_POLL_WAIT_MS} (Capabilities.max_poll_wait_ms)",
                r.wait_ms
            )));
        }
        let most = self.shared.options.call_timeout.mul_f64(0.75);
        let until = tokio::time::Instant::now() + Duration::from_millis(r.wait_ms.into()).min(most);
        let mut stop = self.shared.stop.clone();
        let id = r.load_id;
        loop {
            // Registered before the look, so a result booked in between still wakes it.
            let ended = self.shared.ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            match self.shared.book().poll(id) {
                LoadState::Running => {}
                LoadState::Done(c) => {
                    return Ok(Response::new(PollLoadResponse {
                        completion: Some(c),
                        pending: false,
                    }))
                }
                LoadState::Unknown => {
                    return Err(Status::not_found(format!(
                        "{M}: load {id} is unknown, already delivered, or dropped"
                    )))
                }
            }
            if *stop.borrow() || tokio::time::Instant::now() >= until {
                return Ok(Response::new(PollLoadResponse {
                    completion: None,
                    pending: true,
                }));
            }
            tokio::select! {
                _ = ended => {}
                _ = tokio::time::sleep_until(until) => {}
                _ = stop.changed() => {}
            }
        }
    }
}

/// Reports one load of the Engine API as it lands: its layers into its completion board
/// slot, and its end into the completion book (for PollLoad and the stream) and then the
/// board, from the node's thread as the transfer ends.
struct LoadWatch {
    shared: Arc<Shared>,
    load_id: u64,
    req: api::LoadRequest,
    board: Option<(Arc<Board>, u32, u32)>,
    reported: AtomicBool,
    /// Set by CancelLoad; the transfer reads it before each batch.
    cancel: Arc<AtomicBool>,
}

impl LoadWatch {
    /// Books the result, then shows it on the board; once, whoever comes first.
    fn report(&self, r: Result<&Result<api::TransferReport, crate::NodeError>, ()>) {
        if self.reported.swap(true, Ordering::AcqRel) {
            return;
        }
        let c = completion(self.load_id, &self.req, r);
        let outcome = if c.status == LoadStatus::LoadOk as i32 {
            Outcome::Ok
        } else {
            Outcome::Failed {
                blocks: u32::try_from(c.failed_blocks.len()).unwrap_or(u32::MAX),
            }
        };
        // The board's ok is the delivery: that result stays in the book only for details.
        let shown = self.board.is_some() && outcome == Outcome::Ok;
        self.shared.book().finish(c, shown);
        self.shared.ended.notify_waiters();
        // After the book: a client woken by the board finds the details in PollLoad.
        if let Some((b, slot, tag)) = &self.board {
            b.finish(*slot, *tag, outcome);
        }
    }
}

impl api::LoadObserver for LoadWatch {
    fn layers_landed(&self, layers: u32, _total: u32) {
        if let Some((b, slot, tag)) = &self.board {
            b.layers(*slot, *tag, layers);
        }
    }

    fn finished(&self, result: &Result<api::TransferReport, crate::NodeError>) {
        self.report(Ok(result));
    }

    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Acquire)
    }
}

fn completion(
    load_id: u64,
    req: &api::LoadRequest,
    r: Result<&Result<api::TransferReport, crate::NodeError>, ()>,
) -> LoadCompletion {
    let mut c = LoadCompletion {
        load_id,
        instance: req.instance.as_str().to_owned(),
        rank: req.rank,
        ..Default::default()
    };
    match r {
        Ok(Ok(rep)) => {
            c.status = LoadStatus::LoadOk as i32;
            c.bytes = rep.bytes;
            c.blocks = rep.blocks as u32;
            c.path = rep.path.as_str().to_owned();
            c.seconds = rep.seconds;
            c.stages = rep
                .stages
                .iter()
                .map(|s| StageSeconds {
                    name: s.name.as_str().to_owned(),
                    seconds: s.seconds,
                })
                .collect();
        }
        Ok(Err(e)) => {
            c.status = LoadStatus::LoadFailed as i32;
            c.error_kind = check::error_kind(e).to_owned();
            c.error = e.to_string();
            c.failed_blocks = req.dest_blocks.clone();
        }
        Err(()) => {
            c.status = LoadStatus::LoadFailed as i32;
            c.error_kind = "stopped".into();
            c.error = "the transfer ended without a report (the node is stopping)".into();
            c.failed_blocks = req.dest_blocks.clone();
        }
    }
    c
}
