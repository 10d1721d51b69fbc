"""KV layouts of real engines, described as kvferry registers them.

kvferry registers a rank's KV as *planes*: per layer, the K and V planes (or one plane with
MLA), each at a byte offset inside a memory region, every block ``block_stride`` bytes after
the previous one and ``segment_bytes`` long. :func:`describe_layout` derives that from the
tensors an engine allocated, in one of the layouts engines use:

``"flash_attn"``   per layer ``(2, num_blocks, block_size, heads, head_dim)``: K plane, then V
``"flashinfer"``   per layer ``(num_blocks, 2, block_size, heads, head_dim)``: K, V per block
``"mla"``          per layer ``(num_blocks, block_size, head_dim)``: one segment
``"cross_layer"``  one tensor ``(num_blocks, layers, 2, block_size, heads, head_dim)``: one
                   block is one contiguous range holding every layer's K and V

and :func:`register_tensors` registers planes with a node, sending each piece of memory once:
CPU memory must come from :mod:`kvferry.memfd` (``kvferry.torch.memfd_empty``), CUDA memory
goes by its CUDA IPC handle (one region per caching-allocator block), or, for a VMM
allocation (vLLM 0.34's extensible KV cache), by the POSIX fd of the allocation
(:mod:`kvferry.vmm`, one region per allocation). Torch tensors and numpy
arrays are both understood (by duck typing: neither is imported here). Tensors that do not fit
raise :class:`LayoutError` naming the layer, before anything reaches the node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .errors import LayoutError
from . import memfd

__all__ = [
    "LAYOUTS",
    "KvPlanes",
    "KvLayout",
    "TensorInfo",
    "describe_layout",
    "register_tensors",
    "register_kv",
    "LayoutError",
]

LAYOUTS = ("flash_attn", "flashinfer", "mla", "cross_layer")

#: The node requires segment sizes in multiples of this many bytes.
SEGMENT_ALIGN = 64


@dataclass(frozen=True)
class TensorInfo:
    """What a layout needs to know of a tensor or array."""

    shape: Tuple[int, ...]
    #: In bytes.
    strides: Tuple[int, ...]
    itemsize: int
    address: int
    #: "cpu", "cuda:0", ...
    device: str
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def contiguous(self) -> bool:
        expect = self.itemsize
        for size, stride in zip(reversed(self.shape), reversed(self.strides)):
            if size != 1 and stride != expect:
                return False
            expect *= size
        return True

    @staticmethod
    def of(t: Any) -> "TensorInfo":
        """From a torch tensor or a numpy array."""
        if hasattr(t, "data_ptr") and hasattr(t, "element_size"):  # torch
            size = t.element_size()
            dev = t.device
            device = dev.type if dev.index is None else f"{dev.type}:{dev.index}"
            return TensorInfo(
                shape=tuple(t.shape),
                strides=tuple(s * size for s in t.stride()),
                itemsize=size,
                address=t.data_ptr(),
                device=device,
                dtype=str(t.dtype).replace("torch.", ""),
            )
        if hasattr(t, "__array_interface__"):  # numpy and friends
            return TensorInfo(
                shape=tuple(t.shape),
                strides=tuple(t.strides),
                itemsize=t.itemsize,
                address=t.__array_interface__["data"][0],
                device="cpu",
                dtype=str(t.dtype),
            )
        raise TypeError(f"not a tensor or array: {type(t).__name__}")


@dataclass
class KvPlanes:
    """One layer's planes: block 0 of K at ``k_offset`` bytes into tensor ``k``, of V at
    ``v_offset`` bytes into ``v`` (None with one segment, MLA)."""

    k: Any
    k_offset: int = 0
    v: Any = None
    v_offset: int = 0


@dataclass
class KvLayout:
    """A rank's KV as planes; ``register_kwargs()`` feeds :func:`register_tensors`."""

    layout: str
    segments: int
    segment_bytes: int
    block_stride: int
    num_blocks: int
    layers: List[KvPlanes]
    kind: str = "attention"
    dtype: str = ""
    device: str = "cpu"
    #: The distinct tensors, in layer order.
    tensors: List[Any] = field(default_factory=list)

    def register_kwargs(self) -> Dict[str, Any]:
        return {
            "layers": self.layers,
            "segments": self.segments,
            "segment_bytes": self.segment_bytes,
            "block_stride": self.block_stride,
            "num_blocks": self.num_blocks,
            "kind": self.kind,
        }


