"""vLLM's per-layer KV tensors as kvferry planes, detected from the tensors themselves.

vLLM hands a KV connector ``{layer_name: tensor}``. What the tensors look like depends on
the vLLM version, the attention backend and the KV cache layout it resolved:

- vLLM 0.26 to 0.34, every attention backend: ``(num_blocks, kv_heads, block_size,
  2 * head_size)`` with the strides of the resolved layout: ``LBNHC``/``LBHNC`` (0.26: ``NHD``
  / ``HND``; one allocation per layer, a block contiguous: one segment), ``BLHNC``/``BLNHC``
  (cross-layer: one allocation, a block holds every layer, each layer's view strides over
  whole blocks; 0.26 hands it over as one tensor, see :func:`cross_layer_views`);
- older vLLM FlashAttention ``(2, num_blocks, block_size, heads, head_dim)`` (a K plane then
  a V plane: two segments), FlashInfer ``(num_blocks, 2, ...)``, MLA
  ``(num_blocks, block_size, head_dim)``.

All of them are "a block dimension, at most one K/V dimension outside it, and a densely
packed rest", which :func:`describe_kv_caches` finds from shapes and strides (the block
dimension is the one of size ``num_blocks``), so a layout is never guessed from a name.
The attention backend's name is only used in error messages. A layout where all layers'
segments of one block tile one contiguous range in layer order is registered as
``cross_layer`` (a load is then one copy per block). Nothing here imports vLLM; torch is
imported only to make byte views of CUDA/CPU storages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = [
    "KvCacheLayoutError",
    "LayerPlanes",
    "RankLayout",
    "cross_layer_views",
    "describe_kv_caches",
]

SEGMENT_ALIGN = 64


class KvCacheLayoutError(ValueError):
    """vLLM KV tensors kvferry cannot register; the message names the layer."""


@dataclass
class LayerPlanes:
    name: str
    #: Byte addresses of block 0 of each segment (K then V, or the one segment).
    addresses: List[int]
    tensor: Any


@dataclass
class RankLayout:
    """One rank's KV: ``layers`` in registration order, every plane ``block_stride`` bytes
    per block, ``segment_bytes`` long."""

    layers: List[LayerPlanes]
    segments: int
    segment_bytes: int
    block_stride: int
    num_blocks: int
    kind: str  # "attention" or "cross_layer"
    dtype: str
    device: str
    #: Tensors vLLM listed more than once (KV shared between layers): layer name -> the
    #: name of the layer registered for it.
    shared: Dict[str, str] = field(default_factory=dict)
    #: The order of the elements inside a segment (see ``_layer_planes``).
    element_order: str = ""

    @property
    def block_bytes(self) -> int:
        return len(self.layers) * self.segments * self.segment_bytes


def _natural_key(name: str) -> Tuple[Any, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def _dev(t: Any) -> str:
    d = t.device
    return d.type if d.index is None else f"{d.type}:{d.index}"


def _layer_planes(
    name: str, t: Any, num_blocks: int, backend: str
) -> Tuple[int, int, int, List[int], str]:
    """(segments, segment_bytes, block_stride, segment addresses, element order) of one
    layer tensor. The element order names the dimensions inside a segment from outermost
    to innermost (``"2x16.1x2.3x64"``: dim 2 of 16, then dim 1 of 2, then dim 3 of 64): two
    engines whose segments hold the same bytes in another order must not share blocks."""
    shape, stride, elt = tuple(t.shape), tuple(t.stride()), t.element_size()
    where = f"layer {name!r}" + (f" ({backend})" if backend else "")
    cands = [d for d, s in enumerate(shape) if s == num_blocks]
    if not cands:
        raise KvCacheLayoutError(
            f"{where}: no dimension of shape {shape} has the {num_blocks} blocks of the KV "
            "cache"
        )
    errors = []
    for b in cands:
        sb = stride[b]
        others = [d for d in range(len(shape)) if d != b and shape[d] > 1]
        outer = [d for d in others if stride[d] > sb]
        inner = sorted((d for d in others if stride[d] <= sb), key=lambda d: stride[d])
        expect = 1
        dense = True
        for d in inner:
            if stride[d] != expect:
                dense = False
                break
            expect *= shape[d]
        if not dense:
            errors.append(
                f"dim {b} as blocks: the rest of a block is not densely packed (shape "
                f"{shape}, strides {stride})"
            )
            continue
        seg_elems = expect
        if seg_elems > sb and num_blocks > 1:
            errors.append(f"dim {b} as blocks: blocks overlap (stride {sb} < {seg_elems})")
            continue
        nseg = 1
        offsets = [0]
        if len(outer) == 1 and shape[outer[0]] == 2:
            nseg = 2
            offsets = [0, stride[outer[0]] * elt]
        elif outer:
            errors.append(
                f"dim {b} as blocks: dims {outer} lie outside a block; at most one of size 2 "
                "(K and V) can"
            )
            continue
        seg_bytes = seg_elems * elt
        base = t.data_ptr()
        order = ".".join(f"{d}x{shape[d]}" for d in reversed(inner))
        return nseg, seg_bytes, sb * elt, [base + o for o in offsets], order
    raise KvCacheLayoutError(f"{where}: " + "; ".join(errors))


def describe_kv_caches(
    kv_caches: Dict[str, Any], num_blocks: int, backend: str = ""
) -> RankLayout:
    """The planes of one rank's ``{layer_name: tensor}`` (see the module doc)."""
    if not kv_caches:
        raise KvCacheLayoutError("vLLM registered no KV cache tensors")
    names = sorted(kv_caches, key=_natural_key)
    seen: Dict[Tuple[int, Tuple[int, ...], Tuple[int, ...]], str] = {}
    shared: Dict[str, str] = {}
    layers: List[LayerPlanes] = []
    shape0: Optional[Tuple[int, int, int]] = None
    dtype = device = order0 = ""
    for name in names:
        t = kv_caches[name]
        if isinstance(t, (list, tuple)):
            raise KvCacheLayoutError(
                f"layer {name!r}: a list of tensors (K and V apart); kvferry takes one tensor "
                "per layer"
            )
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if key in seen:
            shared[name] = seen[key]
            continue
        seen[key] = name
        dev = _dev(t)
        dt = str(t.dtype).replace("torch.", "")
        nseg, seg, stride, addrs, order = _layer_planes(name, t, num_blocks, backend)
        if shape0 is None:
            shape0, dtype, device, order0 = (nseg, seg, stride), dt, dev, order
        elif (nseg, seg, stride) != shape0 or order != order0:
            raise KvCacheLayoutError(
                f"layer {name!r}: {nseg} segment(s) of {seg} bytes every {stride} bytes, but "
                f"layer {layers[0].name!r} has {shape0[0]} of {shape0[1]} every {shape0[2]} "
                f"(element order {order} vs {order0}; every layer must have the same shape)"
            )
        elif dev != device or dt != dtype:
            raise KvCacheLayoutError(
                f"layer {name!r}: {dt} on {dev}, but layer {layers[0].name!r} is {dtype} on "
                f"{device}"
            )
        layers.append(LayerPlanes(name, addrs, t))
    assert shape0 is not None
    nseg, seg, stride = shape0
    if seg % SEGMENT_ALIGN:
        raise KvCacheLayoutError(
            f"layer {layers[0].name!r}: a block's segment is {seg} bytes; kvferry needs a "
            f"multiple of {SEGMENT_ALIGN} (a larger block size fixes it)"
        )
    # Cross-layer: every layer's segments of block 0 tile [first, first + stride) in
    # (layer, segment) order.
    first = layers[0].addresses[0]
    tiles = stride == len(layers) * nseg * seg and all(
        a == first + (i * nseg + s) * seg
        for i, lp in enumerate(layers)
        for s, a in enumerate(lp.addresses)
    )
    kind = "cross_layer" if tiles and len(layers) > 1 else "attention"
    return RankLayout(layers, nseg, seg, stride, num_blocks, kind, dtype, device, shared, order0)


