"""VMM KV memory (vLLM 0.34's extensible KV cache) registered by POSIX fd: the connector's
``kv_cache_access`` choice, the ctypes marshalling of the driver calls, and registration
choosing the fd path where the driver says the memory is a VMM allocation, sending each
allocation once and closing every exported fd. The driver is a fake here; the GPU half is
``gpu_vmm_export.py`` (run on the H200 with the CUDA test binary as the importer)."""

from __future__ import annotations

import ctypes
import enum
import logging
import os

import pytest

from kvferry import LayoutError, vmm
from kvferry.layout import KvPlanes, register_tensors
from kvferry.vllm import vmm as vllm_vmm


class KVCacheAccess(enum.IntFlag):
    """vLLM 0.34's flags (``vllm.config.kv_transfer``), as the connector sees them."""

    IN_PROCESS = 0
    REGISTERS = enum.auto()
    EXPORTS_FD = enum.auto()
    EXPORTS_FABRIC = enum.auto()
    LEGACY_IPC = enum.auto()


def test_supported_access_follows_the_driver_and_the_config(monkeypatch, caplog):
    monkeypatch.setattr(vmm, "available", lambda: None)
    assert vllm_vmm.supported_access() == ("EXPORTS_FD",)
    assert vllm_vmm.supported_access({"kv_cache_access": "AUTO"}) == ("EXPORTS_FD",)
    assert vllm_vmm.supported_access({"kv_cache_access": "legacy-ipc"}) == ("LEGACY_IPC",)
    # Without the driver calls: the logged fallback, unless the user insists.
    monkeypatch.setattr(vmm, "available", lambda: "libcuda.so.1 cannot be loaded (test)")
    with caplog.at_level(logging.WARNING, logger="kvferry.vllm"):
        assert vllm_vmm.supported_access({}) == ("LEGACY_IPC",)
    assert "cannot be loaded (test)" in caplog.text and "LEGACY_IPC" in caplog.text
    assert vllm_vmm.supported_access({"kv_cache_access": "exports_fd"}) == ("EXPORTS_FD",)
    with pytest.raises(ValueError, match="kv_cache_access.*'fabric'.*auto, exports_fd"):
        vllm_vmm.supported_access({"kv_cache_access": "fabric"})


def test_flags_of_the_release():
    flags = vllm_vmm.as_flags(("EXPORTS_FD",), KVCacheAccess)
    assert flags == KVCacheAccess.EXPORTS_FD and KVCacheAccess.LEGACY_IPC not in flags
    assert vllm_vmm.as_flags((), KVCacheAccess) == KVCacheAccess.IN_PROCESS

    class Older(enum.IntFlag):
        IN_PROCESS = 0
        REGISTERS = 1

    with pytest.raises(ValueError, match="has no EXPORTS_FD"):
        vllm_vmm.as_flags(("EXPORTS_FD",), Older)


def test_without_a_driver_nothing_is_exported():
    if vmm.available() is None:
        pytest.skip("this machine has a CUDA driver")
    assert "libcuda" in vmm.available()
    assert vmm.sharing_of(0x7000_0000) == vmm.IPC
    with pytest.raises(vmm.VmmError, match="VMM export"):
        vmm.export(0x7000_0000, 4096)


class FakeLib:
    """The four driver entry points, over a table of VMM mappings."""

    def __init__(self, mappings, exportable=True):
        self.mappings = mappings  # [(base, size)]
        self.exportable = exportable
        self.retained = 0
        self.fds = []
        lib = self

        def get_attrs(n, attrs, data, ptr):
            hit = [(b, s) for b, s in lib.mappings if b <= ptr < b + s]
            for i in range(n):
                cell = ctypes.c_uint64.from_address(data[i])
                a = attrs[i]
                if a == 10:  # legacy IPC capable: only outside VMM mappings
                    ctypes.c_uint8.from_address(data[i]).value = 0 if hit else 1
                elif a == 14:
                    cell.value = 1 if hit and lib.exportable else 0
                elif a == 18:
                    cell.value = hit[0][1] if hit else 0
                elif a == 19:
                    cell.value = hit[0][0] if hit else 0
            return 0

        def retain(handle, addr):
            lib.retained += 1
            ctypes.cast(handle, ctypes.POINTER(ctypes.c_uint64))[0] = 77
            return 0

        def export(out, handle, kind, flags):
            if not lib.exportable:
                return 1
            fd = os.open("/dev/null", os.O_RDONLY)
            lib.fds.append(fd)
            ctypes.c_int.from_address(out).value = fd
            return 0

        def release(handle):
            lib.retained -= 1
            return 0

        self.cuPointerGetAttributes = get_attrs
        self.cuMemRetainAllocationHandle = retain
        self.cuMemExportToShareableHandle = export
        self.cuMemRelease = release


class Fn:
    """A Python callable standing in for a ctypes function (takes argtypes/restype)."""

    def __init__(self, f, convert):
        self.f, self.convert = f, convert

    def __call__(self, *a):
        return self.f(*self.convert(a))


def fake_driver(lib):
    def ptrs(a):
        # ctypes would pass addresses; hand the fakes what they index or write through.
        return [ctypes.addressof(x._obj) if isinstance(x, type(ctypes.byref(ctypes.c_int()))) else x
                for x in a]

    class Lib:
        pass

    shim = Lib()
    shim.cuPointerGetAttributes = Fn(lib.cuPointerGetAttributes, lambda a: a)
    shim.cuMemRetainAllocationHandle = Fn(lib.cuMemRetainAllocationHandle, ptrs)
    shim.cuMemExportToShareableHandle = Fn(lib.cuMemExportToShareableHandle, ptrs)
    shim.cuMemRelease = Fn(lib.cuMemRelease, lambda a: a)
    return vmm.CudaDriver(shim)


