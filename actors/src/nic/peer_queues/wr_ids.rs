//! `wr_id`s are unique per QP: the callers' ids are replaced by a per-QP counter on the way in
//! (see `advance`), and these put the callers' ids back into what is reported on the way out.

use std::collections::VecDeque;

use kvferry_transport::{QpError, QueueFault, RcQueueError};

use super::slot::Batch;

/// The caller's id of QP-local id `id`, where a batch still holds it.
pub(super) fn caller_id<B>(batches: &VecDeque<Batch<B>>, id: u64) -> u64 {
    batches
        .iter()
        .find_map(|b| {
            let i = id.checked_sub(b.first)?;
            b.ids.get(usize::try_from(i).ok()?).copied()
        })
        .unwrap_or(id)
}

pub(super) fn caller_fault<B>(f: QueueFault, batches: &VecDeque<Batch<B>>) -> QueueFault {
    let id = |id| caller_id(batches, id);
    match f {
        QueueFault::Completion { wr_id, status } => QueueFault::Completion {
            wr_id: id(wr_id),
            status,
        },
        QueueFault::PostFailed { wr_id } => QueueFault::PostFailed { wr_id: id(wr_id) },
        QueueFault::Timeout { wr_id } => QueueFault::Timeout { wr_id: id(wr_id) },
        QueueFault::ConnectionLost { wr_id } => QueueFault::ConnectionLost { wr_id: id(wr_id) },
        other => other,
    }
}

/// A refusal of a batch that was never queued, naming the caller's `wr_id`.
pub(super) fn caller_error(e: QpError, first: u64, ids: &[u64]) -> QpError {
    let id = |id: u64| {
        id.checked_sub(first)
            .and_then(|i| ids.get(usize::try_from(i).ok()?).copied())
            .unwrap_or(id)
    };
    match e {
        QpError::LocalSegment { qp, wr_id, source } => QpError::LocalSegment {
            qp,
            wr_id: id(wr_id),
            source,
        },
        QpError::LengthMismatch {
            qp,
            wr_id,
            remote_len,
            local_len,
        } => QpError::LengthMismatch {
            qp,
            wr_id: id(wr_id),
            remote_len,
            local_len,
        },
        QpError::Queue { qp, source } => QpError::Queue {
            qp,
            source: match source {
                RcQueueError::TooManySegments {
                    wr_id,
                    sges,
                    max_sge,
                } => RcQueueError::TooManySegments {
                    wr_id: id(wr_id),
                    sges,
                    max_sge,
                },
                RcQueueError::EmptyRequest { wr_id } => {
                    RcQueueError::EmptyRequest { wr_id: id(wr_id) }
                }
                other => other,
            },
        },
        other => other,
    }
}
