"""CUDA device memory shared between processes (proto CudaIpcRegion, docs/CUDA_IPC.md).

Two halves:

- Pure logic, testable without a GPU: GPU UUID bytes <-> text, choosing the local device whose
  UUID matches (ordinals differ between processes when CUDA_VISIBLE_DEVICES differs), region
  checks, and the wording of errors (which name CUDA_VISIBLE_DEVICES).
- The CUDA driver API through ctypes (libcuda.so.1, the driver itself, present wherever a GPU is
  usable): allocation ranges, legacy IPC handles (cuIpcGetMemHandle / cuIpcOpenMemHandle, the
  driver twins of cudaIpcGetMemHandle / cudaIpcOpenMemHandle: the handles are the same 64 bytes),
  each call made in the device's primary context, the one PyTorch and the CUDA runtime use.

The driver API is used rather than libcudart because it needs no particular runtime library
(PyTorch may link the runtime statically or bundle its own), and rather than PyTorch's private
`_share_cuda_` / `_new_shared_cuda`, whose reference-counting side files and signatures change
between releases.
"""
from __future__ import annotations

import ctypes
import os
import re
import shlex
import threading
import uuid as _uuid
import weakref
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from refit._common import RefitError

IPC_HANDLE_BYTES = 64
UUID_BYTES = 16

# ---- pure logic -----------------------------------------------------------------------------------


class CudaIpcError(RefitError):
    """CUDA IPC could not be used: CUDA unavailable, the GPU not visible, a handle that does not
    open, or a region that does not fit its allocation."""


def uuid_text(raw: bytes) -> str:
    """16 raw UUID bytes -> 'GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx' (nvidia-smi -L's form)."""
    raw = bytes(raw)
    if len(raw) != UUID_BYTES:
        raise ValueError(f"a GPU UUID has {UUID_BYTES} bytes, not {len(raw)}")
    return "GPU-" + str(_uuid.UUID(bytes=raw))


_UUID_HEX = re.compile(r"^(?:GPU-|MIG-)?([0-9a-fA-F]{8})-?([0-9a-fA-F]{4})-?([0-9a-fA-F]{4})-?"
                       r"([0-9a-fA-F]{4})-?([0-9a-fA-F]{12})$")