def _info(t: Any, layer: int) -> TensorInfo:
    try:
        return TensorInfo.of(t)
    except TypeError as e:
        raise LayoutError(f"layer {layer}: {e}", layer=layer) from None


def _infos(tensors: Sequence[Any]) -> List[TensorInfo]:
    return [_info(t, i) for i, t in enumerate(tensors)]


def _check_alike(infos: Sequence[TensorInfo], what: str = "layer") -> None:
    first = infos[0]
    for i, info in enumerate(infos):
        if not info.contiguous:
            raise LayoutError(
                f"{what} {i}: the tensor is not contiguous (shape {info.shape}, strides "
                f"{info.strides} bytes); kvferry needs each block's segments contiguous",
                layer=i,
            )
        for attr in ("shape", "dtype", "device"):
            if getattr(info, attr) != getattr(first, attr):
                raise LayoutError(
                    f"{what} {i}: {attr} {getattr(info, attr)} differs from layer 0's "
                    f"{getattr(first, attr)}",
                    layer=i,
                )
    spans = sorted((info.address, info.address + info.nbytes, i) for i, info in enumerate(infos))
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            i, j = sorted((a, b))
            raise LayoutError(
                f"{what} {j}: its tensor overlaps layer {i}'s (one allocation per layer, or "
                "the cross_layer layout for one shared tensor)",
                layer=j,
            )


def _need_ndim(info: TensorInfo, layer: int, at_least: int, form: str) -> None:
    if len(info.shape) < at_least:
        raise LayoutError(f"layer {layer}: shape {info.shape} is not {form}", layer=layer)


def _segment_bytes(info: TensorInfo, dims: Tuple[int, ...], layer: int) -> int:
    seg = math.prod(dims) * info.itemsize
    if seg == 0 or seg % SEGMENT_ALIGN:
        raise LayoutError(
            f"layer {layer}: one block's segment is {seg} bytes ({dims} x {info.itemsize}); "
            f"kvferry needs a nonzero multiple of {SEGMENT_ALIGN}",
            layer=layer,
        )
    return seg


