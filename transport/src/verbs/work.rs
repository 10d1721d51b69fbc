//! Building RDMA READ work requests and reading their completions, as plain data; the FFI layer
//! copies a [`ReadWr`] into an `ibv_send_wr` field for field.

use thiserror::Error;

use super::registration::{KeyMap, RegistrationError, Sge};
use crate::completion::CompletionStatus;
use crate::descriptor::RemoteDescriptor;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WorkError {
    #[error("request {wr_id}: remote range not readable")]
    Remote {
        wr_id: u64,
        #[source]
        source: RegistrationError,
    },
    #[error("request {wr_id}: local destination not registered on this NIC")]
    Local {
        wr_id: u64,
        #[source]
        source: RegistrationError,
    },
    #[error("request {wr_id} needs {sges} SGEs after splitting, the QP takes {max_sge}")]
    TooManySges {
        wr_id: u64,
        sges: usize,
        max_sge: u32,
    },
    #[error("request {wr_id} reads {remote} bytes into {local}")]
    LengthMismatch { wr_id: u64, remote: u64, local: u64 },
    #[error("request {wr_id} reads {len} bytes; the port's max_msg_sz is {max}")]
    TooLong { wr_id: u64, len: u64, max: u64 },
}

/// The largest message the verbs ABI can express in one work request (a 32-bit length); a
/// port's `max_msg_sz` is at most this (2^30 on mlx5).
pub const MAX_READ: u64 = 1 << 31;

/// One signaled `IBV_WR_RDMA_READ`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadWr {
    pub wr_id: u64,
    pub remote_addr: u64,
    pub rkey: u32,
    pub sges: Vec<Sge>,
}

/// Builds the read of `remote` into `local` ranges `(addr, len)`: the remote rkey from the
/// peer's advertised regions, local SGEs split at this NIC's region boundaries; at most
/// `max_msg` bytes (the port's `max_msg_sz`; callers cut longer reads first).
pub fn build_read(
    wr_id: u64,
    remote: &RemoteDescriptor,
    local: &[(u64, u64)],
    remote_keys: &KeyMap,
    local_keys: &KeyMap,
    max_sge: u32,
    max_msg: u64,
) -> Result<ReadWr, WorkError> {
    let max = max_msg.min(MAX_READ);
    if remote.len > max {
        return Err(WorkError::TooLong {
            wr_id,
            len: remote.len,
            max,
        });
    }
    let local_len: u64 = local.iter().map(|r| r.1).sum();
    if local_len != remote.len {
        return Err(WorkError::LengthMismatch {
            wr_id,
            remote: remote.len,
            local: local_len,
        });
    }
    let rkey = remote_keys
        .remote_key(remote.addr, remote.len)
        .map_err(|source| WorkError::Remote { wr_id, source })?;
    let sges = local_keys
        .local_sges(local)
        .map_err(|source| WorkError::Local { wr_id, source })?;
    if sges.len() > max_sge as usize {
        return Err(WorkError::TooManySges {
            wr_id,
            sges: sges.len(),
            max_sge,
        });
    }
    Ok(ReadWr {
        wr_id,
        remote_addr: remote.addr,
        rkey,
        sges,
    })
}

/// `ibv_wc_status` codes (stable ABI values from `verbs.h`).
pub mod wc {
    pub const SUCCESS: u32 = 0;
    pub const LOC_LEN_ERR: u32 = 1;
    pub const LOC_QP_OP_ERR: u32 = 2;
    pub const LOC_PROT_ERR: u32 = 4;
    pub const WR_FLUSH_ERR: u32 = 5;
    pub const LOC_ACCESS_ERR: u32 = 8;
    pub const REM_INV_REQ_ERR: u32 = 9;
    pub const REM_ACCESS_ERR: u32 = 10;
    pub const REM_OP_ERR: u32 = 11;
    pub const RETRY_EXC_ERR: u32 = 12;
    pub const RNR_RETRY_EXC_ERR: u32 = 13;
}

