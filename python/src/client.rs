//! `kvferry.EngineClient`: one connection to a node's engine service. Each method converts
//! its arguments, then waits for the Rust client on this object's runtime with the GIL
//! released, so other Python threads (an engine's scheduler) run meanwhile.

use std::future::Future;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_client::proto::api;
use kvferry_client::proto::shm::board::Board;
use kvferry_client::proto::InstanceId;
use kvferry_client::KvFd;
use kvferry_client::{EngineClient as RustClient, EngineClientError, RegisterRegions};
use kvferry_client::{LoadOptions, Registration};
use kvferry_gpu::KvShape;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use tokio::runtime::Runtime;

use crate::board::CompletionBoard;
use crate::session::Session;
use crate::{convert, errors};

/// Deadline of every call unless the constructor says otherwise.
pub const DEFAULT_DEADLINE_S: f64 = 10.0;

/// Longest a `wait_load` stays away from Python, so Ctrl-C interrupts it.
const SIGNAL_CHECK: Duration = Duration::from_millis(200);

/// A client of one node's engine service (`kvferry.v1.Engine`).
#[pyclass(module = "kvferry._native", frozen)]
pub struct EngineClient {
    /// Shared with the sessions this client opened: their streams live on it.
    rt: Arc<Runtime>,
    inner: RustClient,
    addr: String,
    /// The process that made the runtime: its threads do not survive a fork.
    pid: u32,
}

/// A deadline from Python seconds: positive and finite.
pub(crate) fn seconds(py: Python<'_>, what: &str, s: f64) -> PyResult<Duration> {
    match Duration::try_from_secs_f64(s) {
        Ok(d) if !d.is_zero() => Ok(d),
        _ => Err(errors::invalid(
            py,
            "EngineClient",
            format!("{what} must be a positive number of seconds, got {s}"),
        )),
    }
}

/// A descriptor of our own for Python's `fd`, so a Python thread closing `fd` meanwhile
/// cannot make us send whatever file reuses the number.
fn own_fd(py: Python<'_>, method: &str, fd: i32) -> PyResult<OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC reads no memory; an fd that is not open fails with EBADF.
    let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        let e = std::io::Error::last_os_error();
        return Err(errors::invalid(py, method, format!("fd {fd}: {e}")));
    }
    // SAFETY: `dup` is a descriptor fcntl just created for us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(dup) })
}

/// What every `send_*` of an fd checks first: the instance it is for, and the caller's fd,
/// duplicated so that it stays theirs.
fn instance_and_fd(
    py: Python<'_>,
    method: &str,
    instance: &str,
    fd: i32,
) -> PyResult<(InstanceId, OwnedFd)> {
    Ok((
        convert::instance(py, method, instance)?,
        own_fd(py, method, fd)?,
    ))
}