def cross_layer_views(kv_cache: Any, attn_backend: Any, kv_cache_config: Any) -> Dict[str, Any]:
    """vLLM 0.26's cross-layer KV (``register_cross_layers_kv_cache``: one tensor for all
    layers, in the attention backend's physical order) as ``{layer_name: view}``: the views
    vLLM's own layers use, made as its model runner makes them (the backend's stride order
    with the layers dimension, inverted; layer ``i`` is ``kv_cache_tensors[i]``)."""
    tensors = list(getattr(kv_cache_config, "kv_cache_tensors", None) or ())
    backend = getattr(attn_backend, "get_name", lambda: str(attn_backend))()
    if not tensors:
        raise KvCacheLayoutError(
            f"cross-layer KV cache ({backend}): the KV cache config names no layers"
        )
    try:
        order = tuple(attn_backend.get_kv_cache_stride_order(include_num_layers_dimension=True))
    except (AttributeError, NotImplementedError, TypeError):
        order = tuple(range(kv_cache.dim()))
    if sorted(order) != list(range(kv_cache.dim())):
        raise KvCacheLayoutError(
            f"cross-layer KV cache ({backend}): stride order {order} does not fit a tensor of "
            f"shape {tuple(kv_cache.shape)}"
        )
    logical = kv_cache.permute(*[order.index(i) for i in range(len(order))])
    if logical.shape[0] != len(tensors):
        raise KvCacheLayoutError(
            f"cross-layer KV cache ({backend}): {logical.shape[0]} layers in a tensor of shape "
            f"{tuple(kv_cache.shape)}, but the KV cache config has {len(tensors)}"
        )
    out: Dict[str, Any] = {}
    for i, kt in enumerate(tensors):
        for name in getattr(kt, "shared_by", None) or ():
            out[name] = logical[i]
    return out


