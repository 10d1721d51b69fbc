//! The families a node exports, by name, and their HELP lines ([`describe`]).

use ::metrics::{describe_counter, describe_gauge, describe_histogram, Unit};

// Family names. Operators scrape these: they are the names the hand-written renderer used.
pub const LEASES_LIVE: &str = "kvferry_leases_live";
pub const BLOCKS: &str = "kvferry_blocks";
pub const BLOCKS_SEALED: &str = "kvferry_blocks_sealed";
pub const PINNED_BLOCKS: &str = "kvferry_pinned_blocks";
pub const PINS: &str = "kvferry_pins";
pub const POOL_SLOTS: &str = "kvferry_pool_slots";
pub const INSTANCES: &str = "kvferry_instances";
pub const TRANSFERS_IN_FLIGHT: &str = "kvferry_transfers_in_flight";
pub const PEER_PINS: &str = "kvferry_peer_pins";
pub const LEASES_EXPIRED: &str = "kvferry_leases_expired_total";
pub const EVICTIONS: &str = "kvferry_evictions_total";
pub const QUERIES: &str = "kvferry_queries_total";
pub const QUERY_BLOCKS: &str = "kvferry_query_blocks_total";
/// Per namespace (label `namespace`, bounded: see `metrics/namespaces.rs`).
pub const NAMESPACE_QUERY_BLOCKS: &str = "kvferry_namespace_query_blocks_total";
pub const NAMESPACE_RAM_BYTES: &str = "kvferry_namespace_ram_bytes";
pub const NAMESPACE_RAM_QUOTA_BYTES: &str = "kvferry_namespace_ram_quota_bytes";
pub const NAMESPACE_REFUSED: &str = "kvferry_namespace_refused_blocks_total";
pub const NAMESPACE_SSD_BYTES: &str = "kvferry_namespace_ssd_bytes";
pub const NAMESPACE_SSD_QUOTA_BYTES: &str = "kvferry_namespace_ssd_quota_bytes";
pub const NAMESPACE_SSD_REFUSED: &str = "kvferry_namespace_ssd_refused_blocks_total";
pub const ABANDONED: &str = "kvferry_abandoned_total";
pub const DATA_REJECTED: &str = "kvferry_data_rejected_total";
pub const LOADS: &str = "kvferry_loads_total";
pub const BYTES: &str = "kvferry_bytes_total";
pub const STAGE_SECONDS: &str = "kvferry_stage_seconds";
pub const DIRECTORY_OPERATIONS: &str = "kvferry_directory_operations_total";
pub const DIRECTORY_BREAKER_OPEN: &str = "kvferry_directory_breaker_open";
pub const DIRECTORY_BREAKER_TRIPS: &str = "kvferry_directory_breaker_trips_total";
pub const DIRECTORY_LOOKUPS_SKIPPED: &str = "kvferry_directory_lookups_skipped_total";
pub const DIRECTORY_REANNOUNCES: &str = "kvferry_directory_reannounces_total";
pub const DIRECTORY_FAILURES: &str = "kvferry_directory_failures_total";
pub const DIRECTORY_PENDING: &str = "kvferry_directory_pending_updates";
pub const DIRECTORY_CALL_SECONDS: &str = "kvferry_directory_call_seconds";
/// Metric names of the NIC actors.
pub const MR_REGISTRATIONS: &str = "kvferry_mr_registrations_total";
pub const MR_REGISTRATION_FAILURES: &str = "kvferry_mr_registration_failures_total";
pub const MRS_REGISTERED: &str = "kvferry_mrs_registered";
pub const QPS: &str = "kvferry_qps";
pub const COMPLETION_ERRORS: &str = "kvferry_completion_errors_total";
pub const TLS_HANDSHAKE_FAILURES: &str = "kvferry_tls_handshake_failures_total";
pub const TLS_RELOADS: &str = "kvferry_tls_reloads_total";
pub const TLS_CERT_EXPIRY: &str = "kvferry_tls_cert_expiry_seconds";
pub const ENGINE_SESSIONS: &str = "kvferry_engine_sessions";
pub const ENGINE_MEMORY_HANDLES: &str = "kvferry_engine_memory_handles";
pub const ENGINE_LOADS_PENDING: &str = "kvferry_engine_loads_pending";
pub const ENGINE_COMPLETIONS_RETAINED: &str = "kvferry_engine_completions_retained";
pub const ENGINE_COMPLETIONS_DROPPED: &str = "kvferry_engine_completions_dropped_total";
pub const ENGINE_MAILBOXES: &str = "kvferry_engine_mailboxes";
pub const ENGINE_MAILBOX_REQUESTS: &str = "kvferry_engine_mailbox_requests_total";
/// The SSD tier's families (`ssd::SsdStats`).
pub const SSD_BLOCKS: &str = "kvferry_ssd_blocks";
pub const SSD_CAPACITY_BLOCKS: &str = "kvferry_ssd_capacity_blocks";
pub const SSD_HELD_BLOCKS: &str = "kvferry_ssd_held_blocks";
pub const SSD_STAGING_SLOTS: &str = "kvferry_ssd_staging_slots";
pub const SSD_EVICTIONS: &str = "kvferry_ssd_evictions_total";
pub const SSD_WRITES: &str = "kvferry_ssd_writes_total";
pub const SSD_WRITE_BYTES: &str = "kvferry_ssd_write_bytes_total";
pub const SSD_WRITE_ERRORS: &str = "kvferry_ssd_write_errors_total";
pub const SSD_DISK_FULL: &str = "kvferry_ssd_disk_full_total";
pub const SSD_WRITES_SKIPPED: &str = "kvferry_ssd_writes_skipped_total";
pub const SSD_WRITE_BACKLOG_BYTES: &str = "kvferry_ssd_write_backlog_bytes";
pub const SSD_WRITE_BACKLOG_PEAK_BYTES: &str = "kvferry_ssd_write_backlog_peak_bytes";
pub const SSD_WRITE_BACKLOG_LIMIT_BYTES: &str = "kvferry_ssd_write_backlog_limit_bytes";
pub const SSD_READS: &str = "kvferry_ssd_reads_total";
pub const SSD_READ_BYTES: &str = "kvferry_ssd_read_bytes_total";
pub const SSD_READ_ERRORS: &str = "kvferry_ssd_read_errors_total";
pub const SSD_PROMOTE_NO_ROOM: &str = "kvferry_ssd_promote_no_room_total";
pub const SSD_DAMAGED_BLOCKS: &str = "kvferry_ssd_damaged_blocks_total";
pub const SSD_HIT_BLOCKS: &str = "kvferry_ssd_hit_blocks_total";
/// KV events (`events::EventTotals`).
pub const EVENTS_RECORDED: &str = "kvferry_events_total";
pub const EVENTS_DROPPED: &str = "kvferry_events_dropped_total";
pub const EVENTS_PUBLISHED: &str = "kvferry_events_published_total";
pub const EVENTS_REPLAYS: &str = "kvferry_events_replays_total";

