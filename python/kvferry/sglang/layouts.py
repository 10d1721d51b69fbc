"""SGLang's KV pools described as kvferry layouts: planes of "base + block stride", one
block per SGLang page.

Host pools (HiCache, ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``: one tensor,
``kv_buffer``), by ``--hicache-mem-layout``:

=====================  ==================================  ==============================
layout                 MHA ``kv_buffer``                   kvferry planes
=====================  ==================================  ==============================
``layer_first``        ``(2, layers, tokens, heads, dim)``  per layer K and V, a page each
``page_first_direct``  ``(2, pages, layers, page, h, d)``   per layer K and V, a page each
``page_first``         ``(2, tokens, layers, heads, dim)``  one K and one V range per page
``page_head``          ``(2, pages, heads, page, l, d)``    one K and one V range per page
=====================  ==================================  ==============================

MLA host pools are the same without the leading 2 (one segment), ``page_head`` aside.
``layer_first`` and ``page_first_direct`` hold each (layer, K/V) of a page in the same byte
order, so they share the tag ``"lf"``; ``page_first`` (``"pf"``) and ``page_head`` (``"ph"``)
interleave layers and heads inside a page, so their blocks are kept apart by tag (the tag
salts every hash). ``page_first_kv_split`` (Ascend) and any other layout are refused,
naming it.

Device pools (``MHATokenToKVPool`` / ``MLATokenToKVPool``): per layer ``k_buffer[l]`` and
``v_buffer[l]`` of ``(pages * page_size, heads, dim)`` (NHD, tag ``"lf"``) or ``(pages,
heads, page_size, dim)`` (HND, tag ``"hnd"``); MLA ``kv_buffer[l]`` of ``(tokens, 1, dim)``.
Row 0's page is SGLang's padding page; it is block 0 like any other.

Everything is read from the pool's attributes (duck typing): nothing here imports SGLang
or torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List

from ..layout import SEGMENT_ALIGN, KvPlanes, LayoutError, TensorInfo

__all__ = ["HOST_LAYOUTS", "PoolLayout", "describe_device_pool", "describe_host_pool"]

HOST_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


@dataclass
class PoolLayout:
    """One rank's pool as kvferry planes; ``register_kwargs()`` feeds
    :func:`kvferry.layout.register_tensors`."""

    #: The byte order of a block, salted into every hash ("lf", "pf", "ph", "hnd").
    tag: str
    #: "mha" or "mla".
    kind: str
    page_size: int
    segments: int
    segment_bytes: int
    block_stride: int
    num_blocks: int
    layers: List[KvPlanes]
    dtype: str
    device: str
    #: The tensors the planes lie in (what must be mappable by the node).
    tensors: List[Any]

    def register_kwargs(self) -> dict:
        return {
            "layers": self.layers,
            "segments": self.segments,
            "segment_bytes": self.segment_bytes,
            "block_stride": self.block_stride,
            "num_blocks": self.num_blocks,
        }


def _info(t: Any, what: str) -> TensorInfo:
    try:
        info = TensorInfo.of(t)
    except TypeError as e:
        raise LayoutError(f"{what}: {e}") from None
    if not info.contiguous:
        raise LayoutError(f"{what}: not contiguous (shape {info.shape}, strides {info.strides})")
    return info


def _seg(nbytes: int, what: str) -> int:
    if nbytes <= 0 or nbytes % SEGMENT_ALIGN:
        raise LayoutError(
            f"{what}: a page's segment is {nbytes} bytes; kvferry needs a nonzero multiple of "
            f"{SEGMENT_ALIGN}"
        )
    return nbytes


def _page_size(pool: Any, what: str) -> int:
    ps = getattr(pool, "page_size", None)
    if not isinstance(ps, int) or ps <= 0:
        raise LayoutError(f"{what}: page_size {ps!r} is not a positive whole number")
    return ps


def describe_host_pool(pool: Any) -> PoolLayout:
    """The planes of an SGLang HiCache host pool (see the module doc)."""
    cls = type(pool).__name__
    layout = getattr(pool, "layout", None)
    if layout not in HOST_LAYOUTS:
        raise LayoutError(
            f"SGLang host pool {cls}: hicache-mem-layout {layout!r} cannot be described as "
            f"kvferry planes (supported: {', '.join(HOST_LAYOUTS)})"
        )
    buf = getattr(pool, "kv_buffer", None)
    if buf is None or isinstance(buf, (list, tuple)):
        raise LayoutError(
            f"SGLang host pool {cls}: no single kv_buffer tensor (layout {layout!r}); kvferry "
            "describes pools of one tensor"
        )
    what = f"SGLang host pool {cls} ({layout})"
    info = _info(buf, what)
    ps = _page_size(pool, what)
    shape, isz = info.shape, info.itemsize
    # MLA host pools carry kv_cache_dim (the latent and rope dims); MHA ones K and V planes.
    mha = not hasattr(pool, "kv_cache_dim")
    if mha and (not shape or shape[0] != 2):
        raise LayoutError(f"{what}: kv_buffer shape {shape} does not start with K, V (2)")
    if mha:
        if layout == "layer_first":
            _, nl, tokens, h, d = _need(shape, 5, what)
            seg = _seg(ps * h * d * isz, what)
            plane = tokens * h * d * isz
            k = [l * plane for l in range(nl)]
            v = [(nl + l) * plane for l in range(nl)]
            stride, pages, tag = seg, tokens // ps, "lf"
        elif layout == "page_first_direct":
            _, pages, nl, p, h, d = _need(shape, 6, what)
            _same_page(p, ps, what)
            seg = _seg(ps * h * d * isz, what)
            k = [l * seg for l in range(nl)]
            v = [pages * nl * seg + l * seg for l in range(nl)]
            stride, tag = nl * seg, "lf"
        elif layout == "page_first":
            _, tokens, nl, h, d = _need(shape, 5, what)
            seg = _seg(ps * nl * h * d * isz, what)
            pages = tokens // ps
            k, v, stride, tag = [0], [tokens * nl * h * d * isz], seg, "pf"
        else:  # page_head
            _, pages, h, p, nl, d = _need(shape, 6, what)
            _same_page(p, ps, what)
            seg = _seg(h * ps * nl * d * isz, what)
            k, v, stride, tag = [0], [pages * seg], seg, "ph"
        planes = [KvPlanes(buf, ko, buf, vo) for ko, vo in zip(k, v)]
        segments = 2
    else:
        if layout == "layer_first":
            nl, tokens, one, c = _need(shape, 4, what)
            seg = _seg(ps * one * c * isz, what)
            offs = [l * tokens * one * c * isz for l in range(nl)]
            stride, pages, tag = seg, tokens // ps, "lf"
        elif layout == "page_first_direct":
            pages, nl, p, one, c = _need(shape, 5, what)
            _same_page(p, ps, what)
            seg = _seg(ps * one * c * isz, what)
            offs = [l * seg for l in range(nl)]
            stride, tag = nl * seg, "lf"
        elif layout == "page_first":
            tokens, nl, one, c = _need(shape, 4, what)
            seg = _seg(ps * nl * one * c * isz, what)
            offs, stride, pages, tag = [0], seg, tokens // ps, "pf"
        else:
            raise LayoutError(f"{what}: page_head is an MHA layout; this pool has one segment")
        planes = [KvPlanes(buf, o) for o in offs]
        segments = 1
    if pages <= 0:
        raise LayoutError(f"{what}: holds no whole page of {ps} tokens")
    return PoolLayout(
        tag, "mha" if mha else "mla", ps, segments, seg, stride, pages, planes, info.dtype,
        info.device, [buf],
    )


def _need(shape: tuple, ndim: int, what: str) -> tuple:
    if len(shape) != ndim:
        raise LayoutError(f"{what}: kv_buffer shape {shape} is not {ndim}-dimensional")
    return shape


def _same_page(p: int, ps: int, what: str) -> None:
    if p != ps:
        raise LayoutError(f"{what}: pages of {p} tokens in the buffer, page_size {ps}")


def describe_device_pool(pool: Any) -> PoolLayout:
    """The planes of an SGLang device KV pool (see the module doc)."""
    cls = type(pool).__name__
    what = f"SGLang device pool {cls}"
    ps = _page_size(pool, what)
    layout = getattr(pool, "kv_cache_layout", None)
    if layout not in (None, "", "nhd", "NHD", "hnd", "HND"):
        raise LayoutError(
            f"{what}: kv_cache_layout {layout!r} cannot be described as kvferry planes "
            "(supported: the default NHD rows, and HND pages)"
        )
    ks = getattr(pool, "k_buffer", None)
    vs = getattr(pool, "v_buffer", None)
    mla = ks is None and getattr(pool, "kv_buffer", None) is not None
    if mla:
        ks, vs = getattr(pool, "kv_buffer"), None
    if not isinstance(ks, (list, tuple)) or not ks:
        raise LayoutError(f"{what}: no per-layer KV tensors (k_buffer / kv_buffer)")
    if vs is not None and (not isinstance(vs, (list, tuple)) or len(vs) != len(ks)):
        raise LayoutError(f"{what}: v_buffer does not hold one tensor per layer of k_buffer")
    kinfos = [_info(t, f"{what} layer {i} K") for i, t in enumerate(ks)]
    first = kinfos[0]
    for i, info in enumerate(kinfos):
        if (info.shape, info.dtype, info.device) != (first.shape, first.dtype, first.device):
            raise LayoutError(f"{what} layer {i}: K is {info.shape} {info.dtype} on "
                              f"{info.device}, layer 0's {first.shape} {first.dtype} on "
                              f"{first.device}", layer=i)
    if vs is not None:
        for i, t in enumerate(vs):
            vi = _info(t, f"{what} layer {i} V")
            if (vi.shape, vi.dtype, vi.device) != (first.shape, first.dtype, first.device):
                raise LayoutError(
                    f"{what} layer {i}: V is {vi.shape}, K {first.shape} (a v_head_dim other "
                    "than head_dim); kvferry needs K and V segments of one size", layer=i)
    shape = first.shape
    hnd = bool(getattr(pool, "use_hnd", False)) or layout in ("hnd", "HND")
    if hnd:
        if len(shape) != 4 or shape[2] != ps:
            raise LayoutError(f"{what}: HND tensors {shape} are not (pages, heads, {ps}, dim)")
        pages, tag = shape[0], "hnd"
    else:
        if len(shape) != 3:
            raise LayoutError(f"{what}: per-layer tensors {shape} are not (tokens, heads, dim)")
        if shape[0] % ps:
            raise LayoutError(f"{what}: {shape[0]} token rows are not whole pages of {ps}")
        pages, tag = shape[0] // ps, "lf"
    seg = _seg(math.prod(shape[1:]) * first.itemsize * (1 if hnd else ps), what)
    if vs is None:
        planes = [KvPlanes(k, 0) for k in ks]
    else:
        planes = [KvPlanes(k, 0, v, 0) for k, v in zip(ks, vs)]
    tensors = list(ks) + (list(vs) if vs is not None else [])
    return PoolLayout(tag, "mla" if vs is None else "mha", ps, 1 if vs is None else 2, seg,
                      seg, pages, planes, first.dtype, first.device, tensors)
