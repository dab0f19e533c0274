"""refit._cuda.Driver's ctypes bindings against a stand-in driver library compiled from
fake_driver/fake_libcuda.c with the real cuda.h (so the C side has the driver's exact prototypes):
the marshaling that the GPU tests exercise for real, checked on a machine without a GPU. Skips
without a C compiler or cuda.h."""
from __future__ import annotations

import ctypes
import gc
import glob
import os
import shutil
import subprocess

import pytest

from refit import _cuda

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20
SHIFT = 0x100000000000


def cuda_include():
    for d in [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*")),
              "/usr"]:
        if d and os.path.exists(os.path.join(d, "include", "cuda.h")):
            return os.path.join(d, "include")
    return None


@pytest.fixture(scope="module")
def fake_lib(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    inc = cuda_include()
    if not cc or not inc:
        pytest.skip("needs a C compiler and cuda.h (CUDA toolkit headers)")
    out = str(tmp_path_factory.mktemp("fakecuda") / "libfakecuda.so")
    subprocess.run([cc, "-shared", "-fPIC", "-Wall", "-Werror", "-I", inc, "-o", out,
                    os.path.join(HERE, "fake_driver", "fake_libcuda.c")], check=True)
    return out


@pytest.fixture
def drv(fake_lib, monkeypatch):
    d = _cuda.Driver(fake_lib)
    monkeypatch.setattr(_cuda, "_driver", d)  # what driver() hands out
    yield d


def test_devices_and_uuids(drv):
    assert drv.device_count() == 2
    assert drv.device_uuid(1) == bytes(0x20 + i for i in range(16))
    assert _cuda.uuid_text(drv.device_uuid(0)) == "GPU-10111213-1415-1617-1819-1a1b1c1d1e1f"
    with pytest.raises(_cuda.CudaIpcError, match=r"cuDeviceGet\(5\) failed: CUDA_ERROR_INVALID_DEVICE"):
        drv.device_uuid(5)


def test_export_then_open_roundtrip(drv, fake_lib):
    ptr = 0x7F0012345678                   # inside the allocation at 0x7F0012300000
    base, size = drv.address_range(1, ptr)
    assert (base, size) == (ptr & ~(MiB - 1), MiB)
    handle = drv.ipc_handle(1, base)
    assert len(handle) == 64 and handle[:7] == b"FAKEIPC" and handle[63] == 0x5A
    with pytest.raises(_cuda.CudaIpcError, match="cuIpcGetMemHandle.*CUDA_ERROR_INVALID_VALUE"):
        drv.ipc_handle(1, ptr)             # not the allocation's base
    # Opening happens in the device's primary context (the fake checks the device matches).
    with pytest.raises(_cuda.CudaIpcError, match="CUDA_ERROR_INVALID_DEVICE"):
        drv.ipc_open(0, handle)
    mapped = drv.ipc_open(1, handle)
    assert mapped == base + SHIFT
    lib = ctypes.CDLL(fake_lib)
    assert lib.fake_last_open_flags() == _cuda.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    assert lib.fake_open_mappings() == 1
    drv.ipc_close(1, mapped)
    assert lib.fake_open_mappings() == 0
    bad = b"\x00" * 64
    with pytest.raises(_cuda.CudaIpcError,
                       match="cuIpcOpenMemHandle failed: CUDA_ERROR_INVALID_HANDLE: invalid resource handle"):
        drv.ipc_open(1, bad)
    # Every call popped its context: a push would fail in the fake otherwise.
    drv.address_range(0, ptr)


def test_mappings_are_shared_and_closed_with_their_last_user(drv, fake_lib):
    lib = ctypes.CDLL(fake_lib)
    handle = drv.ipc_handle(0, 0x7F0000000000)
    m1 = _cuda.open_handle(handle, 0)
    m2 = _cuda.open_handle(handle, 0)      # a handle opens once per process
    assert m1 is m2 and lib.fake_open_mappings() == 1
    holder = _cuda._DeviceBytes(m1, m1.ptr + 256, 1024)  # what a tensor keeps alive
    iface = holder.__cuda_array_interface__
    assert iface["data"][0] == 0x7F0000000000 + SHIFT + 256 and iface["shape"] == (1024,)
    assert iface["typestr"] == "|u1"
    del m1, m2
    gc.collect()
    assert lib.fake_open_mappings() == 1   # still used
    del holder, iface
    gc.collect()
    assert lib.fake_open_mappings() == 0
    assert (handle, 0) not in _cuda._open


def test_missing_driver_library_is_a_clear_error():
    with pytest.raises(_cuda.CudaIpcError, match="cannot load the CUDA driver library.*no-such-libcuda"):
        _cuda.Driver("no-such-libcuda.so.1")
