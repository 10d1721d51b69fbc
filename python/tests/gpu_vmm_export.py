"""The GPU half of ``test_vmm.py`` (not collected by pytest; needs a CUDA GPU):

    python3 python/tests/gpu_vmm_export.py IMPORTER

``IMPORTER`` is the kvferry-gpu CUDA test binary (``cargo test -p kvferry-gpu --test cuda
--no-run``). This process allocates KV the way vLLM 0.34's extensible KV cache does for a
connector declaring ``EXPORTS_FD`` (``cuMemCreate`` with the POSIX fd handle type, reserved
and mapped with ``cuMemMap``), fills it with a canary, and asks :mod:`kvferry.vmm` how it is
shared and for its fd; the importer (``vmm_import_child``, a node's role) maps the fd in its
own process and loads a pattern into it; this process then checks every byte of its own
allocation. It also checks the driver's answers that registration depends on: ordinary
``cuMemAlloc`` memory goes by CUDA IPC handle, a VMM allocation created without the fd
handle type cannot be shared. Only ctypes and the driver: no torch, no kvferry extension.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load_vmm():
    try:
        from kvferry import vmm  # an installed package

        return vmm
    except ImportError:
        path = HERE.parent / "kvferry" / "vmm.py"
        spec = importlib.util.spec_from_file_location("kvferry_vmm", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class AllocProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", AllocFlags),
    ]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


cu = ctypes.CDLL("libcuda.so.1")
u64 = ctypes.c_uint64


def check(call, r):
    if r != 0:
        name = ctypes.c_char_p()
        cu.cuGetErrorName(r, ctypes.byref(name))
        raise SystemExit(f"{call} failed: {name.value} ({r})")


def vmm_alloc(size, handle_types):
    prop = AllocProp()
    prop.type = 1  # pinned
    prop.requestedHandleTypes = handle_types
    prop.location = Location(1, 0)  # device 0
    h, ptr = u64(0), u64(0)
    check("cuMemCreate", cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(prop), u64(0)))
    check("cuMemAddressReserve", cu.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0), u64(0), u64(0)))
    check("cuMemMap", cu.cuMemMap(ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), h, u64(0)))
    desc = AccessDesc(Location(1, 0), 3)  # read-write
    check("cuMemSetAccess", cu.cuMemSetAccess(ptr, ctypes.c_size_t(size), ctypes.byref(desc), ctypes.c_size_t(1)))
    return h, ptr.value


def vmm_free(h, ptr, size):
    check("cuMemUnmap", cu.cuMemUnmap(u64(ptr), ctypes.c_size_t(size)))
    check("cuMemRelease", cu.cuMemRelease(h))
    check("cuMemAddressFree", cu.cuMemAddressFree(u64(ptr), ctypes.c_size_t(size)))


# The importer's load (gpu/tests/cuda.rs `vmm_import_child`): one layer, K plane then V plane
# of 12 blocks of 4096 bytes at byte 0, host slot s holding pat(s, 0, 0, seg, off).
BLOCKS, SEG = 12, 4096
PAIRS = [(0, 9), (3, 1), (5, 4), (1, 7), (2, 0), (4, 11)]


def pat(block, rank, layer, seg, off):
    return (block * 131 + rank * 53 + layer * 31 + seg * 17 + off * 7) % 251


def expected(size):
    out = bytearray([0xCD]) * size
    for slot, block in PAIRS:
        for s in range(2):
            at = s * BLOCKS * SEG + block * SEG
            out[at:at + SEG] = bytes(pat(slot, 0, 0, s, off) for off in range(SEG))
    return bytes(out)


def main():
    importer = sys.argv[1]
    vmm = load_vmm()
    assert vmm.available() is None, vmm.available()
    check("cuInit", cu.cuInit(0))
    dev, ctx = ctypes.c_int(0), ctypes.c_void_p()
    check("cuDeviceGet", cu.cuDeviceGet(ctypes.byref(dev), 0))
    check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
    check("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))
    gran = ctypes.c_size_t(0)
    prop = AllocProp()
    prop.type, prop.requestedHandleTypes, prop.location = 1, 1, Location(1, 0)
    check("cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 0))
    size = gran.value
    assert size >= 2 * BLOCKS * SEG

    # Ordinary device memory keeps the CUDA IPC path.
    plain = u64(0)
    check("cuMemAlloc", cu.cuMemAlloc_v2(ctypes.byref(plain), ctypes.c_size_t(1 << 20)))
    assert vmm.sharing_of(plain.value + 4096) == vmm.IPC, vmm.mapping_of(plain.value)
    # A VMM allocation without the fd handle type cannot be shared.
    h0, p0 = vmm_alloc(size, 0)
    m0 = vmm.mapping_of(p0 + 100)
    assert vmm.sharing_of(p0 + 100) == vmm.NONE, m0
    vmm_free(h0, p0, size)

    h, ptr = vmm_alloc(size, 1)
    check("cuMemsetD8", cu.cuMemsetD8_v2(u64(ptr), ctypes.c_ubyte(0xCD), ctypes.c_size_t(size)))
    m = vmm.mapping_of(ptr + 4096)
    assert (m.base, m.size, m.posix_fd, m.legacy_ipc) == (ptr, size, True, False), m
    assert vmm.sharing_of(ptr + 4096) == vmm.FD
    region = vmm.export(ptr + 4096, 2 * BLOCKS * SEG - 4096)
    assert (region.base, region.size, region.offset) == (ptr, size, 4096), region
    env = dict(os.environ, KVFERRY_VMM_CHILD_FD=str(region.fd), KVFERRY_VMM_CHILD_LEN=str(region.size))
    out = subprocess.run(
        [importer, "--exact", "vmm_import_child", "--ignored", "--nocapture", "--test-threads", "1"],
        env=env, pass_fds=(region.fd,), capture_output=True, text=True, timeout=120,
    )
    region.close()
    if out.returncode != 0 or "VMM_CHILD_OK" not in out.stdout + out.stderr:
        raise SystemExit(f"importer failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    got = (ctypes.c_ubyte * size)()
    check("cuMemcpyDtoH", cu.cuMemcpyDtoH_v2(got, u64(ptr), ctypes.c_size_t(size)))
    want = expected(size)
    got = bytes(got)
    if got != want:
        at = next(i for i in range(size) if got[i] != want[i])
        raise SystemExit(f"byte {at}: got {got[at]:#x}, expected {want[at]:#x}")
    vmm_free(h, ptr, size)
    print(f"GPU_VMM_EXPORT_OK: kvferry.vmm exported a {size}-byte VMM allocation; another "
          "process loaded into it; every byte checked")


if __name__ == "__main__":
    main()