def uuid_bytes(value) -> bytes:
    """A GPU UUID in any form PyTorch or the driver gives it -> 16 raw bytes.

    Accepts 16 raw bytes, a uuid.UUID, text with or without the 'GPU-' (or 'MIG-') prefix and
    dashes, and objects with a `bytes` attribute (PyTorch >= 2's _CUuuid: a list of 16 ints)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if len(raw) != UUID_BYTES:
            raise ValueError(f"a GPU UUID has {UUID_BYTES} bytes, not {len(raw)}")
        return raw
    if isinstance(value, _uuid.UUID):
        return value.bytes
    if isinstance(value, str):
        m = _UUID_HEX.match(value.strip())
        if not m:
            raise ValueError(f"not a GPU UUID: {value!r} (expected 'GPU-' + 32 hex digits)")
        return bytes.fromhex("".join(m.groups()))
    b = getattr(value, "bytes", None)
    if b is not None:
        if isinstance(b, (bytes, bytearray)):
            return uuid_bytes(bytes(b))
        return uuid_bytes(bytes(int(x) & 0xFF for x in b))
    return uuid_bytes(str(value))


def choose_ordinal(device_uuid: bytes, devices: Sequence[Tuple[int, bytes]]) -> Optional[int]:
    """The local ordinal whose UUID is `device_uuid`, from (ordinal, uuid bytes) pairs; None if
    the GPU is not visible here."""
    want = uuid_bytes(device_uuid)
    for ordinal, u in devices:
        if uuid_bytes(u) == want:
            return ordinal
    return None


def visible_devices_text(env: Optional[Mapping[str, str]] = None) -> str:
    """How this process's CUDA_VISIBLE_DEVICES reads in a message: 'CUDA_VISIBLE_DEVICES=2,3',
    "CUDA_VISIBLE_DEVICES=''" (no GPU), or 'CUDA_VISIBLE_DEVICES unset' (every GPU)."""
    env = os.environ if env is None else env
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return "CUDA_VISIBLE_DEVICES unset"
    return "CUDA_VISIBLE_DEVICES=" + shlex.quote(value)


def devices_text(devices: Sequence[Tuple[int, bytes]]) -> str:
    """'cuda:0 GPU-..., cuda:1 GPU-...' or 'none'."""
    if not devices:
        return "none"
    return ", ".join(f"cuda:{o} {uuid_text(u)}" for o, u in devices)


def not_visible_message(name: str, device_uuid: bytes, devices: Sequence[Tuple[int, bytes]],
                        env: Optional[Mapping[str, str]] = None) -> str:
    return (f"tensor '{name}': its GPU {uuid_text(device_uuid)} is not visible to this process "
            f"({visible_devices_text(env)}; visible GPUs: {devices_text(devices)}): make the "
            "same GPU visible to the daemon and to this process (docs/CUDA_IPC.md)")


def cuda_unavailable_message(name: str, device_uuid: bytes, torch_cuda: Optional[str],
                             env: Optional[Mapping[str, str]] = None) -> str:
    built = f"PyTorch built with CUDA {torch_cuda}" if torch_cuda else "a CPU-only PyTorch build"
    return (f"tensor '{name}' lives in CUDA memory on GPU {uuid_text(device_uuid)}, but CUDA is "
            f"not available in this process ({built}; {visible_devices_text(env)}): run the "
            "consumer with that GPU visible (docs/CUDA_IPC.md)")


def open_failed_message(name: str, device_uuid: bytes, ordinal: int, error: str,
                        env: Optional[Mapping[str, str]] = None) -> str:
    return (f"tensor '{name}': cannot open the CUDA IPC handle of its allocation on cuda:{ordinal} "
            f"({uuid_text(device_uuid)}; {visible_devices_text(env)}): {error}. CUDA IPC needs the "
            "daemon and this process on the same host with the GPU visible to both, in the same "
            "IPC namespace and able to see each other's processes (e.g. Kubernetes hostIPC and "
            "shareProcessNamespace, docker --ipc=host --pid=host); see docs/CUDA_IPC.md")


def check_cuda_region(name: str, ipc_handle: bytes, device_uuid: bytes, offset: int,
                      size_bytes: int, allocation_bytes: int, expected_bytes: int) -> None:
    """ValueError naming the tensor unless the region is well formed: a 64-byte handle, a 16-byte
    UUID, size_bytes = the tensor's bytes, and [offset, offset + size_bytes) inside the
    allocation when its size is known (allocation_bytes != 0)."""
    if len(ipc_handle) != IPC_HANDLE_BYTES:
        raise ValueError(f"tensor '{name}': CUDA IPC handle of {len(ipc_handle)} bytes (expected "
                         f"{IPC_HANDLE_BYTES})")
    if len(device_uuid) != UUID_BYTES:
        raise ValueError(f"tensor '{name}': device UUID of {len(device_uuid)} bytes (expected "
                         f"{UUID_BYTES})")
    if size_bytes != expected_bytes:
        raise ValueError(f"tensor '{name}': CUDA region of {size_bytes} bytes, but its dtype and "
                         f"shape make {expected_bytes} bytes")
    if allocation_bytes and offset + size_bytes > allocation_bytes:
        raise ValueError(f"tensor '{name}': CUDA region [{offset}, {offset + size_bytes}) lies "
                         f"outside its allocation of {allocation_bytes} bytes")


# ---- the driver API -------------------------------------------------------------------------------

CUDA_SUCCESS = 0
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
_CUdeviceptr = ctypes.c_uint64
_CUcontext = ctypes.c_void_p


class _CUipcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class _CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_char * UUID_BYTES)]


class Driver:
    """The few CUDA driver calls refit needs, through ctypes. One per process (driver())."""

    def __init__(self, lib: Optional[str] = None):
        names = [lib] if lib else ["libcuda.so.1", "libcuda.so"]
        errors = []
        self._lib = None
        for n in names:
            try:
                self._lib = ctypes.CDLL(n)
                break
            except OSError as e:
                errors.append(f"{n}: {e}")
        if self._lib is None:
            raise CudaIpcError("cannot load the CUDA driver library (" + "; ".join(errors) +
                               "): no NVIDIA driver in this process's environment")
        self._fn = {}
        for name, args in {
            "cuInit": [ctypes.c_uint],
            "cuDeviceGetCount": [ctypes.POINTER(ctypes.c_int)],
            "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_CUcontext), ctypes.c_int],
            "cuCtxSynchronize": [],
            "cuIpcCloseMemHandle": [_CUdeviceptr],
            "cuIpcGetMemHandle": [ctypes.POINTER(_CUipcMemHandle), _CUdeviceptr],
        }.items():
            self._fn[name] = self._bind(name, args)
        # Versioned entry points: the _v2 ABI where the header #defines the plain name to it.
        self._fn["cuCtxPushCurrent"] = self._bind_first(["cuCtxPushCurrent_v2", "cuCtxPushCurrent"],
                                                        [_CUcontext])
        self._fn["cuCtxPopCurrent"] = self._bind_first(["cuCtxPopCurrent_v2", "cuCtxPopCurrent"],
                                                       [ctypes.POINTER(_CUcontext)])
        self._fn["cuMemGetAddressRange"] = self._bind_first(
            ["cuMemGetAddressRange_v2"],
            [ctypes.POINTER(_CUdeviceptr), ctypes.POINTER(ctypes.c_size_t), _CUdeviceptr])
        self._fn["cuIpcOpenMemHandle"] = self._bind_first(
            ["cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"],
            [ctypes.POINTER(_CUdeviceptr), _CUipcMemHandle, ctypes.c_uint])
        # cudaDeviceProp.uuid comes from cuDeviceGetUuid_v2 (MIG instances get their own UUID).
        self._fn["cuDeviceGetUuid"] = self._bind_first(["cuDeviceGetUuid_v2", "cuDeviceGetUuid"],
                                                       [ctypes.POINTER(_CUuuid), ctypes.c_int])
        self._lock = threading.Lock()
        self._contexts: Dict[int, int] = {}
        self.check(self._fn["cuInit"](0), "cuInit")

    def _bind(self, name, args):
        f = getattr(self._lib, name)
        f.argtypes = args
        f.restype = ctypes.c_int
        return f

    def _bind_first(self, names, args):
        for n in names:
            if hasattr(self._lib, n):
                return self._bind(n, args)
        raise CudaIpcError(f"the CUDA driver lacks {names[0]} (driver too old)")

    def error_text(self, rc: int) -> str:
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        try:
            self._lib.cuGetErrorName(rc, ctypes.byref(name))
            self._lib.cuGetErrorString(rc, ctypes.byref(text))
        except (AttributeError, OSError):
            pass
        n = name.value.decode() if name.value else f"CUresult {rc}"
        return f"{n}: {text.value.decode()}" if text.value else n

    def check(self, rc: int, what: str) -> None:
        if rc != CUDA_SUCCESS:
            raise CudaIpcError(f"{what} failed: {self.error_text(rc)}")

    # -- devices and contexts --

    def device_count(self) -> int:
        n = ctypes.c_int()
        self.check(self._fn["cuDeviceGetCount"](ctypes.byref(n)), "cuDeviceGetCount")
        return n.value

    def device_uuid(self, ordinal: int) -> bytes:
        dev = ctypes.c_int()
        self.check(self._fn["cuDeviceGet"](ctypes.byref(dev), ordinal), f"cuDeviceGet({ordinal})")
        u = _CUuuid()
        self.check(self._fn["cuDeviceGetUuid"](ctypes.byref(u), dev), "cuDeviceGetUuid")
        return bytes(ctypes.string_at(ctypes.addressof(u), UUID_BYTES))

    def _context(self, ordinal: int) -> int:
        """The primary context of device `ordinal` (retained once, for the process's life)."""
        with self._lock:
            ctx = self._contexts.get(ordinal)
            if ctx is None:
                dev = ctypes.c_int()
                self.check(self._fn["cuDeviceGet"](ctypes.byref(dev), ordinal),
                           f"cuDeviceGet({ordinal})")
                c = _CUcontext()
                self.check(self._fn["cuDevicePrimaryCtxRetain"](ctypes.byref(c), dev),
                           f"cuDevicePrimaryCtxRetain(cuda:{ordinal})")
                ctx = self._contexts[ordinal] = c.value
            return ctx

    def _call_in(self, ordinal: int, fn):
        """fn() with device `ordinal`'s primary context current on this thread."""
        self.check(self._fn["cuCtxPushCurrent"](_CUcontext(self._context(ordinal))),
                   "cuCtxPushCurrent")
        try:
            return fn()
        finally:
            popped = _CUcontext()
            self._fn["cuCtxPopCurrent"](ctypes.byref(popped))

    # -- memory --

    def address_range(self, ordinal: int, ptr: int) -> Tuple[int, int]:
        """(base, bytes) of the allocation holding device pointer `ptr`."""
        base, size = _CUdeviceptr(), ctypes.c_size_t()

        def f():
            self.check(self._fn["cuMemGetAddressRange"](ctypes.byref(base), ctypes.byref(size),
                                                        _CUdeviceptr(ptr)),
                       f"cuMemGetAddressRange({ptr:#x})")
        self._call_in(ordinal, f)
        return base.value, size.value

    def ipc_handle(self, ordinal: int, base: int) -> bytes:
        """The legacy IPC handle of the allocation starting at `base`."""
        h = _CUipcMemHandle()

        def f():
            self.check(self._fn["cuIpcGetMemHandle"](ctypes.byref(h), _CUdeviceptr(base)),
                       f"cuIpcGetMemHandle({base:#x})")
        self._call_in(ordinal, f)
        return bytes(ctypes.string_at(ctypes.addressof(h), IPC_HANDLE_BYTES))

    def ipc_open(self, ordinal: int, handle: bytes) -> int:
        """Maps another process's allocation on device `ordinal`; returns its base pointer here."""
        h = _CUipcMemHandle()
        ctypes.memmove(ctypes.addressof(h), handle, IPC_HANDLE_BYTES)
        ptr = _CUdeviceptr()

        def f():
            self.check(self._fn["cuIpcOpenMemHandle"](ctypes.byref(ptr), h,
                                                      CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                       "cuIpcOpenMemHandle")
        self._call_in(ordinal, f)
        return ptr.value

    def ipc_close(self, ordinal: int, ptr: int) -> None:
        """Waits for the device's work (kernels may still read the mapping), then unmaps."""
        def f():
            self._fn["cuCtxSynchronize"]()
            self.check(self._fn["cuIpcCloseMemHandle"](_CUdeviceptr(ptr)), "cuIpcCloseMemHandle")
        self._call_in(ordinal, f)


_driver: Optional[Driver] = None
_driver_lock = threading.Lock()


def driver() -> Driver:
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = Driver()
        return _driver


def local_devices() -> List[Tuple[int, bytes]]:
    """(torch ordinal, UUID bytes) of every GPU this process sees; [] without CUDA."""
    import torch
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        u = getattr(torch.cuda.get_device_properties(i), "uuid", None)  # PyTorch >= 2.0
        # torch's ordinal i is the runtime's and the driver's ordinal i (same enumeration, same
        # CUDA_VISIBLE_DEVICES).
        out.append((i, uuid_bytes(u) if u is not None else driver().device_uuid(i)))
    return out


# ---- exporting (trainer) --------------------------------------------------------------------------


class ExportedRegion:
    """Where a CUDA tensor's bytes live, as a CudaIpcRegion says it."""

    __slots__ = ("ipc_handle", "device_uuid", "offset", "size_bytes", "allocation_bytes")

    def __init__(self, ipc_handle: bytes, device_uuid: bytes, offset: int, size_bytes: int,
                 allocation_bytes: int):
        self.ipc_handle, self.device_uuid = ipc_handle, device_uuid
        self.offset, self.size_bytes, self.allocation_bytes = offset, size_bytes, allocation_bytes


def export_tensor(name: str, t, uuids: Dict[int, bytes]) -> ExportedRegion:
    """The CudaIpcRegion of a contiguous CUDA tensor: the IPC handle of the allocation holding it
    (the caching allocator's segment for PyTorch tensors), the offset of its first byte from the
    allocation's base. `uuids` caches ordinal -> UUID."""
    if not t.is_contiguous():
        raise ValueError(f"tensor '{name}': a CUDA tensor must be contiguous to be shared "
                         "(register t.contiguous() and keep writing into that tensor)")
    ordinal = t.device.index if t.device.index is not None else 0
    size = t.numel() * t.element_size()
    ptr = t.data_ptr()
    drv = driver()
    base, alloc = drv.address_range(ordinal, ptr)
    try:
        handle = drv.ipc_handle(ordinal, base)
    except CudaIpcError as e:
        raise CudaIpcError(
            f"tensor '{name}' on cuda:{ordinal}: {e.details}. Legacy CUDA IPC needs memory from "
            "cudaMalloc / PyTorch's default caching allocator (not expandable_segments, "
            "cudaMallocAsync pools or managed memory)") from None
    if ordinal not in uuids:
        uuids[ordinal] = dict(local_devices())[ordinal]
    return ExportedRegion(handle, uuids[ordinal], ptr - base, size, alloc)


# ---- importing (consumer) -------------------------------------------------------------------------


class IpcMapping:
    """One opened IPC handle (another process's allocation mapped here). Closed when the last
    reference goes: the Consumer's cache and every tensor made from it hold one, so a tensor never
    outlives its mapping."""

    def __init__(self, handle: bytes, ordinal: int, ptr: int):
        self.handle, self.ordinal, self.ptr = handle, ordinal, ptr
        self._finalizer = weakref.finalize(self, _close_quietly, ordinal, ptr)


def _close_quietly(ordinal: int, ptr: int) -> None:
    try:
        driver().ipc_close(ordinal, ptr)
    except Exception:  # noqa: BLE001 - at interpreter exit the driver may be gone already
        pass


# A handle may be opened only once per process (CUDA_ERROR_ALREADY_MAPPED otherwise): share live
# mappings between Consumers and with stale tensors that still hold one.
_open: "weakref.WeakValueDictionary[Tuple[bytes, int], IpcMapping]" = weakref.WeakValueDictionary()
_open_lock = threading.Lock()


def open_handle(handle: bytes, ordinal: int) -> IpcMapping:
    with _open_lock:
        m = _open.get((handle, ordinal))
        if m is None:
            m = IpcMapping(handle, ordinal, driver().ipc_open(ordinal, handle))
            _open[(handle, ordinal)] = m
        return m


class _DeviceBytes:
    """`size` bytes at `ptr` as a __cuda_array_interface__ (v2) uint8 vector; keeps `owner`
    alive for as long as a tensor made from it exists (torch holds the object)."""

    def __init__(self, owner, ptr: int, size: int):
        self._owner = owner
        # Read-only by contract; torch ignores the flag, so it is not claimed here.
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 2}


def device_tensor(mapping: IpcMapping, offset: int, size: int, dtype, shape):
    """A torch tensor of dtype x shape over mapping.ptr + offset, zero copy."""
    import torch
    shape = tuple(int(d) for d in shape)
    device = torch.device("cuda", mapping.ordinal)
    if size == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    ptr = mapping.ptr + offset
    raw = torch.as_tensor(_DeviceBytes(mapping, ptr, size), device=device)
    if raw.data_ptr() != ptr or raw.dtype != torch.uint8:  # never a copy
        raise CudaIpcError(f"torch copied the shared CUDA memory at {ptr:#x} instead of "
                           "wrapping it")
    t = raw.view(dtype) if dtype != torch.uint8 else raw
    return t.view(shape)