class CudaTensor:
    """What registration reads of a torch CUDA tensor (no torch here)."""

    class device:
        type, index = "cuda", 0

    def __init__(self, address, nbytes):
        self.address, self.shape = address, (nbytes,)

    def data_ptr(self):
        return self.address

    def element_size(self):
        return 1

    def stride(self):
        return (1,)

    dtype = "torch.uint8"


class Client:
    def __init__(self):
        self.sent, self.registered = [], None

    def send_vmm(self, instance, rank, device, fd, length):
        os.fstat(fd)  # still open while it is sent
        self.sent.append((instance, rank, device, length))
        return 100 + len(self.sent)

    def register(self, *a, **kw):
        self.registered = kw
        return "ns"


MB2 = 2 << 20
BASE = 0x7F00_0000_0000


def test_the_driver_is_asked_through_ctypes():
    lib = FakeLib([(BASE, MB2)])
    d = fake_driver(lib)
    m = d.mapping(BASE + 4096)
    assert (m.base, m.size, m.posix_fd, m.legacy_ipc) == (BASE, MB2, True, False)
    assert not d.mapping(0x1000).size and d.mapping(0x1000).legacy_ipc
    fd = d.export_fd(BASE + 4096)
    assert fd == lib.fds[0] and lib.retained == 0, "the retained reference is dropped"
    os.close(fd)
    lib.exportable = False
    with pytest.raises(vmm.VmmError, match="cuMemExportToShareableHandle"):
        d.export_fd(BASE)
    assert lib.retained == 0


def registration(layers, segments=2, num_blocks=8, seg=4096):
    return dict(rank=0, tp_size=1, device=0, layers=layers, block_stride=seg,
                num_blocks=num_blocks, segment_bytes=seg, segments=segments)


def test_vmm_tensors_go_by_fd_once_per_allocation(monkeypatch):
    # Two layers in allocation A (a tensor each), one in B; K plane then V plane per layer.
    a, b = BASE, BASE + 8 * MB2
    lib = FakeLib([(a, MB2), (b, MB2)])
    monkeypatch.setattr(vmm, "driver", lambda: fake_driver(lib))
    plane = 8 * 4096
    t0, t1, t2 = CudaTensor(a, 2 * plane), CudaTensor(a + 2 * plane, 2 * plane), CudaTensor(b + 4096, 2 * plane)
    layers = [KvPlanes(t, 0, t, plane) for t in (t0, t1, t2)]
    c = Client()
    assert register_tensors(c, "eng", "m", "bf16", **registration(layers)) == "ns"
    assert c.sent == [("eng", 0, 0, MB2), ("eng", 0, 0, MB2)], "each allocation sent once, whole"
    assert c.registered["regions"] == [("handle", 101), ("handle", 102)]
    assert c.registered["planes"] == [
        (0, 0, 0, plane),
        (0, 2 * plane, 0, 3 * plane),
        (1, 4096, 1, 4096 + plane),
    ]
    assert lib.fds, "fds were exported"
    for fd in lib.fds:
        with pytest.raises(OSError):
            os.fstat(fd)  # every exported fd is closed once sent


def test_vmm_memory_that_cannot_be_shared_is_refused_naming_the_layer(monkeypatch):
    lib = FakeLib([(BASE, MB2)], exportable=False)
    monkeypatch.setattr(vmm, "driver", lambda: fake_driver(lib))
    t = CudaTensor(BASE, 2 * 8 * 4096)
    with pytest.raises(LayoutError, match="layer 0: .*VMM allocation.*EXPORTS_FD"):
        register_tensors(Client(), "eng", "m", "bf16", **registration([KvPlanes(t, 0, t, 8 * 4096)]))
    # A tensor running past its allocation: one region per allocation.
    lib = FakeLib([(BASE, MB2)])
    monkeypatch.setattr(vmm, "driver", lambda: fake_driver(lib))
    t = CudaTensor(BASE + MB2 - 4096, 2 * 8 * 4096)
    with pytest.raises(LayoutError, match="spans more than one VMM allocation"):
        register_tensors(Client(), "eng", "m", "bf16", **registration([KvPlanes(t, 0, t, 8 * 4096)]))
    assert not lib.fds


def test_exported_fds_are_closed_when_a_later_layer_is_refused(monkeypatch):
    lib = FakeLib([(BASE, MB2), (BASE + 4 * MB2, MB2)])
    monkeypatch.setattr(vmm, "driver", lambda: fake_driver(lib))
    plane = 8 * 4096
    good = CudaTensor(BASE, 2 * plane)
    short = CudaTensor(BASE + 4 * MB2, plane)  # no room for its V plane
    c = Client()
    with pytest.raises(LayoutError, match="layer 1: the V plane"):
        register_tensors(c, "eng", "m", "bf16", **registration(
            [KvPlanes(good, 0, good, plane), KvPlanes(short, 0, short, plane)]))
    assert c.sent == [] and len(lib.fds) == 2
    for fd in lib.fds:
        with pytest.raises(OSError):
            os.fstat(fd)