def describe_layout(tensors: Any, layout: str) -> KvLayout:
    """The planes of one rank's KV, allocated as ``layout`` (see the module doc).

    ``tensors``: one tensor per layer, or for ``"cross_layer"`` the one tensor (or a
    one-element list)."""
    if layout not in LAYOUTS:
        raise LayoutError(f"layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    if layout == "cross_layer":
        one = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
        if len(one) != 1:
            raise LayoutError(
                f"cross_layer takes the one tensor holding every layer, got {len(one)}"
            )
        (info,) = _infos(one)
        _check_alike([info])
        form = "(num_blocks, layers, 2, block_size, heads, head_dim)"
        _need_ndim(info, 0, 4, form)
        if info.shape[2] != 2:
            raise LayoutError(f"layer 0: shape {info.shape} is not {form}", layer=0)
        num_blocks, nlayers = info.shape[0], info.shape[1]
        if nlayers == 0:
            raise LayoutError(f"shape {info.shape} holds no layer")
        seg = _segment_bytes(info, info.shape[3:], 0)
        t = one[0]
        layers = [KvPlanes(t, 2 * l * seg, t, (2 * l + 1) * seg) for l in range(nlayers)]
        return KvLayout(
            layout, 2, seg, 2 * nlayers * seg, num_blocks, layers, "cross_layer",
            info.dtype, info.device, [t],
        )

    tensors = list(tensors)
    if not tensors:
        raise LayoutError("no layer given")
    infos = _infos(tensors)
    first = infos[0]
    for i, info in enumerate(infos):
        if layout == "flash_attn":
            form = "(2, num_blocks, block_size, heads, head_dim)"
            _need_ndim(info, i, 3, form)
            ok = info.shape[0] == 2
        elif layout == "flashinfer":
            form = "(num_blocks, 2, block_size, heads, head_dim)"
            _need_ndim(info, i, 3, form)
            ok = info.shape[1] == 2
        else:
            form = "(num_blocks, block_size, head_dim)"
            _need_ndim(info, i, 2, form)
            ok = True
        if not ok:
            raise LayoutError(f"layer {i}: shape {info.shape} is not {form}", layer=i)
    _check_alike(infos)
    if layout == "flash_attn":
        num_blocks = first.shape[1]
        seg = _segment_bytes(first, first.shape[2:], 0)
        layers = [KvPlanes(t, 0, t, num_blocks * seg) for t in tensors]
        return KvLayout(layout, 2, seg, seg, num_blocks, layers, "attention", first.dtype,
                        first.device, tensors)
    if layout == "flashinfer":
        num_blocks = first.shape[0]
        seg = _segment_bytes(first, first.shape[2:], 0)
        layers = [KvPlanes(t, 0, t, seg) for t in tensors]
        return KvLayout(layout, 2, seg, 2 * seg, num_blocks, layers, "attention", first.dtype,
                        first.device, tensors)
    num_blocks = first.shape[0]
    seg = _segment_bytes(first, first.shape[1:], 0)
    layers = [KvPlanes(t, 0) for t in tensors]
    return KvLayout(layout, 1, seg, seg, num_blocks, layers, "attention", first.dtype,
                    first.device, tensors)


# A region key, the region as `EngineClient.register` takes it (before memfds are sent), and
# the byte offset of the tensor's data inside the region.
_Resolved = Tuple[Tuple[Any, ...], Tuple[str, Any], int]


def _resolve(t: Any, info: TensorInfo, layer: int) -> _Resolved:
    if info.device == "cpu":
        found = memfd.lookup(info.address, info.nbytes)
        if found is None:
            raise LayoutError(
                f"layer {layer}: a CPU tensor must live in a memfd the node can map: allocate "
                "it with kvferry.torch.memfd_empty (or on kvferry.memfd.allocate)",
                layer=layer,
            )
        buf, offset = found
        return ("memfd", buf.fd), ("memfd", (buf.fd, buf.length)), offset
    if info.device.startswith("cuda"):
        from . import vmm

        # How the memory can be shared is the driver's to say, not a guess from the engine.
        sharing = vmm.sharing_of(info.address)
        if sharing != vmm.IPC:
            if sharing == vmm.NONE:
                raise LayoutError(
                    f"layer {layer}: the tensor is in a VMM allocation that can be shared "
                    "neither by CUDA IPC handle nor by fd (vLLM 0.34's extensible KV cache "
                    "under a connector that does not declare KVCacheAccess.EXPORTS_FD; see "
                    "kvferry.vllm.vmm.supported_access)",
                    layer=layer,
                )
            try:
                region = vmm.export(info.address, info.nbytes)
            except vmm.VmmError as e:
                raise LayoutError(f"layer {layer}: {e}", layer=layer) from None
            return ("vmm", region.base), ("vmm", region), region.offset
        from .torch import cuda_region  # torch is there: this is a CUDA tensor

        handle, offset = cuda_region(t)
        return ("cuda", handle), ("cuda_ipc", handle), offset
    raise LayoutError(f"layer {layer}: device {info.device} cannot be registered", layer=layer)


def register_tensors(
    client: Any,
    instance: str,
    model: str,
    dtype_name: str,
    *,
    rank: int,
    tp_size: int,
    device: int,
    layers: Sequence[KvPlanes],
    block_stride: int,
    num_blocks: int,
    segment_bytes: int,
    segments: int,
    kind: str = "attention",
    board: Any = None,
) -> str:
    """Registers one rank's planes with the node behind ``client``; returns the namespace.

    Each memfd is sent once (``send_memfd``), each VMM allocation once (``send_vmm``), and
    each other CUDA allocation is one region (its IPC handle). Every
    plane is checked against its tensor first: nothing is sent for a layout that is wrong.
    ``board`` (from ``client.open_board``) receives the progress of loads naming its slots.
    """
    if segments not in (1, 2):
        raise LayoutError(f"segments must be 1 or 2, got {segments}")
    if not layers:
        raise LayoutError("no layer given")
    if num_blocks <= 0 or block_stride <= 0:
        raise LayoutError(f"num_blocks {num_blocks} and block_stride {block_stride} must be > 0")
    span = (num_blocks - 1) * block_stride + segment_bytes
    keys: Dict[Tuple[Any, ...], int] = {}
    regions: List[Tuple[str, Any]] = []
    planes: List[Tuple[int, ...]] = []
    seen: Dict[int, Tuple[TensorInfo, _Resolved]] = {}
    device_of: Optional[str] = None
    # VMM fds exported for this registration: ours until sent (the node keeps what it
    # imported), closed whatever happens.
    exported: List[Any] = []
    wire: List[Tuple[str, Any]] = []
    try:
        for i, p in enumerate(layers):
            pairs = [("K", p.k, p.k_offset)]
            if segments == 2:
                if p.v is None:
                    raise LayoutError(f"layer {i}: no V tensor with 2 segments", layer=i)
                pairs.append(("V", p.v, p.v_offset))
            elif p.v is not None:
                raise LayoutError(f"layer {i}: a V tensor with 1 segment (MLA)", layer=i)
            row: List[int] = []
            for name, t, off in pairs:
                if id(t) not in seen:
                    info = _info(t, i)
                    if not info.contiguous:
                        raise LayoutError(
                            f"layer {i}: the {name} tensor is not contiguous", layer=i
                        )
                    resolved = _resolve(t, info, i)
                    seen[id(t)] = (info, resolved)
                    if resolved[1][0] == "vmm":
                        exported.append(resolved[1][1])
                info, (key, region, base) = seen[id(t)]
                if device_of is None:
                    device_of = info.device
                elif info.device != device_of:
                    raise LayoutError(
                        f"layer {i}: {name} is on {info.device}, layer 0 on {device_of}", layer=i
                    )
                if off < 0 or off + span > info.nbytes:
                    raise LayoutError(
                        f"layer {i}: the {name} plane [{off}, {off + span}) lies outside its "
                        f"tensor of {info.nbytes} bytes",
                        layer=i,
                    )
                if key not in keys:
                    keys[key] = len(regions)
                    regions.append(region)
                row += [keys[key], base + off]
            planes.append(tuple(row))
        for kind_, value in regions:
            if kind_ == "memfd":
                fd, length = value
                wire.append(("handle", client.send_memfd(instance, rank, device, fd, length)))
            elif kind_ == "vmm":
                h = client.send_vmm(instance, rank, device, value.fd, value.size)
                wire.append(("handle", h))
            else:
                wire.append((kind_, value))
    finally:
        for region in exported:
            region.close()
    return client.register(
        instance,
        model,
        dtype_name,
        layers=len(layers),
        tp_size=tp_size,
        segments=segments,
        segment_bytes=segment_bytes,
        rank=rank,
        device=device,
        kind=kind,
        block_stride=block_stride,
        num_blocks=num_blocks,
        regions=wire,
        planes=planes,
        **({"board": board} if board is not None else {}),
    )


def register_kv(
    client: Any,
    instance: str,
    model: str,
    tensors: Any,
    layout: str,
    *,
    rank: int = 0,
    tp_size: int = 1,
    device: Optional[int] = None,
    dtype_name: Optional[str] = None,
    board: Any = None,
) -> Tuple[str, KvLayout]:
    """:func:`describe_layout` then :func:`register_tensors`. ``device``: the node's device
    ordinal (default: the tensors' CUDA index, 0 for CPU); ``dtype_name``: default the
    tensors' dtype; ``board``: a completion board from ``client.open_board``. Returns
    ``(namespace, layout)``."""
    kv = describe_layout(tensors, layout)
    if device is None:
        device = int(kv.device.split(":")[1]) if ":" in kv.device else 0
    ns = register_tensors(
        client,
        instance,
        model,
        dtype_name or kv.dtype,
        rank=rank,
        tp_size=tp_size,
        device=device,
        board=board,
        **kv.register_kwargs(),
    )
    return ns, kv