/// Describes every family this crate exports to the recorder in effect (one HELP line
/// each; the exporter writes the TYPE from how a family is recorded).
pub fn describe() {
    for (name, help) in [
        (LEASES_LIVE, "Leases not yet consumed, released or expired."),
        (
            BLOCKS,
            "Blocks held in the host pool (sealed or being written).",
        ),
        (BLOCKS_SEALED, "Blocks every TP rank has written."),
        (
            PINNED_BLOCKS,
            "Blocks pinned by leases, transfers or peers.",
        ),
        (PINS, "Pins held on blocks."),
        (POOL_SLOTS, "Slots in the host pool."),
        (INSTANCES, "Registered engine instances."),
        (
            TRANSFERS_IN_FLIGHT,
            "Loads and saves whose copies have not drained.",
        ),
        (PEER_PINS, "Pins this node holds for peers."),
        (
            DIRECTORY_BREAKER_OPEN,
            "1 while the directory's breaker is open or half-open: queries plan without it.",
        ),
        (
            DIRECTORY_PENDING,
            "Block updates queued for the directory and not yet written.",
        ),
        (
            MRS_REGISTERED,
            "Registrations in each nic's MR table (deferred deregistrations included).",
        ),
        (
            QPS,
            "Queue pairs by nic and state (reset, init, rtr, rts, error).",
        ),
        (
            ENGINE_SESSIONS,
            "Open engine sessions (each unregisters its instances when it ends).",
        ),
        (
            ENGINE_MEMORY_HANDLES,
            "Client memory (memfd or DMA-BUF) passed on the fd socket and held.",
        ),
        (
            ENGINE_LOADS_PENDING,
            "Engine loads accepted and not yet completed.",
        ),
        (
            ENGINE_COMPLETIONS_RETAINED,
            "Load completions waiting for a poll.",
        ),
        (
            ENGINE_MAILBOXES,
            "Request mailboxes attached to engine sessions (a node thread each).",
        ),
        (
            TLS_CERT_EXPIRY,
            "Seconds until this node's own TLS certificate expires (its notAfter); negative once \
             it has. Alert well before 0: peers refuse an expired certificate.",
        ),
        (SSD_BLOCKS, "Blocks held on SSD."),
        (SSD_CAPACITY_BLOCKS, "Block slots of the SSD directories."),
        (
            SSD_HELD_BLOCKS,
            "SSD blocks held for leases (not evictable until the lease is gone).",
        ),
        (
            SSD_STAGING_SLOTS,
            "Pool slots lent to loads for their SSD reads.",
        ),
        (
            NAMESPACE_RAM_BYTES,
            "Pool bytes held by each namespace's blocks (whole slots), by namespace (the first \
             tenants.metric-namespaces seen by name, the rest as \"other\").",
        ),
        (
            NAMESPACE_RAM_QUOTA_BYTES,
            "RAM quota of each namespace that has one ([[tenants.quota]]), by namespace.",
        ),
        (
            NAMESPACE_SSD_BYTES,
            "SSD tier bytes held by each namespace's blocks (whole disk slots: the block and \
             its header), by namespace (labelled as the RAM families are).",
        ),
        (
            NAMESPACE_SSD_QUOTA_BYTES,
            "SSD quota of each namespace that has one ([[tenants.quota]] ssd), by namespace.",
        ),
    ] {
        describe_gauge!(name, help);
    }
    for (name, help) in [
        (LEASES_EXPIRED, "Leases removed by expiry."),
        (EVICTIONS, "Blocks evicted from the host pool."),
        (QUERIES, "Queries by result (local, remote, miss)."),
        (
            ABANDONED,
            "Requests whose client gave up before they took effect, by op: saves and puts \
             whose blocks were discarded unsealed, queries whose lease was released.",
        ),
        (
            QUERY_BLOCKS,
            "Queried blocks by where they were found (ram, ssd, remote, miss); they sum to the hashes queried.",
        ),
        (
            NAMESPACE_QUERY_BLOCKS,
            "Queried blocks by namespace and result (hit: found on this node or a peer, miss).",
        ),
        (
            NAMESPACE_REFUSED,
            "Blocks refused for their namespace's RAM quota (all of its blocks pinned, or a \
             quota of 0), by namespace.",
        ),
        (
            NAMESPACE_SSD_REFUSED,
            "SSD writes refused for their namespace's SSD quota (all of its disk blocks busy, \
             or a quota of 0), by namespace.",
        ),
        (
            LOADS,
            "Transfers by path (local, direct, staged, save) and status.",
        ),
        (
            DATA_REJECTED,
            "Connections the tcp data server refused or closed, by reason (bad_hello, \
             hello_timeout, wrong_peer, unknown_link, stale_link, bad_proof, bad_read, banned, \
             busy, tls, tls_timeout: a TLS handshake past the hello deadline).",
        ),
        (DIRECTORY_OPERATIONS, "Directory operations by kind."),
        (
            DIRECTORY_BREAKER_TRIPS,
            "Times the directory's breaker opened.",
        ),
        (
            DIRECTORY_LOOKUPS_SKIPPED,
            "Lookups answered without the directory, its breaker being open.",
        ),
        (
            DIRECTORY_REANNOUNCES,
            "Times this process's nodes re-announced all they hold (after an outage or a restart of the directory).",
        ),
        (
            DIRECTORY_FAILURES,
            "Directory calls that failed or missed their deadline, by op.",
        ),
        (
            MR_REGISTRATIONS,
            "Memory registrations made, by nic and kind (host, device).",
        ),
        (
            MR_REGISTRATION_FAILURES,
            "Memory registrations refused, by nic, kind and reason.",
        ),
        (
            COMPLETION_ERRORS,
            "Reads reported with an error, by nic and completion status (flushes included).",
        ),
        (
            ENGINE_COMPLETIONS_DROPPED,
            "Load completions dropped uncollected, over the retention bound.",
        ),
        (
            ENGINE_MAILBOX_REQUESTS,
            "Query and Load requests served from request mailboxes.",
        ),
        (
            TLS_HANDSHAKE_FAILURES,
            "TLS handshakes that failed or missed their deadline, by listener (engine, peer, \
             data, metrics; peer-client and data-client: this node calling its peers).",
        ),
        (
            TLS_RELOADS,
            "Rereads of the TLS certificate, key and CA, by result (ok, failed: the old ones stay).",
        ),
        (SSD_EVICTIONS, "Blocks evicted from SSD by capacity."),
        (EVENTS_RECORDED, "KV events recorded in the node's event log."),
        (
            EVENTS_DROPPED,
            "KV events the publisher could not send: the ring let them go before it got to them \
             (a PUB socket's drops for one slow subscriber are silent, not counted here).",
        ),
        (EVENTS_PUBLISHED, "KV events sent on the PUB socket."),
        (
            EVENTS_REPLAYS,
            "Replay requests by status (ok, refused: malformed).",
        ),
        (SSD_WRITES, "Blocks written to SSD."),
        (
            SSD_WRITE_ERRORS,
            "SSD block writes that failed (disk full included).",
        ),
        (SSD_DISK_FULL, "SSD block writes refused for lack of space."),
        (
            SSD_WRITES_SKIPPED,
            "SSD block writes not made, by reason: busy (every SSD slot was being read, written or held), backlog (the write backlog was full: a block evicted from RAM that left the node).",
        ),
        (
            SSD_READS,
            "Blocks read from SSD (into staging slots for loads, into RAM for peers).",
        ),
        (
            SSD_READ_ERRORS,
            "SSD block reads that failed with an I/O error.",
        ),
        (
            SSD_PROMOTE_NO_ROOM,
            "Peer pins of SSD-held blocks cut short: no RAM slot to read them into.",
        ),
        (
            SSD_DAMAGED_BLOCKS,
            "Blocks read from SSD that were torn or corrupt (a miss, never served), by damage (header, key, checksum).",
        ),
        (
            SSD_HIT_BLOCKS,
            "Blocks of the local prefix by tier (ram, ssd).",
        ),
    ] {
        describe_counter!(name, help);
    }
    describe_counter!(
        SSD_WRITE_BYTES,
        Unit::Bytes,
        "Bytes written to SSD (headers and padding included)."
    );
    describe_counter!(SSD_READ_BYTES, Unit::Bytes, "Block bytes read from SSD.");
    for (name, help) in [
        (
            SSD_WRITE_BACKLOG_BYTES,
            "Memory held by copies of blocks queued for the SSD directories.",
        ),
        (
            SSD_WRITE_BACKLOG_PEAK_BYTES,
            "The most memory the SSD write backlog ever held.",
        ),
        (
            SSD_WRITE_BACKLOG_LIMIT_BYTES,
            "The SSD write backlog's bound (ssd.write-backlog).",
        ),
    ] {
        describe_gauge!(name, Unit::Bytes, help);
    }
    describe_counter!(
        BYTES,
        Unit::Bytes,
        "Bytes moved by successful transfers, by path."
    );
    describe_histogram!(
        STAGE_SECONDS,
        Unit::Seconds,
        "Seconds per transfer stage (plan, pin, register, post, wire, h2d, d2h, fence)."
    );
    describe_histogram!(
        DIRECTORY_CALL_SECONDS,
        Unit::Seconds,
        "Seconds per directory call (lookup; write: one pipeline), failed ones included."
    );
}