impl EngineClient {
    /// Runs `fut` on the runtime with the GIL released.
    fn wait<T, F>(&self, py: Python<'_>, method: &str, fut: F) -> PyResult<T>
    where
        T: Send,
        F: Future<Output = Result<T, EngineClientError>> + Send,
    {
        self.check_process(py, method)?;
        let rt = &self.rt;
        py.detach(|| rt.block_on(fut))
            .map_err(|e| errors::client(py, method, &e))
    }

    /// A client copied into a forked child would wait forever on runtime threads that
    /// stayed in the parent.
    fn check_process(&self, py: Python<'_>, method: &str) -> PyResult<()> {
        if std::process::id() == self.pid {
            return Ok(());
        }
        Err(errors::precondition(
            py,
            method,
            "this client was made in another process (before a fork): make one in this process",
        ))
    }
}

#[pymethods]
impl EngineClient {
    /// Connects to the engine service at `addr` ("host:port"). `token`: the node's engine
    /// token; `deadline_s`: of every call; `fd_socket`: the node's fd socket path where it
    /// differs from what the node announces (another mount namespace). `tls_ca`: the PEM
    /// file of the CA that signed the node's certificate, for a node whose engine listener
    /// speaks TLS; `tls_server_name`: the name that certificate carries (default: the
    /// address's host); `tls_cert` and `tls_key`: a client certificate to present.
    #[new]
    #[pyo3(signature = (addr, token=None, deadline_s=DEFAULT_DEADLINE_S, connect_timeout_s=5.0, fd_socket=None, *, tls_ca=None, tls_server_name=None, tls_cert=None, tls_key=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        addr: String,
        token: Option<String>,
        deadline_s: f64,
        connect_timeout_s: f64,
        fd_socket: Option<PathBuf>,
        tls_ca: Option<PathBuf>,
        tls_server_name: Option<String>,
        tls_cert: Option<PathBuf>,
        tls_key: Option<PathBuf>,
    ) -> PyResult<Self> {
        let tls = match (&tls_ca, &tls_cert, &tls_key) {
            (None, None, None) => None,
            (None, _, _) => {
                return Err(pyo3::exceptions::PyValueError::new_err(
                    "tls_cert and tls_key need tls_ca (the CA of the node's certificate)",
                ))
            }
            (Some(_), Some(_), None) | (Some(_), None, Some(_)) => {
                return Err(pyo3::exceptions::PyValueError::new_err(
                    "tls_cert and tls_key go together",
                ))
            }
            (Some(ca), cert, key) => {
                let identity = cert.as_deref().zip(key.as_deref());
                let name = tls_server_name.as_deref().unwrap_or("");
                Some(
                    kvferry_client::EngineTls::from_files(ca, name, identity).map_err(|e| {
                        pyo3::exceptions::PyOSError::new_err(format!("kvferry TLS files: {e}"))
                    })?,
                )
            }
        };
        let deadline = seconds(py, "deadline_s", deadline_s)?;
        let connect_timeout = seconds(py, "connect_timeout_s", connect_timeout_s)?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvferry-client")
            .enable_all()
            .build()
            .map_err(|e| {
                pyo3::exceptions::PyOSError::new_err(format!("kvferry client runtime: {e}"))
            })?;
        let token = token.unwrap_or_default();
        // The Rust client bounds a connect by its own default deadline; this bounds it by
        // `connect_timeout_s`, so a host that drops packets costs no more than that.
        let connect = |fd: Option<PathBuf>| {
            let (addr, token, tls) = (addr.clone(), token.clone(), tls.clone());
            async move {
                let connecting = RustClient::connect_tls(&addr, fd, token, tls.as_ref());
                match tokio::time::timeout(connect_timeout, connecting).await {
                    Ok(c) => Ok(c?.with_deadline(deadline)),
                    Err(_) => Err(EngineClientError::ConnectTimeout {
                        addr,
                        after: connect_timeout,
                    }),
                }
            }
        };
        let connected = async {
            let first = connect(fd_socket.clone()).await?;
            if fd_socket.is_some() {
                return Ok(first);
            }
            // The fd socket's path comes from the node; the Rust client takes it when
            // connecting, so a node that serves one is connected to again with it.
            let caps = first.capabilities().await?;
            if caps.fd_socket.is_empty() {
                return Ok(first);
            }
            connect(Some(caps.fd_socket.into())).await
        };
        let inner = py
            .detach(|| rt.block_on(connected))
            .map_err(|e| errors::client(py, "EngineClient", &e))?;
        Ok(Self {
            rt: Arc::new(rt),
            inner,
            addr,
            pid: std::process::id(),
        })
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let addr = pyo3::types::PyString::new(py, &self.addr).repr()?;
        Ok(format!("EngineClient({addr})"))
    }

    #[getter]
    fn addr(&self) -> &str {
        &self.addr
    }

