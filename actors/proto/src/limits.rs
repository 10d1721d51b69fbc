//! What this build speaks and the limits it advertises: protocol revisions, capabilities
//! and the most one request may carry. Both sides read them from here, so a limit the node
//! enforces is the one a client is told about.

/// The peer protocol revision this build speaks. 2: a tcp Handshake grants a data link, and
/// the data port (wire version 2) serves only connections that prove one, so a node of
/// revision 1 is told at Hello rather than failing on the data port.
pub const PROTOCOL: u32 = 2;

/// What this build can do for peers, announced in Hello.
pub const CAPABILITIES: &[&str] = &["pin-blocks", "pin-ttl", "unpin"];

/// Most hashes accepted in one PinBlocks request; more: RESOURCE_EXHAUSTED.
pub const MAX_PIN_HASHES: usize = 4096;

/// Largest Peer request decoded (4096 hashes of 32 bytes with framing fit well inside it);
/// larger: RESOURCE_EXHAUSTED.
pub const MAX_PEER_REQUEST_BYTES: usize = 256 << 10;

/// The kvferry release of this build.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The engine protocol revision this build speaks. 2: a registration may spread a rank's KV
/// over many memory regions (`RegisterInstanceRequest.regions`), and cross-layer groups are
/// accepted. Protocol 1 requests (one memory handle or CUDA IPC handle) are still served.
/// 3: completion boards (`RegisterInstanceRequest.completion_board`, `LoadRequest.board_slot`):
/// a load's layers and end visible in shared memory; older requests are served unchanged.
/// 4: `QueryRequest.packed_hashes`: a query's hashes in one field; the repeated form is still
/// served. 5: request mailboxes (`SessionRequest.mailbox`): Query, Load and Save through shared
/// memory beside the calls. 6: fences (`fence_ns` in Save, PutBlocks and Query, see
/// [`crate::fence`]) and `CapabilitiesResponse.monotonic_ns`; requests without one are served
/// as before. 7: one way a load's outcome reaches the engine — the board's final word, or
/// `PollLoad` (which may now wait, `PollLoadRequest.wait_ms`); the `Completions` stream is
/// gone. 8: `LoadRequest.per_layer`: a load whose local prefix lands layer by layer. 9:
/// `tenant` in Query and Save: a tenant's blocks in a namespace of their own; `CancelLoad`.
pub const ENGINE_PROTOCOL: u32 = 9;

// Limits on what one engine request carries, advertised in `Capabilities`; a request over
// one is refused with RESOURCE_EXHAUSTED before it reaches the node, so the work one request
// causes is bounded. The message as a whole is bounded by `engine.max-message-bytes`.

/// Most memory regions in one registration (one per layer and K/V plane at most).
pub const MAX_ENGINE_REGIONS: usize = 2 * MAX_ENGINE_LAYERS as usize;

/// Most layers of a registered KV shape and layout.
pub const MAX_ENGINE_LAYERS: u32 = kvferry_gpu::KvLayout::MAX_LAYERS;

/// Most hashes in one engine request (Query, Save, PutBlocks).
pub const MAX_ENGINE_HASHES: usize = 4096;

/// Most hashes in one Lookup (it pins nothing and answers with counts, so it takes more
/// than a Query; a router asks about a long prompt at once).
pub const MAX_LOOKUP_HASHES: usize = 65_536;

/// Most tenants (Query and Save `tenant`) one node keeps apart: each is a namespace with its
/// own use, quota and metric label, kept while the node runs.
pub const MAX_TENANTS: usize = 4096;

/// Most block indices in one engine request (Load's destinations, Save's sources).
pub const MAX_ENGINE_BLOCKS: usize = MAX_ENGINE_HASHES;

/// Longest wait one PollLoad takes, in ms (a client waiting longer polls again).
pub const MAX_POLL_WAIT_MS: u32 = 10_000;

/// Most request mailboxes attached on one node at once (a node thread each).
pub const MAX_ENGINE_MAILBOXES: usize = 64;

/// Longest block hash, in bytes (and 1 at least).
pub const MAX_HASH_BYTES: usize = crate::model::MAX_HASH_LEN;