def _byte_view(t: Any) -> Tuple[Any, int]:
    """A flat uint8 tensor over the whole storage of ``t``, and its address."""
    import torch

    st = t.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=t.device)
    flat.set_(st, 0, (st.nbytes(),), (1,))
    return flat, flat.data_ptr()


def planes_for_registration(layout: RankLayout) -> List[Any]:
    """``kvferry.KvPlanes`` per layer over byte views of each storage (one view per storage,
    so each memfd or CUDA allocation is sent once)."""
    from kvferry.layout import KvPlanes

    views: Dict[int, Tuple[Any, int]] = {}
    out = []
    for lp in layout.layers:
        key = lp.tensor.untyped_storage().data_ptr()
        if key not in views:
            views[key] = _byte_view(lp.tensor)
        flat, base = views[key]
        offs = [a - base for a in lp.addresses]
        if len(offs) == 2:
            out.append(KvPlanes(flat, offs[0], flat, offs[1]))
        else:
            out.append(KvPlanes(flat, offs[0]))
    return out


def register_rank(
    client: Any,
    layout: RankLayout,
    *,
    instance: str,
    model: str,
    dtype_name: str,
    rank: int,
    tp_size: int,
    device: int,
    board: Any = None,
) -> str:
    """Registers one rank's KV with the node (with ``board``, a completion board that its
    loads report to layer by layer); returns the namespace."""
    from kvferry.layout import register_tensors

    return register_tensors(
        client,
        instance,
        model,
        dtype_name,
        rank=rank,
        tp_size=tp_size,
        device=device,
        layers=planes_for_registration(layout),
        block_stride=layout.block_stride,
        num_blocks=layout.num_blocks,
        segment_bytes=layout.segment_bytes,
        segments=layout.segments,
        kind=layout.kind,
        board=board,
    )


def device_ordinal(layout: RankLayout) -> int:
    """The node's ordinal of the GPU holding the KV: torch's index mapped through
    ``CUDA_VISIBLE_DEVICES`` (vLLM workers often see one GPU as ``cuda:0``; the node sees
    them all). Entries that are not plain indices (UUIDs) leave torch's index as is."""
    import os

    index = int(layout.device.split(":")[1]) if ":" in layout.device else 0
    env = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    visible = [p.strip() for p in env.split(",") if p.strip()]
    if index < len(visible) and all(p.isdigit() for p in visible):
        return int(visible[index])
    return index


def layer_names(layout: RankLayout) -> Sequence[str]:
    return [lp.name for lp in layout.layers]
