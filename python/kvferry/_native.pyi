"""Types of kvferry._native (the Rust engine client bound with PyO3)."""

from typing import Dict, List, Optional, Sequence, Tuple, Union

__version__: str
DEFAULT_DEADLINE_S: float

Region = Union[Tuple[str, int], Tuple[str, bytes]]  # ("handle", h) or ("cuda_ipc", handle)
Planes = Union[Tuple[int, int, int, int], Tuple[int, int]]

class Session:
    """Binds instances to a client: when it closes, the node unregisters them."""

    @property
    def closed(self) -> bool: ...
    @property
    def instances(self) -> List[str]: ...
    def bind(self, instance: str) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> "Session": ...
    def __exit__(self, *exc: object) -> bool: ...

class CompletionBoard:
    """A rank's loads landing and ending, in shared memory (engine protocol 3, board
    version 2): a view is ``{"tag", "state", "layers", "done", "ok", "failed_blocks"}``."""

    handle: int
    @property
    def slots(self) -> int: ...
    def view(self, slot: int) -> Dict[str, object]: ...
    def wait(
        self, slot: int, tag: int, layers: int, timeout_s: float = 10.0
    ) -> Dict[str, object]: ...
    def wait_ends(
        self, loads: Sequence[Tuple[int, int]], timeout_s: float = 10.0
    ) -> List[Dict[str, object]]: ...
    def interrupt(self) -> None: ...

class EngineClient:
    """A client of one node's engine service; every call releases the GIL while it waits."""

    def __init__(
        self,
        addr: str,
        token: Optional[str] = None,
        deadline_s: float = 10.0,
        connect_timeout_s: float = 5.0,
        fd_socket: Optional[str] = None,
        *,
        tls_ca: Optional[str] = None,
        tls_server_name: Optional[str] = None,
        tls_cert: Optional[str] = None,
        tls_key: Optional[str] = None,
    ) -> None: ...
    @property
    def addr(self) -> str: ...
    def capabilities(self) -> Dict[str, object]: ...
    def health(self) -> bool: ...
    def stats(self) -> Dict[str, int]: ...
    def lookup(self, namespace: str, hashes: List[bytes]) -> List[Tuple[str, int]]: ...
    def send_memfd(self, instance: str, rank: int, device: int, fd: int, length: int) -> int: ...
    def send_dmabuf(
        self, instance: str, rank: int, device: int, fd: int, base: int, length: int
    ) -> int: ...
    def send_vmm(self, instance: str, rank: int, device: int, fd: int, length: int) -> int: ...
    def register(
        self,
        instance: str,
        model: str,
        dtype: str,
        *,
        layers: int,
        tp_size: int,
        segments: int,
        segment_bytes: int,
        rank: int,
        device: int,
        kind: str = "attention",
        block_stride: int,
        num_blocks: int,
        regions: Sequence[Region],
        planes: Sequence[Planes],
        board: Optional[CompletionBoard] = None,
    ) -> str: ...
    def open_board(self, instance: str, rank: int, slots: int = 256) -> CompletionBoard: ...
    def unregister(self, instance: str) -> int: ...
    def open_session(self, instances: Sequence[str] = ...) -> Session: ...
    def attach_mailbox(self, instance: str) -> bool: ...
    @property
    def has_mailbox(self) -> bool: ...
    def query(
        self,
        instance: str,
        hashes: Sequence[bytes],
        direct_gpu: bool = False,
        tenant: Optional[str] = None,
    ) -> Dict[str, object]: ...
    def load(
        self,
        lease: str,
        instance: str,
        rank: int,
        dest_blocks: Sequence[int],
        board_slot: Optional[int] = None,
        board_tag: int = 0,
        per_layer: bool = False,
    ) -> int: ...
    def poll_load(self, load_id: int) -> Optional[Dict[str, object]]: ...
    def cancel_load(self, instance: str, rank: int, load_id: int) -> bool: ...
    def wait_load(self, load_id: int, timeout_s: float = 10.0) -> Dict[str, object]: ...
    def save(
        self,
        instance: str,
        rank: int,
        hashes: Sequence[bytes],
        src_blocks: Sequence[int],
        tenant: Optional[str] = None,
    ) -> Dict[str, object]: ...
    def put_blocks(
        self, instance: str, rank: int, blocks: Sequence[Tuple[bytes, bytes]]
    ) -> Dict[str, object]: ...
    def release(self, lease: str) -> None: ...