    /// Every field of the node's CapabilitiesResponse.
    fn capabilities<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.wait(py, "capabilities", self.inner.capabilities())?;
        convert::capabilities(py, c)
    }

    /// Whether the node's actors answer (raises where the node cannot be reached).
    fn health(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(self.wait(py, "health", self.inner.health())?.serving)
    }

    /// `[(node_id, blocks)]`: the longest prefix of `hashes` each node holds, longest first.
    fn lookup(
        &self,
        py: Python<'_>,
        namespace: &str,
        hashes: Vec<Vec<u8>>,
    ) -> PyResult<Vec<(String, u32)>> {
        let r = self.wait(py, "lookup", self.inner.lookup(namespace, &hashes))?;
        Ok(r.nodes.into_iter().map(|n| (n.node_id, n.blocks)).collect())
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.wait(py, "stats", self.inner.stats())?;
        convert::stats(py, s)
    }

    /// Sends `length` bytes of host KV in memfd `fd` (created with MFD_ALLOW_SEALING) for
    /// `instance` rank `rank` on node device `device`; returns the memory handle.
    fn send_memfd(
        &self,
        py: Python<'_>,
        instance: &str,
        rank: u32,
        device: u32,
        fd: i32,
        length: u64,
    ) -> PyResult<u64> {
        self.send_kv_fd(
            py,
            "send_memfd",
            instance,
            (rank, device),
            fd,
            KvFd::Memfd { len: length },
        )
    }

    /// Sends a DMA-BUF `fd` of GPU KV covering `[base, base + length)` as the node addresses
    /// it; returns the memory handle (a `("handle", h)` region).
    #[allow(clippy::too_many_arguments)]
    fn send_dmabuf(
        &self,
        py: Python<'_>,
        instance: &str,
        rank: u32,
        device: u32,
        fd: i32,
        base: u64,
        length: u64,
    ) -> PyResult<u64> {
        self.send_kv_fd(
            py,
            "send_dmabuf",
            instance,
            (rank, device),
            fd,
            KvFd::Dmabuf { base, len: length },
        )
    }

    /// Sends the POSIX fd of a VMM allocation of GPU KV (`cuMemExportToShareableHandle`),
    /// `length` bytes (the whole mapping); the node maps it on `device`. The fd stays the
    /// caller's. Returns the memory handle (a `("handle", h)` region, offsets from byte 0).
    fn send_vmm(
        &self,
        py: Python<'_>,
        instance: &str,
        rank: u32,
        device: u32,
        fd: i32,
        length: u64,
    ) -> PyResult<u64> {
        self.send_kv_fd(
            py,
            "send_vmm",
            instance,
            (rank, device),
            fd,
            KvFd::Vmm { len: length },
        )
    }

    /// Creates a completion board of `slots` slots for `instance` rank `rank` and sends it
    /// to the node (protocol 3); pass it to `register(..., board=)`, then name its slots in
    /// `load(..., board_slot=, board_tag=)`.
    #[pyo3(signature = (instance, rank, slots=256))]
    fn open_board(
        &self,
        py: Python<'_>,
        instance: &str,
        rank: u32,
        slots: u32,
    ) -> PyResult<CompletionBoard> {
        const M: &str = "open_board";
        let id = convert::instance(py, M, instance)?;
        let board = Board::create(slots).map_err(|e| errors::invalid(py, M, e.to_string()))?;
        let board = Arc::new(board);
        let handle = self.wait(py, M, self.inner.send_board(&id, rank, &board))?;
        Ok(CompletionBoard { board, handle })
    }

    /// Registers one rank whose KV is spread over `regions`; `planes` give each layer's
    /// placement in them; `board` (from `open_board`) receives the progress of loads that
    /// name its slots. Returns the namespace.
    #[pyo3(signature = (instance, model, dtype, *, layers, tp_size, segments, segment_bytes, rank, device, kind="attention", block_stride, num_blocks, regions, planes, board=None))]
    #[allow(clippy::too_many_arguments)]
    fn register(
        &self,
        py: Python<'_>,
        instance: &str,
        model: String,
        dtype: String,
        layers: u32,
        tp_size: u32,
        segments: u32,
        segment_bytes: u64,
        rank: u32,
        device: u32,
        kind: &str,
        block_stride: u64,
        num_blocks: u32,
        regions: Vec<(String, Bound<'_, PyAny>)>,
        planes: Vec<Bound<'_, PyAny>>,
        board: Option<PyRef<'_, CompletionBoard>>,
    ) -> PyResult<String> {
        const M: &str = "register";
        let id = convert::instance(py, M, instance)?;
        let shape = KvShape::new(layers, tp_size, segments, segment_bytes)
            .map_err(|e| errors::invalid(py, M, e.to_string()))?;
        if planes.len() != layers as usize {
            return Err(errors::invalid(
                py,
                M,
                format!("{} planes given for {layers} layers", planes.len()),
            ));
        }
        let regions = convert::regions(py, &regions)?;
        let layers = convert::planes(py, segments, regions.len(), &planes)?;
        let req = RegisterRegions {
            instance: id,
            model,
            dtype,
            shape,
            rank,
            device,
            kind: convert::kind(py, kind)?,
            block_stride,
            num_blocks,
            regions,
            layers,
        };
        let board = board.map(|b| b.handle).unwrap_or(0);
        self.wait(
            py,
            M,
            self.inner
                .register(Registration::regions(&req).with_board(board)),
        )
    }

    /// Unregisters an instance; returns how many of its leases were released.
    fn unregister(&self, py: Python<'_>, instance: &str) -> PyResult<u32> {
        let id = convert::instance(py, "unregister", instance)?;
        self.wait(py, "unregister", self.inner.unregister(&id))
    }

    /// Opens a session binding `instances`: when it closes (or this process dies) the node
    /// unregisters them.
    #[pyo3(signature = (instances=Vec::new()))]
    fn open_session(&self, py: Python<'_>, instances: Vec<String>) -> PyResult<Session> {
        let ids = convert::instances(py, "open_session", &instances)?;
        let s = self.wait(py, "open_session", self.inner.open_session(&ids))?;
        Ok(Session::new(self.rt.clone(), s, instances))
    }

    /// Sends `query`, `load` and `save` through a request mailbox (shared memory beside the gRPC
    /// connection, engine protocol 5) from now on, this client and its clones; False (and
    /// nothing changed) where the node is older. `instance` names this client on the fd
    /// socket.
    fn attach_mailbox(&self, py: Python<'_>, instance: &str) -> PyResult<bool> {
        let id = convert::instance(py, "attach_mailbox", instance)?;
        self.wait(py, "attach_mailbox", self.inner.attach_mailbox(&id))
    }

    /// Whether `query`, `load` and `save` go through a mailbox.
    #[getter]
    fn has_mailbox(&self) -> bool {
        self.inner.has_mailbox()
    }

    /// Leases the longest prefix of `hashes` the node and its peers hold; with `tenant`, of
    /// that tenant's blocks (a namespace of their own, node protocol 9).
    #[pyo3(signature = (instance, hashes, direct_gpu=false, tenant=None))]
    fn query<'py>(
        &self,
        py: Python<'py>,
        instance: &str,
        hashes: Vec<Vec<u8>>,
        direct_gpu: bool,
        tenant: Option<String>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let id = convert::instance(py, "query", instance)?;
        let hashes = convert::hashes(py, "query", &hashes)?;
        let q = self.wait(
            py,
            "query",
            self.inner
                .query_tenant(&id, &hashes, direct_gpu, tenant.as_deref()),
        )?;
        convert::query(py, q)
    }

    /// Starts this rank's load of `lease` into `dest_blocks` (one per leased block, in
    /// prefix order); returns its load id at once. With `board_slot`, the load reports its
    /// layers and its end to that slot of the rank's board under `board_tag`. With
    /// `per_layer`, the local prefix lands one layer per copy batch (for a forward that waits
    /// layer by layer) instead of a few long batches.
    #[pyo3(signature = (lease, instance, rank, dest_blocks, board_slot=None, board_tag=0, per_layer=false))]
    #[allow(clippy::too_many_arguments)]
    fn load(
        &self,
        py: Python<'_>,
        lease: &str,
        instance: &str,
        rank: u32,
        dest_blocks: Vec<u32>,
        board_slot: Option<u32>,
        board_tag: u32,
        per_layer: bool,
    ) -> PyResult<u64> {
        let req = api::LoadRequest {
            lease: convert::lease(py, "load", lease)?,
            instance: convert::instance(py, "load", instance)?,
            rank,
            dest_blocks,
            per_layer,
        };
        let board = board_slot.map(|slot| (slot, board_tag));
        self.wait(py, "load", self.inner.load(&req, LoadOptions::board(board)))
    }

    /// The completion of `load_id` (consuming it), or None while it runs.
    fn poll_load<'py>(
        &self,
        py: Python<'py>,
        load_id: u64,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        match self.wait(py, "poll_load", self.inner.poll_load(load_id))? {
            Some(c) => Ok(Some(convert::completion(py, c)?)),
            None => Ok(None),
        }
    }

    /// Asks running load `load_id` of `instance`'s `rank` to stop: it copies nothing more and
    /// ends failed ("cancelled") once what it submitted has drained. True where it was
    /// running. A node older than protocol 9 refuses (FailedPrecondition).
    fn cancel_load(
        &self,
        py: Python<'_>,
        instance: &str,
        rank: u32,
        load_id: u64,
    ) -> PyResult<bool> {
        let id = convert::instance(py, "cancel_load", instance)?;
        self.wait(
            py,
            "cancel_load",
            self.inner.cancel_load(&id, rank, load_id),
        )
    }

    /// Waits up to `timeout_s` for the completion of `load_id` (DeadlineExceeded after).
    #[pyo3(signature = (load_id, timeout_s=DEFAULT_DEADLINE_S))]
    fn wait_load<'py>(
        &self,
        py: Python<'py>,
        load_id: u64,
        timeout_s: f64,
    ) -> PyResult<Bound<'py, PyDict>> {
        const M: &str = "wait_load";
        // Zero polls once.
        let timeout = Duration::try_from_secs_f64(timeout_s).map_err(|_| {
            errors::invalid(
                py,
                M,
                format!("timeout_s must be >= 0 seconds, got {timeout_s}"),
            )
        })?;
        let end = Instant::now() + timeout;
        loop {
            // In slices, so Ctrl-C reaches Python between them; each slice is one PollLoad
            // the node holds until the load ends, so the result comes as soon as it is booked.
            let slice = end
                .saturating_duration_since(Instant::now())
                .min(SIGNAL_CHECK);
            let polled = self.wait(py, M, async {
                match self.inner.wait_load(load_id, slice).await {
                    Ok(c) => Ok(Some(c)),
                    Err(EngineClientError::WaitTimeout { .. }) => Ok(None),
                    Err(e) => Err(e),
                }
            })?;
            if let Some(c) = polled {
                return convert::completion(py, c);
            }
            if Instant::now() >= end {
                return Err(errors::deadline(
                    py,
                    M,
                    format!("load {load_id}: no completion within {timeout_s} s"),
                ));
            }
            py.check_signals()?;
        }
    }

    /// Copies device blocks `src_blocks` of one rank into host blocks named by `hashes`.
    /// Returns, or raises, only once the node is done reading `src_blocks` or can no longer
    /// seal them (a call given up on returns after its fence: see the README), so the
    /// caller may reuse the blocks whenever it returns. With `tenant`, into that tenant's
    /// namespace (see `query`).
    #[pyo3(signature = (instance, rank, hashes, src_blocks, tenant=None))]
    fn save<'py>(
        &self,
        py: Python<'py>,
        instance: &str,
        rank: u32,
        hashes: Vec<Vec<u8>>,
        src_blocks: Vec<u32>,
        tenant: Option<String>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let req = api::SaveRequest {
            instance: convert::instance(py, "save", instance)?,
            rank,
            hashes: convert::hashes(py, "save", &hashes)?,
            src_blocks,
            tenant,
        };
        let s = self.wait(py, "save", self.inner.save(&req))?;
        convert::store(py, s)
    }

    /// Stores one rank's bytes of whole blocks: `[(hash, bytes)]`.
    fn put_blocks<'py>(
        &self,
        py: Python<'py>,
        instance: &str,
        rank: u32,
        blocks: Vec<(Vec<u8>, Vec<u8>)>,
    ) -> PyResult<Bound<'py, PyDict>> {
        const M: &str = "put_blocks";
        let (hashes, data): (Vec<_>, Vec<_>) = blocks.into_iter().unzip();
        let req = api::PutBlocks {
            instance: convert::instance(py, M, instance)?,
            rank,
            blocks: convert::hashes(py, M, &hashes)?
                .into_iter()
                .zip(data)
                .collect(),
        };
        let s = self.wait(py, M, self.inner.put_blocks(&req))?;
        convert::store(py, s)
    }

    /// Releases a lease whatever its ranks still owe.
    fn release(&self, py: Python<'_>, lease: &str) -> PyResult<()> {
        let lease = convert::lease(py, "release", lease)?;
        self.wait(py, "release", self.inner.release(lease))
    }
}

impl EngineClient {
    /// One `send_*` of a KV fd: the instance name and the fd checked, the fd duplicated for
    /// the call (it stays the caller's), and the node's answer.
    fn send_kv_fd(
        &self,
        py: Python<'_>,
        method: &'static str,
        instance: &str,
        (rank, device): (u32, u32),
        fd: i32,
        kv: KvFd,
    ) -> PyResult<u64> {
        let (id, owned) = instance_and_fd(py, method, instance, fd)?;
        let fut = self.inner.send_kv(&id, rank, device, owned.as_fd(), kv);
        self.wait(py, method, fut)
    }
}