/// Maps a verbs completion status onto the provider-neutral one.
pub fn completion_status(code: u32) -> CompletionStatus {
    match code {
        wc::SUCCESS => CompletionStatus::Success,
        wc::WR_FLUSH_ERR => CompletionStatus::Flushed,
        wc::REM_ACCESS_ERR | wc::REM_INV_REQ_ERR => CompletionStatus::RemoteAccessError,
        wc::LOC_LEN_ERR | wc::LOC_PROT_ERR | wc::LOC_ACCESS_ERR => {
            CompletionStatus::LocalWriteError
        }
        // Retry exhaustion, remote operation errors and the rest: the path or the peer failed.
        _ => CompletionStatus::TransportError,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mr_table::MrKey;
    use crate::verbs::registration::{Chunk, NicKeys};

    fn maps() -> (KeyMap, KeyMap) {
        let mut remote = KeyMap::new();
        remote
            .insert(
                Chunk {
                    addr: 0x1_0000,
                    len: 0x1_0000,
                },
                NicKeys {
                    lkey: 1,
                    rkey: 0xaa,
                },
            )
            .unwrap();
        let mut local = KeyMap::new();
        local
            .insert(
                Chunk {
                    addr: 0x8000,
                    len: 0x1000,
                },
                NicKeys { lkey: 7, rkey: 0 },
            )
            .unwrap();
        local
            .insert(
                Chunk {
                    addr: 0x9000,
                    len: 0x1000,
                },
                NicKeys { lkey: 8, rkey: 0 },
            )
            .unwrap();
        (remote, local)
    }

    fn rd(addr: u64, len: u64) -> RemoteDescriptor {
        RemoteDescriptor {
            addr,
            len,
            rkey: MrKey(1),
        }
    }

    #[test]
    fn builds_scatter_read() {
        let (remote, local) = maps();
        let wr = build_read(
            5,
            &rd(0x1_0100, 0x300),
            &[(0x8f00, 0x200), (0x8000, 0x100)],
            &remote,
            &local,
            4,
            1 << 30,
        )
        .unwrap();
        assert_eq!(wr.rkey, 0xaa);
        assert_eq!(wr.remote_addr, 0x1_0100);
        let lens: Vec<_> = wr.sges.iter().map(|s| (s.addr, s.len, s.lkey)).collect();
        assert_eq!(
            lens,
            vec![(0x8f00, 0x100, 7), (0x9000, 0x100, 8), (0x8000, 0x100, 7)]
        );
        assert!(matches!(
            build_read(
                5,
                &rd(0x1_0100, 0x300),
                &[(0x8f00, 0x200), (0x8000, 0x100)],
                &remote,
                &local,
                2,
                1 << 30
            ),
            Err(WorkError::TooManySges { sges: 3, .. })
        ));
        assert!(matches!(
            build_read(
                5,
                &rd(0x1_0100, 0x300),
                &[(0x8000, 0x100)],
                &remote,
                &local,
                4,
                1 << 30
            ),
            Err(WorkError::LengthMismatch { .. })
        ));
        assert!(matches!(
            build_read(
                5,
                &rd(0x1_ff00, 0x200),
                &[(0x8000, 0x200)],
                &remote,
                &local,
                4,
                1 << 30
            ),
            Err(WorkError::Remote { .. })
        ));
        assert!(matches!(
            build_read(
                5,
                &rd(0x1_0000, 0x10),
                &[(0xa000, 0x10)],
                &remote,
                &local,
                4,
                1 << 30
            ),
            Err(WorkError::Local { .. })
        ));
    }

    /// The SGEs of a posted read are the MR-table-checked destination ranges, keyed by the
    /// NIC registrations covering them (split registrations split the SGE), with no bounce.
    #[test]
    fn reads_land_in_the_destination_not_a_staging_buffer() {
        use crate::descriptor::LocalSegment;
        use crate::mr_table::{Access, MrTable};
        use crate::region::HostRegion;
        use crate::scatter::Scatter;
        use crate::verbs::registration::split;
        use std::sync::Arc;

        let table = MrTable::new();
        let dst = Arc::new(HostRegion::anonymous(4 * 4096).unwrap());
        let h = table
            .register_host(dst.clone(), Access::LOCAL_WRITE)
            .unwrap();
        // The same region registered on the NIC, split into 4 KiB MRs.
        let mut nic = KeyMap::new();
        for (i, c) in split(dst.addr(), 4 * 4096, 4096)
            .unwrap()
            .into_iter()
            .enumerate()
        {
            let k = 10 + i as u32;
            nic.insert(c, NicKeys { lkey: k, rkey: 0 }).unwrap();
        }
        let (remote, _) = maps();
        let segs = [
            LocalSegment {
                lkey: h.key(),
                addr: dst.addr() + 4000,
                len: 200,
            },
            LocalSegment {
                lkey: h.key(),
                addr: dst.addr() + 3 * 4096,
                len: 56,
            },
        ];
        let scatter = Scatter::resolve(&table, &segs).unwrap();
        let wr = build_read(
            9,
            &rd(0x1_0000, 256),
            &scatter.ranges(),
            &remote,
            &nic,
            4,
            1 << 30,
        )
        .unwrap();
        let sges: Vec<_> = wr.sges.iter().map(|s| (s.addr, s.len, s.lkey)).collect();
        assert_eq!(
            sges,
            vec![
                (dst.addr() + 4000, 96, 10),
                (dst.addr() + 4096, 104, 11),
                (dst.addr() + 3 * 4096, 56, 13),
            ]
        );
        // A destination the MR table accepts but this NIC has not registered is refused:
        // the read is not staged elsewhere.
        let other = Arc::new(HostRegion::anonymous(4096).unwrap());
        let oh = table
            .register_host(other.clone(), Access::LOCAL_WRITE)
            .unwrap();
        let scatter = Scatter::resolve(
            &table,
            &[LocalSegment {
                lkey: oh.key(),
                addr: other.addr(),
                len: 256,
            }],
        )
        .unwrap();
        assert!(matches!(
            build_read(
                10,
                &rd(0x1_0000, 256),
                &scatter.ranges(),
                &remote,
                &nic,
                4,
                1 << 30
            ),
            Err(WorkError::Local { wr_id: 10, .. })
        ));
    }

    #[test]
    fn reads_longer_than_max_msg_sz_are_refused() {
        let (remote, local) = maps();
        let e = build_read(
            3,
            &rd(0x1_0000, 0x200),
            &[(0x8000, 0x200)],
            &remote,
            &local,
            4,
            0x100,
        )
        .unwrap_err();
        assert_eq!(
            e,
            WorkError::TooLong {
                wr_id: 3,
                len: 0x200,
                max: 0x100
            }
        );
    }

    #[test]
    fn statuses() {
        assert_eq!(completion_status(wc::SUCCESS), CompletionStatus::Success);
        assert_eq!(
            completion_status(wc::WR_FLUSH_ERR),
            CompletionStatus::Flushed
        );
        assert_eq!(
            completion_status(wc::REM_ACCESS_ERR),
            CompletionStatus::RemoteAccessError
        );
        assert_eq!(
            completion_status(wc::LOC_PROT_ERR),
            CompletionStatus::LocalWriteError
        );
        assert_eq!(
            completion_status(wc::RETRY_EXC_ERR),
            CompletionStatus::TransportError
        );
        assert_eq!(completion_status(99), CompletionStatus::TransportError);
    }
}
